"""ResidualControlCallback: patch a model's residual merges (optional) and record what they do."""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from ..metrics import GradStats, StreamStats
from . import _common as C

__all__ = ["ResidualControlCallback"]

_STREAM_FAMILIES = ("stream_rms", "update_rms", "update_ratio", "growth", "max_abs", "max_over_median")


class ResidualControlCallback(Callback):
    """Patch the residual merges of the LightningModule (``method``) and log per-depth diagnostics.

    Args:
        method: ``None`` only observes (a model patched by hand is observed as is; an unpatched model is
            patched with ``"add"`` — plain additions, outputs bitwise unchanged — to find its merges, and
            unpatched again at teardown); ``"rescontroller"``, ``"mgr"`` or ``"add"`` patch in ``setup``
            (after ``configure_model`` when the module overrides it), before optimizers and wrapping.
        log_every_n_steps: log every N optimizer steps (default: the Trainer's ``log_every_n_steps``);
            the same steps as Lightning's own logging. Other steps run no probe at all.
        histograms: write MGR gate histograms (loggers with ``add_histogram_raw``, e.g. TensorBoard).
        depth_images: write depth-profile images at validation end (curves vs depth, depth x step map).
        grad_stats: record gradient RMS of the stream at each merge (tensor hook) and of the branch parameters.
        example_input, include, exclude: passed to :func:`patch_residuals`.
        prefix: tag prefix (``f"{prefix}/{family}/{depth:02d}"``).
        **method_options: options of the merge rule (e.g. ``streams=4`` for MGR).

    Per depth d (merge index, ordered by chain then position, as in ``merge_sites(model)``) the families of
    :mod:`lightning_resctl.metrics` are computed over the logging step's batch(es), reduced over ranks
    and logged by rank zero through ``Logger.log_metrics``; TensorBoard also gets a custom-scalars layout
    (one chart per family, all depths), gate histograms and images. After fit, :attr:`depth_profile`
    holds the last logged values ``{family: [value per depth]}`` (NaN where not observed).

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
        grad_stats: bool = True,
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        prefix: str = "resctl",
        **method_options: Any,
    ) -> None:
        super().__init__()
        self.method = C.check_method(method, method_options)
        if log_every_n_steps is not None and (
            not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be a positive int or None, got {log_every_n_steps!r}")
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
        self.log_every_n_steps = log_every_n_steps
        self.histograms = bool(histograms)
        self.depth_images = bool(depth_images)
        self.grad_stats = bool(grad_stats)
        self.prefix = prefix
        self._patch_kwargs = dict(
            example_input=example_input, include=include, exclude=exclude, method_options=method_options
        )
        self.depth_profile: dict[str, list[float]] = {}
        self.history: list[tuple[int, dict[str, list[float]]]] = []
        self._owns_patch = False
        self._wrapped_configure = False
        self._module: nn.Module | None = None
        self._sites: list = []
        self._reset_runtime()

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
        self._stepped_at_start = 0
        self._layout_written = False

    def patch(self, pl_module: nn.Module, model: nn.Module | None = None) -> bool:
        """Patch ``model`` (default ``pl_module``; a submodule such as ``self.model`` is fine) now with this
        callback's method (no-op if ``pl_module`` holds merge sites already).

        This is what :func:`patch_in_configure_model` calls between building and ``fully_shard``.
        """
        target = pl_module if model is None else model
        if model is not None and model is not pl_module and C._surgery().merge_sites(pl_module):
            return False
        patched = C.ensure_patched(target, self.method, example_from=pl_module, **self._patch_kwargs)
        self._owns_patch = self._owns_patch or (patched and self.method is None)
        return patched

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._module = pl_module
        if is_overridden("configure_model", pl_module) and not self._wrapped_configure:
            original = pl_module.configure_model

            @functools.wraps(original)
            def configure_model_then_patch(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                self.patch(pl_module)
                C.patch_copies(trainer, pl_module, self.method, **self._patch_kwargs)
                return out

            pl_module.configure_model = configure_model_then_patch
            self._wrapped_configure = True
        else:
            self.patch(pl_module)
            C.patch_copies(trainer, pl_module, self.method, **self._patch_kwargs)

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._clear_observers()
        if self._wrapped_configure and "configure_model" in vars(pl_module):
            del pl_module.configure_model
        self._wrapped_configure = False
        if self._owns_patch:
            from lightning_resctl.surgery import unpatch_residuals

            unpatch_residuals(pl_module)
            self._owns_patch = False
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
        self._build(pl_module)

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
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*before the ``update`` method.*")
            D = len(self._entries)
            hists: list = []
            for metric in self._metrics():
                out = dict(metric.compute())  # reduced over ranks
                fam_prefix = getattr(metric, "family_prefix", "")
                for k, v in out.items():
                    # torchmetrics squeezes one-element results: restore (D,) / (D, n) / (D, n, bins)
                    if k.endswith("_hist"):
                        if self.histograms:
                            hists.append((fam_prefix + k, v.reshape(D, -1, metric.hist_bins), metric.histogram_edges()))
                    else:
                        values[fam_prefix + k] = v.reshape(D) if v.numel() == D else v.reshape(D, -1)
                metric.reset()
        D = len(self._entries)
        tags = C.scalar_tags(self.prefix, values, D)
        profile = {}
        for fam, t in values.items():
            t = t.detach().double().cpu()
            if t.dim() == 1:
                profile[fam] = t.tolist()
            else:
                for i in range(t.shape[1]):
                    profile[f"{fam}_s{i}"] = t[:, i].tolist()
        self.depth_profile = profile
        self.history.append((int(step), {k: profile[k] for k in ("stream_rms", "update_ratio") if k in profile}))
        if not trainer.is_global_zero:
            return
        if not self._layout_written:
            C.add_custom_scalars(trainer, self.prefix, C.families_of(tags, self.prefix))
            self._layout_written = True
        C.log_scalars(trainer, tags, step)
        for fam, hist, edges in hists:
            for d in range(hist.shape[0]):
                for i in range(hist.shape[1]):
                    C.add_histogram_raw(trainer, f"{self.prefix}/{fam}_s{i}/{C.depth_tag(d, D)}", hist[d, i], edges, step)

    def on_validation_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if not self.depth_images or trainer.sanity_checking or not trainer.is_global_zero or not self.depth_profile:
            return
        if not C.tensorboard_writers(trainer):
            return
        from ..plots import curves_figure, figure_to_array, heatmap_figure

        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        prof = self.depth_profile
        depths = list(range(len(self._entries) or len(prof.get("stream_rms", []))))
        rms = {k: (depths, prof[k]) for k in ("stream_rms", "update_rms") if k in prof}
        if rms:
            fig = curves_figure(rms, "depth (merge index)", "RMS", "stream / update RMS vs depth", logy=True)
            C.add_image(trainer, f"{self.prefix}/depth_profile/rms", figure_to_array(fig), step)
        ratio = {k: (depths, prof[k]) for k in ("update_ratio", "growth") if k in prof}
        if ratio:
            fig = curves_figure(ratio, "depth (merge index)", "ratio", "update/stream ratio and growth vs depth")
            C.add_image(trainer, f"{self.prefix}/depth_profile/ratio", figure_to_array(fig), step)
        for fam in ("stream_rms", "update_ratio"):
            cols = [(s, v[fam]) for s, v in self.history if fam in v]
            if not cols:
                continue
            matrix = torch.tensor([c[1] for c in cols], dtype=torch.float64).T  # depth x step
            fig = heatmap_figure(
                matrix, "logging step", "depth", f"{fam}: depth x step",
                xticks=[c[0] for c in cols], yticks=depths if len(depths) == matrix.shape[0] else None,
            )
            C.add_image(trainer, f"{self.prefix}/depth_heatmap/{fam}", figure_to_array(fig), step)

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
