"""Autograd helpers for a merge rule's own math: the context it runs in, whatever the caller's, and its closed-form
paths' contracts.

* :func:`autocast_off`, :func:`fp32_matmul` and :func:`fp32_bmm` — a rule's internal math (its row moments, gates,
  pools, coefficients) runs in its documented compute dtype (fp32, fp64 for fp64 inputs) also under
  ``torch.autocast`` (Lightning's ``precision="bf16-mixed"`` / ``"16-mixed"``), which would otherwise run its
  matmuls, ``bmm`` and ``vecdot`` in bf16/fp16. The closed-form paths run forward and backward under
  :func:`autocast_off`; the plain-autograd paths use :func:`fp32_matmul`, whose backward also stays out of
  autocast when ``backward()`` is called inside an autocast region (Lightning's ``manual_backward``). Only the
  merge is taken out of autocast: the model's branches keep it.
* :func:`refuse_transforms` — the closed-form ``autograd.Function`` paths (ResController's and MGR's torch
  path, the Triton ops) have a hand-written backward only; forward-mode AD (``torch.autograd.forward_ad``,
  ``torch.func.jvp``) and the ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev`` ...) are refused
  with a message naming the backend that supports them (``backend="reference"``, plain autograd);
  :func:`refuse_second_derivative` does the same for a backward with ``create_graph=True``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import forward_ad

__all__ = ["autocast_off", "fp32_matmul", "fp32_bmm", "refuse_transforms", "refuse_second_derivative",
           "traced_under_saved_tensor_hooks"]


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)`` when autocast is on for ``device_type``, else a null
    context (nothing to undo; also for device types autocast does not know, e.g. ``"meta"``)."""
    if _autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _autocast_on(device_type: str) -> bool:
    # a compiled region runs on a device type autocast knows (the availability check is for eager "meta" tensors),
    # and torch 2.11's dynamo cannot trace the check: a graph break in every merge under autocast
    if torch.compiler.is_compiling():
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


class _Product(torch.autograd.Function):
    """A matrix product with autocast off in the forward and the backward: the shared part of :class:`_Matmul`
    and :class:`_Bmm` (they differ in the product and its backward)."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)


def _product_jvp(product, ctx, ta, tb):
    """The tangent of ``product(a, b)``: ``ta @ b + a @ tb``, each term with ``product``."""
    a, b = ctx.saved_tensors
    out = None if ta is None else product(ta, b)
    if tb is not None:
        out = product(a, tb) if out is None else out + product(a, tb)
    return out


def _outside_autocast(a, b, function: type, with_jvp: type, plain):
    """``function.apply(a, b)`` under ``torch.compile``; ``with_jvp.apply`` when a backward is recorded,
    autocast is on, a forward-mode level or a functorch transform is active; else ``plain(a, b)``."""
    if torch.compiler.is_compiling():
        return function.apply(a, b)
    records = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if records or _autocast_on(a.device.type) or forward_ad._current_level >= 0 \
            or torch._C._are_functorch_transforms_active():
        return with_jvp.apply(a, b)
    return plain(a, b)


class _Matmul(_Product):
    """``a @ b`` with autocast off in the forward and the backward (see :func:`fp32_matmul`)."""

    @staticmethod
    def forward(a, b):
        with autocast_off(a.device.type):
            return a @ b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = db = None
        with autocast_off(grad.device.type):  # also traced into a compiled backward graph
            if ctx.needs_input_grad[0]:
                da = fp32_matmul(grad, b.mT) if b.dim() == 2 else grad.unsqueeze(-1) * b
            if ctx.needs_input_grad[1]:
                rows = a.reshape(-1, a.shape[-1]).mT
                db = fp32_matmul(rows, grad.reshape(-1, b.shape[-1]) if b.dim() == 2 else grad.reshape(-1))
        return da, db


class _MatmulWithJvp(_Matmul):
    """:class:`_Matmul` with forward-mode AD (eager only: dynamo does not trace a custom ``jvp``)."""

    @staticmethod
    def jvp(ctx, ta, tb):
        return _product_jvp(fp32_matmul, ctx, ta, tb)


def fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a (..., K)`` and ``b (K, N)`` or ``(K,)``, computed in the inputs' dtype whatever the
    autocast state — in the forward, the backward (also a backward called inside an autocast region, a double
    backward, and the backward graph ``torch.compile`` traces under the forward's autocast) and forward-mode AD
    (eager); ``vmap`` works. Plain ``a @ b`` when autocast is off and no backward is recorded."""
    return _outside_autocast(a, b, _Matmul, _MatmulWithJvp, torch.matmul)


class _Bmm(_Product):
    """``a @ b`` for batched ``a (..., M, K)`` and ``b (..., K, N)`` of one batch shape, with autocast off in the
    forward and the backward (see :func:`fp32_bmm`)."""

    @staticmethod
    def forward(a, b):
        with autocast_off(a.device.type):
            return torch.matmul(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = fp32_bmm(grad, b.mT) if ctx.needs_input_grad[0] else None
        db = fp32_bmm(a.mT, grad) if ctx.needs_input_grad[1] else None
        return da, db


class _BmmWithJvp(_Bmm):
    """:class:`_Bmm` with forward-mode AD (eager only)."""

    @staticmethod
    def jvp(ctx, ta, tb):
        return _product_jvp(fp32_bmm, ctx, ta, tb)


def fp32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` (``a (..., M, K)``, ``b (..., K, N)``, one batch shape) computed in the inputs' dtype
    whatever the autocast state, like :func:`fp32_matmul` (forward, backward — also one called inside an autocast
    region —, double backward, forward-mode AD in eager, ``vmap``)."""
    if a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"fp32_bmm needs one batch shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return _outside_autocast(a, b, _Bmm, _BmmWithJvp, torch.matmul)


def _has_tangent(tensors) -> bool:
    if forward_ad._current_level < 0:  # no dual level entered: no tensor has a tangent (one int compare)
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def refuse_transforms(what: str, oracle: str, *tensors) -> None:
    """Raise a RuntimeError naming ``oracle`` when a ``torch.func`` transform (vmap, grad, jacrev, jvp ...) is
    active or one of ``tensors`` carries a forward-mode tangent: ``what`` (a closed-form autograd.Function or a
    custom op) supports neither. Called before the Function is applied; costs one C call otherwise."""
    if torch._C._are_functorch_transforms_active():
        kind = "torch.func transforms (vmap, grad, jacrev, jvp, ...)"
    elif _has_tangent(tensors):
        kind = "forward-mode AD (a dual tensor from torch.autograd.forward_ad)"
    else:
        return
    raise RuntimeError(f"{what}: {kind} cannot run through its closed-form backward (an autograd.Function with a "
                       f"hand-written backward only); {oracle} (plain autograd) supports them")


def refuse_second_derivative(what: str, oracle: str) -> None:
    """Called first in the backward of a closed-form ``autograd.Function``: a backward with ``create_graph=True``
    (grad mode on) would differentiate math that is not differentiable again, so it raises, naming ``oracle``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what}: its closed-form backward is not differentiable, so a second derivative (a backward with "
            f"create_graph=True) is not available; {oracle} (plain autograd) has one")



@torch.compiler.assume_constant_result
def traced_under_saved_tensor_hooks() -> bool:
    """While dynamo traces: whether saved-tensor hooks other than the observing ones (marked ``_mgr_transparent``)
    were active when the trace started (a block compiled on its own inside an eager ``torch.utils.checkpoint``, or
    offloading), or a backward pass runs. A constant of the graph (the block is traced inside the checkpoint it
    runs in). Dynamo cannot trace a ``torch.func`` transform in a Function's backward there."""
    if torch._C._current_graph_task_id() != -1:
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and not getattr(hooks[0], "_mgr_transparent", False)
