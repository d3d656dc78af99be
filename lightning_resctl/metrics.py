"""Per-depth residual statistics as torchmetrics ``Metric`` objects.

Every state is a sum, a count, a maximum or a fixed-bin histogram, declared with
``add_state(..., dist_reduce_fx="sum"|"max")``, so reducing the states over ranks
and then calling :meth:`compute` gives exactly what one process would compute on
the union of the ranks' data (up to float summation order). Squares are formed in
fp32 (fp64 for fp64 inputs) and accumulated in fp64. Depth ``d`` is the index of a merge,
ordered by chain, then position (``merge_sites(model)`` order).

Families (``compute()`` returns ``{family: tensor (D,)}`` or ``(D, n)`` for per-stream ones):

* :class:`StreamStats` — ``stream_rms[d] = sqrt(sum x^2 / N)`` of the stream entering merge d,
  ``update_rms`` likewise for the update, ``update_ratio = update_rms / stream_rms``,
  ``growth[d] = stream_rms[d] / stream_rms[start of d's chain]``, ``max_abs = max |x|``,
  ``max_over_median = max |x| / median |x|`` (the median read off a log2-spaced histogram of
  ``|x|`` with :data:`ABS_BINS_PER_OCTAVE` bins per octave, interpolated geometrically in the bin).
* :class:`ControllerStats` — ResController's ``alpha_mean``, ``beta_mean`` (means over rows of
  the update and stream scales) and ``update_cap_frac``, ``stream_cap_frac`` (fraction of rows
  whose cap is active).
* :class:`MGRStats` — gate beta per stream (``gate_mean``, ``gate_std``, ``gate_hist``: counts in
  ``hist_bins`` equal bins over [0, 1]), ``forget_mean``, ``pool_entropy`` (``-sum_i a_i log a_i`` of the pool weights, nats),
  per-stream ``stream_rms`` and ``angle`` (mean angle in radians between pairs of streams).
  ``gate_families`` flags ``gate_hist`` as gates in [0, 1]; ``notes()`` explains where the families start.
* :class:`GradStats` — ``stream_grad_rms`` (RMS of d loss / d stream at merge d) and
  ``param_grad_rms`` (RMS over all gradient entries of the parameters of merge d's branch).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "StreamStats",
    "ControllerStats",
    "MGRStats",
    "GradStats",
    "ABS_BINS_PER_OCTAVE",
    "ABS_LOG2_RANGE",
    "histogram_median",
]

#: |x| histogram used for the median: log2(|x|) in ABS_LOG2_RANGE, ABS_BINS_PER_OCTAVE bins per octave.
ABS_LOG2_RANGE = (-32.0, 32.0)
ABS_BINS_PER_OCTAVE = 16
_ABS_BINS = int((ABS_LOG2_RANGE[1] - ABS_LOG2_RANGE[0]) * ABS_BINS_PER_OCTAVE)
_DT = torch.float64


def _check_depths(num_depths: int) -> int:
    if not isinstance(num_depths, int) or isinstance(num_depths, bool) or num_depths < 1:
        raise ValueError(f"num_depths must be a positive int, got {num_depths!r}")
    return num_depths


def _float(t: Tensor) -> Tensor:
    """Detached fp32 (or fp64) view of ``t``: sums of it are accumulated in fp64."""
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, NaN where den == 0 (nothing observed)."""
    out = num / den.clamp_min(1e-300)
    return torch.where(den > 0, out, torch.full_like(out, float("nan")))


def histogram_median(hist: Tensor, lo: float = ABS_LOG2_RANGE[0], hi: float = ABS_LOG2_RANGE[1]) -> Tensor:
    """Median of values whose log2 was histogrammed in ``[lo, hi]`` (last dim = bins).

    Returns ``2 ** m`` where ``m`` interpolates linearly inside the bin holding the middle count
    (NaN for an empty histogram).
    """
    bins = hist.shape[-1]
    width = (hi - lo) / bins
    total = hist.sum(-1, keepdim=True)
    cum = hist.cumsum(-1)
    half = total / 2
    idx = torch.searchsorted(cum.contiguous(), half.contiguous()).clamp(max=bins - 1)
    below = torch.where(idx > 0, cum.gather(-1, (idx - 1).clamp_min(0)), torch.zeros_like(half))
    inbin = hist.gather(-1, idx).clamp_min(1e-300)
    frac = ((half - below) / inbin).clamp(0, 1)
    log2 = lo + (idx.to(hist.dtype) + frac) * width
    med = torch.exp2(log2).squeeze(-1)
    return torch.where(total.squeeze(-1) > 0, med, torch.full_like(med, float("nan")))


class _DepthMetric(Metric):
    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_depths = _check_depths(num_depths)

    def _state(self, name: str, shape: tuple[int, ...], fx: str = "sum") -> None:
        self.add_state(name, default=torch.zeros(shape, dtype=_DT), dist_reduce_fx=fx)

    def _check_depth(self, depth: int) -> int:
        if not 0 <= depth < self.num_depths:
            raise ValueError(f"depth must be in [0, {self.num_depths}), got {depth!r}")
        return depth


class StreamStats(_DepthMetric):
    """Stream energy and activation growth per depth (see the module docstring for the formulas).

    ``chain_starts[d]`` is the depth index of the first merge of d's chain (default: 0 for all).
    """

    def __init__(self, num_depths: int, chain_starts: Sequence[int] | None = None, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        if chain_starts is None:
            chain_starts = [0] * num_depths
        chain_starts = list(chain_starts)
        if len(chain_starts) != num_depths or any(not 0 <= c < num_depths for c in chain_starts):
            raise ValueError(f"chain_starts must hold {num_depths} depth indices, got {chain_starts!r}")
        self.chain_starts = chain_starts
        D = num_depths
        self._state("stream_sumsq", (D,))
        self._state("stream_count", (D,))
        self._state("update_sumsq", (D,))
        self._state("update_n", (D,))
        self._state("max_abs", (D,), "max")
        self._state("abs_hist", (D, _ABS_BINS))

    @torch.no_grad()
    def update(self, depth: int, stream: Tensor, update: Tensor | None = None) -> None:
        d = self._check_depth(depth)
        s = _float(stream)
        self.stream_sumsq[d] += s.square().sum(dtype=_DT)
        self.stream_count[d] += s.numel()
        if s.numel():
            a = s.abs()
            self.max_abs[d] = torch.maximum(self.max_abs[d], a.max().to(_DT))
            lg = torch.log2(a.clamp_(min=2.0**-126)).clamp_(*ABS_LOG2_RANGE)
            self.abs_hist[d] += torch.histc(lg, bins=_ABS_BINS, min=ABS_LOG2_RANGE[0], max=ABS_LOG2_RANGE[1]).to(_DT)
        if update is not None:
            u = _float(update)
            self.update_sumsq[d] += u.square().sum(dtype=_DT)
            self.update_n[d] += u.numel()

    def compute(self) -> dict[str, Tensor]:
        stream_rms = _safe_div(self.stream_sumsq, self.stream_count).sqrt()
        update_rms = _safe_div(self.update_sumsq, self.update_n).sqrt()
        start = stream_rms[torch.as_tensor(self.chain_starts, device=stream_rms.device)]
        median = histogram_median(self.abs_hist)
        seen = self.stream_count > 0
        max_abs = torch.where(seen, self.max_abs, torch.full_like(self.max_abs, float("nan")))
        return {
            "stream_rms": stream_rms,
            "update_rms": update_rms,
            "update_ratio": update_rms / stream_rms,
            "growth": stream_rms / start,
            "max_abs": max_abs,
            "max_over_median": max_abs / median,
        }


class ControllerStats(_DepthMetric):
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
        self.alpha_sum[d] += scales.alpha.detach().to(_DT).sum()
        self.beta_sum[d] += scales.beta.detach().to(_DT).sum()
        self.ucap_sum[d] += scales.update_cap_active.detach().to(_DT).sum()
        self.scap_sum[d] += scales.stream_cap_active.detach().to(_DT).sum()
        self.rows[d] += scales.alpha.numel()

    def compute(self) -> dict[str, Tensor]:
        return {
            "alpha_mean": _safe_div(self.alpha_sum, self.rows),
            "beta_mean": _safe_div(self.beta_sum, self.rows),
            "update_cap_frac": _safe_div(self.ucap_sum, self.rows),
            "stream_cap_frac": _safe_div(self.scap_sum, self.rows),
        }


class MGRStats(_DepthMetric):
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
            b = beta.detach().to(_DT).reshape(-1, beta.shape[-1])
            k = min(b.shape[-1], self.streams)
            b = b[:, :k]
            self.beta_sum[d, :k] += b.sum(0)
            self.beta_sumsq[d, :k] += b.square().sum(0)
            self.beta_count[d, :k] += b.shape[0]
            for i in range(k):
                self.beta_hist[d, i] += torch.histc(b[:, i].float(), bins=self.hist_bins, min=0.0, max=1.0).to(_DT)
        if forget is not None:
            f = forget.detach().to(_DT)
            self.forget_sum[d] += f.sum()
            self.forget_count[d] += f.numel()
        if pool is not None:
            a = pool.detach().to(_DT)
            ent = -(a * a.clamp_min(1e-300).log()).sum(-1)
            self.entropy_sum[d] += ent.sum()
            self.entropy_count[d] += ent.numel()
        if streams is not None:
            s = streams.detach().to(_DT)
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
        mean = _safe_div(self.beta_sum, self.beta_count)
        var = (_safe_div(self.beta_sumsq, self.beta_count) - mean.square()).clamp_min(0)
        return {
            "gate_mean": mean,
            "gate_std": var.sqrt(),
            "forget_mean": _safe_div(self.forget_sum, self.forget_count),
            "pool_entropy": _safe_div(self.entropy_sum, self.entropy_count),
            "stream_rms": _safe_div(self.stream_sumsq, self.stream_count).sqrt(),
            "angle": _safe_div(self.angle_sum, self.angle_count),
            "gate_hist": self.beta_hist.clone(),  # (D, n, hist_bins) counts, reduced over ranks like the rest
        }

    def histogram_edges(self) -> Tensor:
        """Bucket edges (hist_bins + 1,) of ``beta_hist`` over [0, 1]."""
        return torch.linspace(0.0, 1.0, self.hist_bins + 1, dtype=_DT)


class GradStats(_DepthMetric):
    """Gradient RMS per depth: of the stream entering merge d and of its branch's parameters.

    Both are ``sqrt(sum g^2 / N)``; under DDP the parameter gradients are identical on every
    rank, so summing sums and counts over ranks leaves the RMS unchanged; under FSDP each rank
    adds its local shard. Stream gradients are those of each rank's own loss.
    """

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(num_depths, **kwargs)
        D = num_depths
        for name in ("stream_sumsq", "stream_count", "param_sumsq", "param_count"):
            self._state(name, (D,))

    @torch.no_grad()
    def update(
        self,
        depth: int,
        grad: Tensor | None = None,
        *,
        param_sumsq: float | Tensor | None = None,
        param_count: int = 0,
    ) -> None:
        """Add a stream gradient ``grad`` and/or a parameter-gradient partial sum for ``depth``."""
        d = self._check_depth(depth)
        if grad is not None:
            g = grad.detach().to(_DT)
            self.stream_sumsq[d] += g.square().sum()
            self.stream_count[d] += g.numel()
        if param_sumsq is not None:
            self.param_sumsq[d] += torch.as_tensor(param_sumsq, dtype=_DT, device=self.param_sumsq.device)
            self.param_count[d] += param_count

    def compute(self) -> dict[str, Tensor]:
        return {
            "stream_grad_rms": _safe_div(self.stream_sumsq, self.stream_count).sqrt(),
            "param_grad_rms": _safe_div(self.param_sumsq, self.param_count).sqrt(),
        }


def nan_to_none(values: Tensor) -> list[float | None]:
    """Tensor -> list of floats, NaN -> None (for JSON-ish consumers)."""
    return [None if math.isnan(v) else v for v in values.tolist()]
