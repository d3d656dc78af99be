"""AttnRes's diagnostics as a torchmetrics ``Metric``: ``attnres_weight (D, M)``: mean depth-attention weight alpha
per source (source 0 = the chain input; NaN where merge d has fewer sources), ``attnres_entropy (D,)``: mean
``-sum_i alpha_i log alpha_i`` (nats), ``attnres_sources (D,)``: sources seen by merge d."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, SourceWeightsMetric, safe_div

__all__ = ["AttnResStats"]


class AttnResStats(SourceWeightsMetric):
    """``update(depth, alpha=(..., m))``: the depth-attention weights of merge ``depth`` over its m sources."""

    def __init__(self, num_depths: int, max_sources: int, **kwargs) -> None:
        super().__init__(num_depths, max_sources, **kwargs)
        D = num_depths
        self._state("entropy_sum", (D,))
        self._state("entropy_count", (D,))
        self._state("sources_sum", (D,))

    @torch.no_grad()
    def update(self, depth: int, alpha: Tensor) -> None:
        d = self._check_depth(depth)
        a = alpha.detach().to(STATS_DTYPE).reshape(-1, alpha.shape[-1])
        m = a.shape[-1]
        if m > self.max_sources:
            raise ValueError(f"alpha has {m} sources, more than max_sources={self.max_sources}")
        self.weight_sum[d, :m] += a.sum(0)
        self.weight_count[d, :m] += a.shape[0]
        ent = -(a * a.clamp_min(1e-300).log()).sum(-1)
        self.entropy_sum[d] += ent.sum()
        self.entropy_count[d] += ent.numel()
        self.sources_sum[d] += m * ent.numel()

    def compute(self) -> dict[str, Tensor]:
        return {
            "attnres_weight": safe_div(self.weight_sum, self.weight_count),
            "attnres_entropy": safe_div(self.entropy_sum, self.entropy_count),
            "attnres_sources": safe_div(self.sources_sum, self.entropy_count),
        }
