"""The options of ``dwa``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..checks import check_choice, check_int

__all__ = ["DWAConfig", "SCHEDULES"]

#: "paper": an average after every block i with period | i, over the outputs X_j with j = i mod dilation (the paper,
#: and its package DWAModules); "grouped": the experiments' model (increase_T_every): the blocks in groups of
#: ``period``, an average after each group over the group outputs, dilation counted in groups
SCHEDULES = ("paper", "grouped")


@dataclass
class DWAConfig:
    """Options of ``dwa`` (DenseFormer's depth-weighted average; docs/rules/dwa.md).

    dilation: k >= 1; the average after block i reads the outputs X_j with j = i mod k (1: all of them).
    period: p >= 1; an average after the blocks i with p | i only (1: after every block). "k x p-DenseFormer".
    schedule: ``"paper"`` or ``"grouped"`` (the experiments code's period: groups of p blocks; the number of blocks
        must then be a multiple of p).
    merges_per_block: None: a block is what the surgery groups (the merges one module of the model's stack of
        blocks runs: two per transformer block); M >= 1: every M merges of a chain form one block (1: an average
        after every residual addition, a variant the paper did not evaluate).
    """

    dilation: int = 1
    period: int = 1
    schedule: str = "paper"
    merges_per_block: Optional[int] = None

    def validate(self) -> "DWAConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_int("dilation", self.dilation, 1)
        check_int("period", self.period, 1)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_int("merges_per_block", self.merges_per_block, 1, allow_none=True)
        return self
