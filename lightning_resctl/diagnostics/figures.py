"""The diagnostics' figures, built from logged values (no model needed): tag -> matplotlib figure.

* :func:`depth_profile_figures` — stream / update RMS and ratio / growth vs depth, and one depth x step heat
  map per family of ``heatmap_ranges`` (fixed log colour range);
* :func:`gate_figures` — each histogram family as a depth x value map of the share of values per bin;
* :func:`ablation_figure` — the loss increase when each merge is skipped, vs depth.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch


def depth_profile_figures(profile: Mapping[str, Sequence[float]], history: Sequence[tuple[int, Mapping]],
                          step: int, *, labels: Sequence[str] | None = None, kinds: Sequence[str] | None = None,
                          heatmap_ranges: Mapping[str, tuple[float, float]]) -> Iterator[tuple[str, Any]]:
    """``("depth_profile/rms" | "depth_profile/ratio" | "depth_heatmap/<family>", figure)`` for the values of
    ``profile`` (``{family: [value per depth]}``) and ``history`` (``[(step, {family: [value per depth]})]``)."""
    from .plots import curves_figure, heatmap_figure

    D = len(labels) if labels else len(profile.get("stream_rms", []))
    depths = list(range(D))
    rms = {k: (depths, profile[k]) for k in ("stream_rms", "update_rms") if k in profile}
    if rms:
        yield "depth_profile/rms", curves_figure(
            rms, "depth (merge index)", "RMS", f"stream / update RMS vs depth (step {step})", logy=True, kinds=kinds)
    ratio = {k: (depths, profile[k]) for k in ("update_ratio", "growth") if k in profile}
    if ratio:
        yield "depth_profile/ratio", curves_figure(
            ratio, "depth (merge index)", "ratio", f"update/stream ratio and growth vs depth (step {step})",
            logy=True, kinds=kinds)
    for fam, (vmin, vmax) in heatmap_ranges.items():
        cols = [(s, v[fam]) for s, v in history if fam in v]
        if not cols:
            continue
        matrix = torch.tensor([c[1] for c in cols], dtype=torch.float64).T  # depth x step
        yield f"depth_heatmap/{fam}", heatmap_figure(
            matrix, "logging step", "depth", f"{fam}: depth x step (log colour, fixed range)",
            xticks=[c[0] for c in cols], yticks=list(labels) if labels and len(labels) == D else None,
            vmin=vmin, vmax=vmax, log=True)


def gate_figures(hists: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
    """``("depth_histogram/<family>", figure)`` per histogram family ``(family, counts (D, n, bins), edges)``:
    one depth x value heat map (summed over streams), readable without a histogram tab and the only form
    loggers without histograms get. The title says where values start."""
    from .plots import heatmap_figure

    for fam, hist, edges in hists:
        counts = hist.detach().double().cpu().sum(1)  # (D, bins)
        D = counts.shape[0]
        seen = [d for d in range(D) if counts[d].sum() > 0]
        if not seen:
            continue
        frac = counts / counts.sum(1, keepdim=True).clamp_min(1)
        frac[counts.sum(1) == 0] = float("nan")
        e = edges.detach().double().cpu().tolist()
        labels = [f"{(e[i] + e[i + 1]) / 2:.2f}" for i in range(len(e) - 1)]
        title = f"{fam}: share of values per bin; first depth with values: {seen[0]}"
        yield f"depth_histogram/{fam}", heatmap_figure(
            frac.T, "depth (merge index)", "value", title, xticks=list(range(D)), yticks=labels, vmin=0.0, vmax=1.0)


def ablation_figure(loss_increase: Sequence[float]) -> Any:
    """The loss increase when merge d's update is skipped, vs depth d."""
    from .plots import curves_figure

    return curves_figure({"loss increase": (list(range(len(loss_increase))), list(loss_increase))},
                         "depth (merge index)", "loss increase", "ablation: skip one merge's update")
