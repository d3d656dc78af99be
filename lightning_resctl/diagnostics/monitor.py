"""ResidualMonitor: per-depth residual diagnostics for any training loop (Trainer, Fabric, plain PyTorch)."""
from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from . import depths as D_
from .branch_params import BranchParameters
from .metrics import GradStats, StreamStats
from .sinks import PNGSink, Sink, sinks_for

__all__ = ["ResidualMonitor", "Record"]

#: finished records kept for :meth:`ResidualMonitor.log_to` until it is called
_MAX_UNWRITTEN = 1000


@dataclass
class Record:
    """What one logging step recorded: ``scalars`` (tag -> value, the chosen depths and the summary),
    ``summary`` (name -> value) and ``hists`` (``(family, counts (D, n, bins), edges)``)."""

    step: int
    scalars: dict[str, float]
    summary: dict[str, float]
    hists: list = field(default_factory=list)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class _Step:
    """The context of :meth:`ResidualMonitor.step` (a plain class: a few attribute look-ups per step)."""

    __slots__ = ("monitor", "index", "on")

    def __init__(self, monitor: "ResidualMonitor", index: int) -> None:
        self.monitor, self.index, self.on = monitor, index, False

    def __enter__(self) -> bool:
        self.on = self.monitor.start(self.index)
        return self.on

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            self.monitor.stop()


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.to_local().device if hasattr(p, "to_local") else p.device
    return torch.device("cpu")


class ResidualMonitor:
    """Per-depth diagnostics of a model's residual merges, for any training loop: the one implementation behind
    :class:`~lightning_resctl.ResidualControlCallback` (a thin Lightning adapter of it).

    ::

        monitor = ResidualMonitor(model, log_every_n_steps=50)   # patch (method=...) before the optimizer
        for step, batch in enumerate(loader):
            with monitor.step(step):                             # probes only on logging steps
                loss = loss_fn(model(batch))
                loss.backward()                                  # or fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            monitor.log_to(writer)                               # or fabric, a Lightning logger, a list

    Args:
        model: the model (a submodule or a wrapper such as Fabric's is fine). ``method=None`` observes: a model
            patched already (``patch_residuals``) is observed as is, an unpatched one is patched with ``"add"``
            (plain additions, outputs bitwise unchanged) to find its merges, and :meth:`close` removes that patch.
            With a merge rule the model is patched now — before the optimizer and ``fabric.setup``, so that new
            parameters are trained. ``None``: call :meth:`attach` later (what the callback does).
        log_every_n_steps: step ``s`` (0-based, as passed to :meth:`step`) is a logging step when
            ``(s + 1) % log_every_n_steps == 0`` — Lightning's own logging steps. Other steps run no probe at all.
        method, options, example_input, include, exclude, **method_options: the patch, as for
            :func:`~lightning_resctl.patch_residuals` (``options``: the YAML form, ``{"streams": 4}``).
            Unknown methods and options raise here.
        per_depth: which depths get per-depth scalars: ``"few"`` (first, middle and last merge), ``"all"``, or a
            list of depth indices. The summary scalars always cover every depth.
        histograms: gate histograms (TensorBoard), or the gate figure for destinations without histograms.
        depth_images: depth-profile figures and depth x step heat maps (:meth:`log_figures`).
        alert_growth: warn once (rank zero) when the stream RMS at a chain's last merge exceeds this multiple of
            the chain start (``None``: never).
        alert_max_over_median: warn once when max|x| / median|x| of a stream exceeds this (``None``: never).
        heatmap_ranges: fixed colour range per heat-map family (log scale), overriding
            :data:`lightning_resctl.diagnostics.plots.HEATMAP_RANGES`, so heat maps of different runs compare by colour.
        dirpath: also write figures as PNG files here (without it, PNG files go to
            ``<log dir>/resctl_figures`` only when no destination takes images).
        grad_stats: record the gradient RMS of the stream at each merge (tensor hook) and of the branch's
            parameters (read when the ``step`` block ends: run the backward inside it).
        prefix: tag prefix (``f"{prefix}/{family}/{depth:02d}"``).

    What is recorded: for depth d (merge index, ordered by chain then position, as in ``merge_sites(model)``)
    the families of :mod:`lightning_resctl.diagnostics.metrics` (stream / update RMS and their ratio, growth, max|x|,
    max|x| / median|x|, each rule's own families, stream and parameter gradient RMS) over the logging step's
    batch(es) — every ``with monitor.step(s)`` block of the same ``s`` adds to it (gradient accumulation) —
    reduced over ranks (``torch.distributed``; equal to one process on the union of the data, except
    ``stream_grad_rms``, the gradient of each rank's own loss). The health summary ``f"{prefix}/summary/..."``:
    ``growth_last`` (largest stream RMS at a chain's last merge over its start), ``update_ratio_max``,
    ``max_over_median_max`` and, for rules with gates, ``gate_saturation`` (fraction of gate values within one
    histogram bin of 0 or 1). :attr:`depth_profile` holds the last values ``{family: [value per depth]}`` (NaN
    where not observed), :attr:`history` the heat-map families per logging step, :attr:`depth_labels` the depth
    labels (``"07 mlp"``).

    Distributed runs: call :meth:`metrics` / :meth:`log_to` on every rank (the reduction is collective); only
    global rank zero writes (pass ``None`` as the destination on the other ranks).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        log_every_n_steps: int = 50,
        *,
        per_depth: Literal["few", "all"] | list[int] = "few",
        prefix: str = "resctl",
        grad_stats: bool = True,
        histograms: bool = True,
        depth_images: bool = True,
        dirpath: str | None = None,
        heatmap_ranges: dict[str, tuple[float, float]] | None = None,
        alert_growth: float | None = 100.0,
        alert_max_over_median: float | None = 1000.0,
        # the patch (the callback has its own patcher)
        method: str | None = None,
        options: dict[str, Any] | None = None,
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        **method_options: Any,
    ) -> None:
        from ..surgery.patcher import ResidualPatcher, merge_options

        self.log_every_n_steps = _positive_int("log_every_n_steps", log_every_n_steps)
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
        self.per_depth = D_.check_per_depth(per_depth)
        for name, value in (("alert_growth", alert_growth), ("alert_max_over_median", alert_max_over_median)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        from .plots import HEATMAP_RANGES

        self.heatmap_ranges = {**HEATMAP_RANGES, **{k: tuple(v) for k, v in (heatmap_ranges or {}).items()}}
        for fam, rng in self.heatmap_ranges.items():
            if len(rng) != 2 or not 0 < rng[0] < rng[1]:
                raise ValueError(f"heatmap_ranges[{fam!r}] must be (vmin, vmax) with 0 < vmin < vmax, got {rng!r}")
        self.patcher = ResidualPatcher(method, merge_options(options, method_options), example_input=example_input,
                                       include=include, exclude=exclude)
        self.alert_growth = alert_growth
        self.alert_max_over_median = alert_max_over_median
        self.dirpath = dirpath
        self.histograms = bool(histograms)
        self.depth_images = bool(depth_images)
        self.grad_stats = bool(grad_stats)
        self.prefix = prefix
        #: last logged values ``{family: [value per depth]}`` (per-stream families as ``family_s<i>``)
        self.depth_profile: dict[str, list[float]] = {}
        #: ``[(step, {family: [value per depth]})]`` for the heat-map families
        self.history: list[tuple[int, dict[str, list[float]]]] = []
        #: ``"07 mlp"``: depth tag and branch kind per merge
        self.depth_labels: list[str] = []
        #: the name alerts and notes are given under (the callback sets its own)
        self.owner = type(self).__name__
        self._model: nn.Module | None = None
        self._sites: list = []
        self._alerted: set[str] = set()
        self._prepared: set = set()      # sinks that got the layout and the about text
        self._loaded_prepared = False    # load_state_dict: the checkpointed run's destinations got them
        self._continued = False          # this run continues a checkpointed one whose destinations got them
        self._latest: Record | None = None
        self._unwritten: deque[Record] = deque(maxlen=_MAX_UNWRITTEN)
        self._dropped = 0
        self._current_step: int | None = None
        self._warned_backward = False
        self._warned_nowhere = False
        self._eager: contextlib.ExitStack | None = None  # the force_eager stance of an observed step
        self._reset_runtime()
        if model is not None:
            self.attach(model)

    @property
    def method(self) -> str | None:
        """The merge rule the monitor patches with (None: observe only)."""
        return self.patcher.method

    @property
    def model(self) -> nn.Module | None:
        return self._model

    # ------------------------------------------------------------------ attaching
    def _reset_runtime(self) -> None:
        self._entries: list[tuple[Any, int]] = []
        self._depth_of: dict[tuple[int, int], int] = {}
        self._position = D_.PositionCounter()
        self._stream: StreamStats | None = None
        self._rule_stats: list[tuple[Any, Any]] = []   # (rule, its Metric)
        self._stats_of: dict[int, Any] = {}              # id(rule) -> its Metric
        self._grad: GradStats | None = None
        self._branch = BranchParameters()
        self._observing = False
        self._data_step: int | None = None               # the step whose observations the metric states hold
        self._param_sums: list | None = None
        self._hooks_set = 0
        self._hooks_run = 0
        self._last_hists: list = []

    def attach(self, model: nn.Module, *, patch: bool = True) -> None:
        """Observe ``model``'s merges from now on (``patch``: first patch it as the constructor describes).
        The records so far (:attr:`history`, :attr:`depth_profile`) are kept."""
        from lightning_resctl.surgery import merge_sites

        self.detach()
        if patch:
            self.patcher.patch(model)
        self._model = model
        sites = merge_sites(model)
        self._sites = sites
        if not sites:  # (patching raised already when it found no merge)
            return
        self._entries = D_.depth_entries(sites)
        D = len(self._entries)
        self._depth_of = {(id(s), p): d for d, (s, p) in enumerate(self._entries)}
        first_of_chain: dict[Any, int] = {}
        starts = [first_of_chain.setdefault(getattr(s, "chain", 0), d) for d, (s, _) in enumerate(self._entries)]
        self._stream = StreamStats(D, starts)
        for rule in D_.rules_of(sites):
            stats = rule.make_stats(D, model)
            if stats is not None:
                self._rule_stats.append((rule, stats))
                self._stats_of[id(rule)] = stats
        if self.grad_stats:
            self._grad = GradStats(D)
        self._to(_module_device(model))
        self.depth_labels = D_.depth_labels(self._entries)

    def detach(self) -> None:
        """Stop observing (observers and hooks removed); the patch stays (see :meth:`close`). Observations not
        yet turned into a record are recorded first (collective under DDP, like :meth:`metrics`)."""
        self.stop(record_param_grads=False)
        if self._data_step is not None:
            self._finish()
        self._set_observers(False)
        self._branch.remove_hooks()
        self._sites = []
        self._model = None
        self._reset_runtime()

    def close(self) -> None:
        """:meth:`detach`, and remove the ``"add"`` patch the monitor applied to observe (a patch with a merge
        rule stays: its weights are trained)."""
        model = self._model
        self.detach()
        if model is not None:
            self.patcher.teardown(model)

    def _metrics(self) -> list:
        return [m for m in (self._stream, *(st for _, st in self._rule_stats), self._grad) if m is not None]

    def _to(self, device: torch.device) -> None:
        for m in self._metrics():
            if m.device != device:
                m.to(device)

    # ------------------------------------------------------------------ probes
    def is_logging_step(self, step: int) -> bool:
        """``(step + 1) % log_every_n_steps == 0`` (0-based steps, as in Lightning)."""
        return (int(step) + 1) % self.log_every_n_steps == 0

    @property
    def observing(self) -> bool:
        """True between :meth:`start` and :meth:`stop` of a logging step."""
        return self._observing

    def start(self, step: int) -> bool:
        """Begin optimizer step ``step``: on a logging step, set the observers (another ``start`` of the same step
        adds to it: gradient accumulation) and return True; else return False and do nothing else. A step whose
        observations were not yet turned into a record is finished first (see :meth:`metrics`)."""
        step = int(step)
        self._current_step = step
        if self._observing:
            if step == self._data_step:
                return True
            self.stop(record_param_grads=False)
        if self._data_step is not None and self._data_step != step:
            self._finish()
        if not self._sites or not self.is_logging_step(step):
            return False
        if self._data_step is None:  # first micro-batch of this logging step
            self._to(_module_device(self._model))
            self._param_sums = None
            self._hooks_set = self._hooks_run = 0
            if self._grad is not None and self._branch.params is None and not self._branch.tracing:
                self._branch.trace(self._model, self._sites)
        self._data_step = step
        self._position.reset()
        self._set_observers(True)
        self._observing = True
        return True

    def stop(self, *, record_param_grads: bool = True) -> None:
        """End observing this forward/backward (``record_param_grads``: read the branch parameters' gradients
        now — the Lightning callback reads them in ``on_before_optimizer_step`` instead)."""
        if not self._observing:
            return
        self._set_observers(False)
        self._observing = False
        if record_param_grads:
            self.record_param_grads()

    def step(self, step: int) -> "_Step":
        """``with monitor.step(step): forward + backward`` — probes run inside on logging steps only; ``as``
        gives whether this is one. The parameter gradients are read when the block ends."""
        return _Step(self, step)

    def record_param_grads(self) -> None:
        """Read the gradients of each merge's branch parameters now (the latest read of a step counts)."""
        if self._data_step is None or self._grad is None:
            return
        if self._branch.tracing:
            self._branch.finish(len(self._entries))
        if self._hooks_set and not self._hooks_run:
            if not self._warned_backward:
                self._warned_backward = True
                warnings.warn(f"{self.owner}: no gradient reached the merges during step {self._data_step}: run the "
                              "backward inside `with monitor.step(step):` so that stream_grad_rms and "
                              "param_grad_rms are recorded", stacklevel=3)
            return
        self._param_sums = self._branch.grad_sums()

    def _set_observers(self, on: bool) -> None:
        """Set (or remove) the observers, and run compiled code eagerly while they are set
        (``torch.compiler.set_stance("force_eager")``, forward and backward of the logging step): an observed merge
        traced by dynamo would compile graphs of its own, one per kind of block and observer state, until its
        recompile limit; the logging step runs the same math eagerly and every other step keeps its graphs."""
        fn = self._observe if on else None
        for s in self._sites:
            s.observer = fn
        if on and self._eager is None:
            self._eager = contextlib.ExitStack()
            self._eager.enter_context(torch.compiler.set_stance("force_eager"))
        elif not on and self._eager is not None:
            self._eager.close()
            self._eager = None

    def _observe(self, site: Any, stream: torch.Tensor, update: torch.Tensor, streams: torch.Tensor | None) -> None:
        pos = self._position(site)
        d = self._depth_of.get((id(site), pos))
        if d is None:
            return
        if self._branch.tracing:
            self._branch.merged(site, d)
        with torch.no_grad():
            s = stream.detach()
            u = update.detach()
            self._stream.update(d, s, u)
            rule = getattr(site, "rule", None)
            stats = self._stats_of.get(id(rule))
            if stats is not None:
                rule.observe(stats, d, site, pos, s, u, getattr(site, "chain_state", None))
        if self._grad is not None and stream.requires_grad and torch.is_grad_enabled():
            stream.register_hook(functools.partial(self._grad_hook, d))
            self._hooks_set += 1

    def _grad_hook(self, d: int, grad: torch.Tensor) -> None:
        if self._grad is not None:
            self._grad.update(d, grad)
            self._hooks_run += 1

    # ------------------------------------------------------------------ records
    def _finish(self) -> Record:
        """Reduce the step's observations over ranks (collective) into a :class:`Record`."""
        step = self._data_step
        if self._branch.tracing:
            self._branch.finish(len(self._entries))
        if self._grad is not None and self._param_sums:
            for d, (sumsq, count) in enumerate(self._param_sums):
                if count:
                    self._grad.update(d, param_sumsq=sumsq, param_count=count)
        values: dict[str, torch.Tensor] = {}
        gate_counts: list[torch.Tensor] = []
        hists: list = []
        D = len(self._entries)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*before the ``update`` method.*")
            for metric in self._metrics():
                out = dict(metric.compute())  # reduced over ranks
                fam_prefix = getattr(metric, "family_prefix", "")
                gates = set(getattr(metric, "gate_families", ()))
                for k, v in out.items():
                    # torchmetrics squeezes one-element results: restore (D,) / (D, n) / (D, n, bins)
                    if k.endswith("_hist"):
                        h = v.reshape(D, -1, metric.hist_bins)
                        if k in gates:
                            gate_counts.append(h)
                        hists.append((fam_prefix + k, h.detach().cpu(), metric.histogram_edges()))
                    else:
                        values[fam_prefix + k] = v.reshape(D) if v.numel() == D else v.reshape(D, -1)
                metric.reset()
        summary = self._summary(values, gate_counts)
        tags = D_.scalar_tags(self.prefix, values, D, D_.chosen_depths(self.per_depth, D))
        tags.update({f"{self.prefix}/summary/{k}": v for k, v in summary.items()})
        profile = {}
        for fam, t in values.items():
            t = t.detach().double().cpu()
            if t.dim() == 1:
                profile[fam] = t.tolist()
            else:
                for i in range(t.shape[1]):
                    profile[f"{fam}_s{i}"] = t[:, i].tolist()
        self.depth_profile = profile
        self.history.append((step, {k: profile[k] for k in self.heatmap_ranges if k in profile}))
        self._last_hists = hists
        self._data_step = None
        self._param_sums = None
        record = Record(step, tags, summary, hists)
        self._latest = record
        if len(self._unwritten) == self._unwritten.maxlen:
            self._dropped += 1
        self._unwritten.append(record)
        if _global_rank() == 0:
            self._alert(summary, step)
        return record

    def _summary(self, values: dict[str, torch.Tensor], gate_counts: list[torch.Tensor]) -> dict[str, float]:
        """The health scalars (see the class docstring); entries with nothing observed are left out."""
        out: dict[str, float] = {}

        def nanmax(t: torch.Tensor) -> float | None:
            t = t.detach().double().flatten()
            t = t[~torch.isnan(t)]
            return float(t.max()) if t.numel() else None

        growth = values.get("growth")
        if growth is not None:
            last: dict[Any, int] = {}
            for d, (s, _) in enumerate(self._entries):
                last[getattr(s, "chain", 0)] = d
            v = nanmax(growth.detach().double().cpu()[list(last.values())])
            if v is not None:
                out["growth_last"] = v
        for fam, name in (("update_ratio", "update_ratio_max"), ("max_over_median", "max_over_median_max")):
            if fam in values:
                v = nanmax(values[fam])
                if v is not None:
                    out[name] = v
        if gate_counts:
            sat = total = 0.0
            for h in gate_counts:
                h = h.detach().double().cpu()
                sat += float(h[..., 0].sum() + h[..., -1].sum())
                total += float(h.sum())
            if total > 0:
                out["gate_saturation"] = sat / total
        return out

    def _alert(self, summary: dict[str, float], step: int) -> None:
        checks = (
            ("growth_last", self.alert_growth, "alert_growth",
             "the stream RMS at the last merge is {v:.3g}x the chain start"),
            ("max_over_median_max", self.alert_max_over_median, "alert_max_over_median",
             "a stream's max|x| / median|x| reached {v:.3g} (massive activations)"),
        )
        for key, limit, arg, what in checks:
            v = summary.get(key)
            if limit is None or v is None or not math.isfinite(v) or v <= limit or key in self._alerted:
                continue
            self._alerted.add(key)
            warnings.warn(
                f"{self.owner}: at step {step} {what.format(v=v)} (> {arg}={limit:g}). See "
                f"{self.prefix}/summary/{key} and the per-depth charts; this warning is shown once per run.",
                UserWarning, stacklevel=2)

    def new_run(self) -> None:
        """Forget the alerts already shown and what was written where (a new run; the records are kept). A run
        resumed from a checkpoint (:meth:`load_state_dict` first) continues its destinations' records: the layout
        and the ``about`` text they got before the checkpoint are not written again."""
        self._alerted = set()
        self._prepared = set()
        self._continued, self._loaded_prepared = self._loaded_prepared, False

    def metrics(self) -> dict[str, float]:
        """The scalars of the current step (the one last passed to :meth:`step` / :meth:`start`):
        ``{tag: value}`` on a logging step once its block has ended, ``{}`` on any other step. Ready for
        ``fabric.log_dict(monitor.metrics(), step=step)`` or ``logger.log_metrics``; collective under DDP."""
        if self._data_step is not None and not self._observing:
            self._finish()
        rec = self._latest
        return dict(rec.scalars) if rec is not None and rec.step == self._current_step else {}

    # ------------------------------------------------------------------ output
    def log_to(self, *destinations: Any) -> None:
        """Write the records not written yet (scalars, gate histograms; once, the custom-scalars layout and the
        ``about`` text) to ``destinations``: a Trainer, a Fabric, Lightning loggers (TensorBoard, W&B, MLflow,
        CSV, ...), a ``SummaryWriter``, lists of them; ``None`` is skipped. Costs nothing when there is nothing
        new (non-logging steps): call it every step, on every rank (the reduction is collective; rank zero
        writes). Figures: :meth:`log_figures`."""
        if self._data_step is not None and not self._observing:
            self._finish()
        if not self._unwritten:
            return
        sinks = self._sinks(destinations, "log_to") if _global_rank() == 0 else []
        records = list(self._unwritten)
        self._unwritten.clear()
        dropped, self._dropped = self._dropped, 0
        if dropped and _global_rank() == 0:
            warnings.warn(f"{self.owner}: the records of {dropped} logging steps were dropped before log_to was "
                          f"called (it keeps the last {_MAX_UNWRITTEN}); call log_to every step (free on "
                          "non-logging steps)", stacklevel=2)
        for sink in sinks:
            if sink.key not in self._prepared:
                self._prepared.add(sink.key)
                if not self._continued:
                    self._prepare(sink, records[0])
            for rec in records:
                sink.scalars(rec.scalars, rec.step)
                if self.histograms and sink.takes_histograms:
                    D = len(self.depth_labels)
                    for fam, hist, edges in rec.hists:
                        for d in range(hist.shape[0]):
                            for i in range(hist.shape[1]):
                                sink.histogram(f"{self.prefix}/{fam}_s{i}/{D_.depth_tag(d, D)}", hist[d, i], edges,
                                               rec.step)

    def _sinks(self, destinations: tuple, what: str) -> list[Sink]:
        """The sinks of ``destinations``; a warning (once) when there are none: the records would be lost."""
        sinks = sinks_for(destinations, self.dirpath, what=f"{self.owner}.{what}")
        if not sinks and not self._warned_nowhere:
            self._warned_nowhere = True
            warnings.warn(f"{self.owner}.{what}: nothing to write to (destinations: "
                          f"{[type(d).__name__ for d in destinations]}, e.g. a Fabric without loggers); pass a "
                          "SummaryWriter or a Lightning logger, or dirpath= for the figures", stacklevel=3)
        return sinks

    def _prepare(self, sink: Sink, record: Record) -> None:
        """The custom-scalars layout (one chart per summary scalar; one per family with its depths) and the
        ``about`` text."""
        prefix = self.prefix
        D = len(self._entries) or len(self.depth_labels)
        layout: dict[str, dict[str, list]] = {}
        if record.summary:
            layout[f"{prefix} summary"] = {name: ["Multiline", [f"^{re.escape(prefix)}/summary/{re.escape(name)}$"]]
                                          for name in record.summary}
        depth_tags = None if self.per_depth == "all" else [
            D_.depth_tag(d, D) for d in D_.chosen_depths(self.per_depth, D)]
        charts = {}
        for fam in D_.families_of(record.scalars, prefix):
            if depth_tags is None:
                charts[fam] = ["Multiline", [f"^{re.escape(prefix)}/{re.escape(fam)}/\\d+$"]]
            else:
                charts[f"{fam} @ depth {', '.join(depth_tags)}"] = [
                    "Multiline", [f"^{re.escape(prefix)}/{re.escape(fam)}/{dd}$" for dd in depth_tags]]
        layout[prefix] = charts
        sink.layout(layout)
        if self._entries:
            sink.text(prefix, "about", self.about_text())

    def about_text(self) -> str:
        """Markdown: what the depths are (module, branch kind, source line) and how to read the charts."""
        D = len(self._entries)
        few = D_.chosen_depths(self.per_depth, D)
        methods = sorted({getattr(s, "method", None) or "add" for s in self._sites})
        how = "plain additions, observed" if methods == ["add"] else f"patched with `{', '.join(methods)}`"
        head = [
            f"**{self.prefix}**: {D} residual merges ({how}). Depth d = merge index (chain, then position). "
            f"Per-depth scalars for depths {few}"
            + ("" if self.per_depth == "all" else " (per_depth='all' logs every depth)")
            + f"; the summary scalars `{self.prefix}/summary/*` cover all depths.",
        ]
        lines = [
            "| depth | chain | position | branch | module | source |",
            "|---|---|---|---|---|---|",
        ]
        for d, (site, pos) in enumerate(self._entries):
            src = (getattr(site, "source_line", "") or "").replace("|", "\\|")
            lines.append(f"| {D_.depth_tag(d, D)} | {getattr(site, 'chain', 0)} | {pos} | "
                         f"{getattr(site, 'branch', '') or '-'} | `{getattr(site, 'path', '') or 'root'}` | `{src}` |")
        return "\n".join(head + ["", *self._notes(), ""] + lines)

    def _notes(self) -> list[str]:
        notes = []
        for rule, stats in self._rule_stats:
            note = getattr(stats, "notes", None)
            note = note() if callable(note) else note
            for n in ([note] if isinstance(note, str) else list(note or [])):
                notes.append(f"* `{rule.name}`: {n}")
        ranges = ", ".join(f"{k} {lo:g}..{hi:g}" for k, (lo, hi) in self.heatmap_ranges.items())
        notes.append(f"* Heat maps use fixed log colour ranges ({ranges}; values outside take the end colours), "
                     "so the same colour means the same value in every run.")
        return notes

    def log_figures(self, *destinations: Any, step: int | None = None) -> list[str]:
        """Write the figures of the records so far to the destinations that take images (TensorBoard, W&B,
        MLflow; PNG files in ``dirpath`` and, when none takes images, in ``<log dir>/resctl_figures``): the depth
        profiles and the depth x step heat maps (``depth_images``), and the gate figure (``histograms``; for
        destinations with a histogram view only when ``depth_images``). ``step`` defaults to the last logging
        step. Rank zero only, no collective; returns the tags written. A good moment: after an evaluation."""
        if _global_rank() != 0 or not self.depth_profile:
            return []
        if step is None:
            step = self._latest.step if self._latest is not None else self.history[-1][0] if self.history else 0
        sinks = [s for s in self._sinks(destinations, "log_figures") if s.takes_images]
        if not sinks:
            return []
        for s in sinks:  # a folder of figures says what its depths are
            if isinstance(s, PNGSink) and s.key not in self._prepared and self._entries:
                self._prepared.add(s.key)
                s.text(self.prefix, "about", self.about_text())
        import matplotlib.pyplot as plt

        from .figures import depth_profile_figures, gate_figures

        written: list[str] = []

        def send(name: str, fig: Any, targets: list[Sink]) -> None:
            for s in targets:
                s.image(self.prefix, name, fig, step)
            plt.close(fig)
            written.append(f"{self.prefix}/{name}")

        if self.depth_images:
            kinds = [getattr(s, "branch", "") or "" for s, _ in self._entries] or None
            labels = self.depth_labels or None
            for name, fig in depth_profile_figures(self.depth_profile, self.history, step, labels=labels,
                                                   kinds=kinds, heatmap_ranges=self.heatmap_ranges):
                send(name, fig, sinks)
        gate_sinks = [s for s in sinks if self.depth_images or not s.takes_histograms]
        if self.histograms and self._last_hists and gate_sinks:
            for name, fig in gate_figures(self._last_hists):
                send(name, fig, gate_sinks)
        return written

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``{"history", "depth_profile", "prepared"}`` (e.g. for ``fabric.save``); ``prepared``: the destinations
        got the layout and the ``about`` text already."""
        return {"history": list(self.history), "depth_profile": dict(self.depth_profile),
                "prepared": bool(self._prepared) or self._continued}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.history = [tuple(x) for x in state_dict.get("history", [])]
        self.depth_profile = dict(state_dict.get("depth_profile", {}))
        self._loaded_prepared = bool(state_dict.get("prepared", False))
