"""Fair from step 0: how far each method's model starts from plain's, before any training.

For a seed's initial (unpatched) model, the method's model is a copy patched with the method. On the first
validation batch both run

* in eval mode, without gradients, the user's ``validation_step``; what the LightningModule's own ``forward``
  returns there is the *output* (every floating tensor of it; the step's returned loss when ``forward`` is not
  called);
* in train mode, the user's ``training_step`` (same RNG for both), then ``backward``: the *gradient norm* over the
  parameters the unpatched model has (a rule's own new parameters are left out).

Reported per method: ``output = ||o_m - o_plain|| / ||o_plain||`` and ``grad_norm = |g_m - g_plain| / g_plain``.
A rule whose docs call it identity at init (its class's ``identity_at_init``, see
:func:`~lightning_resctl.compare.methods.claims_identity_at_init`) is *flagged* when either exceeds
:data:`IDENTITY_TOLERANCE`: the comparison would then measure where it starts as much as the rule.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .methods import PLAIN, apply_method, claims_identity_at_init

__all__ = ["IDENTITY_TOLERANCE", "RefusedError", "InitProbe", "init_difference"]

#: Relative difference to plain at init above which an identity-at-init rule is flagged.
IDENTITY_TOLERANCE = 1e-3


class RefusedError(RuntimeError):
    """The surgery cannot apply a method to this model (the message says why)."""


def _floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().double().flatten()] if value.is_floating_point() else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _floats(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    return []


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"training_step returned {type(out).__name__}; the init check needs the loss (a Tensor or "
                        "a dict with 'loss')")
    return out


@contextlib.contextmanager
def _quiet_log():
    """``self.log`` outside a Trainer warns on every call: silence that here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*trainer.*reference is not registered.*")
        yield


class InitProbe:
    """Output and gradient norm of a model at init on one batch (see the module docstring).

    Args:
        batch: the first validation batch (moved to ``device``).
        device: where the probe runs.
        autocast: a context manager factory for the Trainer's precision (e.g. bf16 autocast), or None.
    """

    def __init__(self, batch: Any, device: torch.device, autocast=None):
        from lightning.fabric.utilities.apply_func import move_data_to_device

        self.batch = move_data_to_device(batch, device)
        self.device = device
        self.autocast = autocast or contextlib.nullcontext

    def __call__(self, model: nn.Module, names: set[str]) -> tuple[torch.Tensor, float]:
        model = model.to(self.device)
        captured: list[Any] = []
        hook = model.register_forward_hook(lambda mod, args, out: captured.append(out) if not captured else None)
        was_training = model.training
        try:
            model.eval()
            with torch.no_grad(), self.autocast(), _quiet_log():
                returned = model.validation_step(self.batch, 0)
            hook.remove()
            parts = _floats(captured[0] if captured else returned)
            if not parts:
                raise TypeError("neither the model's forward nor validation_step gave a floating tensor to compare")
            output = torch.cat(parts).cpu()
            model.train()
            model.zero_grad(set_to_none=True)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(0)
                with self.autocast(), _quiet_log():
                    loss = _loss_of(model.training_step(self.batch, 0))
                loss.backward()
            squares = [p.grad.detach().double().pow(2).sum() for n, p in model.named_parameters()
                       if n in names and p.grad is not None]
            grad = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
            model.zero_grad(set_to_none=True)
        finally:
            hook.remove()
            model.train(was_training)
        return output, grad


def _relative(a: float | torch.Tensor, b: float | torch.Tensor) -> float:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return math.inf
        num, den = float((a - b).norm()), float(b.norm())
    else:
        num, den = abs(a - b), abs(b)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def init_difference(reference: nn.Module, method: str, options: Mapping[str, Any] | None, probe: InitProbe,
                    plain: tuple[torch.Tensor, float] | None = None) -> dict[str, Any]:
    """How far ``method`` starts from plain on ``probe``'s batch: ``{"output", "grad_norm", "identity_claimed",
    "flagged"}``; ``plain``: plain's probe result for ``reference`` (computed when None).

    Raises :class:`RefusedError` when the surgery cannot patch a copy of ``reference`` with the method."""
    names = {n for n, _ in reference.named_parameters()}
    if plain is None:
        plain = probe(copy.deepcopy(reference), names)
    if method == PLAIN:
        out, grad = plain
    else:
        model = copy.deepcopy(reference)
        try:
            apply_method(model, method, options)
        except Exception as err:  # noqa: BLE001 - any refusal of the surgery is reported, the other methods run
            raise RefusedError(f"{type(err).__name__}: {err}") from err
        out, grad = probe(model, names)
        del model
    output, grad_norm = _relative(out, plain[0]), _relative(grad, plain[1])
    claimed = claims_identity_at_init(method, options)
    flagged = claimed and max(output, grad_norm) > IDENTITY_TOLERANCE
    return {"output": output, "grad_norm": grad_norm, "identity_claimed": claimed, "flagged": flagged}
