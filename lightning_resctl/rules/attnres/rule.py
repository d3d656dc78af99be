"""``attnres`` (Full Attention Residuals) and ``attnres-block`` (Block AttnRes), Kimi Team 2603.15031, as chain
rules (docs/rules/attnres.md; the formula: :mod:`.reference`; the training path: :mod:`.ops`)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import ChainRule, register_merge_rule
from ..common import compute_dtype
from .config import AttnResConfig, BlockAttnResConfig
from .modules import AttnResChain, BlockAttnResPosition
from .ops import (
                  AttnResState,
                  BlockState,
                  TritonState,
                  advance,
                  block_logits,
                  block_start,
                  pool,
                  site_queries,
                  triton_start,
                  triton_step,
                  triton_to_sources,
                  uses_triton,
)
from .reference import default_block_size

__all__ = ["AttnResRule", "BlockAttnResRule"]


class AttnResRule(ChainRule):
    Config = AttnResConfig
    description = "Full Attention Residuals: each sub-layer reads a softmax-weighted mix of all earlier updates"
    identity_at_init = True  # pre-norm models, up to the norms' eps (docs/rules/attnres.md); Block AttnRes too
    chain_attr = "_resctl_attnres"

    def block_size(self, num_merges: int) -> int:
        return 1

    def summary(self):
        return "full"

    def build_chain(self, dim, num_merges):
        c = self.config
        return AttnResChain(dim, num_merges, self.block_size(num_merges), c.key_norm_affine, c.eps, c.backend)

    # ---- runtime
    def start(self, chain, x):
        if uses_triton(chain, x):  # the fused kernels: the sources in one buffer per forward
            return triton_start(chain, x)
        v = x.to(compute_dtype(x))
        queries = site_queries(chain, v.dtype)
        return AttnResState((v,), (block_logits(chain, v, queries, 0),), (0,), None, 0, queries)

    def _read(self, chain, state, next_k, dtype):
        h, _ = pool(chain, next_k - 1, state)
        return state, h.to(dtype)

    def step(self, chain, k, state, u, next_k):
        if isinstance(state, TritonState):
            if k == state.t and next_k == k + 1:
                return triton_step(chain, k, state, u)
            state = triton_to_sources(chain, state)  # out of order (no grad): the torch path from here
        state = advance(chain, k, state, u.to(compute_dtype(u)))
        return self._read(chain, state, next_k, u.dtype)

    def skip(self, chain, k, state, next_k):
        """Ablation *(choice)*: the update is not added to any source (Full: no new source); block boundaries stay
        where they are."""
        if isinstance(state, TritonState):
            state = triton_to_sources(chain, state)
        dtype = state.blocks[0].dtype
        return self._read(chain, advance(chain, k, state, None), next_k, dtype)

    def streams(self, chain, state):
        """The current sources stacked ``(..., m, C)`` (diagnostics only: a copy)."""
        if isinstance(state, (AttnResState, BlockState, TritonState)):
            return torch.stack(state.sources(), dim=-2)
        return state

    def stage_state(self, chain, state=None, *, packed=None):
        """The completed blocks (``b_0 = x`` first) and the partial block, each once, then an int64 ``layout``:
        ``[t, partial?, first_0, ..., first_{m-1}]`` for the sources as they are (:class:`~.ops.AttnResState`),
        ``[open]`` for Block AttnRes's stacked state in blocks compiled one by one (:class:`~.ops.BlockState`: the
        stack, its rms and the partial). The key logits and the queries are computed again on the next stage, from
        the blocks and the chain's parameters (on every stage). The Triton path's state (:class:`~.ops.TritonState`)
        crosses as the torch path's sources without grad mode, and is refused with it: its kernels keep the sources
        for the backward in one buffer of this stage (``backend='torch'`` trains a pipeline)."""
        if packed is None:
            if isinstance(state, TritonState):
                if torch.is_grad_enabled():
                    raise RuntimeError(
                        f"method={self.name!r} on the Triton kernels cannot hand its sources to another pipeline "
                        "stage while gradients are recorded (the kernels keep them for the backward in one buffer "
                        "of this stage): pass backend='torch' for pipeline parallel training")
                state = triton_to_sources(chain, state)
            if isinstance(state, BlockState):
                return (state.blocks, state.rms, state.partial, _layout([int(state.open)], state.partial))
            partial = [] if state.partial is None else [state.partial]
            layout = _layout([state.t, len(partial), *state.first], state.blocks[0])
            return (*state.blocks, *partial, layout)
        *tensors, layout = packed
        numbers = layout.tolist()
        if len(numbers) == 1:
            blocks, rms, partial = tensors
            return BlockState(blocks, rms, partial, bool(numbers[0]))
        t, has_partial, *first = numbers
        blocks = tuple(tensors[:len(first)])
        queries = site_queries(chain, blocks[0].dtype)
        logits = tuple(block_logits(chain, b, queries, f) for b, f in zip(blocks, first))
        return AttnResState(blocks, logits, tuple(first), tensors[len(first)] if has_partial else None, t, queries)

    def weights(self, chain, k: int, state: AttnResState, u: Tensor) -> Tensor:
        """alpha ``(..., m)`` of site k: its query over the sources after merging ``u`` into ``state``."""
        if isinstance(state, TritonState):
            with torch.no_grad():
                return self.weights(chain, k, triton_to_sources(chain, state), u)
        _, alpha = pool(chain, k, advance(chain, k, state, u.to(compute_dtype(u))))
        return alpha

    # ---- diagnostics
    def make_stats(self, num_depths, model):
        from .stats import AttnResStats  # torchmetrics: imported when diagnostics are asked for

        sizes = [m.max_sources for m in model.modules() if isinstance(m, AttnResChain)]
        return AttnResStats(num_depths, max(sizes) if sizes else num_depths + 1)

    def observe(self, stats, depth, site, position, stream, update, state):
        if not isinstance(state, (AttnResState, BlockState, TritonState)):
            return
        d = site.dim
        u = update.detach()
        if d != -1 and d != u.dim() - 1:
            u = u.movedim(d, -1)
        u = u.reshape(state.sources()[0].shape)
        stats.update(depth, alpha=self.weights(site.chain_module, int(position), state, u))


def _layout(numbers: list, like: Tensor) -> Tensor:
    """A state's structure as an int64 tensor on ``like``'s device (what crosses a stage boundary)."""
    return torch.tensor(numbers, dtype=torch.int64, device=like.device)


class BlockAttnResRule(AttnResRule):
    """Block AttnRes: as Full AttnRes over blocks of S merges. In blocks compiled one by one its state has one
    structure at any depth (:meth:`start_apart`: :class:`~.ops.BlockState`, the completed blocks stacked); eager and
    in a whole-model compile, the sources as they are (:class:`~.ops.AttnResState`: no stacked copies to save)."""

    Config = BlockAttnResConfig
    description = "Block Attention Residuals: sub-layers read a softmax-weighted mix of block sums of updates"
    chain_attr = "_resctl_attnres_block"

    def start_apart(self, chain, x):
        return block_start(chain, x.to(compute_dtype(x)))

    def position(self, chain, k, next_k):
        return BlockAttnResPosition(self, chain, k, next_k)

    def step(self, chain, k, state, u, next_k):
        if isinstance(state, BlockState):
            return self.position(chain, k, next_k).step(state, u)
        return super().step(chain, k, state, u, next_k)

    def skip(self, chain, k, state, next_k):
        if isinstance(state, BlockState):
            return self.position(chain, k, next_k).skip(state)
        return super().skip(chain, k, state, next_k)

    def weights(self, chain, k, state, u):
        if isinstance(state, BlockState):
            return self.position(chain, k, k + 1).weights(state, u)
        return super().weights(chain, k, state, u)

    def block_size(self, num_merges):
        c = self.config
        if c.block_size is not None:
            return c.block_size
        if c.num_blocks is not None:
            return math.ceil(num_merges / c.num_blocks)
        return default_block_size(num_merges)

    def summary(self):
        c = self.config
        if c.block_size is not None:
            return f"block_size={c.block_size}"
        return f"num_blocks={c.num_blocks}" if c.num_blocks is not None else "block_size=default"


register_merge_rule("attnres", AttnResRule)
register_merge_rule("attnres-block", BlockAttnResRule)
