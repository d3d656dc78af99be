"""``rescontroller``: the parameter-free energy-aware merge ``out = r + s_u * s_s * u``.

The math (one docstring, with the formula) is :mod:`lightning_resctl.rescontroller`; this module
only wires it into the registry: options, one :class:`~lightning_resctl.rescontroller.ResController`
per site, and its diagnostics (mean update/stream scales, fraction of rows where each cap is active).
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import MergeRule, check_choice, check_positive


@dataclass
class ResControllerConfig:
    """Options of ``rescontroller`` (see docs/rules/rescontroller.md).

    update_ratio: allowed update RMS relative to the residual RMS.
    stream_ratio: allowed candidate-stream RMS relative to the residual RMS.
    update_softness / stream_softness: sharpness of the soft caps.
    eps: inside every root and denominator.
    backend: "auto" (Triton on CUDA, else torch), "torch" (on CPU one compiled region per direction when a
        C++ compiler is present), "torch-eager", "torch-compiled", "triton" ("native" is an alias) or
        "reference" (plain autograd over the oracle: double backward, forward-mode AD and torch.func work).
        The backend changes how the math runs, not what it computes: a checkpoint loads whatever the backend.
    """

    update_ratio: float = 0.18
    stream_ratio: float = 1.08
    update_softness: float = 8.0
    stream_softness: float = 8.0
    eps: float = 1e-12
    backend: str = "auto"


class ResControllerRule(MergeRule):
    Config = ResControllerConfig
    description = "ResController: parameter-free energy-aware merge r + s_u*s_s*u (soft caps on update and stream RMS)"

    def validate(self, config):
        from ..rescontroller import BACKENDS

        for name in ("update_ratio", "stream_ratio", "update_softness", "stream_softness", "eps"):
            check_positive(name, getattr(config, name))
        check_choice("backend", config.backend, BACKENDS)

    def summary(self):
        c = self.config
        return f"update_ratio={c.update_ratio}, stream_ratio={c.stream_ratio}"

    def build_merge(self, dim):
        from ..rescontroller import ResController

        return ResController(**self.options(), dim=dim)

    def merge(self, module, stream, update, inplace):
        return module(stream, update)

    def make_stats(self, num_depths, model):
        from ..metrics import ControllerStats

        return ControllerStats(num_depths)

    def observe(self, stats, depth, site, position, stream, update, state):
        from ..rescontroller import rescontroller_scales

        module = self.merge_module(site, position)
        stats.update(depth, rescontroller_scales(stream, update, **module.options()))
