"""Patching inside ``LightningModule.configure_model`` (FSDP2 / ModelParallelStrategy).

With :class:`~lightning.pytorch.strategies.ModelParallelStrategy` the model is usually built *and*
sharded (``fully_shard``) inside ``configure_model``, which runs after every callback's ``setup``.
MGR adds parameters, which must exist before ``fully_shard`` so that they are sharded (DTensor) and
handed to the optimizer. One line between building and sharding does it::

    def configure_model(self):
        if self.model is not None:
            return
        self.model = build_model()
        patch_in_configure_model(self, self.model)   # <- applies the Trainer's ResidualControlCallback
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..surgery import get_patch_report, merge_sites
from ..surgery.patcher import check_method, ensure_patched

__all__ = ["patch_in_configure_model"]


def patch_in_configure_model(pl_module: nn.Module, model: nn.Module | None = None, method: str | None = None,
                             **options: Any):
    """Patch the residual merges of ``model`` (default: ``pl_module`` itself; pass the submodule you
    ``fully_shard``, e.g. ``self.model``, so that MGR's new parameters live inside it) now — call it inside
    ``configure_model`` before ``fully_shard``. The example input is ``pl_module.example_input_array``
    unless ``model`` has its own (or ``options`` has ``example_input``).

    Uses the method and options of the :class:`ResidualControlCallback` attached to the module's Trainer;
    without such a callback (or to override it) pass ``method`` and ``options`` (forwarded to
    :func:`patch_residuals`). Does nothing when the module is patched already or when the callback only
    observes (``method=None`` — observing needs no new parameters and is set up after ``configure_model``).
    Returns the :class:`PatchReport` (or ``None`` when nothing was patched by this call).

    The rules' parameters are the same as :func:`patch_residuals` makes (none is 0-d, which FSDP2 refuses), so
    state dicts of both ways load into each other.
    """
    from ..callbacks import ResidualControlCallback

    target = pl_module if model is None else model
    if merge_sites(pl_module):
        return None
    if method is not None:
        check_method(method, {k: v for k, v in options.items() if k != "example_input"})
        example_input = options.pop("example_input", None)
        ensure_patched(target, method, example_input=example_input, method_options=options, example_from=pl_module)
        return get_patch_report(target)
    trainer = getattr(pl_module, "_trainer", None)
    callbacks = [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, ResidualControlCallback)]
    for cb in callbacks:
        if cb.method is not None:
            cb.patch(pl_module, target)
            return get_patch_report(target)
    return None

