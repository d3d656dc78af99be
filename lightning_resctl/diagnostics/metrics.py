"""The generic per-depth residual statistics (any rule) as torchmetrics ``Metric`` objects.

They share the base of the rules' own stats (:class:`lightning_resctl.rules.stats.DepthMetric`: sums, counts,
maxima and histograms reduced over ranks, accumulated in fp64); squares are formed in fp32 (fp64 for fp64 inputs).
A rule's own families live beside the rule (``rules/<name>/stats.py``: ResController's ``ControllerStats``,
MGR's ``MGRStats``, ...).

Families (``compute()`` returns ``{family: tensor (D,)}`` or ``(D, n)`` for per-stream ones):

* :class:`StreamStats` — ``stream_rms[d] = sqrt(sum x^2 / N)`` of the stream entering merge d,
  ``update_rms`` likewise for the update, ``update_ratio = update_rms / stream_rms``,
  ``growth[d] = stream_rms[d] / stream_rms[start of d's chain]``, ``max_abs = max |x|``,
  ``max_over_median = max |x| / median |x|`` (the median read off a log2-spaced histogram of
  ``|x|`` with :data:`ABS_BINS_PER_OCTAVE` bins per octave, interpolated geometrically in the bin).
* :class:`GradStats` — ``stream_grad_rms`` (RMS of d loss / d stream at merge d) and
  ``param_grad_rms`` (RMS over all gradient entries of the parameters of merge d's branch).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..rules.stats import STATS_DTYPE, DepthMetric, as_float, safe_div

__all__ = [
    "StreamStats",
    "GradStats",
    "ABS_BINS_PER_OCTAVE",
    "ABS_LOG2_RANGE",
    "histogram_median",
]

#: |x| histogram used for the median: log2(|x|) in ABS_LOG2_RANGE, ABS_BINS_PER_OCTAVE bins per octave.
ABS_LOG2_RANGE = (-32.0, 32.0)
ABS_BINS_PER_OCTAVE = 16
_ABS_BINS = int((ABS_LOG2_RANGE[1] - ABS_LOG2_RANGE[0]) * ABS_BINS_PER_OCTAVE)


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


class StreamStats(DepthMetric):
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
        s = as_float(stream)
        self.stream_sumsq[d] += s.square().sum(dtype=STATS_DTYPE)
        self.stream_count[d] += s.numel()
        if s.numel():
            a = s.abs()
            self.max_abs[d] = torch.maximum(self.max_abs[d], a.max().to(STATS_DTYPE))
            lg = torch.log2(a.clamp_(min=2.0**-126)).clamp_(*ABS_LOG2_RANGE)
            hist = torch.histc(lg, bins=_ABS_BINS, min=ABS_LOG2_RANGE[0], max=ABS_LOG2_RANGE[1])
            self.abs_hist[d] += hist.to(STATS_DTYPE)
        if update is not None:
            u = as_float(update)
            self.update_sumsq[d] += u.square().sum(dtype=STATS_DTYPE)
            self.update_n[d] += u.numel()

    def compute(self) -> dict[str, Tensor]:
        stream_rms = safe_div(self.stream_sumsq, self.stream_count).sqrt()
        update_rms = safe_div(self.update_sumsq, self.update_n).sqrt()
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


class GradStats(DepthMetric):
    """Gradient RMS per depth: of the stream entering merge d and of its branch's parameters.

    Both are ``sqrt(sum g^2 / N)``; under DDP the parameter gradients are identical on every
    rank, so summing sums and counts over ranks leaves the RMS unchanged; under FSDP and tensor /
    sequence parallel each rank adds the whole gradient's sums too (``branch_params.grad_sumsq``).
    Stream gradients are those of each rank's own loss.
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
            g = grad.detach().to(STATS_DTYPE)
            self.stream_sumsq[d] += g.square().sum()
            self.stream_count[d] += g.numel()
        if param_sumsq is not None:
            self.param_sumsq[d] += torch.as_tensor(param_sumsq, dtype=STATS_DTYPE, device=self.param_sumsq.device)
            self.param_count[d] += param_count

    def compute(self) -> dict[str, Tensor]:
        return {
            "stream_grad_rms": safe_div(self.stream_sumsq, self.stream_count).sqrt(),
            "param_grad_rms": safe_div(self.param_sumsq, self.param_count).sqrt(),
        }
