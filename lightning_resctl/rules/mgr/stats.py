"""MGR's diagnostics as a torchmetrics ``Metric``: gate beta per stream (``gate_mean``, ``gate_std``, ``gate_hist``:
counts in ``hist_bins`` equal bins over [0, 1]), ``forget_mean``, ``pool_entropy`` (``-sum_i a_i log a_i`` of the
pool weights, nats), per-stream ``stream_rms`` and ``angle`` (mean angle in radians between pairs of streams).
``gate_families`` flags ``gate_hist`` as gates in [0, 1]; ``notes()`` explains where the families start."""
from __future__ import annotations

import torch
from torch import Tensor

from ..stats import STATS_DTYPE, DepthMetric, safe_div

__all__ = ["MGRStats"]


class MGRStats(DepthMetric):
    """Multi-Gate Residual statistics per depth and stream (``streams`` = n).

    ``update(depth, streams=(..., n_k, C), beta=(..., n) or None, forget=(...) or None,
    pool=(..., n_k) or None)``; entries for streams not present yet (n_k < n) stay NaN.
    """

    family_prefix = "mgr_"
    #: histogram families whose values are gates in [0, 1] (the callbacks' ``summary/gate_saturation``)
    gate_families = ("gate_hist",)

    def notes(self) -> list[str]:
        """How to read these families (the callbacks show it next to the charts)."""
        n = self.streams
        return [
            f"gate families (`mgr_gate_*`, `mgr_forget_mean`) and gate histograms start at depth n-1 = {n - 1} of "
            f"each chain: the first n-1 merges fill the {n} streams (MGR's accumulation phase) and have no gate.",
            "`mgr_angle` is the mean angle (radians) between pairs of streams: near 0 means the streams collapsed "
            "into one.",
        ]

    def __init__(self, num_depths: int, streams: int, hist_bins: int = 20, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        if not isinstance(hist_bins, int) or hist_bins < 1:
            raise ValueError(f"hist_bins must be a positive int, got {hist_bins!r}")
        self.streams = streams
        self.hist_bins = hist_bins
        D, n = num_depths, streams
        self._state("beta_sum", (D, n))
        self._state("beta_sumsq", (D, n))
        self._state("beta_count", (D, n))
        self._state("beta_hist", (D, n, hist_bins))
        self._state("forget_sum", (D,))
        self._state("forget_count", (D,))
        self._state("entropy_sum", (D,))
        self._state("entropy_count", (D,))
        self._state("stream_sumsq", (D, n))
        self._state("stream_count", (D, n))
        self._state("angle_sum", (D,))
        self._state("angle_count", (D,))

    @torch.no_grad()
    def update(
        self,
        depth: int,
        streams: Tensor | None = None,
        beta: Tensor | None = None,
        forget: Tensor | None = None,
        pool: Tensor | None = None,
    ) -> None:
        d = self._check_depth(depth)
        if beta is not None:
            b = beta.detach().to(STATS_DTYPE).reshape(-1, beta.shape[-1])
            k = min(b.shape[-1], self.streams)
            b = b[:, :k]
            self.beta_sum[d, :k] += b.sum(0)
            self.beta_sumsq[d, :k] += b.square().sum(0)
            self.beta_count[d, :k] += b.shape[0]
            for i in range(k):
                hist = torch.histc(b[:, i].float(), bins=self.hist_bins, min=0.0, max=1.0)
                self.beta_hist[d, i] += hist.to(STATS_DTYPE)
        if forget is not None:
            f = forget.detach().to(STATS_DTYPE)
            self.forget_sum[d] += f.sum()
            self.forget_count[d] += f.numel()
        if pool is not None:
            a = pool.detach().to(STATS_DTYPE)
            ent = -(a * a.clamp_min(1e-300).log()).sum(-1)
            self.entropy_sum[d] += ent.sum()
            self.entropy_count[d] += ent.numel()
        if streams is not None:
            s = streams.detach().to(STATS_DTYPE)
            k = min(s.shape[-2], self.streams)
            s = s[..., :k, :]
            flat = s.reshape(-1, k, s.shape[-1])
            self.stream_sumsq[d, :k] += flat.square().sum(dim=(0, 2))
            self.stream_count[d, :k] += flat.shape[0] * flat.shape[2]
            if k > 1:
                unit = flat / flat.norm(dim=-1, keepdim=True).clamp_min(1e-30)
                cos = unit @ unit.transpose(-1, -2)
                iu = torch.triu_indices(k, k, offset=1, device=cos.device)
                ang = cos[:, iu[0], iu[1]].clamp(-1.0, 1.0).acos()
                self.angle_sum[d] += ang.sum()
                self.angle_count[d] += ang.numel()

    def compute(self) -> dict[str, Tensor]:
        mean = safe_div(self.beta_sum, self.beta_count)
        var = (safe_div(self.beta_sumsq, self.beta_count) - mean.square()).clamp_min(0)
        return {
            "gate_mean": mean,
            "gate_std": var.sqrt(),
            "forget_mean": safe_div(self.forget_sum, self.forget_count),
            "pool_entropy": safe_div(self.entropy_sum, self.entropy_count),
            "stream_rms": safe_div(self.stream_sumsq, self.stream_count).sqrt(),
            "angle": safe_div(self.angle_sum, self.angle_count),
            "gate_hist": self.beta_hist.clone(),  # (D, n, hist_bins) counts, reduced over ranks like the rest
        }

    def histogram_edges(self) -> Tensor:
        """Bucket edges (hist_bins + 1,) of ``beta_hist`` over [0, 1]."""
        return torch.linspace(0.0, 1.0, self.hist_bins + 1, dtype=STATS_DTYPE)
