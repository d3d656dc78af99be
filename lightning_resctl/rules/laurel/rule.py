"""``laurel`` (per merge: RW, LR, RW+LR) and ``laurel-pa`` (a chain: the variants with previous activations),
Menghani et al. ICML 2025 (docs/rules/laurel.md; the formula: :mod:`.reference`)."""
from __future__ import annotations

import itertools

import torch

from ..base import ChainRule, MergeRule, register_merge_rule
from ..common import init_seed
from .config import LaurelConfig, LaurelPAConfig
from .modules import LaurelChain, LaurelMerge, LaurelPosition, LaurelState, laurel_skip, laurel_start, laurel_step
from .reference import laurel_reference

__all__ = ["LaurelRule", "LaurelPARule"]


class _LaurelDiagnostics:
    """What both rules record: the merge's RW weights, its low-rank matrix's norm, how much its LR / PA term adds
    (from the stream it merges and, PA, the earlier streams) and PA's gammas."""

    def __init__(self, name, config):
        super().__init__(name, config)
        self._built = itertools.count()  # the modules built so far: each one's init seed (Xavier)

    def make_stats(self, num_depths, model):
        from .stats import LaurelStats  # torchmetrics: imported when diagnostics are asked for

        return LaurelStats(num_depths, getattr(self.config, "history", 1))

    def _observe(self, stats, depth, merge: LaurelMerge, stream, earlier) -> None:
        values = {}
        if merge.rw:
            values["alpha"], values["beta"] = merge.weights()
        if merge.lr:
            values["lr_norm"] = torch.linalg.matrix_norm(merge.laurel_up[0].double() @ merge.laurel_down[0].double())
        if merge.lr or merge.pa:
            x = stream.movedim(merge.dim, -1) if merge.dim not in (-1, stream.dim() - 1) else stream
            earlier = [h.movedim(merge.dim, -1) if merge.dim not in (-1, h.dim() - 1) else h for h in earlier]
            kw = dict(down=merge.laurel_down if merge.lr else None, up=merge.laurel_up if merge.lr else None,
                      norm_weight=merge.laurel_norm_weight if merge.lr and merge.config.lr_norm else None,
                      gamma=merge.laurel_gamma if merge.pa else None, earlier=earlier, eps=merge.config.eps)
            zero = torch.zeros_like(x)
            term = laurel_reference(x.double(), zero.double(), **kw) - x.double()  # L_i (no RW: x + L_i)
            rms = lambda v: v.square().mean(-1).sqrt()  # noqa: E731
            values["lr_ratio"] = rms(term) / rms(x.double()).clamp_min(1e-30)
        if merge.pa:
            values["gamma"] = merge.laurel_gamma
        stats.update(depth, **values)


class LaurelRule(_LaurelDiagnostics, MergeRule):
    """``x + u`` becomes ``alpha u + beta (x + B A x)`` (RW, LR, or both) at every merge, each with its own
    parameters."""

    Config = LaurelConfig
    description = "LAuReL: learned residual weights (RW) and / or a low-rank term (LR) at every merge, identity init"
    identity_at_init = {"rw_norm": "sigmoid"}

    def summary(self):
        c = self.config
        return f"{c.variant}" + (f", rank={c.rank}" if "lr" in c.variant else "")

    def build_merge_sized(self, dim, width):
        return LaurelMerge(width, self.config, dim=dim, seed=init_seed(next(self._built)))

    def merge(self, module, stream, update, inplace):
        return module(stream, update)

    def observe(self, stats, depth, site, position, stream, update, state):
        self._observe(stats, depth, self.merge_module(site, position), stream, ())


class LaurelPARule(_LaurelDiagnostics, ChainRule):
    """The variants with previous activations: merge i reads the streams entering the k - 1 merges before it too,
    which the chain carries (the merges of one chain, in order)."""

    Config = LaurelPAConfig
    description = "LAuReL with previous activations (PA): each merge also adds learned terms of the k last streams"
    identity_at_init = {"rw_norm": "sigmoid"}
    chain_attr = "_resctl_laurel"

    def summary(self):
        c = self.config
        return f"{c.variant}, history={c.history}" + (f", rank={c.rank}" if "lr" in c.variant else "")

    def build_chain(self, dim, num_merges):
        return LaurelChain(dim, num_merges, self.config, seed=init_seed(next(self._built)))

    def start(self, chain, x):
        return laurel_start(x)

    def position(self, chain, k, next_k):
        return LaurelPosition(self, chain, k, next_k)

    def step(self, chain, k, state, u, next_k):
        return laurel_step(chain.merges[k], chain.history, state, u)

    def skip(self, chain, k, state, next_k):
        """Ablation *(choice)*: the merge is removed, as a per-merge rule's (the stream passes unchanged)."""
        return laurel_skip(chain.history, state)

    def stage_state(self, chain, state=None, *, packed=None):
        """The streams the next merges read as previous activations, newest first (at most ``history``; fewer
        near the chain's start): each once, as they are."""
        if packed is None:
            return tuple(state.streams)
        fresh = () if torch.compiler.is_compiling() or packed[0].is_inference() else tuple(t._version for t in packed)
        return LaurelState(tuple(packed), fresh)

    def observe(self, stats, depth, site, position, stream, update, state):
        if isinstance(state, LaurelState):
            x, *earlier = state.streams
            self._observe(stats, depth, self.merge_module(site, position), x, earlier)


register_merge_rule("laurel", LaurelRule)
register_merge_rule("laurel-pa", LaurelPARule)
