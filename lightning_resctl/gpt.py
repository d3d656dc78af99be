"""Moved to :mod:`lightning_resctl.compare.gpt`; this name keeps old imports working."""
from .compare.gpt import *  # noqa: F401,F403
from .compare.gpt import __all__  # noqa: F401
