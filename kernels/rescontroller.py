"""Fused Triton kernels of the ResController merge (forward and backward) and their op registration.

The rule they compute is stated, and implemented as the torch oracle, in
``lightning_resctl.rules.rescontroller.rescontroller_reference``.

* forward: per row, one read of ``r`` and ``u`` gives the three moments Σr², Σu², Σru (and the row's
  max-abs); the per-row chain gives ``a = s_u·s_s``; one write of ``out = r + a·u``.
* backward: per row, one read of ``r``, ``u`` and ``grad_out`` gives the moments again and Σ g·u; the
  closed-form derivative of the chain gives three per-row coefficients; one write each of
  ``grad_r = g + c_rr·r + c_ru·u`` and ``grad_u = a·g + c_uu·u + c_ru·r``. Nothing but ``r`` and ``u`` is
  saved for backward (the per-row scalars are recomputed from the same single read).

Bytes moved per row: 3C elements forward (read r, u; write out) and 5C backward (read g, r, u; write grad_r,
grad_u) — the minimum — when the row fits a program's registers (``RowTile.single``, rows up to
``kernels.tiles.RESCONTROLLER[...]["single_elems"]``; short rows several to a program). Longer rows are read in
column blocks twice, sums then output, with scalar accumulators: 5C forward, 8C backward (the second read of a
row follows its first within the same program, so on a GPU it comes mostly from L2).

Rows whose max-abs is >= 2^32 have their moments taken of r/k, u/k with k a power of two (no overflow of the
squares; bitwise the same rule below the threshold): the moments are first taken unscaled together with the
max-abs, and taken again, scaled, only when some row of the program reaches the threshold (from registers, or
by one more read of a long row).
Arithmetic is fp32 inside the kernels (fp64 when an input is fp64; the five float options arrive as fp32
scalars either way, so fp64 results match the fp64 oracle to ~1e-7 relative).

Inputs are read through their strides (rows of a column slice, a channels-first tensor moved to features-last:
no copies); outputs get the residual's layout.

:func:`merge_forward` / :func:`merge_backward` launch them (no autograd: the rule's eager path wraps them in one
``autograd.Function``, the least a call costs on the host). Under ``torch.compile`` they are the
``torch.library.custom_op`` ops ``lightning_resctl::rescontroller_fwd`` and ``lightning_resctl::rescontroller_bwd``,
with fake (meta) implementations and a registered autograd formula (``_library.register_fused_ops``), so
``torch.compile(fullgraph=True)`` sees one opaque op per direction.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._env import interpreter_mode
from ._library import register_fused_ops
from .rows import row_grid
from .tiles import Launch, LaunchPlans, RowTile, device_arch, rescontroller_tile

__all__ = ["merge_forward", "merge_backward", "rescontroller_fwd", "rescontroller_bwd", "Launch", "forward_launch",
           "backward_launch"]

#: Rows whose max-abs reaches this have their moments taken of r/k, u/k (k a power of two): no overflow of the
#: squares for rows ~1e20 in fp32. Same value as lightning_resctl.rules.rescontroller.SCALE_THRESHOLD.
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
    values: the same rule, see ``row_inv_scale`` in lightning_resctl.rules.rescontroller.reference); returns the
    values the backward needs too."""
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
def _program_rows(n_rows, ROWS: tl.constexpr):
    """This program's rows (int64), which of them exist, and its batch index (int64)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    return rows.to(tl.int64), rows < n_rows, tl.program_id(1).to(tl.int64)


@triton.jit
def _row_starts(ptr, stride_outer, stride_inner, rows, outer):
    """Pointers to the first element of ``rows`` (int64) in batch ``outer`` (int64) of a strided tensor."""
    return ptr + outer * stride_outer + rows * stride_inner


@triton.jit
def _load(starts, cols, stride_col, mask, CDT: tl.constexpr):
    """A (rows, block) tile of a row-strided tensor (0 where masked off), in the compute dtype."""
    return tl.load(starts[:, None] + cols[None, :] * stride_col, mask=mask, other=0.0).to(CDT)


@triton.jit
def _store(starts, cols, stride_col, value, mask):
    tl.store(starts[:, None] + cols[None, :] * stride_col, value.to(starts.dtype.element_ty), mask=mask)


@triton.jit
def _moments(r, u, g, inv_k, WITH_G: tl.constexpr):
    """Per row of a tile: Σr'², Σu'², Σr'u' and (``WITH_G``) Σg·u' of r' = r·inv_k, u' = u·inv_k."""
    rs = r * inv_k[:, None]
    us = u * inv_k[:, None]
    sgu = tl.sum(g * us, axis=1) if WITH_G else tl.sum(us * 0.0, axis=1)
    return tl.sum(rs * rs, axis=1), tl.sum(us * us, axis=1), tl.sum(rs * us, axis=1), sgu


@triton.jit
def _max_abs(r, u):
    return tl.max(tl.maximum(tl.abs(r), tl.abs(u)), axis=1)


@triton.jit
def _blocked_moments(r_rows, u_rows, g_rows, rsc, usc, gsc, rmask, n_cols, cols, inv_k,
                     CDT: tl.constexpr, BLOCK: tl.constexpr, WITH_G: tl.constexpr):
    """Long rows read in column blocks: the moments of r·inv_k, u·inv_k (and Σ g·u·inv_k), one accumulator per
    row and sum, and the rows' max-abs."""
    srr = inv_k * 0.0
    suu = srr
    sru = srr
    sgu = srr
    mx = srr
    for start in range(0, n_cols, BLOCK):
        mask = rmask[:, None] & (start + cols < n_cols)[None, :]
        r = _load(r_rows, start + cols, rsc, mask, CDT)
        u = _load(u_rows, start + cols, usc, mask, CDT)
        g = _load(g_rows, start + cols, gsc, mask, CDT) if WITH_G else r
        a, b, c, d = _moments(r, u, g, inv_k, WITH_G)
        srr += a
        suu += b
        sru += c
        sgu += d
        mx = tl.maximum(mx, _max_abs(r, u))
    return srr, suu, sru, sgu, mx


@triton.jit
def _row_sums(r_rows, u_rows, g_rows, rsc, usc, gsc, rmask, n_cols, cols,
              CDT: tl.constexpr, BLOCK: tl.constexpr, THRESHOLD: tl.constexpr, WITH_G: tl.constexpr):
    """Long rows: 1/k and the moments of r/k, u/k (and Σ g·u/k); the blocks are read once more, scaled, only
    when a row's max-abs reaches THRESHOLD."""
    one = tl.full(rmask.shape, 1.0, CDT)
    srr, suu, sru, sgu, mx = _blocked_moments(r_rows, u_rows, g_rows, rsc, usc, gsc, rmask, n_cols, cols, one,
                                              CDT, BLOCK, WITH_G)
    inv_k = _inv_scale(mx, THRESHOLD)
    if tl.min(inv_k, axis=0) < 1.0:
        srr, suu, sru, sgu, mx = _blocked_moments(r_rows, u_rows, g_rows, rsc, usc, gsc, rmask, n_cols, cols,
                                                  inv_k, CDT, BLOCK, WITH_G)
    return inv_k, srr, suu, sru, sgu


@triton.jit
def _tile_sums(r, u, g, THRESHOLD: tl.constexpr, WITH_G: tl.constexpr):
    """Rows held in registers: 1/k from the rows' max-abs, then the moments of r/k, u/k (and Σ g·u/k)."""
    inv_k = _inv_scale(_max_abs(r, u), THRESHOLD)
    srr, suu, sru, sgu = _moments(r, u, g, inv_k, WITH_G)
    return inv_k, srr, suu, sru, sgu


@triton.jit
def _fwd_kernel(
    r_ptr, u_ptr, out_ptr, n_rows, n_cols,
    r_so, r_si, r_sc, u_so, u_si, u_sc, o_so, o_si, o_sc,
    ur, sr, ku, ks, eps,
    CDT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, THRESHOLD: tl.constexpr,
):
    rows, rmask, outer = _program_rows(n_rows, ROWS)
    r_rows = _row_starts(r_ptr, r_so, r_si, rows, outer)
    u_rows = _row_starts(u_ptr, u_so, u_si, rows, outer)
    o_rows = _row_starts(out_ptr, o_so, o_si, rows, outer)
    d, ur, sr, ku, ks, eps = _cast_options(n_cols, ur, sr, ku, ks, eps, CDT)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        r = _load(r_rows, cols, r_sc, mask, CDT)
        u = _load(u_rows, cols, u_sc, mask, CDT)
        inv_k, srr, suu, sru, _ = _tile_sums(r, u, r, THRESHOLD, False)
        s_u, s_s = _scales(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        _store(o_rows, cols, o_sc, r + (s_u * s_s)[:, None] * u, mask)
    else:
        inv_k, srr, suu, sru, _ = _row_sums(r_rows, u_rows, r_rows, r_sc, u_sc, r_sc, rmask, n_cols, cols,
                                            CDT, BLOCK, THRESHOLD, False)
        s_u, s_s = _scales(srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        a = (s_u * s_s)[:, None]
        for start in range(0, n_cols, BLOCK):
            mask = rmask[:, None] & (start + cols < n_cols)[None, :]
            r = _load(r_rows, start + cols, r_sc, mask, CDT)
            u = _load(u_rows, start + cols, u_sc, mask, CDT)
            _store(o_rows, start + cols, o_sc, r + a * u, mask)


@triton.jit
def _bwd_kernel(
    g_ptr, r_ptr, u_ptr, gr_ptr, gu_ptr, n_rows, n_cols,
    g_so, g_si, g_sc, r_so, r_si, r_sc, u_so, u_si, u_sc, gr_so, gr_si, gr_sc, gu_so, gu_si, gu_sc,
    ur, sr, ku, ks, eps,
    CDT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, THRESHOLD: tl.constexpr,
):
    rows, rmask, outer = _program_rows(n_rows, ROWS)
    g_rows = _row_starts(g_ptr, g_so, g_si, rows, outer)
    r_rows = _row_starts(r_ptr, r_so, r_si, rows, outer)
    u_rows = _row_starts(u_ptr, u_so, u_si, rows, outer)
    gr_rows = _row_starts(gr_ptr, gr_so, gr_si, rows, outer)
    gu_rows = _row_starts(gu_ptr, gu_so, gu_si, rows, outer)
    d, ur, sr, ku, ks, eps = _cast_options(n_cols, ur, sr, ku, ks, eps, CDT)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        g = _load(g_rows, cols, g_sc, mask, CDT)
        r = _load(r_rows, cols, r_sc, mask, CDT)
        u = _load(u_rows, cols, u_sc, mask, CDT)
        inv_k, srr, suu, sru, sgu = _tile_sums(r, u, g, THRESHOLD, True)
        a, c_rr, c_uu, c_ru = _chain_backward(sgu, srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        a, c_rr, c_uu, c_ru = a[:, None], c_rr[:, None], c_uu[:, None], c_ru[:, None]
        _store(gr_rows, cols, gr_sc, g + c_rr * r + c_ru * u, mask)
        _store(gu_rows, cols, gu_sc, a * g + c_uu * u + c_ru * r, mask)
    else:
        inv_k, srr, suu, sru, sgu = _row_sums(r_rows, u_rows, g_rows, r_sc, u_sc, g_sc, rmask, n_cols, cols,
                                              CDT, BLOCK, THRESHOLD, True)
        a, c_rr, c_uu, c_ru = _chain_backward(sgu, srr, suu, sru, d, ur, sr, ku, ks, eps, inv_k)
        a, c_rr, c_uu, c_ru = a[:, None], c_rr[:, None], c_uu[:, None], c_ru[:, None]
        for start in range(0, n_cols, BLOCK):
            mask = rmask[:, None] & (start + cols < n_cols)[None, :]
            g = _load(g_rows, start + cols, g_sc, mask, CDT)
            r = _load(r_rows, start + cols, r_sc, mask, CDT)
            u = _load(u_rows, start + cols, u_sc, mask, CDT)
            _store(gr_rows, start + cols, gr_sc, g + c_rr * r + c_ru * u, mask)
            _store(gu_rows, start + cols, gu_sc, a * g + c_uu * u + c_ru * r, mask)


# ----------------------------------------------------------------------------------------------
# launch code: what runs, as data (benchmarks/kernels_aot.py compiles exactly these launches ahead of time)
# ----------------------------------------------------------------------------------------------
def _compute_dtype(*tensors: Tensor):
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


def _rows(*tensors: Tensor):
    """The tensors (copied only when their strides cannot be walked as rows) and their row grid."""
    grid = row_grid(*tensors)
    if grid is None:
        tensors = tuple(t.contiguous() for t in tensors)
        grid = row_grid(*tensors)
    return tensors, grid


def _elem_bytes(*tensors: Tensor) -> int:
    return max(t.element_size() for t in tensors)


def _launch(kernel, tensors, n_cols, opts, tile: RowTile, grid) -> Launch:
    strides = tuple(s for per_tensor in grid.strides for s in per_tensor)
    meta = dict(CDT=_compute_dtype(*tensors), ROWS=tile.rows, BLOCK=tile.block, SINGLE=tile.single,
                THRESHOLD=SCALE_THRESHOLD, num_warps=1 if interpreter_mode() else tile.num_warps,
                maxnreg=tile.max_regs)
    return Launch(kernel, (triton.cdiv(grid.inner, tile.rows), grid.outer),
                  (*tensors, grid.inner, n_cols, *strides, *opts), meta)


def _arch(arch, t: Tensor):
    return arch if arch is not None else device_arch(t.device)


def forward_launch(residual: Tensor, update: Tensor, out: Tensor, opts, arch=None) -> Launch:
    """The forward kernel's launch for ``(*lead, C)`` tensors (any strides) for target ``arch`` (compute
    capability; None: the tensors' device's)."""
    (residual, update, out), grid = _rows(residual, update, out)
    return _launch(_fwd_kernel, (residual, update, out), residual.shape[-1], opts,
                   rescontroller_tile(residual.shape[-1], _elem_bytes(residual, update), "forward",
                                      _arch(arch, residual)), grid)


def backward_launch(grad_out: Tensor, residual: Tensor, update: Tensor, grad_r: Tensor, grad_u: Tensor,
                    opts, arch=None) -> Launch:
    """The backward kernel's launch for ``(*lead, C)`` tensors (any strides) for target ``arch`` (compute
    capability; None: the tensors' device's)."""
    tensors, grid = _rows(grad_out, residual, update, grad_r, grad_u)
    return _launch(_bwd_kernel, tensors, residual.shape[-1], opts,
                   rescontroller_tile(residual.shape[-1], _elem_bytes(*tensors[:3]), "backward",
                                      _arch(arch, residual)), grid)


# ----------------------------------------------------------------------------------------------
# ops: (*lead, C) tensors, features last, any strides
# ----------------------------------------------------------------------------------------------
def _out_like(residual: Tensor, update: Tensor) -> Tensor:
    return torch.empty_like(residual, dtype=torch.promote_types(residual.dtype, update.dtype))


#: The launches of earlier calls, by their tensors' signature (the outputs' layout follows from the inputs')
_PLANS = LaunchPlans()


def _run_planned(key, tensors: tuple, make: Callable[[], Launch]) -> None:
    """Launch ``make()`` for ``tensors``, or the plan an earlier call with the same ``key`` left (its launch on these
    tensors: no launch-table arithmetic). A launch that copies its tensors (strides no row grid walks) is not
    kept."""
    plan = _PLANS.get(key)
    if plan is not None:
        kernel, grid, rest, meta = plan
        kernel[grid](*tensors, *rest, **meta)
        return
    launch = make()
    if all(a is t for a, t in zip(launch.args, tensors)):
        _PLANS.put(key, (launch.kernel, launch.grid, launch.args[len(tensors):], launch.meta))
    launch.run()


def merge_forward(residual: Tensor, update: Tensor, opts: tuple) -> Tensor:
    """``out = r + s_u s_s u`` per row of same-shaped ``(*lead, C)`` tensors (features last, any strides; ``out``
    has the residual's layout): one launch, no autograd (``opts``: the five float options in order)."""
    out = _out_like(residual, update)
    if out.numel() == 0:
        return out
    key = (True, residual.shape, residual.stride(), update.stride(), residual.dtype, update.dtype, residual.device,
           opts)
    _run_planned(key, (residual, update, out), lambda: forward_launch(residual, update, out, opts))
    return out


def merge_backward(grad_out: Tensor, residual: Tensor, update: Tensor, opts: tuple) -> tuple[Tensor, Tensor]:
    """``(grad_r, grad_u)`` of the merge per row of same-shaped ``(*lead, C)`` tensors (any strides; each gradient
    has its input's layout): one launch."""
    grad_r = torch.empty_like(residual)
    grad_u = torch.empty_like(update)
    if grad_r.numel() == 0:
        return grad_r, grad_u
    key = (False, residual.shape, grad_out.stride(), residual.stride(), update.stride(), grad_out.dtype,
           residual.dtype, update.dtype, residual.device, opts)
    _run_planned(key, (grad_out, residual, update, grad_r, grad_u),
                 lambda: backward_launch(grad_out, residual, update, grad_r, grad_u, opts))
    return grad_r, grad_u


def _rescontroller_fwd(
    residual: Tensor, update: Tensor,
    update_ratio: float, stream_ratio: float, update_softness: float, stream_softness: float, eps: float,
) -> Tensor:
    """The op: :func:`merge_forward`."""
    return merge_forward(residual, update, (update_ratio, stream_ratio, update_softness, stream_softness, eps))


def _rescontroller_fwd_fake(residual, update, update_ratio, stream_ratio, update_softness, stream_softness, eps):
    return _out_like(residual, update)


def _rescontroller_bwd(
    grad_out: Tensor, residual: Tensor, update: Tensor,
    update_ratio: float, stream_ratio: float, update_softness: float, stream_softness: float, eps: float,
) -> tuple[Tensor, Tensor]:
    """The op: :func:`merge_backward`."""
    return merge_backward(grad_out, residual, update,
                          (update_ratio, stream_ratio, update_softness, stream_softness, eps))


def _rescontroller_bwd_fake(grad_out, residual, update, update_ratio, stream_ratio, update_softness, stream_softness,
                            eps):
    return torch.empty_like(residual), torch.empty_like(update)


def _setup_context(ctx, inputs, output):
    residual, update, *opts = inputs
    ctx.save_for_backward(residual, update)
    ctx.opts = opts


def _grads(backward_op, ctx, grad_out):
    residual, update = ctx.saved_tensors
    grad_r, grad_u = backward_op(grad_out, residual, update, *ctx.opts)
    return grad_r, grad_u, None, None, None, None, None


rescontroller_fwd, rescontroller_bwd = register_fused_ops(
    ("rescontroller_fwd", "rescontroller_bwd"), _rescontroller_fwd, _rescontroller_fwd_fake, _rescontroller_bwd,
    _rescontroller_bwd_fake, _setup_context, _grads)
