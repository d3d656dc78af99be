"""KromHC's diagnostics: the frame's (:class:`~..stats.FrameStats` with prefix ``kromhc``: ``kromhc_res_identity_dist
(D,)``, ``kromhc_ds_error (D,)`` — 0 up to rounding —, ``kromhc_pre_mean (D, n)``, ``kromhc_post_mean (D, n)``) and
``kromhc_factor_identity_dist (D, K)``: the mean Frobenius distance ``||U_k - I||`` of each 2x2 factor
(``2 (1 - p_k)``; 6.7e-4 at init)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, FrameStats, safe_div

__all__ = ["KromHCStats"]


class KromHCStats(FrameStats):
    """``update(depth, pre=, res=, post=, factors=(..., K, 2, 2))``."""

    def __init__(self, num_depths: int, streams: int, **kwargs) -> None:
        super().__init__(num_depths, streams, prefix="kromhc", **kwargs)
        self.num_factors = streams.bit_length() - 1
        self._state("factor_dist_sum", (num_depths, self.num_factors))

    @torch.no_grad()
    def update(self, depth: int, pre: Tensor, res: Tensor, post: Tensor, factors: Tensor = None) -> None:
        super().update(depth, pre=pre, res=res, post=post)
        if factors is not None:
            f = factors.detach().to(STATS_DTYPE).reshape(-1, self.num_factors, 2, 2)
            eye = torch.eye(2, dtype=STATS_DTYPE, device=f.device)
            self.factor_dist_sum[depth] += (f - eye).square().sum((-1, -2)).sqrt().sum(0)

    def compute(self) -> dict[str, Tensor]:
        out = super().compute()
        rows = self.rows.unsqueeze(-1).expand_as(self.factor_dist_sum)
        out["kromhc_factor_identity_dist"] = safe_div(self.factor_dist_sum, rows)
        return out
