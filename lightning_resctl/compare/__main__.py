"""``python -m lightning_resctl.compare [flags]``: the same as ``python -m lightning_resctl compare``."""
import sys

from .cli import main

sys.exit(main())
