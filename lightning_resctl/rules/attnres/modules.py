"""AttnRes nn.Modules: :class:`AttnResMerge` (a site's parameters) and :class:`AttnResChain` (one chain)."""
from __future__ import annotations

import torch
from torch import nn

from .config import AttnResConfig
from .reference import num_sources

__all__ = ["AttnResMerge", "AttnResChain"]


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

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, key_norm_affine={self.key_norm_affine}"


class AttnResChain(nn.Module):
    """One AttnRes chain: ``merges[k]`` (site k's query), the block size S (1 = Full AttnRes) and the key-norm eps."""

    def __init__(self, dim: int, num_merges: int, block_size: int = 1,
                 key_norm_affine: bool = AttnResConfig.key_norm_affine, eps: float = AttnResConfig.eps):
        super().__init__()
        self.dim, self.num_merges, self.block_size = int(dim), int(num_merges), int(block_size)
        self.eps = float(eps)
        self.merges = nn.ModuleList(AttnResMerge(k, dim, key_norm_affine) for k in range(num_merges))

    def reset_parameters(self) -> None:
        for m in self.merges:
            m.reset_parameters()

    @property
    def max_sources(self) -> int:
        return max(num_sources(t, self.block_size) for t in range(1, self.num_merges + 1))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_merges={self.num_merges}, block_size={self.block_size}"
