"""The options of ``mgr`` (and ``mgr-competitive`` / ``mgr-independent``): their defaults and their checks, in one
place (the rule, :class:`~lightning_resctl.rules.mgr.MGRChain` and the reference's init formulas take both from
here)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_choice, check_finite, check_int, check_interval, check_positive
from ..common import RMS_EPS, check_rule_backend

__all__ = ["MGRConfig", "GATINGS"]

GATINGS = ("independent", "competitive")

#: option -> its check (each raises naming the option and the value)
_CHECKS = {
    "streams": lambda v: check_int("streams", v, 2),
    "gating": lambda v: check_choice("gating", v, GATINGS),
    "invert": lambda v: check_choice("invert", v, (True, False, "auto")),
    "backend": check_rule_backend,
    "b_base": lambda v: check_finite("b_base", v),
    "l_base": lambda v: check_int("l_base", v, 1),
    # the shallow-chain clamp sets beta_init = beta_init_max (independent) or beta_init_max / n (competitive, the
    # streams then take beta_init_max in total): a gate value, so strictly inside (0, 1) (docs/rules/mgr.md)
    "beta_init_max": lambda v: check_interval("beta_init_max", v, 0.0, 1.0),
    "invert_top_p": lambda v: check_interval("invert_top_p", v, 0.0, 1.0, closed="both"),
    "invert_threshold": lambda v: check_interval("invert_threshold", v, 0.0, 1.0, closed="high"),
    "invert_max_gain": lambda v: check_interval("invert_max_gain", v, 1.0, math.inf),
    "eps": lambda v: check_positive("eps", v),
}


@dataclass
class MGRConfig:
    """Options of ``mgr`` (see docs/rules/mgr.md; constants marked "ours" there are the project's choices).

    streams: n >= 2 parallel streams per token.
    gating: "competitive" (softmax with a forget logit) or "independent" (sigmoid per stream).
    invert: fallback inversion in the backward (True, False, "auto": fp32/fp64 streams, not under torch.compile).
    backend: "auto" (Triton on CUDA, else torch), "torch" (on CPU the math compiled as one region per direction in
        the background when a C++ compiler is present, eager until then), "torch-eager", "torch-compiled", "triton"
        ("native" is an alias) or "reference" (the oracle).
    b_base, l_base, beta_init_max: depth-aware gate-bias init (beta_init_max in (0, 1)).
    invert_top_p, invert_threshold, invert_max_gain: rows the inversion saves exactly.
    eps: RMSNorm epsilon.
    """

    streams: int = 4
    gating: str = "competitive"
    invert: object = "auto"
    backend: str = "auto"
    b_base: float = -3.0
    l_base: int = 21
    beta_init_max: float = 0.5
    invert_top_p: float = 0.05
    invert_threshold: float = 0.5
    invert_max_gain: float = 8.0
    eps: float = RMS_EPS

    def validate(self) -> "MGRConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        for name in _CHECKS:
            self.check(name, getattr(self, name))
        return self

    @staticmethod
    def check(name: str, value):
        """Check one option (the reference's init formulas check theirs here too)."""
        return _CHECKS[name](value)
