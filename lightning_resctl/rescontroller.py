"""ResController: a parameter-free, energy-aware replacement for the residual merge ``r + u``.

The rule (per row, i.e. along the feature dimension ``dim``; d = its size; all
arithmetic in fp32, or fp64 when an input is fp64, also under ``torch.autocast``)::

    R      = sqrt(mean(r^2) + eps)                # residual RMS
    U      = sqrt(mean(u^2) + eps)                # update RMS
    A_u    = update_ratio * R                     # allowed update RMS
    hard_u = min(A_u / (U + eps), 1)
    p_u    = U / (A_u + eps)                      # update pressure
    g_u    = sigmoid(update_softness * (p_u - 1))
    s_u    = 1 - g_u * (1 - hard_u)               # "alpha"
    C      = sqrt(max((Σr² + 2 s_u Σru + s_u² Σu²) / d, 0) + eps)   # RMS of r + s_u u
    A_s    = stream_ratio * R                     # allowed stream RMS
    hard_s = min(A_s / (C + eps), 1)
    p_s    = C / (A_s + eps)
    g_s    = sigmoid(stream_softness * (p_s - 1))
    s_s    = 1 - g_s * (1 - hard_s)               # "beta"
    out    = r + (s_u * s_s) * u                  # in the input dtype

Three execution paths compute it:

* :func:`rescontroller_reference` — the rule in plain torch ops (the oracle every other
  path is tested against; plain autograd differentiates it; ``backend="reference"``);
* the lean torch path — :class:`_ResControllerFunction`, an ``autograd.Function`` whose
  backward is the closed-form derivative of the rule; it saves only ``r``, ``u`` and a few
  per-row scalars (plain autograd of the reference saves every intermediate);
* the Triton path — fused forward and backward kernels in ``lightning_resctl.kernels.rescontroller``,
  registered as ``torch.library`` custom ops (opaque to ``torch.compile``).

:func:`rescontroller` / :class:`ResController` validate the input and dispatch:
``backend="auto"`` picks Triton for CUDA tensors when Triton works, else the torch path. The torch and Triton
paths refuse double backward, forward-mode AD and the ``torch.func`` transforms (their backward is closed-form)
with an error naming ``backend="reference"``, which supports them.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .runtime.autograd import autocast_off, op_outputs, refuse_second_derivative, refuse_transforms
from .runtime.backends import RULE_BACKENDS, check_backend, opaque_under_compile, resolve_backend, torch_mode
from .runtime.regions import CompiledMath
from .runtime.triton import load_kernels

__all__ = [
    "ControllerScales",
    "ResController",
    "rescontroller",
    "rescontroller_reference",
    "rescontroller_scales",
    "BACKENDS",
]

#: The shared backend names plus "reference": plain autograd over :func:`rescontroller_reference` (double backward,
#: forward-mode AD and the torch.func transforms work there); see lightning_resctl.runtime.backends.
BACKENDS = RULE_BACKENDS
_ORACLE = "backend='reference' (rescontroller_reference)"

_DEFAULTS = dict(update_ratio=0.18, stream_ratio=1.08, update_softness=8.0, stream_softness=8.0, eps=1e-12)


class ControllerScales(NamedTuple):
    """Per-row scales of the rule (fp32, the feature dim reduced away)."""

    alpha: Tensor  # s_u, the update scale
    beta: Tensor  # s_s, the stream scale
    update_cap_active: Tensor  # bool, p_u > 1
    stream_cap_active: Tensor  # bool, p_s > 1


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_option(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_options(update_ratio, stream_ratio, update_softness, stream_softness, eps) -> tuple[float, ...]:
    return (
        _check_option("update_ratio", update_ratio),
        _check_option("stream_ratio", stream_ratio),
        _check_option("update_softness", update_softness),
        _check_option("stream_softness", stream_softness),
        _check_option("eps", eps),
    )


def _check_dim_type(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {dim!r} ({type(dim).__name__})")
    return int(dim)


def _check_dim(dim, ndim: int) -> int:
    dim = _check_dim_type(dim)
    if ndim == 0:
        raise ValueError("residual must have at least one dimension (the feature dim), got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim} is out of range for tensors with {ndim} dimensions")
    return dim % ndim


def _check_backend(backend) -> str:
    return check_backend(backend, BACKENDS)


def _check_tensors(residual, update, dim) -> int:
    for name, t in (("residual", residual), ("update", update)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if residual.shape != update.shape:
        raise ValueError(
            f"residual and update must have the same shape (nothing is broadcast), "
            f"got residual {tuple(residual.shape)} and update {tuple(update.shape)}"
        )
    if residual.device != update.device:
        raise ValueError(
            f"residual and update must be on the same device, got residual on {residual.device} "
            f"and update on {update.device}"
        )
    dim = _check_dim(dim, residual.dim())
    if residual.shape[dim] == 0:
        raise ValueError(f"the feature dim (dim={dim}) must not be empty, got shape {tuple(residual.shape)}")
    return dim


def _compute_dtype(residual: Tensor, update: Tensor) -> torch.dtype:
    """fp64 when an input is fp64, else fp32."""
    return torch.float64 if torch.float64 in (residual.dtype, update.dtype) else torch.float32


# --------------------------------------------------------------------------------------------
# row scaling: the moments of rows of magnitude >= 2^32 are taken of r / k, u / k
# --------------------------------------------------------------------------------------------
#: Rows whose max-abs reaches this are scaled down before squaring (below it, k = 1: nothing changes).
SCALE_THRESHOLD = 2.0 ** 32


def _row_inv_scale(r: Tensor, u: Tensor, dim: int) -> Tensor:
    """Per row (keepdim) ``1 / k`` with ``k`` a power of two near the row's max-abs when that is >= 2^32, else 1.

    The rule is scale-invariant except for ``eps``, so computing it on ``r / k``, ``u / k`` with ``eps / k^2``
    inside square roots and ``eps / k`` beside the RMS values gives the same result without overflowing the
    squares (rows ~1e20 in fp32); powers of two scale exactly. Non-finite rows keep k = 1 (NaN/inf propagate
    as before). Not differentiated: the result does not depend on k."""
    with torch.no_grad():
        mx = torch.maximum(torch.linalg.vector_norm(r, float("inf"), dim=dim, keepdim=True),
                           torch.linalg.vector_norm(u, float("inf"), dim=dim, keepdim=True))
        big = (mx >= SCALE_THRESHOLD) & (mx < float("inf"))
        return torch.where(big, torch.exp2(-torch.floor(torch.log2(mx))), torch.ones_like(mx))


# --------------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------------
def _reference_scales(r: Tensor, u: Tensor, ur, sr, ku, ks, eps, dim: int):
    """The spec's per-row chain in plain torch ops (keepdim); returns (s_u, s_s, p_u, p_s).

    Rows of magnitude >= 2^32 are computed on ``r / k``, ``u / k`` (see :func:`_row_inv_scale`): ``eps2`` is
    eps inside square roots, ``eps1`` eps beside the RMS values (both ``eps`` when k = 1)."""
    inv_k = _row_inv_scale(r, u, dim)
    r, u = r * inv_k, u * inv_k
    eps1 = eps * inv_k
    eps2 = eps1 * inv_k
    mrr = (r * r).mean(dim, keepdim=True)
    muu = (u * u).mean(dim, keepdim=True)
    mru = (r * u).mean(dim, keepdim=True)
    R = torch.sqrt(mrr + eps2)
    U = torch.sqrt(muu + eps2)
    A_u = ur * R
    hard_u = (A_u / (U + eps1)).clamp(max=1.0)
    p_u = U / (A_u + eps1)
    g_u = torch.sigmoid(ku * (p_u - 1.0))
    s_u = 1.0 - g_u * (1.0 - hard_u)
    # RMS of the candidate stream r + s_u u, from the three row moments
    C = torch.sqrt((mrr + 2.0 * s_u * mru + s_u * s_u * muu).clamp(min=0.0) + eps2)
    A_s = sr * R
    hard_s = (A_s / (C + eps1)).clamp(max=1.0)
    p_s = C / (A_s + eps1)
    g_s = torch.sigmoid(ks * (p_s - 1.0))
    s_s = 1.0 - g_s * (1.0 - hard_s)
    return s_u, s_s, p_u, p_s


def rescontroller_reference(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = 0.18,
    stream_ratio: float = 1.08,
    update_softness: float = 8.0,
    stream_softness: float = 8.0,
    eps: float = 1e-12,
    *,
    dim: int = -1,
) -> Tensor:
    """The ResController rule in plain torch ops — the oracle the other paths are tested against.

    Per row along ``dim`` (d = its size), in fp32 (fp64 when an input is fp64)::

        R = sqrt(mean(r²) + eps)              U = sqrt(mean(u²) + eps)
        A_u = update_ratio·R                  hard_u = min(A_u / (U + eps), 1)
        p_u = U / (A_u + eps)                 g_u = sigmoid(update_softness·(p_u − 1))
        s_u = 1 − g_u·(1 − hard_u)
        C = sqrt(max(mean(r²) + 2 s_u mean(ru) + s_u² mean(u²), 0) + eps)
        A_s = stream_ratio·R                  hard_s = min(A_s / (C + eps), 1)
        p_s = C / (A_s + eps)                 g_s = sigmoid(stream_softness·(p_s − 1))
        s_s = 1 − g_s·(1 − hard_s)
        out = r + (s_u·s_s)·u                 (in the promoted input dtype)

    Differentiable by plain autograd (which saves every intermediate).
    """
    dim = _check_tensors(residual, update, dim)
    ur, sr, ku, ks, eps = _check_options(update_ratio, stream_ratio, update_softness, stream_softness, eps)
    cdt = _compute_dtype(residual, update)
    with autocast_off(residual.device.type):
        r, u = residual.to(cdt), update.to(cdt)
        s_u, s_s, _, _ = _reference_scales(r, u, ur, sr, ku, ks, eps, dim)
        out = r + (s_u * s_s) * u
    return out.to(torch.promote_types(residual.dtype, update.dtype))


def rescontroller_scales(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = 0.18,
    stream_ratio: float = 1.08,
    update_softness: float = 8.0,
    stream_softness: float = 8.0,
    eps: float = 1e-12,
    *,
    dim: int = -1,
) -> ControllerScales:
    """Per-row scales of the rule (no grad): ``alpha`` = s_u, ``beta`` = s_s, and whether the
    update cap (p_u > 1) and the stream cap (p_s > 1) are active. Tensors of shape
    ``residual.shape`` with ``dim`` removed; alpha/beta in fp32."""
    dim = _check_tensors(residual, update, dim)
    ur, sr, ku, ks, eps = _check_options(update_ratio, stream_ratio, update_softness, stream_softness, eps)
    cdt = _compute_dtype(residual, update)
    with torch.no_grad(), autocast_off(residual.device.type):
        r, u = residual.detach().to(cdt), update.detach().to(cdt)
        s_u, s_s, p_u, p_s = _reference_scales(r, u, ur, sr, ku, ks, eps, dim)
        return ControllerScales(
            alpha=s_u.squeeze(dim).float(),
            beta=s_s.squeeze(dim).float(),
            update_cap_active=(p_u > 1.0).squeeze(dim),
            stream_cap_active=(p_s > 1.0).squeeze(dim),
        )


# --------------------------------------------------------------------------------------------
# the lean torch path: closed-form backward, saves r, u and per-row scalars only
# --------------------------------------------------------------------------------------------
def _lean_forward(residual: Tensor, update: Tensor, ur: float, sr: float, ku: float, ks: float, eps: float, dim: int):
    """Forward math of the lean path: ``(out, stats)``, stats = the 13 per-row scalars the backward reuses.

    Three row moments (of ``r / k``, ``u / k``; k = 1 unless the row is huge, see :func:`_row_inv_scale`),
    the per-row chain, one ``addcmul``. Plain torch ops: run eagerly or as one compiled region."""
    cdt = _compute_dtype(residual, update)
    r, u = residual.to(cdt), update.to(cdt)
    d = r.shape[dim]
    inv_k = _row_inv_scale(r, u, dim)
    rs, us = r * inv_k, u * inv_k
    eps1 = inv_k * eps
    eps2 = eps1 * inv_k
    mrr = torch.linalg.vector_norm(rs, dim=dim, keepdim=True).square_().div_(d)
    muu = torch.linalg.vector_norm(us, dim=dim, keepdim=True).square_().div_(d)
    mru = torch.linalg.vecdot(rs, us, dim=dim).unsqueeze_(dim).div_(d)
    R = (mrr + eps2).sqrt_()
    U = (muu + eps2).sqrt_()
    A_u = R * ur
    x_u = A_u / (U + eps1)
    hard_u = x_u.clamp(max=1.0)
    p_u = U / (A_u + eps1)
    g_u = torch.sigmoid(ku * (p_u - 1.0))
    s_u = 1.0 - g_u * (1.0 - hard_u)
    m = mrr + 2.0 * s_u * mru + s_u * s_u * muu
    C = (m.clamp(min=0.0) + eps2).sqrt_()
    A_s = R * sr
    x_s = A_s / (C + eps1)
    hard_s = x_s.clamp(max=1.0)
    p_s = C / (A_s + eps1)
    g_s = torch.sigmoid(ks * (p_s - 1.0))
    s_s = 1.0 - g_s * (1.0 - hard_s)
    a = s_u * s_s
    out = torch.addcmul(r, a, u).to(torch.promote_types(residual.dtype, update.dtype))
    stats = torch.cat([mru, muu, s_u, s_s, g_u, g_s, x_u, x_s, m, R, U, C, inv_k], dim=dim)
    return out, stats


def _lean_backward(grad_out: Tensor, residual: Tensor, update: Tensor, stats: Tensor, ur: float, sr: float,
                   ku: float, ks: float, eps: float, dim: int):
    """Closed-form backward of :func:`_lean_forward`: ``(grad_r, grad_u)`` in the inputs' dtypes.

    In the scaled frame (r' = r / k): the chain's derivative with ``Σ g u'`` gives coefficients ``c'`` of
    ``grad_r' = c'_rr r' + c'_ru u'``; then ``grad_r = g + (c'_rr / k) r + (c'_ru / k) u`` (k held fixed: the
    rule does not depend on it), and ``grad_u = a g + (c'_uu / k) u + (c'_ru / k) r``."""
    cdt = stats.dtype
    d = residual.shape[dim]
    mru, muu, s_u, s_s, g_u, g_s, x_u, x_s, m, R, U, C, inv_k = stats.split(1, dim=dim)
    r, u, g = residual.to(cdt), update.to(cdt), grad_out.to(cdt)
    eps1 = inv_k * eps
    a = s_u * s_s
    ga = torch.linalg.vecdot(g, u, dim=dim).unsqueeze_(dim) * inv_k  # dL/da / k = Σ g u'
    gs_u = ga * s_s
    gs_s = ga * s_u
    # s_s = 1 - g_s (1 - hard_s), g_s = sigmoid(ks (p_s - 1)), p_s = C / (A_s + eps)
    hard_s = x_s.clamp(max=1.0)
    A_s_eps = R * sr + eps1
    gp_s = gs_s * (hard_s - 1.0) * (ks * g_s * (1.0 - g_s))
    gx_s = (gs_s * g_s).masked_fill_(x_s > 1.0, 0.0)  # hard_s = min(x_s, 1), x_s = A_s / (C + eps)
    C_eps = C + eps1
    gC = gp_s / A_s_eps - gx_s * x_s / C_eps
    gA_s = gx_s / C_eps - gp_s * C / (A_s_eps * A_s_eps)
    # C = sqrt(max(m, 0) + eps), m = mrr + 2 s_u mru + s_u² muu
    gm = (gC / (2.0 * C)).masked_fill_(m < 0.0, 0.0)
    gs_u = gs_u + gm * 2.0 * (mru + s_u * muu)
    # s_u = 1 - g_u (1 - hard_u), g_u = sigmoid(ku (p_u - 1)), p_u = U / (A_u + eps)
    hard_u = x_u.clamp(max=1.0)
    A_u_eps = R * ur + eps1
    U_eps = U + eps1
    gp_u = gs_u * (hard_u - 1.0) * (ku * g_u * (1.0 - g_u))
    gx_u = (gs_u * g_u).masked_fill_(x_u > 1.0, 0.0)  # hard_u = min(x_u, 1), x_u = A_u / (U + eps)
    gU = gp_u / A_u_eps - gx_u * x_u / U_eps
    gA_u = gx_u / U_eps - gp_u * U / (A_u_eps * A_u_eps)
    gR = gA_s * sr + gA_u * ur
    # R = sqrt(mrr + eps), U = sqrt(muu + eps); mrr = Σr²/d, muu = Σu²/d, mru = Σru/d (scaled frame)
    c_rr = (gR / R + 2.0 * gm) * (inv_k / d)  # coefficient of r in grad_r  (= 2 dL/dmrr / d)
    c_uu = (gU / U + 2.0 * gm * s_u * s_u) * (inv_k / d)  # coefficient of u in grad_u
    c_ru = (2.0 * gm * s_u) * (inv_k / d)  # coefficient of u in grad_r and of r in grad_u
    grad_r = torch.addcmul(g, c_rr, r).addcmul_(c_ru, u).to(residual.dtype)
    grad_u = torch.mul(g, a).addcmul_(c_uu, u).addcmul_(c_ru, r).to(update.dtype)
    return grad_r, grad_u


class _ResControllerFunction(torch.autograd.Function):
    """``out = r + s_u s_s u`` with the closed-form backward (:func:`_lean_forward`, :func:`_lean_backward`).

    Saved for backward: ``r``, ``u`` (the caller's tensors, not copies) and one stack of 13 per-row scalars
    (the feature dim of size 13). Backward: one reduction Σ g·u per row, then
    ``grad_r = g + c_rr r + c_ru u`` and ``grad_u = a g + c_uu u + c_ru r``. ``mode`` picks eager or compiled
    math (see :func:`_math_fns`).
    """

    @staticmethod
    def forward(ctx, residual, update, ur, sr, ku, ks, eps, dim, mode="eager"):
        fwd, _ = _math_fns(mode)
        with autocast_off(residual.device.type):
            out, stats = fwd(residual, update, ur, sr, ku, ks, eps, dim)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(residual, update, stats)
            ctx.opts = (ur, sr, ku, ks, eps, dim, mode)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("rescontroller (torch path)", _ORACLE)
        residual, update, stats = ctx.saved_tensors
        ur, sr, ku, ks, eps, dim, mode = ctx.opts
        _, bwd = _math_fns(mode)
        with autocast_off(residual.device.type):
            grad_r, grad_u = bwd(grad_out, residual, update, stats, ur, sr, ku, ks, eps, dim)
        return (grad_r if ctx.needs_input_grad[0] else None, grad_u if ctx.needs_input_grad[1] else None,
                None, None, None, None, None, None, None)


#: (forward, backward) math for a torch_mode: eager torch ops, or their compiled regions (runtime.regions)
_math_fns = CompiledMath(_lean_forward, _lean_backward)


def _rescontroller_torch(residual, update, ur, sr, ku, ks, eps, dim, backend="torch"):
    refuse_transforms("rescontroller (torch path)", _ORACLE, residual, update)
    if opaque_under_compile():
        return _rescontroller_op(residual, update, ur, sr, ku, ks, eps, dim, backend)[0]
    mode = torch_mode(backend, residual)
    return _ResControllerFunction.apply(residual, update, ur, sr, ku, ks, eps, dim, mode)


# Under torch.compile: the same forward / backward math as two opaque ops (lightning_resctl.runtime.backends.
# opaque_under_compile), run as torch_mode(backend) says when the compiled model runs.
@torch.library.custom_op("lightning_resctl::rescontroller_torch", mutates_args=())
def _rescontroller_op(residual: Tensor, update: Tensor, ur: float, sr: float, ku: float, ks: float, eps: float,
                      dim: int, backend: str) -> tuple[Tensor, Tensor]:
    """``(out, stats)`` of :func:`_lean_forward`."""
    fwd, _ = _math_fns(torch_mode(backend, residual))
    return op_outputs(fwd, residual, update, ur, sr, ku, ks, eps, dim)


@_rescontroller_op.register_fake
def _(residual, update, ur, sr, ku, ks, eps, dim, backend):
    return op_outputs(_lean_forward, residual, update, ur, sr, ku, ks, eps, dim, fake=True)


@torch.library.custom_op("lightning_resctl::rescontroller_torch_backward", mutates_args=())
def _rescontroller_backward_op(grad_out: Tensor, residual: Tensor, update: Tensor, stats: Tensor, ur: float,
                               sr: float, ku: float, ks: float, eps: float, dim: int,
                               backend: str) -> tuple[Tensor, Tensor]:
    """``(grad_r, grad_u)`` of :func:`_lean_backward`."""
    _, bwd = _math_fns(torch_mode(backend, residual))
    return op_outputs(bwd, grad_out, residual, update, stats, ur, sr, ku, ks, eps, dim)


@_rescontroller_backward_op.register_fake
def _(grad_out, residual, update, stats, ur, sr, ku, ks, eps, dim, backend):
    return op_outputs(_lean_backward, grad_out, residual, update, stats, ur, sr, ku, ks, eps, dim, fake=True)


def _op_setup_context(ctx, inputs, output):
    residual, update, *opts = inputs
    ctx.save_for_backward(residual, update, output[1])
    ctx.opts = opts
    ctx.mark_non_differentiable(output[1])


def _op_backward(ctx, grad_out, _grad_stats):
    residual, update, stats = ctx.saved_tensors
    grad_r, grad_u = _rescontroller_backward_op(grad_out, residual, update, stats, *ctx.opts)
    return grad_r, grad_u, None, None, None, None, None, None, None


_rescontroller_op.register_autograd(_op_backward, setup_context=_op_setup_context)


@torch.compiler.assume_constant_result
def _load_kernels() -> bool:
    """Import the Triton kernels (registers ``torch.ops.lightning_resctl.rescontroller_*``).

    ``assume_constant_result`` lets ``torch.compile`` run this once at trace time instead of
    tracing the import (which would break the graph)."""
    load_kernels("rescontroller")
    return True


def _rescontroller_triton(residual, update, ur, sr, ku, ks, eps, dim):
    """Triton path: the fused op on the feature dim moved last (a view: the kernels walk the strides, no
    copy), the caller's layout back."""
    refuse_transforms("rescontroller (Triton op)", _ORACLE, residual, update)
    _load_kernels()
    last = dim == residual.dim() - 1
    r = residual if last else residual.movedim(dim, -1)
    u = update if last else update.movedim(dim, -1)
    with autocast_off(r.device.type):
        out = torch.ops.lightning_resctl.rescontroller_fwd(r, u, ur, sr, ku, ks, eps)
    return out if last else out.movedim(-1, dim)


# --------------------------------------------------------------------------------------------
# dispatch (the backend a call runs: lightning_resctl.runtime.backends.resolve_backend)
# --------------------------------------------------------------------------------------------
def rescontroller(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = 0.18,
    stream_ratio: float = 1.08,
    update_softness: float = 8.0,
    stream_softness: float = 8.0,
    eps: float = 1e-12,
    *,
    dim: int = -1,
    backend: str = "auto",
) -> Tensor:
    """ResController merge ``out = r + s_u·s_s·u`` (see :func:`rescontroller_reference` for the rule).

    ``dim`` is the feature dim (-1 for sequence models, 1 for channels-first conv nets).
    ``backend``: "auto" (Triton for CUDA tensors when Triton works, else torch), "triton"
    (alias "native"), "torch" (the lean autograd.Function; on CPU its math runs as one compiled
    region per direction when a C++ compiler is present — "torch-eager" / "torch-compiled" force
    either, see :mod:`lightning_resctl.runtime.backends`), or "reference" (:func:`rescontroller_reference`
    under plain autograd: slower and saves every intermediate, but double backward, forward-mode AD,
    ``vmap`` and ``torch.func.grad`` work through it; the other backends refuse those with a
    RuntimeError). Output dtype: the promoted input dtype; math in fp32 (fp64 for fp64 inputs), also
    under ``torch.autocast``.
    """
    backend = _check_backend(backend)
    dim = _check_tensors(residual, update, dim)
    opts = _check_options(update_ratio, stream_ratio, update_softness, stream_softness, eps)
    resolved = resolve_backend(backend, residual)
    if resolved == "triton":
        return _rescontroller_triton(residual, update, *opts, dim)
    if resolved == "reference":
        return rescontroller_reference(residual, update, *opts, dim=dim)
    return _rescontroller_torch(residual, update, *opts, dim, backend)


class ResController(nn.Module):
    """Parameter-free ResController merge as a module: ``controller(residual, update)``.

    Computes per row along ``dim``: ``out = r + s_u·s_s·u`` where ``s_u`` softly caps the
    update RMS at ``update_ratio·RMS(r)`` and ``s_s`` softly caps the candidate stream RMS
    ``RMS(r + s_u u)`` at ``stream_ratio·RMS(r)`` (full rule: :func:`rescontroller_reference`).
    """

    def __init__(
        self,
        update_ratio: float = 0.18,
        stream_ratio: float = 1.08,
        update_softness: float = 8.0,
        stream_softness: float = 8.0,
        eps: float = 1e-12,
        *,
        dim: int = -1,
        backend: str = "auto",
    ):
        super().__init__()
        (self.update_ratio, self.stream_ratio, self.update_softness, self.stream_softness, self.eps) = (
            _check_options(update_ratio, stream_ratio, update_softness, stream_softness, eps)
        )
        self.dim = _check_dim_type(dim)
        self.backend = "auto"
        self.set_backend(backend)

    def set_backend(self, name: str) -> "ResController":
        """Choose "auto", "triton" (alias "native"), "torch" ("torch-eager", "torch-compiled") or "reference"
        (see :func:`rescontroller`); returns self."""
        self.backend = _check_backend(name)
        return self

    def resolved_backend(self, tensor: Tensor | None = None) -> str:
        """The backend a call on ``tensor`` would use ("triton", "reference" or a "torch" variant)."""
        return resolve_backend(self.backend, tensor)

    def options(self) -> dict:
        """The rule's options (keyword arguments of :func:`rescontroller`, without ``backend``)."""
        return dict(
            update_ratio=self.update_ratio,
            stream_ratio=self.stream_ratio,
            update_softness=self.update_softness,
            stream_softness=self.stream_softness,
            eps=self.eps,
            dim=self.dim,
        )

    def forward(self, residual: Tensor, update: Tensor) -> Tensor:
        return rescontroller(residual, update, **self.options(), backend=self.backend)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options().items()) + f", backend={self.backend!r}"
