"""Fused Triton kernels of the ResController merge (forward and backward) and their op registration.

The rule they compute is stated, and implemented as the torch oracle, in
``lightning_resctl.rescontroller.rescontroller_reference``.

* forward: per row, one read of ``r`` and ``u`` gives the three moments Σr², Σu², Σru;
  the per-row chain gives ``a = s_u·s_s``; one write of ``out = r + a·u``.
* backward: per row, one read of ``r``, ``u`` and ``grad_out`` gives the moments again and
  Σ g·u; the closed-form derivative of the chain gives three per-row coefficients; one write
  each of ``grad_r = g + c_rr·r + c_ru·u`` and ``grad_u = a·g + c_uu·u + c_ru·r``.
  Nothing but ``r`` and ``u`` is saved for backward (the per-row scalars are recomputed
  from the same single read).

Rows longer than ``MAX_BLOCK`` are processed in column blocks (three passes over the row: max-abs, sums,
output). Rows whose max-abs is >= 2^32 have their moments taken of r/k, u/k with k a power of two (no overflow
of the squares; bitwise the same rule below the threshold).
Arithmetic is fp32 inside the kernels (fp64 when an input is fp64; the five float options
arrive as fp32 scalars either way, so fp64 results match the fp64 oracle to ~1e-7 relative).

The kernels are wrapped as ``torch.library.custom_op`` ops ``lightning_resctl::rescontroller_fwd``
and ``lightning_resctl::rescontroller_bwd`` with fake (meta) implementations and a registered
autograd formula, so ``torch.compile(fullgraph=True)`` sees one opaque op per direction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_resctl._triton import interpreter_mode

__all__ = ["rescontroller_fwd", "rescontroller_bwd", "MAX_BLOCK"]

#: Largest column block held in registers at once; longer rows loop over blocks.
MAX_BLOCK = 16384
#: Rows whose max-abs reaches this have their moments taken of r/k, u/k (k a power of two): no overflow of the
#: squares for rows ~1e20 in fp32. Same value as lightning_resctl.rescontroller.SCALE_THRESHOLD.
SCALE_THRESHOLD = 2.0 ** 32


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _inv_scale(mx, THRESHOLD: tl.constexpr):
    """1/k for a row of max-abs ``mx``: a power of two near 1/mx when mx >= THRESHOLD (finite), else 1
    (the moments of huge rows are taken of r/k, u/k; powers of two scale exactly)."""
    big = (mx >= THRESHOLD) & (mx < float("inf"))
    safe = tl.where(big, mx, 1.0)
    return tl.where(big, tl.exp2(-tl.floor(tl.log2(safe))), 1.0)


@triton.jit
def _chain(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k):
    """The per-row chain from the row sums of r/k, u/k (eps/k^2 inside square roots, eps/k beside the RMS
    values: the same rule, see ``_row_inv_scale`` in lightning_resctl.rescontroller); returns the values the
    backward needs too."""
    eps1 = eps * inv_k
    eps2 = eps1 * inv_k
    mrr = srr / d
    muu = suu / d
    mru = sru / d
    R = tl.sqrt(mrr + eps2)
    U = tl.sqrt(muu + eps2)
    A_u = ur * R
    x_u = A_u / (U + eps1)
    hard_u = tl.where(x_u > 1.0, 1.0, x_u)
    p_u = U / (A_u + eps1)
    g_u = _sigmoid(ku * (p_u - 1.0))
    s_u = 1.0 - g_u * (1.0 - hard_u)
    m = mrr + 2.0 * s_u * mru + s_u * s_u * muu
    C = tl.sqrt(tl.where(m < 0.0, 0.0, m) + eps2)
    A_s = sr * R
    x_s = A_s / (C + eps1)
    hard_s = tl.where(x_s > 1.0, 1.0, x_s)
    p_s = C / (A_s + eps1)
    g_s = _sigmoid(ks * (p_s - 1.0))
    s_s = 1.0 - g_s * (1.0 - hard_s)
    return R, U, A_u, x_u, hard_u, g_u, s_u, mru, muu, m, C, A_s, x_s, hard_s, g_s, s_s, eps1


@triton.jit
def _scales(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k):
    R, U, A_u, x_u, hard_u, g_u, s_u, mru, muu, m, C, A_s, x_s, hard_s, g_s, s_s, eps1 = _chain(
        srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k
    )
    return s_u, s_s


@triton.jit
def _chain_backward(sgu, srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k):
    """Closed-form derivative of the chain: (a, c_rr, c_uu, c_ru) with
    grad_r = g + c_rr r + c_ru u,  grad_u = a g + c_uu u + c_ru r,  given the sums of r/k, u/k and
    sgu = Σ g u/k (the coefficients of the scaled frame times 1/k)."""
    R, U, A_u, x_u, hard_u, g_u, s_u, mru, muu, m, C, A_s, x_s, hard_s, g_s, s_s, eps1 = _chain(
        srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k
    )
    gs_u = sgu * s_s
    gs_s = sgu * s_u
    A_s_eps = A_s + eps1
    C_eps = C + eps1
    gp_s = gs_s * (hard_s - 1.0) * (ks * g_s * (1.0 - g_s))
    gx_s = tl.where(x_s <= 1.0, gs_s * g_s, 0.0)
    gC = gp_s / A_s_eps - gx_s * x_s / C_eps
    gA_s = gx_s / C_eps - gp_s * C / (A_s_eps * A_s_eps)
    gm = tl.where(m >= 0.0, gC / (2.0 * C), 0.0)
    gs_u = gs_u + gm * 2.0 * (mru + s_u * muu)
    A_u_eps = A_u + eps1
    U_eps = U + eps1
    gp_u = gs_u * (hard_u - 1.0) * (ku * g_u * (1.0 - g_u))
    gx_u = tl.where(x_u <= 1.0, gs_u * g_u, 0.0)
    gU = gp_u / A_u_eps - gx_u * x_u / U_eps
    gA_u = gx_u / U_eps - gp_u * U / (A_u_eps * A_u_eps)
    gR = gA_s * sr + gA_u * ur
    c_rr = (gR / R + 2.0 * gm) * (inv_k / d)
    c_uu = (gU / U + 2.0 * gm * s_u * s_u) * (inv_k / d)
    c_ru = (2.0 * gm * s_u) * (inv_k / d)
    return s_u * s_s, c_rr, c_uu, c_ru


@triton.jit
def _cast_options(n_cols, ur, sr, ku, ks, eps, CDT: tl.constexpr):
    """The row length and the five options in the compute dtype."""
    return (tl.cast(n_cols, CDT), tl.cast(ur, CDT), tl.cast(sr, CDT), tl.cast(ku, CDT), tl.cast(ks, CDT),
            tl.cast(eps, CDT))


@triton.jit
def _load_row(ptr, offs, mask, CDT: tl.constexpr):
    """One block of a row (0 past its end), in the compute dtype."""
    return tl.load(ptr + offs, mask=mask, other=0.0).to(CDT)


@triton.jit
def _blocked_inv_scale(r_ptr, u_ptr, n_cols, CDT: tl.constexpr, BLOCK: tl.constexpr, THRESHOLD: tl.constexpr):
    """1/k of a long row (its max-abs read in column blocks)."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=CDT)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        r = tl.abs(_load_row(r_ptr + start, cols, mask, CDT))
        u = tl.abs(_load_row(u_ptr + start, cols, mask, CDT))
        acc = tl.maximum(acc, tl.maximum(r, u))
    return _inv_scale(tl.max(acc, axis=0), THRESHOLD)


@triton.jit
def _blocked_sums(r_ptr, u_ptr, g_ptr, n_cols, inv_k, CDT: tl.constexpr, BLOCK: tl.constexpr,
                  WITH_G: tl.constexpr):
    """Row sums Σr'², Σu'², Σr'u' and (``WITH_G``) Σgu' of r' = r/k, u' = u/k, read in column blocks of
    ``BLOCK``; without ``WITH_G`` ``g_ptr`` is not read and the last sum is 0."""
    cols = tl.arange(0, BLOCK)
    acc_rr = tl.zeros([BLOCK], dtype=CDT)
    acc_uu = tl.zeros([BLOCK], dtype=CDT)
    acc_ru = tl.zeros([BLOCK], dtype=CDT)
    acc_gu = tl.zeros([BLOCK], dtype=CDT)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        if WITH_G:
            g = _load_row(g_ptr + start, cols, mask, CDT)
        r = _load_row(r_ptr + start, cols, mask, CDT) * inv_k
        u = _load_row(u_ptr + start, cols, mask, CDT) * inv_k
        acc_rr += r * r
        acc_uu += u * u
        acc_ru += r * u
        if WITH_G:
            acc_gu += g * u
    return tl.sum(acc_rr, axis=0), tl.sum(acc_uu, axis=0), tl.sum(acc_ru, axis=0), tl.sum(acc_gu, axis=0)


@triton.jit
def _row_moments(r, u, THRESHOLD: tl.constexpr):
    """One row in registers: the scale 1/k (k = 1 below THRESHOLD) and the moments of r/k and u/k;
    also returns u/k (the backward's Σ g·u/k reads it)."""
    inv_k = _inv_scale(tl.max(tl.maximum(tl.abs(r), tl.abs(u)), axis=0), THRESHOLD)
    rs = r * inv_k
    us = u * inv_k
    return inv_k, tl.sum(rs * rs, axis=0), tl.sum(us * us, axis=0), tl.sum(rs * us, axis=0), us


@triton.jit
def _fwd_kernel(
    r_ptr, u_ptr, out_ptr, n_cols,
    ur, sr, ku, ks, eps,
    CDT: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, THRESHOLD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * n_cols
    r_ptr += row
    u_ptr += row
    out_ptr += row
    d, ur, sr, ku, ks, eps = _cast_options(n_cols, ur, sr, ku, ks, eps, CDT)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        r = _load_row(r_ptr, cols, mask, CDT)
        u = _load_row(u_ptr, cols, mask, CDT)
        inv_k, srr, suu, sru, _ = _row_moments(r, u, THRESHOLD)
        s_u, s_s = _scales(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        out = r + (s_u * s_s) * u
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        inv_k = _blocked_inv_scale(r_ptr, u_ptr, n_cols, CDT, BLOCK, THRESHOLD)
        srr, suu, sru, _ = _blocked_sums(r_ptr, u_ptr, u_ptr, n_cols, inv_k, CDT, BLOCK, False)
        s_u, s_s = _scales(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        a = s_u * s_s
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            r = _load_row(r_ptr + start, cols, mask, CDT)
            u = _load_row(u_ptr + start, cols, mask, CDT)
            tl.store(out_ptr + start + cols, (r + a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(
    g_ptr, r_ptr, u_ptr, gr_ptr, gu_ptr, n_cols,
    ur, sr, ku, ks, eps,
    CDT: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, THRESHOLD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * n_cols
    g_ptr += row
    r_ptr += row
    u_ptr += row
    gr_ptr += row
    gu_ptr += row
    d, ur, sr, ku, ks, eps = _cast_options(n_cols, ur, sr, ku, ks, eps, CDT)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        g = _load_row(g_ptr, cols, mask, CDT)
        r = _load_row(r_ptr, cols, mask, CDT)
        u = _load_row(u_ptr, cols, mask, CDT)
        inv_k, srr, suu, sru, us = _row_moments(r, u, THRESHOLD)
        sgu = tl.sum(g * us, axis=0)
        a, c_rr, c_uu, c_ru = _chain_backward(sgu, srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        tl.store(gr_ptr + cols, (g + c_rr * r + c_ru * u).to(gr_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptr + cols, (a * g + c_uu * u + c_ru * r).to(gu_ptr.dtype.element_ty), mask=mask)
    else:
        inv_k = _blocked_inv_scale(r_ptr, u_ptr, n_cols, CDT, BLOCK, THRESHOLD)
        srr, suu, sru, sgu = _blocked_sums(r_ptr, u_ptr, g_ptr, n_cols, inv_k, CDT, BLOCK, True)
        a, c_rr, c_uu, c_ru = _chain_backward(sgu, srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            g = _load_row(g_ptr + start, cols, mask, CDT)
            r = _load_row(r_ptr + start, cols, mask, CDT)
            u = _load_row(u_ptr + start, cols, mask, CDT)
            tl.store(gr_ptr + start + cols, (g + c_rr * r + c_ru * u).to(gr_ptr.dtype.element_ty), mask=mask)
            tl.store(gu_ptr + start + cols, (a * g + c_uu * u + c_ru * r).to(gu_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_cols: int, max_block: int):
    block = min(triton.next_power_of_2(n_cols), max_block)
    single = block >= n_cols
    num_warps = 1 if interpreter_mode() else max(1, min(16, block // 256))
    return block, single, num_warps


def _compute_dtype(*tensors: Tensor):
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


# ----------------------------------------------------------------------------------------------
# ops: 2-D contiguous (rows, C) tensors, features last
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("lightning_resctl::rescontroller_fwd", mutates_args=())
def rescontroller_fwd(
    residual: Tensor, update: Tensor,
    update_ratio: float, stream_ratio: float, update_softness: float, stream_softness: float, eps: float,
) -> Tensor:
    """``out = r + s_u s_s u`` per row of 2-D contiguous ``(rows, C)`` tensors."""
    out = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, update.dtype), device=residual.device)
    rows, n_cols = residual.shape
    if rows == 0:
        return out
    block, single, num_warps = _launch_config(n_cols, MAX_BLOCK)
    _fwd_kernel[(rows,)](
        residual, update, out, n_cols,
        update_ratio, stream_ratio, update_softness, stream_softness, eps,
        CDT=_compute_dtype(residual, update), BLOCK=block, SINGLE=single, THRESHOLD=SCALE_THRESHOLD,
        num_warps=num_warps,
    )
    return out


@rescontroller_fwd.register_fake
def _(residual, update, update_ratio, stream_ratio, update_softness, stream_softness, eps):
    return residual.new_empty(residual.shape, dtype=torch.promote_types(residual.dtype, update.dtype))


@torch.library.custom_op("lightning_resctl::rescontroller_bwd", mutates_args=())
def rescontroller_bwd(
    grad_out: Tensor, residual: Tensor, update: Tensor,
    update_ratio: float, stream_ratio: float, update_softness: float, stream_softness: float, eps: float,
) -> tuple[Tensor, Tensor]:
    """``(grad_r, grad_u)`` of the merge per row of 2-D contiguous ``(rows, C)`` tensors."""
    grad_r = torch.empty_like(residual)
    grad_u = torch.empty_like(update)
    rows, n_cols = residual.shape
    if rows == 0:
        return grad_r, grad_u
    block, single, num_warps = _launch_config(n_cols, MAX_BLOCK)
    _bwd_kernel[(rows,)](
        grad_out, residual, update, grad_r, grad_u, n_cols,
        update_ratio, stream_ratio, update_softness, stream_softness, eps,
        CDT=_compute_dtype(grad_out, residual, update), BLOCK=block, SINGLE=single, THRESHOLD=SCALE_THRESHOLD,
        num_warps=num_warps,
    )
    return grad_r, grad_u


@rescontroller_bwd.register_fake
def _(grad_out, residual, update, update_ratio, stream_ratio, update_softness, stream_softness, eps):
    return torch.empty_like(residual), torch.empty_like(update)


def _setup_context(ctx, inputs, output):
    residual, update, *opts = inputs
    ctx.save_for_backward(residual, update)
    ctx.opts = opts


def _backward(ctx, grad_out):
    residual, update = ctx.saved_tensors
    grad_r, grad_u = rescontroller_bwd(grad_out.contiguous(), residual, update, *ctx.opts)
    return grad_r, grad_u, None, None, None, None, None


rescontroller_fwd.register_autograd(_backward, setup_context=_setup_context)

