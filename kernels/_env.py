"""What the kernels read of their environment, here so that ``kernels/`` imports nothing of ``lightning_resctl``
(``lightning_resctl.runtime.triton`` asks this module too: the fact is written once)."""
from __future__ import annotations

import os

__all__ = ["interpreter_mode"]


def interpreter_mode() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
