"""ResController's diagnostics as a torchmetrics ``Metric``: ``alpha_mean``, ``beta_mean`` (means over rows of the
update and stream scales) and ``update_cap_frac``, ``stream_cap_frac`` (fraction of rows whose cap is active)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, DepthMetric, safe_div

__all__ = ["ControllerStats"]


class ControllerStats(DepthMetric):
    """ResController scales per depth: fed with ``ControllerScales`` (``alpha``, ``beta``,
    ``update_cap_active``, ``stream_cap_active``; one entry per row)."""

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        D = num_depths
        for name in ("alpha_sum", "beta_sum", "ucap_sum", "scap_sum", "rows"):
            self._state(name, (D,))

    @torch.no_grad()
    def update(self, depth: int, scales) -> None:
        d = self._check_depth(depth)
        self.alpha_sum[d] += scales.alpha.detach().to(STATS_DTYPE).sum()
        self.beta_sum[d] += scales.beta.detach().to(STATS_DTYPE).sum()
        self.ucap_sum[d] += scales.update_cap_active.detach().to(STATS_DTYPE).sum()
        self.scap_sum[d] += scales.stream_cap_active.detach().to(STATS_DTYPE).sum()
        self.rows[d] += scales.alpha.numel()

    def compute(self) -> dict[str, Tensor]:
        return {
            "alpha_mean": safe_div(self.alpha_sum, self.rows),
            "beta_mean": safe_div(self.beta_sum, self.rows),
            "update_cap_frac": safe_div(self.ucap_sum, self.rows),
            "stream_cap_frac": safe_div(self.scap_sum, self.rows),
        }
