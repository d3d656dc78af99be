"""The options of ``kromhc``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_choice
from ..common import RMS_EPS
from ..frame import RECOMPUTE_EVERY, check_frame_options
from ..hc.config import INITS

__all__ = ["KromHCConfig"]


@dataclass
class KromHCConfig:
    """Options of ``kromhc`` (docs/rules/kromhc.md).

    streams: n = 2^K >= 2 streams per token (a power of 2: H_res is a Kronecker product of K 2x2 factors; 4).
    init: ``"paper"`` (the official biases: post 1.46 / 0.54) or ``"residual"`` (b_post = 0: post = 1, the plain
        residual at init for pre-norm models).
    reduce: the chain output, ``"sum"`` over streams (official) or ``"mean"``.
    eps: RMSNorm epsilon over n*C (>= 0; official: L2-normalise with a 1e-12 floor, the same except near 0).
    recompute_every: merges per recompute group (>= 1; how the streams are kept for the backward, not the math):
      the streams entering each group's first merge are kept, the others recomputed from them (1: every merge
      keeps its own).
    """

    streams: int = 4
    init: str = "paper"
    reduce: str = "sum"
    eps: float = RMS_EPS
    recompute_every: int = RECOMPUTE_EVERY

    def validate(self) -> "KromHCConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_frame_options(self)
        n = self.streams
        if n < 2 or n & (n - 1):
            raise ValueError(f"streams must be a power of 2 >= 2 for method='kromhc', got {n!r}: H_res is a Kronecker "
                             "product of log2(n) 2x2 factors (official code: the same); use method='mhc' or 'hc' "
                             "for other n")
        check_choice("init", self.init, INITS)
        return self
