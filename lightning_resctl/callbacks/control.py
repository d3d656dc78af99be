"""ResidualControlCallback: patch a model's residual merges (optional) and record what they do."""
from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..diagnostics.monitor import ResidualMonitor
from ..surgery import adapt_optimizer_state
from ..surgery.patcher import ResidualPatcher, merge_options

__all__ = ["ResidualControlCallback"]


class ResidualControlCallback(Callback):
    """Patch the residual merges of the LightningModule (``method``) and log per-depth diagnostics: the Lightning
    adapter of :class:`~lightning_resctl.ResidualMonitor` (:attr:`monitor`), which does the recording.

    Args:
        method: ``None`` only observes (a model patched by hand or by another callback is observed as is; an
            unpatched model is patched with ``"add"`` — plain additions, outputs bitwise unchanged — to find its
            merges, and unpatched again at teardown); a registered merge rule (``lightning_resctl.merge_rules()``)
            patches in ``setup`` (after ``configure_model`` when the module overrides it), before optimizers and
            wrapping. The patch is owned by a :class:`~lightning_resctl.surgery.patcher.ResidualPatcher`
            (:attr:`patcher`); when it patches, one line is logged on rank zero (merges, rule, added parameters;
            the full report is ``lightning_resctl.get_patch_report(model)``).
        log_every_n_steps: log every N optimizer steps (default: the Trainer's ``log_every_n_steps``);
            the same steps as Lightning's own logging. Other steps run no probe at all.
        histograms: write gate histograms (TensorBoard); loggers without a histogram view (W&B, MLflow, CSV)
            get the gate figure (a depth x value map) at validation end.
        depth_images: write depth-profile figures at validation end (curves vs depth, depth x step maps):
            TensorBoard images, W&B ``log_image``, MLflow images, or PNG files (see ``dirpath``) for loggers that
            cannot take images.
        options: options of the merge rule, e.g. ``{"streams": 4}`` — the form LightningCLI / YAML configs use.
            Unknown options and invalid values raise here, on construction.
        per_depth: which depths get per-depth scalars: ``"few"`` (default: first, middle and last merge),
            ``"all"``, or a list of depth indices. The summary scalars always cover every depth.
        alert_growth: warn once per run (rank zero) when the stream RMS at a chain's last merge exceeds this
            multiple of the chain start (``None``: never).
        alert_max_over_median: warn once per run when max|x| / median|x| of a stream exceeds this (``None``: never).
        heatmap_ranges: fixed colour range per heat-map family (log scale), overriding
            :data:`lightning_resctl.diagnostics.plots.HEATMAP_RANGES`, so heat maps of different runs compare by colour.
        dirpath: write figures as PNG files here (default: ``<trainer.log_dir>/resctl_figures`` when no logger
            takes images, said once in the log). With no logger and no ``dirpath`` there is nowhere to write: the
            callback warns, still patches (``method``), and runs no probe.
        grad_stats: record gradient RMS of the stream at each merge (tensor hook) and of the branch parameters.
        example_input, include, exclude: passed to :func:`patch_residuals`.
        prefix: tag prefix (``f"{prefix}/{family}/{depth:02d}"``).
        **method_options: the Python form of ``options`` (``streams=4``); an option may not be given both ways.

    What is recorded is :class:`~lightning_resctl.ResidualMonitor`'s (families, summary scalars, alerts,
    custom-scalars layout, gate histograms, the text ``f"{prefix}/about"``), logged by rank zero at Lightning's
    own step number. After fit, :attr:`depth_profile` holds the last logged values ``{family: [value per
    depth]}`` (NaN where not observed) and :attr:`depth_labels` the depth labels (``"07 mlp"``).

    Notes:
        * A logging step observes every micro-batch of the optimizer step (gradient accumulation) and is
          logged at Lightning's own step number for it (``log_every_n_steps=N`` -> steps N-1, 2N-1, ...).
        * ``param_grad_rms[d]`` covers the parameters of the modules that ran inside the merge's block (the
          module holding the addition) since the block started or since its previous merge — found once, on
          the first logging step, with temporary forward hooks — read in ``on_before_optimizer_step`` (before
          gradient clipping). For the first merge of a block that is the whole model, modules run before the
          stream (e.g. an input projection) are included.
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
        self.log_every_n_steps = log_every_n_steps
        #: the recorder; the callback only tells it when steps start and end, and where to write
        self.monitor = ResidualMonitor(
            None, log_every_n_steps or 1, per_depth=per_depth, histograms=histograms, depth_images=depth_images,
            alert_growth=alert_growth, alert_max_over_median=alert_max_over_median, heatmap_ranges=heatmap_ranges,
            dirpath=dirpath, grad_stats=grad_stats, prefix=prefix)
        self.monitor.owner = type(self).__name__
        self._enabled = True

    @property
    def method(self) -> str | None:
        """The merge rule this callback patches with (None: observe only)."""
        return self.patcher.method

    # the monitor's options and records, under the callback's names
    per_depth = property(lambda self: self.monitor.per_depth)
    heatmap_ranges = property(lambda self: self.monitor.heatmap_ranges)
    alert_growth = property(lambda self: self.monitor.alert_growth)
    alert_max_over_median = property(lambda self: self.monitor.alert_max_over_median)
    dirpath = property(lambda self: self.monitor.dirpath)
    histograms = property(lambda self: self.monitor.histograms)
    depth_images = property(lambda self: self.monitor.depth_images)
    grad_stats = property(lambda self: self.monitor.grad_stats)
    prefix = property(lambda self: self.monitor.prefix)

    @property
    def depth_profile(self) -> dict[str, list[float]]:
        """The last logged values ``{family: [value per depth]}``."""
        return self.monitor.depth_profile

    @property
    def history(self) -> list[tuple[int, dict[str, list[float]]]]:
        """``[(step, {family: [value per depth]})]`` of the heat-map families."""
        return self.monitor.history

    @property
    def depth_labels(self) -> list[str]:
        """``"07 mlp"``: depth tag and branch kind per merge."""
        return self.monitor.depth_labels

    # ------------------------------------------------------------------ patching
    def patch(self, pl_module: nn.Module, model: nn.Module | None = None) -> bool:
        """Patch ``model`` (default ``pl_module``; a submodule such as ``self.model`` is fine) now with this
        callback's method (no-op if ``pl_module`` holds merge sites already).

        This is what :func:`patch_in_configure_model` calls between building and ``fully_shard``.
        """
        return self.patcher.patch(pl_module, model)

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
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
        self.monitor.detach()
        self.patcher.teardown(pl_module)

    # ------------------------------------------------------------------ steps
    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        adapt_optimizer_state(pl_module, trainer.optimizers)  # before a resume restores them
        self.monitor.new_run()
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if not self._enabled or not every:
            self.monitor.detach()
            return
        self.monitor.log_every_n_steps = every
        self.monitor.attach(pl_module, patch=False)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        if self.monitor.model is not None:
            self.monitor.start(trainer.fit_loop.epoch_loop._batches_that_stepped)

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        if self.monitor.observing:
            self.monitor.record_param_grads()

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.monitor.observing or trainer.fit_loop.epoch_loop._should_accumulate():
            return  # not a logging step, or gradient accumulation: keep observing until the optimizer step
        self.monitor.stop(record_param_grads=False)
        self.monitor.log_to(trainer)

    def on_validation_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self._enabled and not trainer.sanity_checking:
            self.monitor.log_figures(trainer, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict)
