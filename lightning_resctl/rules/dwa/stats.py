"""DWA's diagnostics as a torchmetrics ``Metric``: ``dwa_weight (D, M)``: the weight of the average that merge d ends
with on the output of block j (column j; block 0 = the chain input; NaN where merge d ends no average or the
average does not read block j) — a depth x source heat map, as the paper's Fig. 5; ``dwa_self_weight (D,)``: the
weight on the block's own output (1 at init)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, SourceWeightsMetric, safe_div

__all__ = ["DWAStats"]


class DWAStats(SourceWeightsMetric):
    """``update(depth, sources=[j ...], alpha=(m,))``: the weights of the average merge ``depth`` ends with."""

    def __init__(self, num_depths: int, max_sources: int, **kwargs) -> None:
        super().__init__(num_depths, max_sources, **kwargs)
        D = num_depths
        self._state("self_sum", (D,))
        self._state("self_count", (D,))

    @torch.no_grad()
    def update(self, depth: int, sources: list, alpha: Tensor) -> None:
        d = self._check_depth(depth)
        a = alpha.detach().to(STATS_DTYPE).reshape(-1)
        if len(sources) != a.numel() or max(sources) >= self.max_sources:
            raise ValueError(f"alpha has {a.numel()} weights for sources {sources} (max_sources={self.max_sources})")
        idx = torch.tensor(sources, device=self.weight_sum.device)
        self.weight_sum[d].index_add_(0, idx, a.to(self.weight_sum.device))
        self.weight_count[d].index_add_(0, idx, torch.ones_like(a, device=self.weight_sum.device))
        self.self_sum[d] += a[-1].to(self.self_sum.device)
        self.self_count[d] += 1

    def compute(self) -> dict[str, Tensor]:
        return {"dwa_weight": safe_div(self.weight_sum, self.weight_count),
                "dwa_self_weight": safe_div(self.self_sum, self.self_count)}
