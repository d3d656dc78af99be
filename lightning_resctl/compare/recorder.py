"""What one run records (:class:`RunRecorder`), and how a run is matched across methods and resumed exactly.

Matching: the global RNG is seeded with the run's seed when the training ``DataLoader`` creates its iterator (the
loader is given a subclass that does so; other iterables are seeded in ``on_fit_start`` and at every epoch start)
— after the residual patch and everything else that may draw random numbers — so every method of a seed sees the
same batches in the same order (shuffling, workers' seeds) and the same dropout masks as long as its model draws
the same random numbers. Epoch ``e >= 1`` starts from its own seed (:func:`epoch_seed`).

Resuming: the recorder's state goes into the run's checkpoints (Lightning saves callback states): what was
recorded, the RNG state at the checkpoint and the position in the epoch. A resumed fit re-creates that epoch's
data iterator from the same seed, skips the batches already trained on (the training ``DataLoader`` is given a
replaying subclass, which survives Lightning's re-instantiation of loaders for distributed samplers), and puts
the RNG back where the checkpoint left it at the start of the first step (the recorder is the run's first
callback), so the run ends with the same numbers as one that was never stopped. (A dataset that draws from the
global RNG per item in the main process — random augmentation without workers — draws for the batches fetched
ahead of the resumed step from a different state; with workers, each worker is seeded as before.)
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, seed_everything
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

__all__ = ["RunRecorder", "epoch_seed", "find_monitor", "MonitorNotFoundError", "between_epochs"]

#: names tried, in order, when no monitor is given (as ResidualAblationCallback finds the validation loss)
DEFAULT_MONITORS = ("val_loss", "val/loss")


class MonitorNotFoundError(KeyError):
    """The monitored metric is not among what the model logs at validation."""

    def __str__(self) -> str:  # KeyError quotes its message
        return str(self.args[0])


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed the RNG holds when epoch ``epoch`` of a run with ``seed`` creates its data iterator."""
    return seed if epoch == 0 else (seed + 104_729 * epoch) % (2 ** 32 - 1)


def find_monitor(logged: Mapping[str, Any], monitor: str | None) -> str:
    """The metric compared: ``monitor`` when given (it must be logged), else ``val_loss`` / ``val/loss``, else the one
    logged name containing ``loss``; :class:`MonitorNotFoundError` lists what is logged otherwise."""
    names = sorted(logged)
    if monitor is not None:
        if monitor in logged:
            return monitor
        raise MonitorNotFoundError(f"monitor={monitor!r} is not logged at validation; the model logs {names}")
    for name in DEFAULT_MONITORS:
        if name in logged:
            return name
    losses = [n for n in names if "loss" in n and not n.startswith("train")]
    if len(losses) == 1:
        return losses[0]
    raise MonitorNotFoundError(f"no monitor given and none of {list(DEFAULT_MONITORS)} is logged at validation (the "
                               f"model logs {names}): pass monitor=NAME (--monitor NAME)")


def between_epochs(trainer) -> bool:
    """Whether the fit is after an epoch's end and before the next epoch's start (Lightning stops a fit there on
    SIGTERM that comes in the epoch-end hooks)."""
    epochs = trainer.fit_loop.epoch_progress.current
    return epochs.completed == epochs.ready


def _rng_state() -> dict[str, Any]:
    """Lightning's RNG states (torch, CUDA, numpy, Python) in types a ``weights_only`` checkpoint load accepts."""
    states = _collect_rng_states(include_cuda=torch.cuda.is_available())
    name, keys, pos, has_gauss, gauss = states["numpy"]
    states["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return states


def _set_rng_state(states: dict[str, Any]) -> None:
    states = dict(states)
    name, keys, pos, has_gauss, gauss = states["numpy"]
    states["numpy"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)
    states["python"] = tuple(tuple(x) if isinstance(x, list) else x for x in states["python"])
    _set_rng_states(states)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Primed:
    """A data iterator whose next batch was fetched when it was created, so that everything it draws from the global
    RNG (its sampler's shuffle, workers' seeds) is drawn right after the seeding, whatever callbacks do before the
    first training step. Other attributes are the wrapped iterator's."""

    _EMPTY = object()

    def __init__(self, iterator):
        self._iterator = iterator
        self._next = next(iterator, self._EMPTY)

    def __iter__(self):
        return self

    def __next__(self):
        if self._next is not None:
            batch, self._next = self._next, None
            if batch is self._EMPTY:
                raise StopIteration
            return batch
        return next(self._iterator)

    def __len__(self):
        return len(self._iterator)

    def __getattr__(self, name):
        return getattr(self._iterator, name)


def _replaying_class(cls: type, recorder: "RunRecorder") -> type:
    """``cls`` (a DataLoader class) whose new iterators start from the run's seed for the epoch, skip the batches
    ``recorder`` says were trained on already, and fetch their next batch at once (:class:`_Primed`)."""

    def _get_iterator(self):
        skip = recorder._seed_epoch()
        iterator = cls._get_iterator(self)
        for _ in range(skip):
            next(iterator)
        primed = _Primed(iterator)
        recorder._iterator_ready()
        return primed

    # Lightning stores/loads the state of stateful loaders (and stops warning that the loader cannot resume);
    # the position lives in the recorder's state.
    return type(cls.__name__, (cls,), {"_get_iterator": _get_iterator, "state_dict": lambda self: {},
                                        "load_state_dict": lambda self, state: None, "__module__": cls.__module__,
                                        "__doc__": cls.__doc__})


class RunRecorder(Callback):
    """Records what the summary needs from one run, seeds it, and makes its checkpoints resumable exactly.

    * ``curve[(step, value)]``: the monitored metric (``trainer.callback_metrics``) at every validation of the fit
      (sanity checks excluded); ``monitor``: its name;
    * ``train_losses[(step, loss)]``: the loss ``training_step`` returned, every optimizer step;
    * ``train_time_s`` / ``steps_timed``: wall time between consecutive training-batch starts (optimizer,
      logging and callbacks included), leaving out the first ``warmup`` intervals and every interval holding a
      validation;
    * ``earlier_wall_s``: the wall time of the fits before the checkpoint this fit resumes from (0 when it
      does not resume), from their setup to the save.

    Args:
        seed: the run's seed (see the module docstring).
        monitor: the metric to record (None: found at the first validation, see :func:`find_monitor`).
        warmup: intervals left out of the timing.

    The diagnostics callbacks carry their own results (``depth_profile``, ``loss_increase``) in the checkpoint
    through their ``state_dict``, so a run resumed after its last logging step still reports them.
    """

    def __init__(self, seed: int, monitor: str | None = None, warmup: int = 3):
        self.seed = int(seed)
        self.monitor = monitor
        self.warmup = warmup
        self.curve: list[tuple[int, float]] = []
        self.train_losses: list[tuple[int, float]] = []
        self.train_time_s = 0.0
        self.steps_timed = 0
        self._intervals = 0
        self._last_start: float | None = None
        self.earlier_wall_s = 0.0
        self._fit_start = time.perf_counter()
        self._trainer = None
        self._resume: dict[str, Any] | None = None
        self._position: tuple[int, int] | None = None
        self._wrapped: tuple[Any, Any] | None = None  # (the data source, its own train_dataloader attribute)

    # ------------------------------------------------------------------ data order and resume
    def setup(self, trainer, pl_module, stage):
        self._trainer = trainer
        self._fit_start = time.perf_counter()
        if stage != "fit":
            return
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        original = getattr(source, "train_dataloader", None)
        if original is None or getattr(original, "_resctl_replaying", False):
            return
        before = vars(source).get("train_dataloader")  # an instance attribute (e.g. from_datasets) or None

        @functools.wraps(original)
        def train_dataloader():
            loader = original()
            if isinstance(loader, DataLoader) and not hasattr(loader, "state_dict"):
                loader.__class__ = _replaying_class(type(loader), self)
            return loader

        train_dataloader._resctl_replaying = True
        source.train_dataloader = train_dataloader
        self._wrapped = (source, before)

    def teardown(self, trainer, pl_module, stage):
        if self._wrapped is not None:
            source, before = self._wrapped
            if before is None:
                vars(source).pop("train_dataloader", None)
            else:
                source.train_dataloader = before
            self._wrapped = None

    def _seed_epoch(self) -> int:
        """Seed the RNG for the data iterator of the current epoch (see :func:`epoch_seed`); returns how many of its
        batches were trained on before the checkpoint this fit resumes from (0 when not resuming into this epoch:
        a checkpoint at an epoch's end resumes at the next epoch's start, whose RNG is then the epoch's seed)."""
        epoch = self._trainer.current_epoch if self._trainer is not None else 0
        seed_everything(epoch_seed(self.seed, epoch), workers=True, verbose=False)
        resume, self._position = self._position, None
        if (resume is None or resume[0] != epoch) and self._resume is not None:
            # a new epoch starts before the first resumed step (the checkpoint was at an epoch's end): its seed, not
            # the checkpoint's RNG state, is what the uninterrupted run had at that step
            self._resume["rng"] = None
        return resume[1] if resume is not None and resume[0] == epoch else 0

    def _iterator_ready(self) -> None:
        """A fit resumed from a save between two epochs: the uninterrupted run's RNG at the next epoch's first step
        is the one right after that epoch's iterator was created (whatever hooks draw after the creation here)."""
        if self._resume is not None and self._resume["between_epochs"]:
            self._resume["rng"] = _rng_state()

    def on_fit_start(self, trainer, pl_module):
        if self._resume is None:
            seed_everything(self.seed, workers=True, verbose=False)
            return
        seed_everything(epoch_seed(self.seed, self._resume["epoch"]), workers=True, verbose=False)
        self._position = (self._resume["epoch"], self._resume["batches"])

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:  # for iterables other than DataLoader (a DataLoader seeds its own iterator)
            seed_everything(epoch_seed(self.seed, trainer.current_epoch), workers=True, verbose=False)

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        # saved between two epochs (a fit stopped there by SIGTERM): the next epoch starts at its first batch, from
        # its own seed (see _iterator_ready), not from the RNG of the save
        between = between_epochs(trainer)
        return {"seed": self.seed, "monitor": self.monitor, "curve": self.curve, "train_losses": self.train_losses,
                "train_time_s": self.train_time_s, "steps_timed": self.steps_timed, "intervals": self._intervals,
                "epoch": trainer.current_epoch, "batches": 0 if between else progress.completed,
                "rng": None if between else _rng_state(), "between_epochs": between,
                "wall_s": self.earlier_wall_s + time.perf_counter() - self._fit_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint is of a run with seed {state['seed']}, this run has seed {self.seed}")
        self.monitor = state["monitor"]
        self.curve = [tuple(x) for x in state["curve"]]
        self.train_losses = [tuple(x) for x in state["train_losses"]]
        self.train_time_s, self.steps_timed = state["train_time_s"], state["steps_timed"]
        self._intervals = state["intervals"]
        self.earlier_wall_s = state.get("wall_s", 0.0)
        self._resume = {"epoch": state["epoch"], "batches": state["batches"], "rng": state["rng"],
                        "between_epochs": state.get("between_epochs", False)}

    # ------------------------------------------------------------------ training loss and time
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._resume is not None:
            # as late as possible: hooks that run before the first step (e.g. the ablation callback's look at a
            # validation batch) drew their random numbers before the checkpoint in the uninterrupted run
            if self._resume["rng"] is not None:
                _set_rng_state(self._resume["rng"])
            self._resume = None
        _sync(pl_module.device)
        now = time.perf_counter()
        if self._last_start is not None:
            self._intervals += 1
            if self._intervals > self.warmup:
                self.train_time_s += now - self._last_start
                self.steps_timed += 1
        self._last_start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.train_losses.append((trainer.global_step, float(loss.detach())))
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True  # Lightning then validates at the last step too

    def on_train_end(self, trainer, pl_module):
        self._last_start = None

    # ------------------------------------------------------------------ the monitored metric
    def on_validation_end(self, trainer, pl_module):
        self._last_start = None  # a validation interrupts the step-to-step timing
        if trainer.sanity_checking:
            return
        logged = trainer.callback_metrics
        self.monitor = find_monitor(logged, self.monitor)
        value = logged[self.monitor]
        self.curve.append((trainer.global_step, float(value.detach() if isinstance(value, torch.Tensor) else value)))

    # ------------------------------------------------------------------ results
    def final(self) -> float:
        return self.curve[-1][1] if self.curve else math.nan

    def final_train_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at least one step)."""
        if not self.train_losses:
            return math.nan
        tail = max(1, len(self.train_losses) // 10)
        return sum(v for _, v in self.train_losses[-tail:]) / tail
