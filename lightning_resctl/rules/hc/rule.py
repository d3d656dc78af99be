"""``hc`` (Hyper-Connections, Zhu et al. 2409.19606) and ``mhc`` (Manifold-Constrained HC, Xie et al.
2512.24880) as chain rules on the common pre/res/post frame (:mod:`..frame`; the formulas: :mod:`.reference`)."""
from __future__ import annotations

from ..base import register_merge_rule
from ..frame import FrameRule
from .config import HCConfig, MHCConfig
from .modules import HCLayer, MHCLayer

__all__ = ["HCRule", "MHCRule"]


class HCRule(FrameRule):
    Config = HCConfig
    description = "Hyper-Connections (dynamic): n streams, per-layer pre/res/post from a tanh projection, identity init"
    identity_at_init = True
    chain_attr = "_resctl_hc"
    stats_prefix = "hc"

    def build_layer(self, index, dim):
        c = self.config
        return HCLayer(index, dim, c.streams, c.dynamic, c.eps)


class MHCRule(FrameRule):
    Config = MHCConfig
    description = "Manifold-Constrained Hyper-Connections: sigmoid pre/post, Sinkhorn doubly-stochastic res"
    identity_at_init = {"init": "residual"}
    chain_attr = "_resctl_mhc"
    stats_prefix = "mhc"

    def build_layer(self, index, dim):
        c = self.config
        return MHCLayer(index, dim, c.streams, c.init, c.sinkhorn, c.sinkhorn_iters, c.eps, c.hc_eps)


register_merge_rule("hc", HCRule)
register_merge_rule("mhc", MHCRule)
