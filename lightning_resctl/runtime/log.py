"""The package's logger and its one-line messages (shown on stderr like Lightning's own when nothing configured
logging)."""
from __future__ import annotations

import logging
import os
import sys

#: the package's logger (INFO unless configured otherwise).
log = logging.getLogger("lightning_resctl")
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)


def _global_rank() -> int:
    """Lightning's global rank when Lightning is loaded (it is imported only if it already was), else the
    launcher's ``RANK`` (0 without one)."""
    rank_zero = sys.modules.get("lightning.pytorch.utilities.rank_zero")
    if rank_zero is not None:
        return getattr(rank_zero.rank_zero_only, "rank", 0)
    return int(os.environ.get("RANK", 0))


def rank_zero_line(msg: str) -> None:
    """Log ``msg`` (INFO, logger ``lightning_resctl``) on global rank zero only."""
    if _global_rank() != 0:
        return
    if not log.handlers and not logging.getLogger().handlers:  # nothing configured logging: stderr
        log.addHandler(logging.StreamHandler())
    log.info(msg)
