"""The options of ``mhc-lite``: their defaults and their checks, in one place."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_choice
from ..common import RMS_EPS
from ..frame import RECOMPUTE_EVERY, check_frame_options
from ..hc.config import INITS

__all__ = ["MHCLiteConfig", "MAX_STREAMS"]

#: res mixes all n! permutation matrices: n <= 6 (720 of them)
MAX_STREAMS = 6


@dataclass
class MHCLiteConfig:
    """Options of ``mhc-lite`` (docs/rules/mhc_lite.md).

    streams: 1 <= n <= 6 streams per token (n! permutations; official: 4).
    init: ``"paper"`` (official biases) or ``"residual"`` (b_post = 0: post = 1, exact residual at init).
    reduce: ``"sum"`` (official) or ``"mean"``.
    eps: RMSNorm epsilon over n*C (>= 0).
    recompute_every: merges per recompute group (>= 1; how the streams are kept for the backward, not the math):
      the streams entering each group's first merge are kept, the others recomputed from them (1: every merge
      keeps its own).
    """

    streams: int = 4
    init: str = "paper"
    reduce: str = "sum"
    eps: float = RMS_EPS
    recompute_every: int = RECOMPUTE_EVERY

    def validate(self) -> "MHCLiteConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_frame_options(self)
        n = self.streams
        if n > MAX_STREAMS:
            raise ValueError(
                f"streams must be <= {MAX_STREAMS} for method='mhc-lite', got {n!r}: res mixes all n! permutation "
                f"matrices ({math.factorial(min(n, 12))}{'+' if n > 12 else ''} for n={n}), and Phi has n*C*(2n+n!) "
                "entries per layer; use method='mhc' or 'hc' for more streams")
        check_choice("init", self.init, INITS)
        return self
