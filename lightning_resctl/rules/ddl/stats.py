"""DDL's diagnostics as a torchmetrics ``Metric``: ``ddl_beta_mean (D,)``, ``ddl_beta_std (D,)``: the gate beta in
(0, 2) (0: skip, 1: overwrite the readout along k, 2: reflect); ``ddl_proj_mean (D,)``, ``ddl_proj_rms (D,)``: the
readout ``k . x`` of the stream along the update's direction; ``ddl_value_mean (D,)``: the value v written there."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, DepthMetric, safe_div

__all__ = ["DDLStats"]


class DDLStats(DepthMetric):
    """``update(depth, beta=(..., 1), proj=(..., 1), value=(..., 1))``: merge ``depth``'s per-token values."""

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        for name in ("beta_sum", "beta_sq", "proj_sum", "proj_sq", "value_sum", "count"):
            self._state(name, (num_depths,))

    @torch.no_grad()
    def update(self, depth: int, beta: Tensor, proj: Tensor, value: Tensor) -> None:
        d = self._check_depth(depth)
        b, p, v = (t.detach().to(STATS_DTYPE).reshape(-1) for t in (beta, proj, value))
        self.beta_sum[d] += b.sum()
        self.beta_sq[d] += b.square().sum()
        self.proj_sum[d] += p.sum()
        self.proj_sq[d] += p.square().sum()
        self.value_sum[d] += v.sum()
        self.count[d] += b.numel()

    def compute(self) -> dict[str, Tensor]:
        n = self.count
        mean = safe_div(self.beta_sum, n)
        return {"ddl_beta_mean": mean,
                "ddl_beta_std": (safe_div(self.beta_sq, n) - mean.square()).clamp_min(0).sqrt(),
                "ddl_proj_mean": safe_div(self.proj_sum, n),
                "ddl_proj_rms": safe_div(self.proj_sq, n).sqrt(),
                "ddl_value_mean": safe_div(self.value_sum, n)}
