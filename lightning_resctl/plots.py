"""Small matplotlib helpers for depth-profile pictures (Agg backend, no display).

* :func:`curves_figure` — one line per named curve (e.g. a family's value vs depth);
* :func:`heatmap_figure` — a matrix as an image (e.g. depth x logging step);
* :func:`figure_to_array` — a rendered figure as a ``(3, H, W)`` ``uint8`` array,
  the layout ``SummaryWriter.add_image`` expects by default (``dataformats="CHW"``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import matplotlib

matplotlib.use("Agg", force=False)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

__all__ = ["curves_figure", "heatmap_figure", "figure_to_array"]


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
    figsize: tuple[float, float] = (6.0, 4.0),
    dpi: int = 80,
) -> Figure:
    """Line plot with one line per entry of ``curves`` (``label -> (xs, ys)``).

    Non-finite ``ys`` are drawn as gaps. ``logy`` uses a log y-axis (only when
    every finite value is positive).
    """
    if not isinstance(curves, Mapping):
        raise TypeError(f"curves must be a mapping label -> (xs, ys), got {type(curves).__name__}")
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    all_pos = True
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
        ax.plot(xs, ys, marker="o", markersize=3, label=str(label))
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
) -> Figure:
    """Heat map of a 2-D ``matrix`` (rows on the y-axis, columns on the x-axis) with a colour bar.

    ``xticks`` / ``yticks`` optionally label the columns / rows (e.g. logging steps / depths).
    """
    if hasattr(matrix, "detach"):
        matrix = matrix.detach().cpu().numpy()
    arr = np.asarray(matrix, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"matrix must be two-dimensional, got shape {arr.shape}")
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    masked = np.ma.masked_invalid(arr)
    im = ax.imshow(masked, aspect="auto", origin="lower", interpolation="nearest", cmap=cmap)
    fig.colorbar(im, ax=ax)
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
