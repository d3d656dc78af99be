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


@dataclass
class MGRConfig:
    """Options of ``mgr`` (see docs/rules/mgr.md; constants marked "ours" there are the project's choices).

    streams: n >= 2 parallel streams per token.
    gating: "competitive" (softmax with a forget logit) or "independent" (sigmoid per stream).
    invert: fallback inversion in the backward (True, False, "auto": fp32/fp64 streams; under torch.compile for a
        patched model, not under activation checkpointing).
    backend: "auto" (Triton on CUDA, else torch), "torch" (on CPU the math compiled as one region per direction in
        the background when a C++ compiler is present, eager until then), "torch-eager", "torch-compiled", "triton"
        ("native" is an alias) or "reference" (the oracle).
    b_base, l_base, beta_init_max: depth-aware gate-bias init (beta_init_max in (0, 1)).
    invert_top_p: the budget of rows the inversion saves exactly, a fraction of a merge's token x stream rows.
    invert_threshold, invert_max_gain: which rows need saving exactly (beta above; the error gain past).
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
        check_int("streams", self.streams, 2)
        check_choice("gating", self.gating, GATINGS)
        check_choice("invert", self.invert, (True, False, "auto"))
        check_rule_backend(self.backend)
        check_finite("b_base", self.b_base)
        check_int("l_base", self.l_base, 1)
        # the shallow-chain clamp sets beta_init = beta_init_max (independent) or beta_init_max / n (competitive,
        # the streams then take beta_init_max in total): a gate value, so strictly inside (0, 1) (docs/rules/mgr.md)
        check_interval("beta_init_max", self.beta_init_max, 0.0, 1.0)
        check_interval("invert_top_p", self.invert_top_p, 0.0, 1.0, closed="both")
        check_interval("invert_threshold", self.invert_threshold, 0.0, 1.0, closed="high")
        check_interval("invert_max_gain", self.invert_max_gain, 1.0, math.inf)
        check_positive("eps", self.eps)
        return self
