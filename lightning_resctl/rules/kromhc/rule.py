"""``kromhc`` (Zhou et al. 2601.21579) as a chain rule on the common pre/res/post frame (:mod:`..frame`; the formula:
:mod:`.reference`)."""
from __future__ import annotations

from ..base import register_merge_rule
from ..frame import FrameRule, FrameState
from .config import KromHCConfig
from .modules import KromHCLayer

__all__ = ["KromHCRule"]


class KromHCRule(FrameRule):
    Config = KromHCConfig
    description = "KromHC: mHC with res a Kronecker product of doubly stochastic 2x2 factors (n a power of 2)"
    identity_at_init = {"init": "residual"}
    chain_attr = "_resctl_kromhc"
    stats_prefix = "kromhc"

    def build_layer(self, index, dim):
        c = self.config
        return KromHCLayer(index, dim, c.streams, c.init, c.eps)

    def make_stats(self, num_depths, model):
        from .stats import KromHCStats  # torchmetrics: imported when diagnostics are asked for

        return KromHCStats(num_depths, self.config.streams)

    def observe(self, stats, depth, site, position, stream, update, state):
        if state is None:
            return
        s = (state.streams if isinstance(state, FrameState) else state).detach()
        layer = self.merge_module(site, int(position))
        pre, res, post = layer.coefficients(s)
        stats.update(depth, pre=pre, res=res, post=post, factors=layer.factor_matrices(s))


register_merge_rule("kromhc", KromHCRule)
