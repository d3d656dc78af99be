"""``dwa`` (DenseFormer's depth-weighted average, Pagliardini et al. 2402.02622) as a chain rule that acts per block
(docs/rules/dwa.md; the formula: :mod:`.reference`; the training path: :mod:`.ops`)."""
from __future__ import annotations

import torch

from ..base import ChainRule, register_merge_rule
from .config import DWAConfig
from .modules import DWAChain
from .ops import DWAState, dwa_advance, dwa_start
from .reference import dwa_sources

__all__ = ["DWARule"]


class DWARule(ChainRule):
    """The merges inside a block are the model's plain additions; the last merge of a block records the block's
    output and, where an average follows the block, returns it. A block is what the surgery groups (the merges one
    module of the model's stack of blocks runs) or ``merges_per_block`` merges; the patch report's chain note says
    which."""

    Config = DWAConfig
    description = "DenseFormer: after each block, a learned weighted average of the earlier blocks' outputs"
    identity_at_init = True  # alpha_{i,i} = 1, the others 0: Y_i = X_i exactly (paper §3)
    chain_attr = "_resctl_dwa"

    def summary(self):
        c = self.config
        return f"{c.dilation}x{c.period}" + ("" if c.schedule == "paper" else f" {c.schedule}")

    def build_chain(self, dim, num_merges):
        """A chain of ``num_merges`` merges in blocks of ``merges_per_block`` (1 when unset: the surgery passes its
        grouping through :meth:`build_chain_in_blocks`)."""
        m = self.config.merges_per_block or 1
        blocks = tuple(min(m, num_merges - s) for s in range(0, num_merges, m))
        return self._chain(dim, blocks, f"blocks of merges_per_block={m} merges")

    def build_chain_in_blocks(self, dim, blocks):
        if self.config.merges_per_block is not None:
            return self.build_chain(dim, sum(blocks))
        return self._chain(dim, blocks, "the surgery's grouping: the merges of one module of the model's blocks")

    def _chain(self, dim, blocks, grouping):
        c = self.config
        return DWAChain(dim, blocks, c.dilation, c.period, c.schedule, grouping)

    # ---- runtime
    def start(self, chain, x):
        return dwa_start(chain, x)

    def step(self, chain, k, state, u, next_k):
        state = dwa_advance(chain, k, next_k, state, u)
        return state, state.stream.view_as(state.stream)  # (a tensor the state does not hold: see LaurelPARule)

    def skip(self, chain, k, state, next_k):
        """Ablation *(choice)*: the update is dropped; a block ending here still records its output (the stream
        without this update) and its average runs."""
        state = dwa_advance(chain, k, next_k, state, None)
        return state, state.stream.view_as(state.stream)

    def stage_state(self, chain, state=None, *, packed=None):
        """The stream, then one tensor per completed block: its output where a later average reads it (each once),
        an empty tensor where none does (the history's structure in the tensors' shapes, which the pipeline's shape
        inference keeps: its received values are zeros)."""
        if packed is None:
            done = len(state.history) - 1
            later = {j for i in map(int, chain.averages) if i > done for j in dwa_sources(i, chain.dilation)}
            none = state.stream.new_empty(0)
            return (state.stream, *(t if j in later and t is not None else none
                                    for j, t in enumerate(state.history)))
        stream, *outputs = packed
        history = tuple(None if t.numel() == 0 else t for t in outputs)
        fresh = () if torch.compiler.is_compiling() or stream.is_inference() else tuple(
            -1 if t is None else t._version for t in history)
        return DWAState(stream, history, fresh)

    def merge_module(self, site, position):
        """The weights of the average merge ``position`` ends with (None: it ends none)."""
        chain = site.chain_module
        block = chain.block_end.get(int(position))
        return None if block is None or str(block) not in chain.averages else chain.averages[str(block)]

    # ---- diagnostics
    def make_stats(self, num_depths, model):
        from .stats import DWAStats  # torchmetrics: imported when diagnostics are asked for

        sizes = [m.num_blocks + 1 for m in model.modules() if isinstance(m, DWAChain)]
        return DWAStats(num_depths, max(sizes) if sizes else num_depths + 1)

    def observe(self, stats, depth, site, position, stream, update, state):
        if not isinstance(state, DWAState):
            return
        chain = site.chain_module
        block = chain.block_end.get(int(position))
        weights = None if block is None else chain.weights(block)
        if weights is not None:
            stats.update(depth, sources=dwa_sources(block, chain.dilation), alpha=weights)


register_merge_rule("dwa", DWARule)
