"""ablate(model, batches, loss_fn): the loss increase when each merge's update is skipped in turn."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import depths as D_

__all__ = ["ablate", "AblationResult"]


@dataclass
class AblationResult:
    """``loss_increase[d] = L(skip merge d) - base_loss`` (d: merge index, ordered by chain, then position);
    ``labels[d]``: ``"07 mlp"``."""

    base_loss: float
    loss_increase: list[float]
    labels: list[str]

    def metrics(self, prefix: str = "resctl") -> dict[str, float]:
        """``{f"{prefix}/ablation_loss_increase/{dd}": value, f"{prefix}/ablation_base_loss": base_loss}``."""
        D = len(self.loss_increase)
        out = {f"{prefix}/ablation_loss_increase/{D_.depth_tag(d, D)}": v for d, v in enumerate(self.loss_increase)}
        out[f"{prefix}/ablation_base_loss"] = self.base_loss
        return out

    def log_to(self, *destinations: Any, step: int, prefix: str = "resctl", figure: bool = True,
               dirpath: str | None = None, owner: str = "ablate") -> None:
        """Write :meth:`metrics` and (``figure``) the increase-vs-depth figure ``f"{prefix}/ablation/loss_increase"``
        to ``destinations`` (as :meth:`ResidualMonitor.log_to <lightning_resctl.ResidualMonitor.log_to>` takes
        them; PNG files in ``dirpath`` or, when no destination takes images, ``<log dir>/resctl_figures``).
        Rank zero only; ``owner`` names the caller in messages."""
        from .monitor import _global_rank
        from .sinks import sinks_for

        if _global_rank() != 0:
            return
        sinks = sinks_for(destinations, dirpath, what=f"{owner}.log_to")
        values = self.metrics(prefix)
        for s in sinks:
            s.scalars(values, step)
        if figure and self.loss_increase and any(s.takes_images for s in sinks):
            import matplotlib.pyplot as plt

            from .figures import ablation_figure

            fig = ablation_figure(self.loss_increase)
            for s in sinks:
                if s.takes_images:
                    s.image(prefix, "ablation/loss_increase", fig, step)
            plt.close(fig)


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """All-reduce mean over the default process group (identity when not distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.to_local().device if hasattr(p, "to_local") else p.device
    return torch.device("cpu")


def ablate(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
           reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AblationResult:
    """Skip each residual merge's update in turn (``MergeSite.skip_update``: output = stream) and measure the loss.

    ``loss_increase[d] = L(skip merge d) - L(no skip)``, each ``L`` the mean of ``loss_fn(model, batch)`` over
    ``batches`` (in eval mode, without gradients; the training mode is restored), reduced with ``reduce``
    (default: the mean over the ranks of ``torch.distributed`` when it is initialised — pass the same batches'
    shards on every rank, and call it on every rank). Costs (merges + 1) x len(batches) forwards, run eagerly also
    where the model or its blocks are compiled (``torch.compiler.set_stance("force_eager")``: no graph per skipped
    merge).

    The model must hold merge sites: patch it first (``patch_residuals(model, method="add")`` leaves the
    outputs unchanged), or pass a model a :class:`ResidualMonitor` observes.

    Returns an :class:`AblationResult` (``.loss_increase``, ``.base_loss``; ``.log_to(writer, step=...)``).
    """
    from lightning_resctl.surgery import merge_sites

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch) -> scalar Tensor, got "
                        f"{type(loss_fn).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: pass the (held-out) batches to measure the loss on")
    sites = merge_sites(model)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no merge sites: patch it first, e.g. "
                         "patch_residuals(model, method='add') (outputs unchanged), or pass the model a "
                         "ResidualMonitor observes")
    reduce = reduce or _mean_over_ranks
    device = _device(model)

    def mean_loss() -> float:
        total = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar Tensor, got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            total = total + loss.detach().double().reshape(()).cpu()
        return float(reduce((total / len(batches)).to(device)))

    entries = D_.depth_entries(sites)
    was_training = model.training
    model.eval()
    try:  # eagerly: a skipped update compiled into graphs of its own would fill dynamo's cache (one per merge)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            base = mean_loss()
            inc = []
            for site, pos in entries:
                if len(getattr(site, "positions", (pos,))) == 1:
                    site.skip_update = True
                else:  # one expression, several merges per forward: skip only the call at `pos`
                    counter = D_.PositionCounter()

                    def toggle(s: Any, *_: Any, _pos: int = pos, _counter: Any = counter) -> None:
                        s.skip_update = _counter(s) == _pos

                    site.observer = toggle
                try:
                    inc.append(mean_loss() - base)
                finally:
                    site.skip_update = False
                    site.observer = None
    finally:
        model.train(was_training)
    return AblationResult(base, inc, D_.depth_labels(entries))
