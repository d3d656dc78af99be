"""ResidualAblationCallback: validation-loss increase when each merge's update is skipped in turn."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from . import _common as C

__all__ = ["ResidualAblationCallback"]


class ResidualAblationCallback(Callback):
    """At validation end every ``every_n_epochs`` epochs, skip each merge's update in turn
    (``MergeSite.skip_update = True``: output = stream) and measure the validation loss.

    ``loss_increase[d] = L(skip merge d) - L(no skip)`` (d: merge index ordered by chain, then position), each loss the mean over the first
    ``max_batches`` batches of the (first) validation dataloader, averaged over ranks. Logged as
    ``f"{prefix}/ablation_loss_increase/{d:02d}"`` (plus ``{prefix}/ablation_base_loss``) and, for
    TensorBoard, an image of the increase vs depth.

    Args:
        every_n_epochs: run at the end of every N-th validation epoch (not during the sanity check).
        max_batches: validation batches per evaluation (each evaluation costs (D + 1) x max_batches forwards).
        loss_fn: ``loss_fn(pl_module, batch) -> scalar Tensor``; default: ``pl_module.validation_step(batch, i)``
            whose return is a Tensor or a mapping with ``"loss"`` / ``"val_loss"`` (its ``self.log`` calls are
            silenced during the evaluation).
        method: patch the model with this method if no other callback/user did (``None``: observe only,
            ``"add"`` patch removed at teardown). Usually left ``None`` next to :class:`ResidualControlCallback`.
        depth_images: write the increase-vs-depth image (TensorBoard).
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        max_batches: int = 4,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        *,
        method: str | None = None,
        depth_images: bool = True,
        prefix: str = "resctl",
        example_input: Any = None,
        **method_options: Any,
    ) -> None:
        super().__init__()
        for name, value in (("every_n_epochs", every_n_epochs), ("max_batches", max_batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        self.every_n_epochs = every_n_epochs
        self.max_batches = max_batches
        self.loss_fn = loss_fn
        self.method = C.check_method(method, method_options)
        self.depth_images = bool(depth_images)
        self.prefix = prefix
        self._patch_kwargs = dict(example_input=example_input, method_options=method_options)
        self.loss_increase: list[float] = []
        self.base_loss: float | None = None
        self._owns_patch = False
        self._wrapped_configure = False

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        from lightning.pytorch.utilities.model_helpers import is_overridden

        def do_patch() -> None:
            patched = C.ensure_patched(pl_module, self.method, **self._patch_kwargs)
            self._owns_patch = self._owns_patch or (patched and self.method is None)

        if is_overridden("configure_model", pl_module) and not self._wrapped_configure:
            original = pl_module.configure_model

            def configure_model_then_patch(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                do_patch()
                return out

            pl_module.configure_model = configure_model_then_patch
            self._wrapped_configure = True
        else:
            do_patch()

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if self._wrapped_configure and "configure_model" in vars(pl_module):
            del pl_module.configure_model
        self._wrapped_configure = False
        if self._owns_patch:
            from lightning_resctl.surgery import get_patch_report, unpatch_residuals

            if get_patch_report(pl_module) is not None:
                unpatch_residuals(pl_module)
            self._owns_patch = False

    # ------------------------------------------------------------------ evaluation
    def _batch_loss(self, trainer: Any, pl_module: nn.Module, batch: Any, idx: int) -> torch.Tensor:
        if self.loss_fn is not None:
            out = self.loss_fn(pl_module, batch)
        else:
            out = pl_module.validation_step(batch, idx)
        if isinstance(out, Mapping):
            for key in ("loss", "val_loss"):
                if key in out:
                    out = out[key]
                    break
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TypeError(
                "ResidualAblationCallback needs a scalar loss: validation_step returned "
                f"{type(out).__name__}; pass loss_fn=lambda module, batch: <scalar loss>"
            )
        return out.detach().double().reshape(())

    def _batches(self, trainer: Any) -> list:
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
            if i >= self.max_batches:
                break
            out.append(trainer.strategy.batch_to_device(batch, dataloader_idx=0))
        return out

    @contextlib.contextmanager
    def _silenced_logging(self, pl_module: nn.Module):
        saved = {k: vars(pl_module)[k] for k in ("log", "log_dict") if k in vars(pl_module)}
        pl_module.log = lambda *a, **k: None
        pl_module.log_dict = lambda *a, **k: None
        try:
            yield
        finally:
            for k in ("log", "log_dict"):
                if k in saved:
                    setattr(pl_module, k, saved[k])
                else:
                    delattr(pl_module, k)

    def _mean_loss(self, trainer: Any, pl_module: nn.Module, batches: list) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(batches):
            total = total + self._batch_loss(trainer, pl_module, batch, i).cpu()
        mean = total / max(len(batches), 1)
        mean = trainer.strategy.reduce(mean.to(_device(pl_module)), reduce_op="mean")
        return float(mean)

    def evaluate(self, trainer: Any, pl_module: nn.Module) -> list[float]:
        """Run the ablation now; returns (and stores) ``loss_increase``."""
        from lightning_resctl.surgery import merge_sites

        sites = merge_sites(pl_module)
        batches = self._batches(trainer)
        if not sites or not batches:
            return []
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), self._silenced_logging(pl_module):
                base = self._mean_loss(trainer, pl_module, batches)
                inc = []
                for site, pos in C.depth_entries(sites):
                    if len(getattr(site, "positions", (pos,))) == 1:
                        site.skip_update = True
                    else:  # one expression, several merges per forward: skip only the call at `pos`
                        counter = C.PositionCounter()

                        def toggle(s, *_: Any, _pos: int = pos, _counter=counter) -> None:
                            s.skip_update = _counter(s) == _pos

                        site.observer = toggle
                    try:
                        inc.append(self._mean_loss(trainer, pl_module, batches) - base)
                    finally:
                        site.skip_update = False
                        site.observer = None
        finally:
            pl_module.train(was_training)
        self.base_loss = base
        self.loss_increase = inc
        return inc

    def on_validation_epoch_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        inc = self.evaluate(trainer, pl_module)
        if not inc or not trainer.is_global_zero:
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        D = len(inc)
        tags = {f"{self.prefix}/ablation_loss_increase/{C.depth_tag(d, D)}": v for d, v in enumerate(inc)}
        tags[f"{self.prefix}/ablation_base_loss"] = self.base_loss
        C.log_scalars(trainer, tags, step)
        if self.depth_images and C.tensorboard_writers(trainer):
            from ..plots import curves_figure, figure_to_array

            fig = curves_figure(
                {"loss increase": (list(range(D)), inc)},
                "depth (merge index)", "validation loss increase", "ablation: skip one merge's update",
            )
            C.add_image(trainer, f"{self.prefix}/ablation/loss_increase", figure_to_array(fig), step)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_increase": list(self.loss_increase), "base_loss": self.base_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_increase = list(state_dict.get("loss_increase", []))
        self.base_loss = state_dict.get("base_loss")


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.to_local().device if hasattr(p, "to_local") else p.device
    return torch.device("cpu")
