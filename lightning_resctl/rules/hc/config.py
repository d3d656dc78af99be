"""The options of ``hc`` and ``mhc``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_bool, check_choice, check_eps, check_int
from ..common import RMS_EPS
from ..frame import RECOMPUTE_EVERY, check_frame_options

__all__ = ["HCConfig", "MHCConfig", "SINKHORNS", "INITS"]

SINKHORNS = ("paper", "dsv4")
INITS = ("paper", "residual")


@dataclass
class HCConfig:
    """Options of ``hc`` (docs/rules/hc.md).

    streams: n >= 1 streams per token (paper: 4).
    dynamic: True = DHC (tanh term), False = static HC (only ``hc_static``).
    reduce: chain output ``"sum"`` over streams (paper, lucidrains) or ``"mean"``.
    eps: RMSNorm epsilon of the per-stream norm (>= 0).
    recompute_every: merges per recompute group (>= 1; how the streams are kept for the backward, not the math):
      the streams entering each group's first merge are kept, the others recomputed from them (1: every merge
      keeps its own).
    """

    streams: int = 4
    dynamic: bool = True
    reduce: str = "sum"
    eps: float = RMS_EPS
    recompute_every: int = RECOMPUTE_EVERY

    def validate(self) -> "HCConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_frame_options(self)
        check_bool("dynamic", self.dynamic)
        return self


@dataclass
class MHCConfig:
    """Options of ``mhc`` (docs/rules/hc.md).

    streams: n >= 1 streams per token (paper: 4).
    init: ``"paper"`` (FFTYYY biases, post 1.46/0.54) or ``"residual"`` (b_post = 0: post = 1, exact residual at init).
    sinkhorn: ``"paper"`` (Eq. 9) or ``"dsv4"`` (DeepSeek-V4 inference code).
    sinkhorn_iters: t_max >= 1 (20).
    reduce: ``"sum"`` or ``"mean"``.
    eps: RMSNorm epsilon over n*C (>= 0). hc_eps: the dsv4 variant's eps (>= 0).
    recompute_every: merges per recompute group (>= 1; how the streams are kept for the backward, not the math):
      the streams entering each group's first merge are kept, the others recomputed from them (1: every merge
      keeps its own).
    """

    streams: int = 4
    init: str = "paper"
    sinkhorn: str = "paper"
    sinkhorn_iters: int = 20
    reduce: str = "sum"
    eps: float = RMS_EPS
    hc_eps: float = RMS_EPS
    recompute_every: int = RECOMPUTE_EVERY

    def validate(self) -> "MHCConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_frame_options(self)
        check_choice("init", self.init, INITS)
        check_choice("sinkhorn", self.sinkhorn, SINKHORNS)
        check_int("sinkhorn_iters", self.sinkhorn_iters, 1)
        check_eps("hc_eps", self.hc_eps)
        return self
