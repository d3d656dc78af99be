"""``ddl`` (Deep Delta Learning, Zhang et al. 2601.00417, d_v = 1) as a per-merge rule (docs/rules/ddl.md; the
formula: :mod:`.reference`)."""
from __future__ import annotations

import itertools

from ..base import MergeRule, register_merge_rule
from ..common import init_seed
from .config import DDLConfig
from .modules import DDLMerge

__all__ = ["DDLRule"]


class DDLRule(MergeRule):
    """``x + h`` becomes ``x + beta (v - k . x) k`` with ``k`` the update's direction, at every merge (attention and
    MLP alike, each with its own gate and value)."""

    Config = DDLConfig
    description = "Deep Delta Learning: a gated rank-1 change of the shortcut along the update's direction"
    identity_at_init = False  # x + beta (v - k.x) k cannot express x + h (docs/rules/ddl.md)

    def summary(self):
        return f"value={self.config.value}, beta_init={self.config.beta_init}"

    def __init__(self, name, config):
        super().__init__(name, config)
        self._built = itertools.count()  # the merges built so far: each one's init seed

    def build_merge_sized(self, dim, width):
        return DDLMerge(width, self.config, dim=dim, seed=init_seed(next(self._built)))

    def merge(self, module, stream, update, inplace):
        return module(stream, update)

    def make_stats(self, num_depths, model):
        from .stats import DDLStats  # torchmetrics: imported when diagnostics are asked for

        return DDLStats(num_depths)

    def observe(self, stats, depth, site, position, stream, update, state):
        _, beta, proj, value = self.merge_module(site, position)(stream, update, parts=True)
        stats.update(depth, beta=beta, proj=proj, value=value)


register_merge_rule("ddl", DDLRule)
