"""ResidualControlCallback: patch a model's residual merges (optional) and record what they do."""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..metrics import GradStats, StreamStats
from . import _common as C
from .patcher import ResidualPatcher, merge_options

__all__ = ["ResidualControlCallback"]

_STREAM_FAMILIES = ("stream_rms", "update_rms", "update_ratio", "growth", "max_abs", "max_over_median")


class ResidualControlCallback(Callback):
    """Patch the residual merges of the LightningModule (``method``) and log per-depth diagnostics.

    Args:
        method: ``None`` only observes (a model patched by hand or by another callback is observed as is; an
            unpatched model is patched with ``"add"`` — plain additions, outputs bitwise unchanged — to find its
            merges, and unpatched again at teardown); a registered merge rule (``lightning_resctl.merge_rules()``)
            patches in ``setup`` (after ``configure_model`` when the module overrides it), before optimizers and
            wrapping. The patch is owned by a :class:`~lightning_resctl.callbacks.patcher.ResidualPatcher`
            (:attr:`patcher`); when it patches, one line is logged on rank zero (merges, rule, added parameters;
            the full report is ``lightning_resctl.get_patch_report(model)``).
        log_every_n_steps: log every N optimizer steps (default: the Trainer's ``log_every_n_steps``);
            the same steps as Lightning's own logging. Other steps run no probe at all.
        histograms: write gate histograms (loggers with ``add_histogram_raw``, e.g. TensorBoard; other loggers
            get a PNG figure of them at validation end).
        depth_images: write depth-profile figures at validation end (curves vs depth, depth x step maps):
            TensorBoard images, or PNG files (see ``dirpath``) for loggers that cannot take images.
        options: options of the merge rule, e.g. ``{"streams": 4}`` — the form LightningCLI / YAML configs use.
            Unknown options and invalid values raise here, on construction.
        per_depth: which depths get per-depth scalars: ``"few"`` (default: first, middle and last merge),
            ``"all"``, or a list of depth indices. The summary scalars always cover every depth.
        alert_growth: warn once per run (rank zero) when the stream RMS at a chain's last merge exceeds this
            multiple of the chain start (``None``: never).
        alert_max_over_median: warn once per run when max|x| / median|x| of a stream exceeds this (``None``: never).
        heatmap_ranges: fixed colour range per heat-map family (log scale), overriding
            :data:`lightning_resctl.plots.HEATMAP_RANGES`, so heat maps of different runs compare by colour.
        dirpath: write figures as PNG files here (default: ``<trainer.log_dir>/resctl_figures`` when no logger
            takes images). With no logger and no ``dirpath`` there is nowhere to write: the callback warns,
            still patches (``method``), and runs no probe.
        grad_stats: record gradient RMS of the stream at each merge (tensor hook) and of the branch parameters.
        example_input, include, exclude: passed to :func:`patch_residuals`.
        prefix: tag prefix (``f"{prefix}/{family}/{depth:02d}"``).
        **method_options: the Python form of ``options`` (``streams=4``); an option may not be given both ways.

    Per depth d (merge index, ordered by chain then position, as in ``merge_sites(model)``) the families of
    :mod:`lightning_resctl.metrics` are computed over the logging step's batch(es), reduced over ranks
    and logged by rank zero through ``Logger.log_metrics``. Every logging step also logs the health summary
    ``f"{prefix}/summary/..."``: ``growth_last`` (stream RMS at each chain's last merge over its start; the
    largest), ``update_ratio_max``, ``max_over_median_max`` and, for rules with gates, ``gate_saturation``
    (fraction of gate values within one histogram bin of 0 or 1). TensorBoard also gets a custom-scalars
    layout (the summary; one chart per family with the chosen depths), gate histograms, images and a text
    ``f"{prefix}/about"`` (depth -> module, branch kind, source line; the rule's notes). After fit,
    :attr:`depth_profile` holds the last logged values ``{family: [value per depth]}`` (NaN where not
    observed) and :attr:`depth_labels` the depth labels (``"07 mlp"``).

    Notes:
        * A logging step observes every micro-batch of the optimizer step (gradient accumulation) and is
          logged at Lightning's own step number for it (``log_every_n_steps=N`` -> steps N-1, 2N-1, ...).
        * ``param_grad_rms[d]`` covers the parameters of the modules that ran inside the merge's block (the
          module holding the addition) since the block started or since its previous merge — found once, on
          the first logging step, with temporary forward hooks. For the first merge of a block that is the
          whole model, modules run before the stream (e.g. an input projection) are included.
        * ``stream_grad_rms`` is d(loss)/d(stream) of each rank's own loss: under DDP with a mean loss it is
          ``world_size`` times the single-process value on the union of the data. Every other family equals
          the single-process value on the union.
        * Merges run by one expression several times per forward (a ``for`` loop) are told apart by call
          order within the step (``site.positions``).
    """

    def __init__(
        self,
        method: str | None = None,
        log_every_n_steps: int | None = None,
        histograms: bool = True,
        depth_images: bool = True,
        *,
        options: dict[str, Any] | None = None,
        per_depth: Literal["few", "all"] | list[int] = "few",
        alert_growth: float | None = 100.0,
        alert_max_over_median: float | None = 1000.0,
        heatmap_ranges: dict[str, tuple[float, float]] | None = None,
        dirpath: str | None = None,
        grad_stats: bool = True,
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        prefix: str = "resctl",
        **method_options: Any,
    ) -> None:
        super().__init__()
        self.patcher = ResidualPatcher(method, merge_options(options, method_options), example_input=example_input,
                                       include=include, exclude=exclude)
        if log_every_n_steps is not None and (
            not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be a positive int or None, got {log_every_n_steps!r}")
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
        self.per_depth = C.check_per_depth(per_depth)
        for name, value in (("alert_growth", alert_growth), ("alert_max_over_median", alert_max_over_median)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        from ..plots import HEATMAP_RANGES

        self.heatmap_ranges = {**HEATMAP_RANGES, **{k: tuple(v) for k, v in (heatmap_ranges or {}).items()}}
        for fam, rng in self.heatmap_ranges.items():
            if len(rng) != 2 or not 0 < rng[0] < rng[1]:
                raise ValueError(f"heatmap_ranges[{fam!r}] must be (vmin, vmax) with 0 < vmin < vmax, got {rng!r}")
        self.alert_growth = alert_growth
        self.alert_max_over_median = alert_max_over_median
        self.dirpath = dirpath
        self.log_every_n_steps = log_every_n_steps
        self.histograms = bool(histograms)
        self.depth_images = bool(depth_images)
        self.grad_stats = bool(grad_stats)
        self.prefix = prefix
        self.depth_profile: dict[str, list[float]] = {}
        self.depth_labels: list[str] = []
        self.history: list[tuple[int, dict[str, list[float]]]] = []
        self._enabled = True
        self._alerted: set[str] = set()
        self._module: nn.Module | None = None
        self._sites: list = []
        self._reset_runtime()

    @property
    def method(self) -> str | None:
        """The merge rule this callback patches with (None: observe only)."""
        return self.patcher.method

    # ------------------------------------------------------------------ patching
    def _reset_runtime(self) -> None:
        self._depth_of: dict[tuple[int, int], int] = {}
        self._entries: list[tuple[Any, int]] = []
        self._position = C.PositionCounter()
        self._stream: StreamStats | None = None
        self._rule_stats: list[tuple[Any, Any]] = []   # (rule, its Metric)
        self._stats_of: dict[int, Any] = {}              # id(rule) -> its Metric
        self._grad: GradStats | None = None
        self._branch_params: list[list[nn.Parameter]] | None = None
        self._trace_hooks: list = []
        self._pending: dict[int, set] = {}
        self._owner_of_site: dict[int, int] = {}
        self._branch_modules: dict[int, set] = {}
        self._logging_now = False
        self._last_hists: list = []
        self._layout_written = False

    def patch(self, pl_module: nn.Module, model: nn.Module | None = None) -> bool:
        """Patch ``model`` (default ``pl_module``; a submodule such as ``self.model`` is fine) now with this
        callback's method (no-op if ``pl_module`` holds merge sites already).

        This is what :func:`patch_in_configure_model` calls between building and ``fully_shard``.
        """
        return self.patcher.patch(pl_module, model)

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._module = pl_module
        self._enabled = bool(getattr(trainer, "loggers", None)) or self.dirpath is not None
        if not self._enabled:
            rank_zero_warn(
                f"{type(self).__name__}: the Trainer has no logger and no dirpath= was given, so there is nowhere "
                "to write diagnostics: no probe will run"
                + (f" (the {self.method!r} patch is applied)" if self.method else "")
                + ". Pass a logger (e.g. TensorBoardLogger) or dirpath= to record them."
            )
            if self.method is None:
                return  # nothing to observe, nothing to patch
        self.patcher.setup(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._clear_observers()
        self.patcher.teardown(pl_module)
        self._sites = []
        self._reset_runtime()

    # ------------------------------------------------------------------ sites and metrics
    def _build(self, pl_module: nn.Module) -> None:
        from lightning_resctl.surgery import merge_sites

        self._reset_runtime()
        sites = merge_sites(pl_module)
        self._sites = sites
        if not sites:
            return
        self._entries = C.depth_entries(sites)
        D = len(self._entries)
        self._depth_of = {(id(s), p): d for d, (s, p) in enumerate(self._entries)}
        starts: list[int] = []
        first_of_chain: dict[Any, int] = {}
        for d, (s, _) in enumerate(self._entries):
            starts.append(first_of_chain.setdefault(getattr(s, "chain", 0), d))
        device = _module_device(pl_module)
        self._stream = StreamStats(D, starts).to(device)
        for rule in C.rules_of(sites):
            stats = rule.make_stats(D, pl_module)
            if stats is not None:
                stats = stats.to(device)
                self._rule_stats.append((rule, stats))
                self._stats_of[id(rule)] = stats
        if self.grad_stats:
            self._grad = GradStats(D).to(device)

    def _metrics(self) -> list:
        return [m for m in (self._stream, *(st for _, st in self._rule_stats), self._grad) if m is not None]

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._alerted = set()
        if not self._enabled:
            self._reset_runtime()
            self._sites = []
            return
        self._build(pl_module)
        self.depth_labels = [
            f"{C.depth_tag(d, len(self._entries))} {getattr(s, 'branch', '') or ''}".strip()
            for d, (s, _) in enumerate(self._entries)
        ]
        if self._entries and trainer.is_global_zero:
            C.add_text(trainer, f"{self.prefix}/about", self._about_text(), 0)

    def _about_text(self) -> str:
        """Markdown for TensorBoard's text tab: what the depths are and how to read the charts."""
        D = len(self._entries)
        few = C.chosen_depths(self.per_depth, D)
        head = [
            f"**{self.prefix}**: {D} residual merges"
            + (f", patched with `{self.method}`" if self.method else " (observed)")
            + f". Depth d = merge index (chain, then position). Per-depth scalars for depths {few}"
            + ("" if self.per_depth == "all" else " (per_depth='all' logs every depth)")
            + f"; the summary scalars `{self.prefix}/summary/*` cover all depths.",
        ]
        lines = [
            "| depth | chain | position | branch | module | source |",
            "|---|---|---|---|---|---|",
        ]
        for d, (site, pos) in enumerate(self._entries):
            src = (getattr(site, "source_line", "") or "").replace("|", "\\|")
            lines.append(f"| {C.depth_tag(d, D)} | {getattr(site, 'chain', 0)} | {pos} | "
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

    # ------------------------------------------------------------------ probes
    def _every(self, trainer: Any) -> int:
        return self.log_every_n_steps or trainer.log_every_n_steps

    def _will_log(self, trainer: Any) -> bool:
        n = self._every(trainer)
        if not n:
            return False
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % n == 0

    def _observe(self, site: Any, stream: torch.Tensor, update: torch.Tensor, streams: torch.Tensor | None) -> None:
        pos = self._position(site)
        d = self._depth_of.get((id(site), pos))
        if d is None:
            return
        if self._trace_hooks:
            owner = self._owner_of_site.get(id(site))
            if owner is not None:
                self._branch_modules.setdefault(d, set()).update(self._pending.get(owner, ()))
                self._pending[owner] = set()
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

    def _grad_hook(self, d: int, grad: torch.Tensor) -> None:
        if self._grad is not None:
            self._grad.update(d, grad)

    def _set_observers(self, on: bool) -> None:
        fn = self._observe if on else None
        for s in self._sites:
            s.observer = fn

    def _clear_observers(self) -> None:
        self._set_observers(False)
        self._remove_trace_hooks()

    def _install_trace_hooks(self, pl_module: nn.Module) -> None:
        """First logging step only: attribute parameter-holding modules to the merge whose update they feed
        (modules that ran inside the site's owner block since the owner started or its previous merge)."""
        from lightning_resctl.surgery import MergeSite

        excluded: set[int] = set()
        for m in pl_module.modules():
            if isinstance(m, MergeSite):
                excluded.update(id(x) for x in m.modules())
        for s in self._sites:
            ch = getattr(s, "chain_module", None)
            if ch is not None:
                excluded.update(id(x) for x in ch.modules())
        owners: dict[int, nn.Module] = {}
        for s in self._sites:
            owner = _resolve_owner(pl_module, s)
            owners[id(owner)] = owner
            self._owner_of_site[id(s)] = id(owner)

        def reset(oid: int, *_: Any) -> None:
            self._pending[oid] = set()

        for oid, owner in owners.items():
            self._trace_hooks.append(owner.register_forward_pre_hook(functools.partial(reset, oid)))
        # innermost owner of each parameter-holding module
        for oid, owner in owners.items():
            for m in owner.modules():
                if id(m) in excluded or not any(True for _ in m.parameters(recurse=False)):
                    continue
                inner = _innermost_owner(m, owners)
                if inner != oid:
                    continue

                def mark(mod: nn.Module, *_: Any, _oid: int = oid) -> None:
                    self._pending.setdefault(_oid, set()).add(mod)

                self._trace_hooks.append(m.register_forward_hook(mark))

    def _remove_trace_hooks(self) -> None:
        for h in self._trace_hooks:
            h.remove()
        self._trace_hooks = []

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        if not self._sites or self._logging_now:
            return
        if not self._will_log(trainer):
            return
        self._logging_now = True
        self._position.reset()
        self._stepped_at_start = trainer.fit_loop.epoch_loop._batches_that_stepped
        if self._grad is not None and self._branch_params is None:
            self._install_trace_hooks(pl_module)
        self._set_observers(True)

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        if not self._logging_now or self._grad is None:
            return
        if self._branch_params is None:
            self._finish_trace()
        for d, params in enumerate(self._branch_params or []):
            sumsq = torch.zeros((), dtype=torch.float64)
            count = 0
            for p in params:
                g = p.grad
                if g is None:
                    continue
                g = g.to_local() if hasattr(g, "to_local") else g
                sumsq = sumsq + g.detach().double().square().sum().cpu()
                count += g.numel()
            if count:
                self._grad.update(d, param_sumsq=sumsq, param_count=count)

    def _finish_trace(self) -> None:
        self._remove_trace_hooks()
        out = []
        for d in range(len(self._entries)):
            seen: set[int] = set()
            params = []
            for m in self._branch_modules.get(d, ()):
                for p in m.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            out.append(params)
        self._branch_params = out
        self._branch_modules = {}
        self._pending = {}

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._logging_now:
            return
        stepped = trainer.fit_loop.epoch_loop._should_accumulate() is False
        if not stepped:
            return  # gradient accumulation: keep observing until the optimizer step
        self._set_observers(False)
        if self._trace_hooks:
            self._finish_trace()
        self._logging_now = False
        self._flush(trainer, trainer.fit_loop.epoch_loop._batches_that_stepped)

    # ------------------------------------------------------------------ output
    def _flush(self, trainer: Any, step: int) -> None:
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
                        hists.append((fam_prefix + k, h, metric.histogram_edges()))
                    else:
                        values[fam_prefix + k] = v.reshape(D) if v.numel() == D else v.reshape(D, -1)
                metric.reset()
        summary = self._summary(values, gate_counts)
        tags = C.scalar_tags(self.prefix, values, D, C.chosen_depths(self.per_depth, D))
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
        self.history.append((int(step), {k: profile[k] for k in self.heatmap_ranges if k in profile}))
        self._last_hists = hists
        if not trainer.is_global_zero:
            return
        self._alert(summary, step)
        if not self._layout_written:
            depth_tags = None if self.per_depth == "all" else [
                C.depth_tag(d, D) for d in C.chosen_depths(self.per_depth, D)]
            C.add_custom_scalars(trainer, self.prefix, C.families_of(tags, self.prefix), depth_tags=depth_tags,
                                 summary=list(summary))
            self._layout_written = True
        C.log_scalars(trainer, tags, step)
        if self.histograms:
            for fam, hist, edges in hists:
                for d in range(hist.shape[0]):
                    for i in range(hist.shape[1]):
                        C.add_histogram_raw(trainer, f"{self.prefix}/{fam}_s{i}/{C.depth_tag(d, D)}", hist[d, i],
                                            edges, step)

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
            rank_zero_warn(
                f"{type(self).__name__}: at step {step} {what.format(v=v)} (> {arg}={limit:g}). See "
                f"{self.prefix}/summary/{key} and the per-depth charts; this warning is shown once per run."
            )

    def on_validation_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if not self._enabled or trainer.sanity_checking or not trainer.is_global_zero or not self.depth_profile:
            return
        writers = C.tensorboard_writers(trainer)
        png_dir = C.figure_dir(trainer, self.dirpath)
        if not writers and png_dir is None:
            return
        from ..plots import curves_figure, heatmap_figure

        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        prof = self.depth_profile
        D = len(self._entries) or len(prof.get("stream_rms", []))
        depths = list(range(D))
        kinds = [getattr(s, "branch", "") or "" for s, _ in self._entries] if self._entries else None

        def emit(tag: str, fig: Any) -> None:
            C.emit_figure(trainer, self.prefix, tag, fig, step, self.dirpath)
            import matplotlib.pyplot as plt

            plt.close(fig)

        if self.depth_images:
            rms = {k: (depths, prof[k]) for k in ("stream_rms", "update_rms") if k in prof}
            if rms:
                emit("depth_profile/rms", curves_figure(
                    rms, "depth (merge index)", "RMS", f"stream / update RMS vs depth (step {step})",
                    logy=True, kinds=kinds))
            ratio = {k: (depths, prof[k]) for k in ("update_ratio", "growth") if k in prof}
            if ratio:
                emit("depth_profile/ratio", curves_figure(
                    ratio, "depth (merge index)", "ratio", f"update/stream ratio and growth vs depth (step {step})",
                    logy=True, kinds=kinds))
            for fam, (vmin, vmax) in self.heatmap_ranges.items():
                cols = [(s, v[fam]) for s, v in self.history if fam in v]
                if not cols:
                    continue
                matrix = torch.tensor([c[1] for c in cols], dtype=torch.float64).T  # depth x step
                emit(f"depth_heatmap/{fam}", heatmap_figure(
                    matrix, "logging step", "depth", f"{fam}: depth x step (log colour, fixed range)",
                    xticks=[c[0] for c in cols], yticks=self.depth_labels if len(self.depth_labels) == D else None,
                    vmin=vmin, vmax=vmax, log=True))
        if self._last_hists and self.histograms and (png_dir is not None or self.depth_images):
            self._gate_figures(emit)

    def _gate_figures(self, emit: Any) -> None:
        """Histogram families as one depth x value heat map each (summed over streams): readable without the
        histogram tab, and the only form loggers without histograms get. The title says where values start."""
        from ..plots import heatmap_figure

        D = len(self._entries)
        for fam, hist, edges in self._last_hists:
            counts = hist.detach().double().cpu().sum(1)  # (D, bins)
            seen = [d for d in range(D) if counts[d].sum() > 0]
            if not seen:
                continue
            frac = counts / counts.sum(1, keepdim=True).clamp_min(1)
            frac[counts.sum(1) == 0] = float("nan")
            e = edges.detach().double().cpu().tolist()
            labels = [f"{(e[i] + e[i + 1]) / 2:.2f}" for i in range(len(e) - 1)]
            title = f"{fam}: share of values per bin; first depth with values: {seen[0]}"
            emit(f"depth_histogram/{fam}", heatmap_figure(
                frac.T, "depth (merge index)", "value", title, xticks=list(range(D)), yticks=labels, vmin=0.0,
                vmax=1.0))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "depth_profile": dict(self.depth_profile)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(x) for x in state_dict.get("history", [])]
        self.depth_profile = dict(state_dict.get("depth_profile", {}))


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        if hasattr(p, "to_local"):
            return p.to_local().device
        return p.device
    return torch.device("cpu")


def _resolve_owner(root: nn.Module, site: Any) -> nn.Module:
    """The module whose forward contains the site's addition (``site.path``, relative to the patched model)."""
    path = getattr(site, "path", "") or ""
    if path:
        try:
            return root.get_submodule(path)
        except AttributeError:
            pass
        for name, m in root.named_modules():
            if name.endswith("." + path):
                return m
    return root


def _innermost_owner(module: nn.Module, owners: dict[int, nn.Module]) -> int | None:
    best = None
    best_size = None
    for oid, owner in owners.items():
        mods = list(owner.modules())
        if any(m is module for m in mods) and (best_size is None or len(mods) < best_size):
            best, best_size = oid, len(mods)
    return best
