"""The ResController merge's fast paths and its dispatch (the rule and the oracle: :mod:`.reference`).

* the lean torch path — :class:`_ResControllerFunction`, an ``autograd.Function`` whose backward is the
  closed-form derivative of the rule; it saves only ``r``, ``u`` and a few per-row scalars (plain autograd of the
  reference saves every intermediate); under a whole-model ``torch.compile`` dynamo inlines it, so the compiler
  sees the forward math and the closed-form backward as plain ops and fuses them with the model's;
* the Triton path — fused forward and backward kernels in ``lightning_resctl.kernels.rescontroller``: in eager code
  one ``autograd.Function`` around the two launches (:class:`_TritonMerge`), under ``torch.compile`` their
  ``torch.library`` custom ops (opaque to the compiler).

:func:`rescontroller` validates the input and dispatches: ``backend="auto"`` picks Triton for CUDA tensors when
Triton works, else the torch path. The torch and Triton paths refuse double backward, forward-mode AD and the
``torch.func`` transforms (their backward is closed-form) with an error naming ``backend="reference"``, which
supports them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...runtime.autograd import autocast_off, refuse_second_derivative, refuse_transforms
from ...runtime.backends import exporting_for_training, resolve_backend, torch_mode
from ...runtime.regions import CompiledMath
from ...runtime.triton import load_kernels
from ..common import check_rule_backend, compute_dtype
from .config import ResControllerConfig
from .reference import check_tensors, reference_merge, row_inv_scale

__all__ = ["rescontroller", "rescontroller_merge"]

_ORACLE = "backend='reference' (rescontroller_reference)"


# --------------------------------------------------------------------------------------------
# the lean torch path: closed-form backward, saves r, u and per-row scalars only
# --------------------------------------------------------------------------------------------
def _lean_forward(residual: Tensor, update: Tensor, ur: float, sr: float, ku: float, ks: float, eps: float, dim: int):
    """Forward math of the lean path: ``(out, stats)``, stats = the 13 per-row scalars the backward reuses.

    Three row moments (of ``r / k``, ``u / k``; k = 1 unless the row is huge, see :func:`row_inv_scale`),
    the per-row chain, one ``addcmul``. Plain torch ops: run eagerly or as one compiled region."""
    cdt = compute_dtype(residual, update)
    r, u = residual.to(cdt), update.to(cdt)
    d = r.shape[dim]
    inv_k = row_inv_scale(r, u, dim)
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


#: (forward, backward) math for a torch_mode: eager torch ops, or their compiled regions
#: (lightning_resctl.runtime.backends)
_math_fns = CompiledMath(_lean_forward, _lean_backward, rule="rescontroller")


def _rescontroller_torch(residual, update, ur, sr, ku, ks, eps, dim, backend="torch"):
    refuse_transforms("rescontroller (torch path)", _ORACLE, residual, update)
    # under torch.compile torch_mode is "eager": dynamo inlines the Function, so the compiler traces the forward
    # math and the closed-form backward and fuses them with the model's neighbouring ops
    return _ResControllerFunction.apply(residual, update, ur, sr, ku, ks, eps, dim, torch_mode(backend, residual))


class _TritonMerge(torch.autograd.Function):
    """The Triton path in eager code: one kernel forward, one backward (``kernels/rescontroller.py``), and what a
    call costs on the host besides them: this Function, two allocations. Saves ``r`` and ``u`` (the caller's
    tensors); the kernels take any strides and need no autocast context (they run no torch op)."""

    @staticmethod
    def forward(ctx, residual, update, opts):
        kernels = load_kernels("rescontroller")
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(residual, update)
            ctx.opts = opts
        return kernels.merge_forward(residual, update, opts)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("rescontroller (Triton kernels)", _ORACLE)
        residual, update = ctx.saved_tensors
        grad_r, grad_u = load_kernels("rescontroller").merge_backward(grad_out, residual, update, ctx.opts)
        return (grad_r if ctx.needs_input_grad[0] else None, grad_u if ctx.needs_input_grad[1] else None, None)


def _rescontroller_triton(residual, update, opts, dim):
    """Triton path: the kernels on the feature dim moved last (a view: the kernels walk the strides, no copy), the
    caller's layout back. Eager: :class:`_TritonMerge`; under ``torch.compile`` the ``torch.library`` op (one opaque
    op per direction, no graph break)."""
    refuse_transforms("rescontroller (Triton op)", _ORACLE, residual, update)
    last = dim == residual.dim() - 1
    r = residual if last else residual.movedim(dim, -1)
    u = update if last else update.movedim(dim, -1)
    if torch.compiler.is_compiling():
        load_kernels("rescontroller")  # registers torch.ops.lightning_resctl.rescontroller_*
        with autocast_off(r.device.type):
            out = torch.ops.lightning_resctl.rescontroller_fwd(r, u, *opts)
    else:
        out = _TritonMerge.apply(r, u, opts)
    return out if last else out.movedim(-1, dim)


def rescontroller(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = ResControllerConfig.update_ratio,
    stream_ratio: float = ResControllerConfig.stream_ratio,
    update_softness: float = ResControllerConfig.update_softness,
    stream_softness: float = ResControllerConfig.stream_softness,
    eps: float = ResControllerConfig.eps,
    *,
    dim: int = -1,
    backend: str = ResControllerConfig.backend,
) -> Tensor:
    """ResController merge ``out = r + s_u·s_s·u`` (see :func:`rescontroller_reference` for the rule).

    ``dim`` is the feature dim (-1 for sequence models, 1 for channels-first conv nets).
    ``backend``: "auto" (Triton for CUDA tensors when Triton works, else torch), "triton"
    (alias "native"), "torch" (the lean autograd.Function; on CPU its math runs as one compiled
    region per direction, compiled in the background while the first calls run eagerly, when a C++ compiler is
    present — "torch-eager" / "torch-compiled" force either, see :mod:`lightning_resctl.runtime.backends`), or
    "reference" (:func:`rescontroller_reference` under plain autograd: slower and saves every intermediate, but
    double backward, forward-mode AD, ``vmap`` and ``torch.func.grad`` work through it; the other backends refuse
    those with a RuntimeError). Output dtype: the promoted input dtype; math in fp32 (fp64 for fp64 inputs), also
    under ``torch.autocast``.
    """
    backend = check_rule_backend(backend)
    dim = check_tensors(residual, update, dim)
    opts = ResControllerConfig(update_ratio, stream_ratio, update_softness, stream_softness, eps).math()
    return rescontroller_merge(residual, update, opts, dim, backend)


def rescontroller_merge(residual: Tensor, update: Tensor, opts: tuple, dim: int, backend: str) -> Tensor:
    """The dispatch of :func:`rescontroller` on checked arguments (nothing is checked again): ``opts`` =
    :meth:`ResControllerConfig.math`, ``dim`` as :func:`~.reference.check_tensors` returns it, ``backend``
    canonical. :class:`~.modules.ResController` calls it with the options it checked once, at construction."""
    resolved = resolve_backend(backend, residual)
    if resolved == "triton":
        return _rescontroller_triton(residual, update, opts, dim)
    if resolved == "reference" or exporting_for_training(residual, update):
        return reference_merge(residual, update, opts, dim)
    return _rescontroller_torch(residual, update, *opts, dim, backend)

