"""ResidualTrainerCallback: the Hugging Face ``transformers.Trainer`` adapter of :class:`ResidualMonitor`.

This module imports transformers; ``lightning_resctl`` imports it only when ``ResidualTrainerCallback`` is used.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Literal

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ..diagnostics.monitor import ResidualMonitor, _positive_int
from ..diagnostics.sinks import MLflowSink, Sink, TensorBoardSink, WandbSink
from ..surgery.pretrained import example_input_for

__all__ = ["ResidualTrainerCallback"]


class _AtTrainerStep(Sink):
    """A sink writing at the Trainer's step numbers: they count finished optimizer steps (its logs of the first
    step are at step 1), the monitor's are 0-based (Lightning's)."""

    def __init__(self, sink: Sink) -> None:
        super().__init__(sink.target)
        self.sink = sink
        self.takes_images, self.takes_histograms = sink.takes_images, sink.takes_histograms

    @property
    def key(self) -> Any:
        return self.sink.key

    def scalars(self, values: Any, step: int) -> None:
        self.sink.scalars(values, step + 1)

    def image(self, prefix: str, name: str, fig: Any, step: int) -> None:
        self.sink.image(prefix, name, fig, step + 1)

    def histogram(self, tag: str, counts: Any, edges: Any, step: int) -> None:
        self.sink.histogram(tag, counts, edges, step + 1)

    def text(self, prefix: str, name: str, text: str) -> None:
        self.sink.text(prefix, name, text)

    def layout(self, layout: Any) -> None:
        self.sink.layout(layout)


class _WandbRun:
    """The W&B run of the Trainer's ``WandbCallback``, as the logger :class:`WandbSink` writes to (the Trainer
    plots W&B charts against ``train/global_step``)."""

    def __init__(self, wandb: Any) -> None:
        self.wandb = wandb

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.wandb.log({**metrics, "train/global_step": step})

    def log_image(self, key: str, images: list, step: int) -> None:
        self.wandb.log({key: [self.wandb.Image(i) for i in images], "train/global_step": step})


class _MlflowRun:
    """The active MLflow run of the Trainer's ``MLflowCallback``, as the logger :class:`MLflowSink` writes to."""

    def __init__(self, mlflow: Any) -> None:
        self.mlflow = mlflow
        self.run_id = mlflow.active_run().info.run_id
        self.experiment = mlflow.MlflowClient()

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics(dict(metrics), step=step)


def _calling_handler() -> CallbackHandler | None:
    """The Trainer's ``CallbackHandler`` running the current event: a callback is not given the Trainer nor its
    other callbacks, but the handler calls every callback from its own ``call_event`` frame."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), CallbackHandler):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _reporting_sinks(handler: CallbackHandler | None) -> list[Sink]:
    """Sinks for the Trainer's reporting integrations that are running (TensorBoard, W&B, MLflow)."""
    from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback

    sinks: list[Sink] = []
    for cb in getattr(handler, "callbacks", ()):
        if isinstance(cb, TensorBoardCallback) and getattr(cb, "tb_writer", None) is not None:
            sinks.append(TensorBoardSink(cb.tb_writer))
        elif isinstance(cb, WandbCallback) and cb._initialized and getattr(cb._wandb, "run", None) is not None:
            sinks.append(WandbSink(_WandbRun(cb._wandb)))
        elif isinstance(cb, MLflowCallback) and cb._initialized and cb._ml_flow.active_run() is not None:
            sinks.append(MLflowSink(_MlflowRun(cb._ml_flow)))
    return sinks


def _enable_checkpointing_as_the_trainer_will(model: nn.Module, args: Any) -> None:
    """``Trainer.train`` turns on activation checkpointing after ``on_init_end``: turn it on now the same way, so
    that the patch sees the model as it will train (a rule that cannot be recomputed refuses it here)."""
    if not getattr(args, "activation_checkpointing", False):
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                              offload=offload)


class ResidualTrainerCallback(TrainerCallback):
    """Patch the residual merges of a ``transformers.Trainer``'s model (``method``) and log per-depth diagnostics
    to the Trainer's reporting integrations: the HF adapter of :class:`~lightning_resctl.ResidualMonitor`
    (:attr:`monitor`), as :class:`~lightning_resctl.ResidualControlCallback` is Lightning's::

        trainer = Trainer(model=model, args=TrainingArguments(..., report_to=["tensorboard"], logging_steps=50),
                          train_dataset=data, callbacks=[ResidualTrainerCallback(method="mgr",
                                                                                 options={"streams": 4})])
        trainer.train()
        trainer.save_model("out")             # then lightning_resctl.from_pretrained(AutoModelForCausalLM, "out")

    When: the model is patched in ``on_init_end`` — at the end of ``Trainer(...)``, before ``train()`` builds the
    optimizer and wraps the model — with one forward on ``example_input`` (default: ``model.example_input_array``,
    else the transformers model's ``dummy_inputs``). With ``activation_checkpointing`` (``gradient_checkpointing``)
    in the arguments, checkpointing is turned on first, as ``train()`` will: every rule runs inside the checkpointed
    layers (HF's default, non-reentrant; ``use_reentrant=True`` is refused by rules that carry a stream between
    merges, at the first training forward). An optimizer given to the Trainer (``optimizers=``) was
    built before the patch: a rule that adds parameters then raises (they would not be trained).

    What is logged: :class:`~lightning_resctl.ResidualMonitor`'s scalars, gate histograms, custom-scalars layout
    and ``about`` text, at the Trainer's logging steps (``logging_steps``; its step numbers: the first logging step
    is ``logging_steps``), with the stream gradients of the step's backward passes and the branch parameters'
    gradients read in ``on_pre_optimizer_step`` (after the Trainer's gradient clipping, ``max_grad_norm``: what the
    optimizer sees); the figures (depth profiles, heat maps, gate figure) after each evaluation and at the last
    step. Destinations: the reporting integrations the Trainer runs (``report_to``): TensorBoard (its
    ``SummaryWriter``: the same event files as the Trainer's own scalars), W&B and MLflow (their active runs), plus
    PNG files in ``dirpath`` when given. With none of them there is nowhere to write: a warning, the patch is still
    applied, no probe runs.

    Args are :class:`~lightning_resctl.ResidualControlCallback`'s: ``method`` (None observes: an unpatched model
    gets the ``"add"`` patch until training ends), ``options`` / ``**method_options``, ``log_every_n_steps``
    (default: the Trainer's ``logging_steps``; required with another ``logging_strategy``), ``histograms``,
    ``depth_images``, ``per_depth``, ``alert_growth``, ``alert_max_over_median``, ``heatmap_ranges``,
    ``dirpath``, ``grad_stats``, ``example_input``, ``include``, ``exclude``, ``prefix``.
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
        self.log_every_n_steps = None if log_every_n_steps is None else _positive_int("log_every_n_steps",
                                                                                      log_every_n_steps)
        #: the recorder (and, through ``monitor.patcher``, the owner of the patch)
        self.monitor = ResidualMonitor(
            None, log_every_n_steps or 1, per_depth=per_depth, histograms=histograms, depth_images=depth_images,
            alert_growth=alert_growth, alert_max_over_median=alert_max_over_median, heatmap_ranges=heatmap_ranges,
            dirpath=dirpath, grad_stats=grad_stats, prefix=prefix, method=method, options=options,
            example_input=example_input, include=include, exclude=exclude, **method_options)
        self.monitor.owner = type(self).__name__
        self._handler: CallbackHandler | None = None
        self._sinks: list[Sink] = []

    @property
    def method(self) -> str | None:
        """The merge rule this callback patches with (None: observe only)."""
        return self.monitor.method

    @property
    def depth_profile(self) -> dict[str, list[float]]:
        """The last logged values ``{family: [value per depth]}``."""
        return self.monitor.depth_profile

    # ------------------------------------------------------------------ patching
    def _patch(self, model: nn.Module) -> None:
        patcher = self.monitor.patcher
        if patcher.example_input is None:
            patcher.example_input = example_input_for(model)
        patcher.patch(model)

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    optimizer: Any = None, **kwargs: Any) -> None:
        self._handler = _calling_handler()
        if model is None or self.method is None:
            return  # observing: the "add" patch adds no parameter, it is applied in on_train_begin
        _enable_checkpointing_as_the_trainer_will(model, args)
        self._patch(model)
        new = getattr(self.monitor.patcher.report, "new_parameters", None)
        if optimizer is not None and new:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            params = dict(model.named_parameters())
            untrained = [n for n in new if n in params and id(params[n]) not in held]
            if untrained:
                raise ValueError(
                    f"{type(self).__name__}(method={self.method!r}) added {len(untrained)} parameters (e.g. "
                    f"{untrained[0]!r}) that the optimizer given to the Trainer (optimizers=) does not hold: it was "
                    "built before the patch. Let the Trainer build the optimizer, or patch first "
                    "(lightning_resctl.patch_residuals(model, ...)), then build the optimizer and pass "
                    "ResidualTrainerCallback() to observe")

    # ------------------------------------------------------------------ steps
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        from ..surgery import merge_sites

        self.monitor.new_run()
        self._handler = self._handler or _calling_handler()
        if model is None:
            return
        if self.method is not None and not merge_sites(model):
            raise RuntimeError(f"{type(self).__name__}(method={self.method!r}): the Trainer trains a model that is not "
                               "patched (a model built by model_init after Trainer(...)): patch it in model_init "
                               "(lightning_resctl.patch_residuals) and pass ResidualTrainerCallback() to observe")
        every = self.log_every_n_steps
        if every is None and str(getattr(args.logging_strategy, "value", args.logging_strategy)) == "steps":
            every = state.logging_steps
        if not every:
            raise ValueError(f"{type(self).__name__}: logging_strategy={args.logging_strategy!r} has no logging "
                             "step: pass log_every_n_steps=")
        self._sinks = [_AtTrainerStep(s) for s in _reporting_sinks(self._handler)]
        if not self._sinks and self.monitor.dirpath is None:
            warnings.warn(f"{type(self).__name__}: none of the Trainer's reporting integrations that it writes to "
                          f"(TensorBoard, W&B, MLflow) is running (report_to={args.report_to!r}) and no dirpath= was "
                          "given, so there is nowhere to write diagnostics: no probe will run", stacklevel=2)
            return
        self.monitor.log_every_n_steps = every
        if not merge_sites(model):
            self._patch(model)
        self.monitor.attach(model, patch=False)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor.model is not None:
            self.monitor.start(state.global_step)  # steps finished so far = this step's 0-based index

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor.observing:
            self.monitor.record_param_grads()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor.model is None:
            return
        self.monitor.stop(record_param_grads=False)
        self.monitor.log_to(self._sinks)
        if state.global_step >= state.max_steps or control.should_training_stop:
            self.monitor.log_figures(self._sinks, step=state.global_step - 1)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor.model is not None and state.global_step < state.max_steps:
            self.monitor.log_figures(self._sinks, step=state.global_step - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                     **kwargs: Any) -> None:
        self.monitor.detach()
        if model is not None:
            self.monitor.patcher.teardown(model)  # removes an observation ("add") patch only
        self._sinks = []
