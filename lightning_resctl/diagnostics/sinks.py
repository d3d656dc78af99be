"""Where the diagnostics go: one :class:`Sink` per destination, each taking what its logger can show.

* ``SummaryWriter`` / ``TensorBoardLogger``: scalars (one event per logging step), images, gate histograms,
  the ``about`` text (Text tab) and a custom-scalars layout;
* ``WandbLogger``: scalars (``log_metrics``), figures (``log_image``); histograms arrive as the gate figure;
* ``MLFlowLogger``: scalars (``log_metrics``), figures (``MlflowClient.log_image(key=, step=)``: the run's
  image cards with a step slider), the ``about`` text as the artifact ``<prefix>/about.md``;
* other Lightning loggers (``CSVLogger``, ...): scalars (``log_metrics``);
* a folder (:class:`PNGSink`): figures as PNG files, the ``about`` text as ``about.md``.

:func:`sinks_for` turns what the user passes (a Trainer, a Fabric, loggers, a SummaryWriter, ready sinks, None) into
sinks;
when none of them takes images, figures go to PNG files in ``<log dir>/resctl_figures``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

FIGURE_DIR_NAME = "resctl_figures"


class Sink:
    """A destination. ``takes_images`` / ``takes_histograms`` say what it shows natively."""

    takes_images = False
    takes_histograms = False

    def __init__(self, target: Any) -> None:
        self.target = target

    @property
    def key(self) -> Any:
        """Identifies the destination across calls (the layout and ``about`` text are written once per key)."""
        return id(self.target)

    @property
    def name(self) -> str:
        return type(self.target).__name__

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write ``{tag: value}`` at ``step``."""

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        """Write a matplotlib figure as ``f"{prefix}/{name}"`` at ``step`` (only called when ``takes_images``)."""

    def histogram(self, tag: str, counts: torch.Tensor, edges: torch.Tensor, step: int) -> None:
        """Fixed-bin ``counts`` (B,) over ``edges`` (B + 1,) (only called when ``takes_histograms``)."""

    def text(self, prefix: str, name: str, text: str) -> None:
        """Markdown ``text`` named ``f"{prefix}/{name}"``, once per run."""

    def layout(self, layout: Mapping[str, Any]) -> None:
        """A TensorBoard custom-scalars layout, once per run."""


def _hwc(fig: Any) -> np.ndarray:
    from .plots import figure_to_array

    return figure_to_array(fig, close=False).transpose(1, 2, 0)


class TensorBoardSink(Sink):
    """A ``SummaryWriter``-like object (``add_scalar``, ``add_image``, ``add_histogram_raw``, ...)."""

    takes_images = True
    takes_histograms = True

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        # torch's SummaryWriter: one event holding all values (one Summary, many values) — same tags, cheaper
        writer = self.target
        file_writer = getattr(writer, "file_writer", None)
        if type(writer).__module__.startswith("torch.utils.tensorboard") and hasattr(file_writer, "add_summary"):
            from tensorboard.compat.proto.summary_pb2 import Summary

            file_writer.add_summary(
                Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]), step)
        else:
            for k, v in values.items():
                writer.add_scalar(k, float(v), step)

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        from .plots import figure_to_array

        self.target.add_image(f"{prefix}/{name}", figure_to_array(fig, close=False), global_step=step,
                              dataformats="CHW")

    def histogram(self, tag: str, counts: torch.Tensor, edges: torch.Tensor, step: int) -> None:
        counts = counts.detach().double().cpu()
        total = float(counts.sum())
        if total <= 0:
            return
        edges = edges.detach().double().cpu()
        centers = (edges[:-1] + edges[1:]) / 2
        nz = counts > 0
        self.target.add_histogram_raw(
            tag, min=float(edges[:-1][nz].min()), max=float(edges[1:][nz].max()), num=total,
            sum=float((counts * centers).sum()), sum_squares=float((counts * centers.square()).sum()),
            bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=step)

    def text(self, prefix: str, name: str, text: str) -> None:
        if hasattr(self.target, "add_text"):
            self.target.add_text(f"{prefix}/{name}", text, global_step=0)

    def layout(self, layout: Mapping[str, Any]) -> None:
        if hasattr(self.target, "add_custom_scalars"):
            self.target.add_custom_scalars(dict(layout))


class LoggerSink(Sink):
    """A Lightning logger without images (``CSVLogger``, ...): scalars through ``log_metrics``."""

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self.target.log_metrics(dict(values), step=step)


class WandbSink(LoggerSink):
    """``WandbLogger``: scalars through ``log_metrics``, figures through ``log_image`` (histograms arrive as the
    gate figure: one panel per family instead of one per depth and stream)."""

    takes_images = True

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        self.target.log_image(key=f"{prefix}/{name}", images=[_hwc(fig)], step=step)


class MLflowSink(LoggerSink):
    """``MLFlowLogger``: scalars through ``log_metrics``, figures through ``MlflowClient.log_image(key=, step=)``
    (the run's image cards, with a step slider), the ``about`` table as a text artifact."""

    takes_images = True

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        self.target.experiment.log_image(self.target.run_id, _hwc(fig), key=f"{prefix}/{name}", step=step)

    def text(self, prefix: str, name: str, text: str) -> None:
        self.target.experiment.log_text(self.target.run_id, text, artifact_file=f"{prefix}/{name}.md")


class PNGSink(Sink):
    """A folder: figures as ``<name with '/' -> '_'>_step<step>.png``, the ``about`` text as ``<name>.md``.

    ``fallback_for`` names the destinations it stands in for (none of them takes images); empty when the
    folder was asked for (``dirpath=``)."""

    takes_images = True

    def __init__(self, dirpath: str | os.PathLike, fallback_for: Sequence[str] = ()) -> None:
        super().__init__(os.fspath(dirpath))
        self.fallback_for = list(fallback_for)

    @property
    def key(self) -> Any:
        return ("png", os.path.abspath(self.target))

    @property
    def name(self) -> str:
        return f"folder {self.target}"

    def _path(self, filename: str) -> str:
        os.makedirs(self.target, exist_ok=True)
        return os.path.join(self.target, filename)

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        fig.savefig(self._path(f"{name.replace('/', '_')}_step{int(step):06d}.png"))

    def text(self, prefix: str, name: str, text: str) -> None:
        with open(self._path(f"{name.replace('/', '_')}.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")


def _has_class(obj: Any, name: str) -> bool:
    """``obj`` is an instance of a class called ``name`` (Lightning's and pytorch_lightning's loggers alike)."""
    return any(c.__name__ == name for c in type(obj).__mro__)


def _log_dir(obj: Any) -> str | None:
    for attr in ("log_dir", "save_dir", "root_dir"):
        try:
            value = getattr(obj, attr, None)
        except Exception:  # noqa: BLE001 - a logger property that cannot answer yet
            value = None
        if isinstance(value, (str, os.PathLike)) and value:
            return os.fspath(value)
    return None


def _collect(dest: Any, out: list[Sink], dirs: list[str], what: str) -> None:
    if dest is None:
        return
    if isinstance(dest, Sink):  # made by an adapter that knows its destination (e.g. the HF Trainer callback)
        out.append(dest)
        return
    if isinstance(dest, (list, tuple)):
        for d in dest:
            _collect(d, out, dirs, what)
        return
    loggers = getattr(dest, "loggers", None)
    if isinstance(loggers, (list, tuple)) and not hasattr(dest, "log_metrics"):  # a Trainer or a Fabric
        for logger in loggers:  # (not Trainer.log_dir: it is a collective, and only rank zero writes)
            _collect(logger, out, dirs, what)
        root = getattr(dest, "default_root_dir", None)
        if loggers and isinstance(root, (str, os.PathLike)):
            dirs.append(os.fspath(root))
        return
    if hasattr(dest, "log_metrics"):  # a Lightning logger
        if _log_dir(dest):
            dirs.append(_log_dir(dest))
        if _has_class(dest, "WandbLogger"):
            out.append(WandbSink(dest))
            return
        if _has_class(dest, "MLFlowLogger"):
            out.append(MLflowSink(dest))
            return
        exp = getattr(dest, "experiment", None)
        if exp is not None and hasattr(exp, "add_image") and hasattr(exp, "add_histogram_raw"):
            out.append(TensorBoardSink(exp))
        else:
            out.append(LoggerSink(dest))
        return
    if hasattr(dest, "add_scalar") and hasattr(dest, "add_image"):  # a SummaryWriter
        out.append(TensorBoardSink(dest))
        return
    raise TypeError(
        f"{what} cannot write to a {type(dest).__name__}: pass a Trainer, a Fabric, a Lightning logger "
        "(TensorBoardLogger, WandbLogger, MLFlowLogger, CSVLogger, ...), a torch.utils.tensorboard.SummaryWriter, "
        "a list of them, or None")


#: PNG folders standing in for loggers without images that were announced already (once per process)
_ANNOUNCED: set = set()


def sinks_for(destinations: Sequence[Any], dirpath: str | os.PathLike | None = None, *,
              what: str = "log_to") -> list[Sink]:
    """The sinks of ``destinations``, plus a :class:`PNGSink`: in ``dirpath`` when given, else in
    ``<log dir of the first destination that has one>/resctl_figures`` when no destination takes images (said
    once, on the ``lightning_resctl`` logger). ``what`` names the caller in messages and in the error for a
    destination of an unknown kind."""
    sinks: list[Sink] = []
    dirs: list[str] = []
    _collect(list(destinations), sinks, dirs, what)
    if dirpath is not None:
        sinks.append(PNGSink(dirpath))
    elif sinks and not any(s.takes_images for s in sinks):
        base = dirs[0] if dirs else os.getcwd()
        png = PNGSink(os.path.join(base, FIGURE_DIR_NAME), fallback_for=[s.name for s in sinks])
        sinks.append(png)
        if png.key not in _ANNOUNCED:
            _ANNOUNCED.add(png.key)
            from ..runtime.log import rank_zero_line

            rank_zero_line(f"{what.split('.')[0]}: {', '.join(sorted(set(png.fallback_for)))} cannot show images; "
                           f"the figures are written as PNG files to {png.target}")
    return sinks
