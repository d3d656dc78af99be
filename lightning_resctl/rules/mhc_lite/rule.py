"""``mhc-lite`` (Yang & Gao 2601.05732) as a chain rule on the common pre/res/post frame (:mod:`..frame`; the
formula: :mod:`.reference`)."""
from __future__ import annotations

from ..base import register_merge_rule
from ..frame import FrameRule
from .config import MHCLiteConfig
from .modules import MHCLiteLayer

__all__ = ["MHCLiteRule"]


class MHCLiteRule(FrameRule):
    Config = MHCLiteConfig
    description = "mHC-lite: mHC with res an exact convex combination of the n! permutation matrices"
    identity_at_init = {"init": "residual"}
    chain_attr = "_resctl_mhcl"
    stats_prefix = "mhcl"

    def build_layer(self, index, dim):
        c = self.config
        return MHCLiteLayer(index, dim, c.streams, c.init, c.eps)


register_merge_rule("mhc-lite", MHCLiteRule)
