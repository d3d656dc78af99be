"""Diagnostics of the baseline chain rules as torchmetrics ``Metric`` objects (pattern of
:class:`lightning_resctl.metrics.MGRStats`: every state a sum or a count declared once with
``dist_reduce_fx="sum"``, accumulated in fp64, so reducing over ranks then ``compute()`` equals one process
on the union of the data).

* :class:`AttnResStats` — ``attnres_weight (D, M)``: mean depth-attention weight alpha per source
  (source 0 = the chain input; NaN where merge d has fewer sources), ``attnres_entropy (D,)``:
  mean ``-sum_i alpha_i log alpha_i`` (nats), ``attnres_sources (D,)``: sources seen by merge d.
* :class:`FrameStats` — hyper-connection coefficients of merge d (``prefix`` = "hc", "mhc", "mhcl"):
  ``{p}_res_identity_dist (D,)``: mean Frobenius ``||res - I||``; ``{p}_ds_error (D,)``: mean of
  ``max(|row sums - 1|, |column sums - 1|)`` (doubly-stochastic error; 0 up to rounding for mHC-lite);
  ``{p}_pre_mean (D, n)``, ``{p}_post_mean (D, n)``: mean pre / post per stream.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..metrics import _DT, _DepthMetric, _safe_div

__all__ = ["AttnResStats", "FrameStats"]


class AttnResStats(_DepthMetric):
    """``update(depth, alpha=(..., m))``: the depth-attention weights of merge ``depth`` over its m sources."""

    def __init__(self, num_depths: int, max_sources: int, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        if not isinstance(max_sources, int) or max_sources < 1:
            raise ValueError(f"max_sources must be a positive int, got {max_sources!r}")
        self.max_sources = max_sources
        D, M = num_depths, max_sources
        self._state("weight_sum", (D, M))
        self._state("weight_count", (D, M))
        self._state("entropy_sum", (D,))
        self._state("entropy_count", (D,))
        self._state("sources_sum", (D,))

    @torch.no_grad()
    def update(self, depth: int, alpha: Tensor) -> None:
        d = self._check_depth(depth)
        a = alpha.detach().to(_DT).reshape(-1, alpha.shape[-1])
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
            "attnres_weight": _safe_div(self.weight_sum, self.weight_count),
            "attnres_entropy": _safe_div(self.entropy_sum, self.entropy_count),
            "attnres_sources": _safe_div(self.sources_sum, self.entropy_count),
        }


class FrameStats(_DepthMetric):
    """``update(depth, pre=(..., n), res=(..., n, n), post=(..., n))``: merge ``depth``'s coefficients."""

    def __init__(self, num_depths: int, streams: int, prefix: str = "hc", **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        self.streams, self.prefix = streams, prefix
        D, n = num_depths, streams
        self._state("dist_sum", (D,))
        self._state("ds_sum", (D,))
        self._state("rows", (D,))
        self._state("pre_sum", (D, n))
        self._state("post_sum", (D, n))

    @torch.no_grad()
    def update(self, depth: int, pre: Tensor, res: Tensor, post: Tensor) -> None:
        d = self._check_depth(depth)
        n = self.streams
        r = res.detach().to(_DT).reshape(-1, n, n)
        eye = torch.eye(n, dtype=_DT, device=r.device)
        self.dist_sum[d] += (r - eye).square().sum((-1, -2)).sqrt().sum()
        err = torch.maximum((r.sum(-1) - 1).abs().amax(-1), (r.sum(-2) - 1).abs().amax(-1))
        self.ds_sum[d] += err.sum()
        self.rows[d] += r.shape[0]
        self.pre_sum[d] += pre.detach().to(_DT).reshape(-1, n).sum(0)
        self.post_sum[d] += post.detach().to(_DT).reshape(-1, n).sum(0)

    def compute(self) -> dict[str, Tensor]:
        p = self.prefix
        rows = self.rows.unsqueeze(-1)
        return {
            f"{p}_res_identity_dist": _safe_div(self.dist_sum, self.rows),
            f"{p}_ds_error": _safe_div(self.ds_sum, self.rows),
            f"{p}_pre_mean": _safe_div(self.pre_sum, rows.expand_as(self.pre_sum)),
            f"{p}_post_mean": _safe_div(self.post_sum, rows.expand_as(self.post_sum)),
        }
