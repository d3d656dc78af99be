"""One (method, seed) run: the user's Trainer settings plus the job's callbacks, ``fit``, and the run's record."""
from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from .events import TrimEvents, event_files
from .methods import PLAIN
from .options import CompareOptions
from .preemption import SigtermCheckpoint
from .recorder import RunRecorder
from .records import JobFolder

__all__ = ["train_run", "job_trainer_settings"]


def job_trainer_settings(opts: CompareOptions) -> dict[str, str]:
    """The Trainer arguments :func:`train_run` sets for every run, whatever the user's say, and what it sets them to
    (the user's other settings are used as given)."""
    settings = {
        "logger": "a TensorBoardLogger in tb/<method>/seed<seed>, then yours",
        "callbacks": "yours, with the job's: the run's recorder (first), ResidualControlCallback (the method), "
                     + ("ResidualAblationCallback (at the last validation), " if opts.ablation else "")
                     + "the progress line and the checkpoint on SIGTERM"
                     + (", the periodic checkpoint" if opts.checkpoint_every_min is not None else ""),
        "enable_progress_bar": "False (the job prints one progress line)",
        "default_root_dir": "runs/<method>_seed<seed>",
    }
    if opts.checkpoint_every_min is not None:
        settings["enable_checkpointing"] = f"True (the run's checkpoint, every {opts.checkpoint_every_min:g} min)"
    return settings


class RunCheckpoint(ModelCheckpoint):
    """The run's latest state in one file (``path``), saved at a validation end when ``every_s`` seconds have passed
    since the last save (0: at every validation end), overwriting the previous one. A validation end is where the
    recorder's curve holds that validation, so a resumed fit continues with the next training step."""

    def __init__(self, path, every_s: float):
        super().__init__(dirpath=str(path.parent), filename=path.stem, save_top_k=1, monitor=None,
                         save_on_train_epoch_end=False, enable_version_counter=False)
        self.every_s = float(every_s)
        self._last_save = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if time.monotonic() - self._last_save < self.every_s:
            return
        super().on_validation_end(trainer, pl_module)
        self._last_save = time.monotonic()


def _count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _floats(values) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "detach"):
        values = values.detach().cpu().tolist()
    return [float(v) for v in values]


def _diagnostics(opts: CompareOptions, method: str) -> tuple[Callback, Callback | None]:
    """ResidualControlCallback — it applies the method (``plain`` is observed through ``add`` merges, which leave
    the outputs bitwise unchanged, and unpatched at teardown) — and, when enabled, ResidualAblationCallback run at
    the validation after the last training step only."""
    from ..callbacks import ResidualAblationCallback, ResidualControlCallback

    class FinalAblation(ResidualAblationCallback):
        """ResidualAblationCallback evaluated only at the validation after the last training step."""

        def on_validation_epoch_end(self, trainer, pl_module):
            if trainer.max_steps > 0 and trainer.global_step < trainer.max_steps:
                return
            super().on_validation_epoch_end(trainer, pl_module)

    rule = None if method == PLAIN else method
    control = ResidualControlCallback(method=rule, options=opts.options.get(method) or None,
                                      log_every_n_steps=opts.diagnostics_every_n_steps,
                                      depth_images=opts.depth_images)
    ablation = (FinalAblation(every_n_epochs=1, max_batches=opts.ablation_batches, monitor=opts.monitor)
                if opts.ablation else None)
    return control, ablation


def _branch(label: str) -> str:
    parts = str(label).split(" ", 1)
    return parts[1] if len(parts) == 2 else ""


def train_run(method: str, seed: int, reference: L.LightningModule, datamodule: L.LightningDataModule | None,
              trainer_kwargs: Mapping[str, Any], opts: CompareOptions, folder: JobFolder,
              extra_callbacks: list[Callback] = (), init_fingerprint: str = "",
              init_difference: dict[str, Any] | None = None,
              on_trainer: Callable[[L.Trainer], None] | None = None) -> dict[str, Any]:
    """Train a copy of ``reference`` (the seed's initial model) with ``method`` and return the run's record.

    ``trainer_kwargs``: the user's Trainer settings; the job adds its callbacks (the method's
    ResidualControlCallback, the recorder, the ablation, the checkpoints: periodic and on SIGTERM) to the user's,
    logs to TensorBoard under ``<out>/tb/<method>/seed<seed>`` (besides the user's loggers) and resumes from the run's
    last checkpoint when there is one."""
    model = copy.deepcopy(reference)
    params_before = _count_params(model)
    control, ablation = _diagnostics(opts, method)
    recorder = RunRecorder(seed, opts.monitor)
    kwargs = dict(trainer_kwargs)
    user_callbacks = kwargs.pop("callbacks", None) or []
    user_callbacks = list(user_callbacks) if isinstance(user_callbacks, (list, tuple)) else [user_callbacks]
    ckpt = folder.checkpoint(method, seed)
    callbacks = [recorder, *user_callbacks, control, *([ablation] if ablation else []), *extra_callbacks,
                 SigtermCheckpoint(ckpt)]
    if opts.checkpoint_every_min is not None:
        callbacks.append(RunCheckpoint(ckpt, 60.0 * opts.checkpoint_every_min))
        kwargs["enable_checkpointing"] = True
    user_loggers = kwargs.pop("logger", None)
    user_loggers = [] if user_loggers in (None, True, False) else (
        list(user_loggers) if isinstance(user_loggers, (list, tuple)) else [user_loggers])
    resume = ckpt.is_file()
    events = folder.tensorboard_dir() / method / f"seed{seed}"
    if resume:  # what the stopped fit logged after its checkpoint is logged again: its earlier copy goes
        callbacks.append(TrimEvents(event_files(events)))
    else:  # a run that starts over (stopped before its first save) logs its events afresh
        shutil.rmtree(events, ignore_errors=True)
    logger = TensorBoardLogger(save_dir=str(folder.tensorboard_dir()), name=method, version=f"seed{seed}",
                               default_hp_metric=False)
    kwargs.update(logger=[logger, *user_loggers], callbacks=callbacks, enable_progress_bar=False,
                  default_root_dir=str(folder.run_dir(method, seed)))
    trainer = L.Trainer(**kwargs)
    if on_trainer is not None:
        on_trainer(trainer)
    # dynamo's code cache holds at most recompile_limit graphs per function, over the whole process: the graphs of
    # the previous run's model (another method) never serve this one, and would leave this run's past the limit
    torch.compiler.reset()
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=str(ckpt) if resume else None)
    wall = time.perf_counter() - started

    from ..surgery import get_patch_report

    report = get_patch_report(model)  # None for plain (its observation patch is removed at teardown)
    profile = getattr(control, "depth_profile", None) or {}
    labels = list(getattr(control, "depth_labels", None) or [])
    loss_increase = getattr(ablation, "loss_increase", None) if ablation is not None else None
    return {
        "method": method, "seed": seed, "status": "done", "reason": None,
        "options": opts.options.get(method, {}), "patch_options": dict(getattr(report, "options", None) or {}),
        "init_fingerprint": init_fingerprint,
        "init_difference": init_difference,
        "monitor": recorder.monitor, "mode": opts.mode,
        "final": recorder.final(), "curve": recorder.curve,
        "final_train_loss": recorder.final_train_loss(), "train_curve": recorder.train_losses,
        "steps": trainer.global_step, "train_time_s": recorder.train_time_s, "steps_timed": recorder.steps_timed,
        "wall_s": recorder.earlier_wall_s + wall, "resumed": resume,
        "params": _count_params(model), "params_added": _count_params(model) - params_before,
        "sites": len(labels) or len(profile.get("stream_rms", []) or []),
        "branches": [_branch(lb) for lb in labels] or None,
        "depth_profile": {k: _floats(v) for k, v in profile.items()},
        "ablation_loss_increase": _floats(loss_increase) if loss_increase else None,
        "tensorboard": f"tb/{method}/seed{seed}",
    }
