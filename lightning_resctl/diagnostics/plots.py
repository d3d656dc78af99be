"""Small matplotlib helpers for depth-profile pictures (Agg backend, no display).

* :func:`curves_figure` — one line per named curve (e.g. a family's value vs depth);
* :func:`heatmap_figure` — a matrix as an image (e.g. depth x logging step);
* :func:`figure_to_array` — a rendered figure as a ``(3, H, W)`` ``uint8`` array,
  the layout ``SummaryWriter.add_image`` expects by default (``dataformats="CHW"``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg", force=False)
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["curves_figure", "heatmap_figure", "figure_to_array", "HEATMAP_RANGES", "KIND_MARKERS"]

#: Fixed colour ranges (log scale) of the callbacks' depth x step heat maps, per family: the same value has the
#: same colour in every run and at every step; values outside are drawn in the end colours (arrows on the bar).
HEATMAP_RANGES: dict[str, tuple[float, float]] = {
    "stream_rms": (1e-2, 1e2),
    "update_ratio": (1e-3, 1e1),
    "growth": (1e-1, 1e3),
}

#: Marker per branch kind on depth profiles (``site.branch``); other kinds get the default marker.
KIND_MARKERS = {"attn": "o", "mlp": "s", "ffn": "s", "conv": "^", "": "o"}


def _as_1d(values: Any, name: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


def curves_figure(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    *,
    logy: bool = False,
    kinds: Sequence[str] | None = None,
    figsize: tuple[float, float] = (6.0, 4.0),
    dpi: int = 80,
) -> Figure:
    """Line plot with one line per entry of ``curves`` (``label -> (xs, ys)``).

    Non-finite ``ys`` are drawn as gaps. ``logy`` uses a log y-axis (only when
    every finite value is positive). ``kinds`` (one string per point, e.g. each merge's branch kind
    ``"attn"`` / ``"mlp"``): points get a marker per kind (filled for the first kind, hollow for the
    others) and the legend names the kinds.
    """
    if not isinstance(curves, Mapping):
        raise TypeError(f"curves must be a mapping label -> (xs, ys), got {type(curves).__name__}")
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    all_pos = True
    kinds = list(kinds) if kinds is not None else None
    distinct = list(dict.fromkeys(kinds)) if kinds else []
    by_kind = len(distinct) > 1 or (len(distinct) == 1 and distinct[0] != "")
    for label, pair in curves.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"curves[{label!r}] must be a pair (xs, ys), got {pair!r}")
        xs = _as_1d(pair[0], f"curves[{label!r}] xs")
        ys = _as_1d(pair[1], f"curves[{label!r}] ys")
        if xs.shape != ys.shape:
            raise ValueError(f"curves[{label!r}]: xs has {xs.size} points but ys has {ys.size}")
        finite = ys[np.isfinite(ys)]
        if finite.size and finite.min() <= 0:
            all_pos = False
        if not by_kind:
            ax.plot(xs, ys, marker="o", markersize=3, label=str(label))
            continue
        if len(kinds) != xs.size:
            raise ValueError(f"kinds has {len(kinds)} entries but curves[{label!r}] has {xs.size} points")
        (line,) = ax.plot(xs, ys, linewidth=1.2, label=str(label))
        for j, kind in enumerate(distinct):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            ax.plot(xs[idx], ys[idx], linestyle="none", marker=KIND_MARKERS.get(kind, "D"), markersize=5,
                    color=line.get_color(), markerfacecolor=line.get_color() if j == 0 else "white")
    if by_kind:
        for j, kind in enumerate(distinct):
            ax.plot([], [], linestyle="none", marker=KIND_MARKERS.get(kind, "D"), color="0.3",
                    markerfacecolor="0.3" if j == 0 else "white", label=f"{kind or 'other'} merge")
    if logy and all_pos:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if curves and len(curves) <= 12:
        ax.legend(fontsize="small")

    fig.tight_layout()
    return fig


def heatmap_figure(
    matrix: Any,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    *,
    xticks: Sequence[Any] | None = None,
    yticks: Sequence[Any] | None = None,
    figsize: tuple[float, float] = (6.0, 4.0),
    dpi: int = 80,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    log: bool = False,
) -> Figure:
    """Heat map of a 2-D ``matrix`` (rows on the y-axis, columns on the x-axis) with a colour bar.

    ``xticks`` / ``yticks`` optionally label the columns / rows (e.g. logging steps / depths).
    ``vmin`` / ``vmax`` fix the colour range (values outside take the end colours; the bar shows arrows),
    so maps of different runs compare by colour; ``log`` uses a log colour scale (needs ``vmin > 0``;
    non-positive values are drawn as gaps).
    """
    if hasattr(matrix, "detach"):
        matrix = matrix.detach().cpu().numpy()
    arr = np.asarray(matrix, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"matrix must be two-dimensional, got shape {arr.shape}")
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if log and vmin is not None and vmin <= 0:
        raise ValueError(f"a log colour scale needs vmin > 0, got {vmin!r}")
    masked = np.ma.masked_invalid(np.where(arr > 0, arr, np.nan) if log else arr)
    norm = None
    if log:
        from matplotlib.colors import LogNorm

        norm = LogNorm(vmin=vmin, vmax=vmax, clip=False)
        im = ax.imshow(masked, aspect="auto", origin="lower", interpolation="nearest", cmap=cmap, norm=norm)
    else:
        im = ax.imshow(masked, aspect="auto", origin="lower", interpolation="nearest", cmap=cmap, vmin=vmin,
                       vmax=vmax)
    fixed = vmin is not None or vmax is not None
    fig.colorbar(im, ax=ax, extend="both" if fixed else "neither")
    if xticks is not None:
        _label_axis(ax.set_xticks, ax.set_xticklabels, "xticks", xticks, arr.shape[1], "columns", most=8)
    if yticks is not None:
        _label_axis(ax.set_yticks, ax.set_yticklabels, "yticks", yticks, arr.shape[0], "rows", most=16)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def figure_to_array(fig: Figure, *, close: bool = True) -> np.ndarray:
    """Render ``fig`` and return its pixels as a ``(3, H, W)`` ``uint8`` array (RGB, channels first)."""
    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    out = np.ascontiguousarray(rgba[..., :3].transpose(2, 0, 1)).astype(np.uint8, copy=False)
    if close:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def _label_axis(set_ticks, set_labels, name: str, labels: Sequence[Any], size: int, what: str, most: int) -> None:
    """Label at most ``most`` evenly spaced positions of an axis of ``size`` cells with ``labels``."""
    if len(labels) != size:
        raise ValueError(f"{name} has {len(labels)} labels but matrix has {size} {what}")
    idx = np.linspace(0, size - 1, num=min(size, most)).round().astype(int)
    set_ticks(idx)
    set_labels([str(labels[i]) for i in idx])
