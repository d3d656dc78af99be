"""LAuReL's diagnostics as a torchmetrics ``Metric`` (NaN where a merge's variant has no such part):
``laurel_alpha (D,)``, ``laurel_beta (D,)``: RW's weights of the update and of the stream term (mean over channels
with ``rw_per_dim``; 1 and 1 at init); ``laurel_lr_norm (D,)``: the Frobenius norm of the low-rank matrix ``B A``
(of the pair on the merge's own stream; 0 at init); ``laurel_lr_ratio (D,)``: mean RMS of the whole LR / PA term
``L_i`` over the stream's RMS (how much it adds); ``laurel_gamma (D, k)``: PA's weights per previous activation."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, DepthMetric, safe_div

__all__ = ["LaurelStats"]


class LaurelStats(DepthMetric):
    """``update(depth, alpha=, beta=, lr_norm=, lr_ratio=(tokens,), gamma=(k,))``, each optional; ``pairs``: the
    largest k (1 without PA)."""

    def __init__(self, num_depths: int, pairs: int = 1, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        self.history = int(pairs)
        D = num_depths
        for name in ("alpha", "beta", "lr_norm", "lr_ratio"):
            self._state(f"{name}_sum", (D,))
            self._state(f"{name}_count", (D,))
        self._state("gamma_sum", (D, self.history))
        self._state("gamma_count", (D, 1))

    @torch.no_grad()
    def update(self, depth: int, **values: Tensor) -> None:
        d = self._check_depth(depth)
        for name in ("alpha", "beta", "lr_norm", "lr_ratio"):
            v = values.get(name)
            if v is not None:
                v = v.detach().to(STATS_DTYPE).reshape(-1)
                getattr(self, f"{name}_sum")[d] += (v.mean() if name in ("alpha", "beta") else v.sum())
                getattr(self, f"{name}_count")[d] += 1 if name in ("alpha", "beta") else v.numel()
        g = values.get("gamma")
        if g is not None:
            self.gamma_sum[d, :g.numel()] += g.detach().to(STATS_DTYPE).reshape(-1)
            self.gamma_count[d] += 1

    def compute(self) -> dict[str, Tensor]:
        out = {f"laurel_{n}": safe_div(getattr(self, f"{n}_sum"), getattr(self, f"{n}_count"))
               for n in ("alpha", "beta", "lr_norm", "lr_ratio")}
        out["laurel_gamma"] = safe_div(self.gamma_sum, self.gamma_count.expand_as(self.gamma_sum))
        return out
