"""AttnRes nn.Modules: :class:`AttnResMerge` (a site's parameters) and :class:`AttnResChain` (one chain)."""
from __future__ import annotations

import torch
from torch import nn

from ..base import ChainPosition
from .config import AttnResConfig
from .ops import BlockState, block_advance, block_pool
from .reference import num_sources

__all__ = ["AttnResMerge", "AttnResChain", "BlockAttnResPosition"]


class AttnResMerge(nn.Module):
    """Site ``index``'s parameters: ``pool_query`` (C,) = w, zeros (paper §5); ``key_norm_weight`` (C,) = g, ones
    (only with ``key_norm_affine``)."""

    def __init__(self, index: int, dim: int, key_norm_affine: bool = AttnResConfig.key_norm_affine):
        super().__init__()
        self.index, self.dim, self.key_norm_affine = int(index), int(dim), bool(key_norm_affine)
        self.pool_query = nn.Parameter(torch.empty(dim))
        if self.key_norm_affine:
            self.key_norm_weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.pool_query.zero_()
        if self.key_norm_affine:
            self.key_norm_weight.fill_(1.0)

    def query(self, dtype: torch.dtype) -> torch.Tensor:
        """``q * g`` (C,) in ``dtype``: the vector this site's key logits are taken with."""
        q = self.pool_query.to(dtype)
        return q * self.key_norm_weight.to(dtype) if self.key_norm_affine else q

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, key_norm_affine={self.key_norm_affine}"


class AttnResChain(nn.Module):
    """One AttnRes chain: ``merges[k]`` (site k's query), the block size S (1 = Full AttnRes), the key-norm eps and
    the backend of its depth pool (``AttnResConfig.backend``)."""

    def __init__(self, dim: int, num_merges: int, block_size: int = 1,
                 key_norm_affine: bool = AttnResConfig.key_norm_affine, eps: float = AttnResConfig.eps,
                 backend: str = AttnResConfig.backend):
        super().__init__()
        self.dim, self.num_merges, self.block_size = int(dim), int(num_merges), int(block_size)
        self.eps = float(eps)
        self.backend = backend
        self.merges = nn.ModuleList(AttnResMerge(k, dim, key_norm_affine) for k in range(num_merges))

    def reset_parameters(self) -> None:
        for m in self.merges:
            m.reset_parameters()

    @property
    def max_sources(self) -> int:
        return max(num_sources(t, self.block_size) for t in range(1, self.num_merges + 1))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_merges={self.num_merges}, block_size={self.block_size}, backend={self.backend!r}"


class BlockAttnResPosition(ChainPosition):
    """Merge ``k`` of a Block AttnRes chain read next by merge ``next_k``: ``step(state, u) -> (state', h)``. Over a
    :class:`~.ops.BlockState` (blocks compiled one by one) it holds the reading site (``merges[next_k - 1]``:
    sub-layer j reads a pool with site j-1's query) and whether the partial block closes after this merge (at a block
    boundary, or when the next merge that runs is in a later block), not the position: the merges of one place in a
    block run the same graph at any depth. Over the sources as they are (:class:`~.ops.AttnResState`) it runs the
    rule by position."""

    shares_graphs = True

    def __init__(self, rule, chain: AttnResChain, k: int, next_k: int):
        super().__init__(rule, chain, k, next_k)
        s = chain.block_size
        self.__dict__["reader"] = chain.merges[min(next_k, chain.num_merges) - 1]
        self.closes = (k + 1) % s == 0 or (not self.output and k // s != next_k // s)

    def step(self, state, u: torch.Tensor) -> tuple:
        if not isinstance(state, BlockState):
            return super().step(state, u)
        return self._read(block_advance(self.chain, state, u.to(state.blocks.dtype), self.closes), u.dtype)

    def skip(self, state) -> tuple:
        """Ablation *(choice)*: the update is added to no block; block boundaries stay where they are."""
        if not isinstance(state, BlockState):
            return super().skip(state)
        return self._read(block_advance(self.chain, state, None, self.closes), state.blocks.dtype)

    def _read(self, state: BlockState, dtype: torch.dtype) -> tuple:
        h, _ = block_pool(state, self.reader.query(state.blocks.dtype), self.chain.eps)
        return state, h.to(dtype)

    def weights(self, state: BlockState, u: torch.Tensor) -> torch.Tensor:
        """alpha ``(..., m)`` of the pool after merging ``u`` into a :class:`~.ops.BlockState` (diagnostics)."""
        state = block_advance(self.chain, state, u.to(state.blocks.dtype), self.closes)
        return block_pool(state, self.reader.query(state.blocks.dtype), self.chain.eps)[1]
