"""The versions of the stack the test suite runs against, written once (``lightning-resctl --version`` prints them
beside the installed ones; ``docs/install.md`` and ``CHANGELOG.md`` quote them, and a test checks they agree)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["TESTED_WITH", "installed", "describe"]

#: distribution -> the version CI's test command runs against (torch: the CPU build; triton: its CPU interpreter)
TESTED_WITH = {"torch": "2.13.0", "lightning": "2.6.6", "transformers": "5.24.0", "triton": "3.9.0"}


def installed(dist: str) -> str:
    """``dist``'s installed version, or ``"not installed"``."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def describe() -> list[str]:
    """One line per distribution of :data:`TESTED_WITH`: ``torch 2.13.0+cpu (tested: 2.13.0)``."""
    width = max(map(len, TESTED_WITH))
    return [f"{dist:<{width}} {installed(dist)} (tested: {tested})" for dist, tested in TESTED_WITH.items()]
