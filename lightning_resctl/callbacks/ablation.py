"""ResidualAblationCallback: validation-loss increase when each merge's update is skipped in turn."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..diagnostics.ablation import ablate
from ..surgery.patcher import ResidualPatcher, merge_options

__all__ = ["ResidualAblationCallback"]


class ResidualAblationCallback(Callback):
    """At validation end every ``every_n_epochs`` epochs, skip each merge's update in turn
    (``MergeSite.skip_update = True``: output = stream) and measure the validation loss.

    ``loss_increase[d] = L(skip merge d) - L(no skip)`` (d: merge index ordered by chain, then position), each
    loss the mean over the first ``max_batches`` batches of the (first) validation dataloader, averaged over
    ranks. Logged as ``f"{prefix}/ablation_loss_increase/{d:02d}"`` (plus ``{prefix}/ablation_base_loss``) and,
    for TensorBoard, an image of the increase vs depth (a PNG file for loggers that cannot take images).

    The loss of a batch, found once at the start of training on the first validation batch (so a module the
    ablation cannot read fails there, not after an epoch); :attr:`loss_source` says which was used:

    1. ``loss_fn(pl_module, batch)`` when given;
    2. the metric ``validation_step`` logs with ``self.log`` / ``self.log_dict`` under ``monitor`` (when given),
       else the scalar it returns (a Tensor, or a mapping with ``"loss"`` / ``"val_loss"``), else the logged
       metric named ``val_loss``, ``val/loss`` or ``loss``, or the one logged name containing ``loss``;
    3. the loss ``training_step`` returns on the validation batch (automatic optimisation only; a warning
       says so, since it may hold regularisation terms).

    ``self.log`` calls are captured, not forwarded to the loggers, during the evaluation.

    Args:
        every_n_epochs: run at the end of every N-th validation epoch (not during the sanity check).
        max_batches: validation batches per evaluation (each evaluation costs (D + 1) x max_batches forwards).
        loss_fn: ``loss_fn(pl_module, batch) -> scalar Tensor``.
        monitor: the name of the logged loss to read (e.g. ``"val/ce"``).
        method, options: patch the model with this merge rule if no other callback does (``None``: observe: a
            patch by another callback or by hand is used as is; an unpatched model gets an ``"add"`` patch,
            removed at teardown). Usually left ``None`` next to :class:`ResidualControlCallback`; the patch is
            owned by :attr:`patcher` (:class:`~lightning_resctl.surgery.patcher.ResidualPatcher`).
        depth_images: write the increase-vs-depth figure.
        dirpath: write the figure as PNG files here (default ``<trainer.log_dir>/resctl_figures`` when no logger
            takes images).
        **method_options: the Python form of ``options``.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        max_batches: int = 4,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        *,
        monitor: str | None = None,
        method: str | None = None,
        options: dict[str, Any] | None = None,
        depth_images: bool = True,
        dirpath: str | None = None,
        prefix: str = "resctl",
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        **method_options: Any,
    ) -> None:
        super().__init__()
        for name, value in (("every_n_epochs", every_n_epochs), ("max_batches", max_batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"monitor must be a metric name or None, got {monitor!r}")
        self.every_n_epochs = every_n_epochs
        self.max_batches = max_batches
        self.loss_fn = loss_fn
        self.monitor = monitor
        self.patcher = ResidualPatcher(method, merge_options(options, method_options), example_input=example_input,
                                       include=include, exclude=exclude)
        self.depth_images = bool(depth_images)
        self.dirpath = dirpath
        self.prefix = prefix
        self.loss_increase: list[float] = []
        self.base_loss: float | None = None
        #: where the loss comes from: "loss_fn", "validation_step return", "logged '<name>'", "training_step"
        self.loss_source: str | None = None
        self._result = None

    @property
    def method(self) -> str | None:
        return self.patcher.method

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self.patcher.setup(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self.patcher.teardown(pl_module)

    # ------------------------------------------------------------------ the loss of a batch
    @contextlib.contextmanager
    def _captured_logging(self, pl_module: nn.Module):
        """``self.log`` / ``self.log_dict`` record into a dict instead of reaching the loggers."""
        logged: dict[str, Any] = {}
        saved = {k: vars(pl_module)[k] for k in ("log", "log_dict") if k in vars(pl_module)}
        pl_module.log = lambda name, value, *a, **k: logged.__setitem__(name, value)
        pl_module.log_dict = lambda values, *a, **k: logged.update(values)
        try:
            yield logged
        finally:
            for k in ("log", "log_dict"):
                if k in saved:
                    setattr(pl_module, k, saved[k])
                else:
                    delattr(pl_module, k)

    @staticmethod
    def _scalar(value: Any) -> torch.Tensor | None:
        if isinstance(value, Mapping):
            for key in ("loss", "val_loss"):
                if key in value:
                    return ResidualAblationCallback._scalar(value[key])
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value), dtype=torch.float64)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            return value.detach().double().reshape(())
        return None

    def _pick_logged(self, logged: Mapping[str, Any]) -> str | None:
        if self.monitor is not None:
            return self.monitor if self.monitor in logged else None
        for name in ("val_loss", "val/loss", "loss"):
            if name in logged:
                return name
        lossy = [k for k in logged if "loss" in k.lower()]
        return lossy[0] if len(lossy) == 1 else None

    def _resolve(self, pl_module: nn.Module, batch: Any) -> str:
        """Find where the loss of a batch comes from (see the class docstring) or raise."""
        if self.loss_fn is not None:
            return "loss_fn"
        with self._captured_logging(pl_module) as logged:
            out = pl_module.validation_step(batch, 0)
        if self.monitor is None and self._scalar(out) is not None:
            return "validation_step return"
        name = self._pick_logged(logged)
        if name is not None:
            if self._scalar(logged[name]) is None:
                raise MisconfigurationException(
                    f"{type(self).__name__}: validation_step logs {name!r} as a {type(logged[name]).__name__}, not "
                    "a scalar loss per batch; pass loss_fn=lambda module, batch: <scalar loss>")
            return f"logged {name!r}"
        if self.monitor is None and getattr(pl_module, "automatic_optimization", True):
            with self._captured_logging(pl_module):
                out = pl_module.training_step(batch, 0)
            if self._scalar(out) is not None:
                rank_zero_warn(
                    f"{type(self).__name__}: validation_step neither returns a loss nor logs one (logged: "
                    f"{sorted(logged)}), so the ablation uses the loss training_step returns on validation batches "
                    "(in eval mode; it may include regularisation terms). Pass monitor= or loss_fn= to choose.")
                return "training_step"
        what = f"does not log {self.monitor!r}" if self.monitor else "neither returns a scalar loss nor logs one"
        raise MisconfigurationException(
            f"{type(self).__name__} cannot find a loss per validation batch: validation_step {what} (logged: "
            f"{sorted(logged)}; returned: {type(out).__name__}). Pass monitor='<name of the logged loss>' or "
            "loss_fn=lambda module, batch: <scalar loss>.")

    def _batch_loss(self, trainer: Any, pl_module: nn.Module, batch: Any, idx: int) -> torch.Tensor:
        if self.loss_source is None:
            self.loss_source = self._resolve(pl_module, batch)
        src = self.loss_source
        with self._captured_logging(pl_module) as logged:
            if src == "loss_fn":
                out = self.loss_fn(pl_module, batch)
            elif src == "training_step":
                out = pl_module.training_step(batch, idx)
            else:
                out = pl_module.validation_step(batch, idx)
        if src.startswith("logged "):
            out = logged.get(src[len("logged '"):-1])
        loss = self._scalar(out)
        if loss is None:
            raise TypeError(f"{type(self).__name__} needs a scalar loss per batch ({src}), got {type(out).__name__}; "
                            "pass loss_fn=lambda module, batch: <scalar loss>")
        return loss

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        """Find the loss on the first validation batch now, before any training step."""
        if self.loss_fn is not None:
            self.loss_source = "loss_fn"
            return
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if trainer.val_dataloaders is None:
            with contextlib.suppress(Exception):
                val_loop.setup_data()
        batches = self._batches(trainer, limit=1)
        if not batches:
            rank_zero_warn(f"{type(self).__name__}: no validation batches (validation_step, val_dataloader, "
                           "limit_val_batches), so the ablation will not run.")
            return
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad():
                self.loss_source = self._resolve(pl_module, batches[0])
        finally:
            pl_module.train(was_training)

    def _batches(self, trainer: Any, limit: int | None = None) -> list:
        loaders = trainer.val_dataloaders
        if loaders is None:
            return []
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        elif isinstance(loaders, Mapping):
            loaders = next(iter(loaders.values()), None)
        if loaders is None:
            return []
        out = []
        for i, batch in enumerate(loaders):
            if i >= (limit or self.max_batches):
                break
            out.append(trainer.strategy.batch_to_device(batch, dataloader_idx=0))
        return out

    def evaluate(self, trainer: Any, pl_module: nn.Module) -> list[float]:
        """Run the ablation now (:func:`~lightning_resctl.ablate` on the first ``max_batches`` validation
        batches, losses averaged over ranks); returns (and stores) ``loss_increase``."""
        from lightning_resctl.surgery import merge_sites

        batches = self._batches(trainer)
        if not merge_sites(pl_module) or not batches:
            return []
        result = ablate(pl_module, list(enumerate(batches)),
                        lambda module, item: self._batch_loss(trainer, module, item[1], item[0]),
                        reduce=lambda value: trainer.strategy.reduce(value, reduce_op="mean"))
        self.base_loss = result.base_loss
        self.loss_increase = result.loss_increase
        self._result = result
        return result.loss_increase

    def on_validation_epoch_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        if not self.evaluate(trainer, pl_module):
            return
        self._result.log_to(trainer, step=trainer.fit_loop.epoch_loop._batches_that_stepped, prefix=self.prefix,
                            figure=self.depth_images, dirpath=self.dirpath, owner=type(self).__name__)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_increase": list(self.loss_increase), "base_loss": self.base_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_increase = list(state_dict.get("loss_increase", []))
        self.base_loss = state_dict.get("base_loss")

