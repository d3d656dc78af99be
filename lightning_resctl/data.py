"""Moved to :mod:`lightning_resctl.compare.data`; this name keeps old imports working."""
from .compare.data import *  # noqa: F401,F403
from .compare.data import __all__  # noqa: F401
