"""The compare job's PNG plots: seed mean as a line, seed range as a band; depth plots with integer
ticks and each merge marked by the sub-layer that feeds it (attention, MLP, ...).

Matplotlib's object API on an Agg canvas (no pyplot, no display, nothing global to close).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg", force=False)
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["SeedCurves", "band_figure", "BRANCH_MARKERS", "depth_markers", "describe_markers"]

#: marker of a merge by the kind of sub-layer that produced its update
BRANCH_MARKERS = {"attn": "o", "mlp": "s", "conv": "^", "ffn": "s", "block": "D"}
_OTHER_MARKERS = ("v", "P", "X", "*", "<", ">")
_MARKER_NAMES = {"o": "circles", "s": "squares", "^": "triangles", "D": "diamonds", "v": "downward triangles",
                 "P": "plus signs", "X": "crosses", "*": "stars", "<": "left triangles", ">": "right triangles",
                 ".": "dots"}
_KIND_NAMES = {"attn": "attention", "mlp": "MLP"}
#: depth plots with more merges than this draw lines without markers (when the merges' sub-layers are unknown)
MAX_DOTTED = 40


def depth_markers(branches: Sequence[str] | None, depth: int) -> dict[str, str]:
    """The markers a depth plot of ``depth`` merges draws: ``{kind: marker}`` by the sub-layer kind of each merge
    (``branches``, one per merge), or ``{"": "."}`` (a dot per merge) when the kinds are unknown and there are at
    most :data:`MAX_DOTTED` merges, else ``{}``."""
    if branches and len(branches) >= depth:
        kinds = list(dict.fromkeys(branches[:depth]))
        return {k: BRANCH_MARKERS.get(k, _OTHER_MARKERS[i % len(_OTHER_MARKERS)]) for i, k in enumerate(kinds)}
    return {"": "."} if depth <= MAX_DOTTED else {}


def _kind_label(kind: str) -> str:
    return f"{_KIND_NAMES.get(kind, kind)} merge"


def describe_markers(markers: dict[str, str]) -> str:
    """The sentence saying what :func:`depth_markers`' markers mean."""
    if not markers:
        return "Depth plots draw lines without markers."
    if "" in markers:
        return f"Depth plots mark each merge with {_MARKER_NAMES[markers['']]}."
    parts = [f"{_kind_label(k)}s with {_MARKER_NAMES.get(m, repr(m))}" for k, m in markers.items()]
    return "Depth plots mark " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + "."


class SeedCurves:
    """One method's curves over seeds on a common x: ``mean``, ``lo`` and ``hi`` (min / max over seeds)."""

    def __init__(self, xs: Sequence[float], per_seed: Sequence[Sequence[float]]):
        self.xs = np.asarray(xs, dtype=np.float64)
        arr = np.asarray(per_seed, dtype=np.float64).reshape(len(per_seed), -1)
        if arr.shape[1] != self.xs.size:
            raise ValueError(f"{arr.shape[1]} values per seed for {self.xs.size} x positions")
        with np.errstate(all="ignore"):
            self.mean = np.nanmean(arr, axis=0) if arr.size else arr
            self.lo = np.nanmin(arr, axis=0) if arr.size else arr
            self.hi = np.nanmax(arr, axis=0) if arr.size else arr
        self.seeds = arr.shape[0]

    @classmethod
    def from_curves(cls, curves: Sequence[Sequence[tuple[int, float]]]) -> "SeedCurves":
        """From per-seed ``[(step, value), ...]`` lists, on the steps every seed has."""
        by_seed = [dict((int(s), float(v)) for s, v in c) for c in curves]
        steps = sorted(set.intersection(*(set(d) for d in by_seed))) if by_seed else []
        return cls(steps, [[d[s] for s in steps] for d in by_seed])

    @classmethod
    def from_profiles(cls, profiles: Sequence[Sequence[float] | None]) -> "SeedCurves | None":
        """From per-seed depth profiles (one value per merge); None when no seed has one."""
        profiles = [p for p in profiles if p]
        if not profiles:
            return None
        depth = min(len(p) for p in profiles)
        return cls(list(range(depth)), [list(p[:depth]) for p in profiles])


def band_figure(curves: Mapping[str, SeedCurves], *, xlabel: str, ylabel: str, title: str, logy: bool = False,
                depth_axis: bool = False, branches: Sequence[str] | None = None,
                figsize: tuple[float, float] = (7.0, 4.5), dpi: int = 90) -> Figure:
    """A line per method (the seed mean) with a shaded band from the lowest to the highest seed.

    ``depth_axis``: integer x ticks (merge index). ``branches``: the sub-layer kind of each merge;
    each point then gets that kind's marker and the legend explains the markers."""
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    positive = all(np.all(c.lo[np.isfinite(c.lo)] > 0) for c in curves.values())
    kinds: set[str] = set()
    seeds = max((c.seeds for c in curves.values()), default=0)
    for label, c in curves.items():
        (line,) = ax.plot(c.xs, c.mean, label=label, linewidth=1.6)
        color = line.get_color()
        if c.seeds > 1:
            ax.fill_between(c.xs, c.lo, c.hi, color=color, alpha=0.18, linewidth=0)
        markers = depth_markers(branches, c.xs.size)
        for kind, marker in markers.items():
            idx = [i for i in range(c.xs.size) if not kind or branches[i] == kind]
            ax.plot(c.xs[idx], c.mean[idx], linestyle="none", marker=marker, markersize=4.5 if kind else 6,
                    color=color, markeredgecolor="white" if kind else color, markeredgewidth=0.5)
        kinds.update(k for k in markers if k)
    marker_of = depth_markers(branches, len(branches)) if branches else {}
    if logy and positive:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # merge indices and steps are integers
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    for kind in (k for k in marker_of if k in kinds):
        handles.append(Line2D([], [], linestyle="none", marker=marker_of[kind], color="0.3"))
        labels.append(_kind_label(kind))
    if seeds > 1:
        from matplotlib.patches import Patch

        handles.append(Patch(color="0.3", alpha=0.18))
        labels.append(f"range over {seeds} seeds")
    ax.legend(handles, labels, fontsize=7, loc="best")
    fig.tight_layout()
    return fig

