"""The base of every per-depth statistic (torchmetrics ``Metric``): a rule's stats (``rules/<name>/stats.py``) and
the generic ones (:mod:`lightning_resctl.diagnostics.metrics`) subclass :class:`DepthMetric`.

Every state is a sum, a count, a maximum or a fixed-bin histogram, declared once with
``add_state(..., dist_reduce_fx="sum"|"max")`` and accumulated in fp64, so reducing the states over ranks and then
calling ``compute()`` gives exactly what one process would compute on the union of the ranks' data (up to float
summation order). Depth ``d`` is the index of a merge, ordered by chain, then position (``merge_sites(model)``
order).

:class:`FrameStats` — the hyper-connection family's coefficients (``hc``, ``mhc``, ``mhc-lite`` share it; here, not
in :mod:`.frame`, so that importing the rules does not import torchmetrics) of merge d (``prefix`` = "hc", "mhc",
"mhcl"): ``{p}_res_identity_dist (D,)``: mean Frobenius ``||res - I||``; ``{p}_ds_error (D,)``: mean of
``max(|row sums - 1|, |column sums - 1|)`` (doubly-stochastic error; 0 up to rounding for mHC-lite);
``{p}_pre_mean (D, n)``, ``{p}_post_mean (D, n)``: mean pre / post per stream.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["DepthMetric", "SourceWeightsMetric", "safe_div", "as_float", "STATS_DTYPE", "FrameStats"]

STATS_DTYPE = torch.float64


def _check_depths(num_depths: int) -> int:
    if not isinstance(num_depths, int) or isinstance(num_depths, bool) or num_depths < 1:
        raise ValueError(f"num_depths must be a positive int, got {num_depths!r}")
    return num_depths


def as_float(t: Tensor) -> Tensor:
    """Detached fp32 (or fp64) view of ``t``: sums of it are accumulated in fp64."""
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, NaN where den == 0 (nothing observed)."""
    out = num / den.clamp_min(1e-300)
    return torch.where(den > 0, out, torch.full_like(out, float("nan")))


class DepthMetric(Metric):
    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_depths = _check_depths(num_depths)

    def _state(self, name: str, shape: tuple[int, ...], fx: str = "sum") -> None:
        self.add_state(name, default=torch.zeros(shape, dtype=STATS_DTYPE), dist_reduce_fx=fx)

    def _check_depth(self, depth: int) -> int:
        if not 0 <= depth < self.num_depths:
            raise ValueError(f"depth must be in [0, {self.num_depths}), got {depth!r}")
        return depth


class SourceWeightsMetric(DepthMetric):
    """A depth metric over weights that each merge puts on up to ``max_sources`` sources (AttnRes's depth
    attention, DWA's averages): the states ``weight_sum`` / ``weight_count`` ``(D, max_sources)``; a subclass adds its
    own and fills them in ``update``."""

    def __init__(self, num_depths: int, max_sources: int, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        if not isinstance(max_sources, int) or max_sources < 1:
            raise ValueError(f"max_sources must be a positive int, got {max_sources!r}")
        self.max_sources = max_sources
        self._state("weight_sum", (num_depths, max_sources))
        self._state("weight_count", (num_depths, max_sources))


class FrameStats(DepthMetric):
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
        r = res.detach().to(STATS_DTYPE).reshape(-1, n, n)
        eye = torch.eye(n, dtype=STATS_DTYPE, device=r.device)
        self.dist_sum[d] += (r - eye).square().sum((-1, -2)).sqrt().sum()
        err = torch.maximum((r.sum(-1) - 1).abs().amax(-1), (r.sum(-2) - 1).abs().amax(-1))
        self.ds_sum[d] += err.sum()
        self.rows[d] += r.shape[0]
        self.pre_sum[d] += pre.detach().to(STATS_DTYPE).reshape(-1, n).sum(0)
        self.post_sum[d] += post.detach().to(STATS_DTYPE).reshape(-1, n).sum(0)

    def compute(self) -> dict[str, Tensor]:
        p = self.prefix
        rows = self.rows.unsqueeze(-1)
        return {
            f"{p}_res_identity_dist": safe_div(self.dist_sum, self.rows),
            f"{p}_ds_error": safe_div(self.ds_sum, self.rows),
            f"{p}_pre_mean": safe_div(self.pre_sum, rows.expand_as(self.pre_sum)),
            f"{p}_post_mean": safe_div(self.post_sum, rows.expand_as(self.post_sum)),
        }
