"""``rescontroller``: the parameter-free energy-aware merge ``out = r + s_u * s_s * u`` as a registered rule.

The math (one docstring, with the formula) is :mod:`.reference`; this module wires it into the registry: options
(:class:`.config.ResControllerConfig`), one :class:`~.modules.ResController` per site, and its diagnostics (mean
update/stream scales, fraction of rows where each cap is active: :class:`.stats.ControllerStats`).
"""
from __future__ import annotations

from ..base import MergeRule, register_merge_rule
from .config import ResControllerConfig
from .modules import ResController
from .reference import rescontroller_scales

__all__ = ["ResControllerRule"]


class ResControllerRule(MergeRule):
    Config = ResControllerConfig
    description = "ResController: parameter-free energy-aware merge r + s_u*s_s*u (soft caps on update and stream RMS)"

    def summary(self):
        c = self.config
        return f"update_ratio={c.update_ratio}, stream_ratio={c.stream_ratio}"

    def build_merge(self, dim):
        return ResController(config=self.config, dim=dim)

    def merge(self, module, stream, update, inplace):
        return module(stream, update)

    def make_stats(self, num_depths, model):
        from .stats import ControllerStats  # torchmetrics: imported when diagnostics are asked for

        return ControllerStats(num_depths)

    def observe(self, stats, depth, site, position, stream, update, state):
        module = self.merge_module(site, position)
        stats.update(depth, rescontroller_scales(stream, update, **module.options()))


register_merge_rule("rescontroller", ResControllerRule)
