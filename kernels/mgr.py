"""Fused Triton kernels of one Multi-Gate-Residual step and their ``torch.library`` registration.

One step = merge k (gates + lerp for a gated merge, append for an accumulating one) followed by the
AttnPool of merge k+1. The math (and its torch reference) is in :mod:`lightning_resctl.rules.mgr`.

Per token, with m input streams, m' output streams (m' = m gated, m + 1 accumulating) of C features:

* forward (one launch): reads S (m x C) and u (C); writes S' (m' x C), h (C) and the fp32 gates beta (m) and pool
  weights a (m'). A gated merge's gates need the row sums Σs², Σs·q; the pool's Σs'², Σs'·w follow from
  Σs², Σs·u, Σs·w, Σu², Σu·w (``s' = (1 - beta) s + beta u``), so one reduction pass and one write pass
  suffice. With the fallback inversion (``Inversion``) it also picks the rows saved exactly (beta above the
  threshold, or the error gain since the last exact row past its limit; at most the program's share of the
  budget, first come in its token order), writes them to the budget's buffer, their slots (T x m, -1: rebuilt)
  and the running gain (T x m).
* backward (two launches): the step kernel reads S (or, inverted, the merge's output S' and the exact rows, and
  rebuilds ``s = s' - (s' - u)(1 - 1/(1 - beta))``), u, beta, a, dS' (when given) and dh (when given); writes dS, du,
  the rebuilt S for the merge before (``deliver``) and per-program partial sums of the parameter gradients (dq, dw,
  dc, df); a second kernel sums the partials into the parameters' gradients. Every per-stream scalar the
  gradients need (dbeta included, from Σ dS'·(u - s), Σ dh·(u - s), Σ w·(u - s), Σ s'·(u - s)) is a row sum of the
  inputs, so again one reduction pass and one write pass.

Bytes moved per token: the minimum — (m + 1) C read and (m' + 1) C written forward, (2 m' + 2) C read and
(m + 1) C written backward (less without dS' or dh; inverted: m C more written, the rebuilt streams), elements of
the streams' dtype — when a token's tile (``kernels.tiles.MGR[...]["single_elems"]`` elements) is held in
registers; larger tokens are read in column tiles twice (sums, then outputs), the second read within the same
program right after the first (on a GPU mostly from L2), and the backward's parameter-gradient partials are read
and written once per token and column tile. Programs loop over tokens (a grid that fills the GPU), so the
parameter vectors q, w are read once per program on the single-tile path. Streams, u, dS' and dh are read through
their strides (token and stream strides; the feature stride must be 1, else they are copied); u may have a dtype
of its own (a bf16 branch output beside fp32 streams, under autocast: converted in registers, du written in it).

With bf16/fp16 streams, the forward's single-tile path pools the stored (rounded) s', like the reference; the
tiled path pools s' from the moments above (unrounded), a difference of the streams' rounding.

:func:`step_forward` / :func:`step_backward` launch them (no autograd: the rule's eager path wraps them in its own
``autograd.Function``). Under ``torch.compile`` they are the ops ``lightning_resctl::mgr_step`` (with a fake and its
autograd) and ``lightning_resctl::mgr_step_backward`` (with a fake), registered by ``_library.register_fused_ops``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._env import interpreter_mode
from ._library import register_fused_ops
from .rows import token_stride
from .tiles import (
    Launch,
    LaunchPlans,
    StreamTile,
    device_arch,
    mgr_tile,
    persistent_programs,
    residency_key,
    residency_known,
)

__all__ = ["mgr_step", "mgr_step_backward", "step_forward", "step_backward", "Inversion", "ExactRows", "Launch",
           "forward_launch", "backward_launch", "partials_launch", "exact_budget"]

#: Fewest tokens per backward program: the parameter-gradient partials are (programs x C), summed by a second
#: kernel.
MIN_TOKENS_PER_PROGRAM = 8
#: Columns and partial rows of one program of the partials' sum.
PARTIALS_BLOCK_C, PARTIALS_BLOCK_P = 256, 16


@triton.jit
def _gate_weights(ss, sq, cb, fb, in_valid, C, inv_sqrt_c, eps, COMPETITIVE: tl.constexpr):
    """beta from per-stream Σs², Σs·q: ``z = q·RMSNorm(s)/sqrt(C) + c``; sigmoid, or softmax beside the forget
    logit ``fb`` (competitive); 0 for rows past the streams."""
    r = 1.0 / tl.sqrt(ss / C + eps)
    z = sq * r * inv_sqrt_c + cb
    if COMPETITIVE:
        z = tl.where(in_valid, z, float("-inf"))
        mx = tl.maximum(tl.max(z, axis=0), fb)
        e = tl.exp(z - mx)
        beta = e / (tl.exp(fb - mx) + tl.sum(e, axis=0))
    else:
        beta = tl.where(in_valid, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    return beta


@triton.jit
def _pool_weights(pp, pw, out_valid, C, inv_sqrt_c, eps):
    """a = softmax over the streams of ``w·RMSNorm(s')/sqrt(C)`` from per-stream Σs'², Σs'·w."""
    r2 = 1.0 / tl.sqrt(pp / C + eps)
    y = tl.where(out_valid, pw * r2 * inv_sqrt_c, float("-inf"))
    ey = tl.exp(y - tl.max(y, axis=0))
    return ey / tl.sum(ey, axis=0)


@triton.jit
def _lerp_pool_moments(beta, ss, su, sw, uu, uw):
    """Σs'², Σs'·w of ``s' = (1 - beta) s + beta u`` from Σs², Σs·u, Σs·w (per stream) and Σu², Σu·w."""
    keep = 1.0 - beta
    pp = keep * keep * ss + 2.0 * beta * keep * su + beta * beta * uu
    return tl.where(pp > 0.0, pp, 0.0), keep * sw + beta * uw


@triton.jit
def _pool_backward(a, pp, pw, pd, C, inv_sqrt_c, eps):
    """(coef, k) of the pool's gradient ``dS' += a dh + coef w - k s'`` from per-stream Σs'², Σs'·w, Σs'·dh."""
    dy = a * (pd - tl.sum(a * pd, axis=0))
    r2 = 1.0 / tl.sqrt(pp / C + eps)
    coef = dy * r2 * inv_sqrt_c
    return coef, coef * pw * r2 * r2 / C


@triton.jit
def _gate_backward(beta, dbeta, ss, sq, C, inv_sqrt_c, eps, COMPETITIVE: tl.constexpr):
    """(dz, df, cz, kq) of the gates' gradient ``dS = (1 - beta) g + cz q - kq s`` from dbeta = Σ g·(u - s)
    and per-stream Σs², Σs·q; df is the forget logit's gradient (competitive; 0 else)."""
    if COMPETITIVE:
        sb = tl.sum(beta * dbeta, axis=0)
        dz = beta * (dbeta - sb)
        df = -(1.0 - tl.sum(beta, axis=0)) * sb
    else:
        dz = dbeta * beta * (1.0 - beta)
        df = tl.sum(dz * 0.0, axis=0)
    r = 1.0 / tl.sqrt(ss / C + eps)
    cz = dz * r * inv_sqrt_c
    return dz, df, cz, cz * sq * r * r / C


@triton.jit
def _round(x, ty, ROUND: tl.constexpr):
    """x as stored in dtype ``ty`` (the streams' rounding) when ROUND."""
    if ROUND:
        x = x.to(ty).to(x.dtype)
    return x


@triton.jit
def _merged(s, u, beta, rows, M_IN: tl.constexpr, GATED: tl.constexpr):
    """The merge's output tile s': lerp toward u (gated), or u appended as stream M_IN (accumulating)."""
    if GATED:
        sp = s + beta[:, None] * (u - s)
    else:
        sp = tl.where((rows == M_IN)[:, None], u, s)
    return sp


@triton.jit
def _vector(ptr, rows, c, cmask, DT: tl.constexpr):
    """Feature vector ``ptr[c]`` (u, w, q, dh) as a (rows x columns) tile, every row the same: loaded in the
    stream tile's own layout, so each thread loads its columns at the tile's width (one 128-bit load per row it
    holds; kernels/tiles.py) with no reshuffle through shared memory. The rows' lanes read the same addresses
    (one memory transaction; the other warps' rows hit L1)."""
    return tl.load(ptr + (rows * 0)[:, None] + c[None, :], mask=(rows >= 0)[:, None] & cmask[None, :],
                   other=0.0).to(DT)


@triton.jit
def _log1p(x):
    """log(1 + x) accurate for small x (Kahan: log(u) * x / (u - 1), u = 1 + x rounded)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / tl.where(u == 1.0, 1.0, u - 1.0))


@triton.jit
def _exact_rows(beta, t, rows, in_valid, GAIN_IN, GAIN_OUT, SLOT, used, budget, first_slot, log_max_gain, threshold,
                HAS_GAIN: tl.constexpr, M_IN: tl.constexpr):
    """The fallback inversion's rows of token ``t`` saved exactly: beta above ``threshold`` or the error gain
    ``Σ -log(1 - beta)`` since the row's last exact save past ``log_max_gain``, while the program's ``budget`` lasts
    (``used`` rows taken, first come in its token order). Writes the token's slots (-1: rebuilt) and running gain (0
    where saved); returns ``(saved, slot, used)``."""
    gain = -_log1p(-tl.minimum(beta, 1.0 - 1e-7))
    if HAS_GAIN:
        gain += tl.load(GAIN_IN + t * M_IN + rows, mask=in_valid, other=0.0).to(gain.dtype)
    must = in_valid & ((beta > threshold) | (gain > log_max_gain))
    rank = used + tl.cumsum(must.to(tl.int32), axis=0) - 1
    saved = must & (rank < budget)
    used += tl.sum(saved.to(tl.int32), axis=0)
    slot = tl.where(saved, first_slot + rank, -1)
    tl.store(SLOT + t * M_IN + rows, slot.to(tl.int32), mask=in_valid)
    tl.store(GAIN_OUT + t * M_IN + rows, tl.where(saved, 0.0, gain), mask=in_valid)
    return saved, slot, used


@triton.jit
def _single_tile(cols, C, rows, in_valid, out_valid, W, Q, GATED: tl.constexpr, DT: tl.constexpr):
    """A token in one tile: the column mask, the input and output tile masks, and the parameter vectors w, q
    (tiles, :func:`_vector`; read once per program)."""
    cmask = cols < C
    w = _vector(W, rows, cols, cmask, DT)
    q = _vector(Q, rows, cols, cmask, DT) if GATED else w
    return cmask, in_valid[:, None] & cmask[None, :], out_valid[:, None] & cmask[None, :], w, q


@triton.jit
def _mgr_fwd_kernel(S, U, W, Q, CB, FB, OUT, H, BETA, A, GAIN_IN, GAIN_OUT, SLOT, EXACT,
                    T, C, s_st, s_sm, u_st, inv_sqrt_c, eps, log_max_gain, threshold, budget,
                    M_IN: tl.constexpr, M_OUT: tl.constexpr, GATED: tl.constexpr, COMPETITIVE: tl.constexpr,
                    ROUND: tl.constexpr, INVERT: tl.constexpr, HAS_GAIN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_C: tl.constexpr, SINGLE: tl.constexpr, DT: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    in_valid = rows < M_IN
    out_valid = rows < M_OUT
    s_rows = rows.to(tl.int64) * s_sm
    o_rows = rows.to(tl.int64) * C
    ty = OUT.dtype.element_ty
    if GATED:
        cb = tl.load(CB + rows, mask=in_valid, other=0.0).to(DT)
        fb = tl.load(FB).to(DT) if COMPETITIVE else 0.0
    else:
        cb = tl.zeros([BLOCK_M], dtype=DT)
        fb = 0.0
    p64 = pid.to(tl.int64)
    zero64 = p64 * 0  # 64-bit token offsets (the loop variable is int32 when compiled)
    used = pid * 0  # exact rows this program saved (inversion)
    first_slot = p64 * budget
    if SINGLE:
        cmask, imask, omask, w, q = _single_tile(cols, C, rows, in_valid, out_valid, W, Q, GATED, DT)
        for t0 in range(pid, T, nprog):
            t = zero64 + t0
            s = tl.load(S + t * s_st + s_rows[:, None] + cols[None, :], mask=imask, other=0.0).to(DT)
            u = _vector(U + t * u_st, rows, cols, cmask, DT)
            beta = cb * 0.0
            if GATED:
                if INVERT:  # the exact rows' store takes registers: q, w read per token (L1) instead of held
                    q = _vector(Q, rows, cols, cmask, DT)
                beta = _gate_weights(tl.sum(s * s, axis=1), tl.sum(s * q, axis=1), cb, fb, in_valid, C,
                                     inv_sqrt_c, eps, COMPETITIVE)
                tl.store(BETA + t * M_IN + rows, beta, mask=in_valid)
                if INVERT:
                    saved, slot, used = _exact_rows(beta, t, rows, in_valid, GAIN_IN, GAIN_OUT, SLOT, used, budget,
                                                    first_slot, log_max_gain, threshold, HAS_GAIN, M_IN)
                    tl.store((EXACT + slot * C)[:, None] + cols[None, :], s.to(ty),
                             mask=saved[:, None] & cmask[None, :])
            sp = _merged(s, u, beta, rows, M_IN, GATED)
            tl.store(OUT + t * M_OUT * C + o_rows[:, None] + cols[None, :], sp.to(ty), mask=omask)
            sp = _round(sp, ty, ROUND)
            if INVERT:
                w = _vector(W, rows, cols, cmask, DT)
            a = _pool_weights(tl.sum(sp * sp, axis=1), tl.sum(sp * w, axis=1), out_valid, C, inv_sqrt_c,
                              eps)
            tl.store(A + t * M_OUT + rows, a, mask=out_valid)
            tl.store(H + t * C + cols, tl.sum(a[:, None] * sp, axis=0).to(ty), mask=cmask)
    else:
        for t0 in range(pid, T, nprog):
            t = zero64 + t0
            s_tok = S + t * s_st + s_rows
            u_tok = U + t * u_st
            # pass 1: row sums over column tiles
            acc_a = cb * 0.0  # gated: Σs², accumulating: Σs'²
            acc_b = cb * 0.0  # gated: Σs·w, accumulating: Σs'·w
            acc_q = cb * 0.0  # Σs·q
            acc_u = cb * 0.0  # Σs·u
            uu = cb * 0.0  # Σu², Σu·w (every row the same)
            uw = cb * 0.0
            for c0 in range(0, C, BLOCK_C):
                cmask = c0 + cols < C
                s = tl.load(s_tok[:, None] + (c0 + cols)[None, :], mask=in_valid[:, None] & cmask[None, :],
                            other=0.0).to(DT)
                u = _vector(u_tok, rows, c0 + cols, cmask, DT)
                w = _vector(W, rows, c0 + cols, cmask, DT)
                if GATED:
                    q = _vector(Q, rows, c0 + cols, cmask, DT)
                    acc_a += tl.sum(s * s, axis=1)
                    acc_b += tl.sum(s * w, axis=1)
                    acc_q += tl.sum(s * q, axis=1)
                    acc_u += tl.sum(s * u, axis=1)
                    uu += tl.sum(u * u, axis=1)
                    uw += tl.sum(u * w, axis=1)
                else:
                    sp = _merged(s, u, cb, rows, M_IN, GATED)
                    acc_a += tl.sum(sp * sp, axis=1)
                    acc_b += tl.sum(sp * w, axis=1)
            beta = cb * 0.0
            saved = in_valid & False
            slot = rows.to(tl.int64) * 0 - 1
            if GATED:
                beta = _gate_weights(acc_a, acc_q, cb, fb, in_valid, C, inv_sqrt_c, eps, COMPETITIVE)
                tl.store(BETA + t * M_IN + rows, beta, mask=in_valid)
                if INVERT:
                    saved, slot, used = _exact_rows(beta, t, rows, in_valid, GAIN_IN, GAIN_OUT, SLOT, used, budget,
                                                    first_slot, log_max_gain, threshold, HAS_GAIN, M_IN)
                acc_a, acc_b = _lerp_pool_moments(beta, acc_a, acc_u, acc_b, uu, uw)
            a = _pool_weights(acc_a, acc_b, out_valid, C, inv_sqrt_c, eps)
            tl.store(A + t * M_OUT + rows, a, mask=out_valid)
            # pass 2: outputs over column tiles
            for c0 in range(0, C, BLOCK_C):
                cmask = c0 + cols < C
                s = tl.load(s_tok[:, None] + (c0 + cols)[None, :], mask=in_valid[:, None] & cmask[None, :],
                            other=0.0).to(DT)
                u = _vector(u_tok, rows, c0 + cols, cmask, DT)
                if INVERT:
                    tl.store(EXACT + slot[:, None] * C + (c0 + cols)[None, :], s.to(ty),
                             mask=saved[:, None] & cmask[None, :])
                sp = _merged(s, u, beta, rows, M_IN, GATED)
                tl.store(OUT + t * M_OUT * C + o_rows[:, None] + (c0 + cols)[None, :], sp.to(ty),
                         mask=out_valid[:, None] & cmask[None, :])
                sp = _round(sp, ty, ROUND)
                tl.store(H + t * C + c0 + cols, tl.sum(a[:, None] * sp, axis=0).to(ty), mask=cmask)


@triton.jit
def _streams_in(x, u, beta, rows, c, cmask, t, SLOT, EXACT, C, in_valid, ty, M_IN: tl.constexpr,
                GATED: tl.constexpr, ROUND: tl.constexpr, INVERT: tl.constexpr, DT: tl.constexpr):
    """The merge's input and output tiles ``(s, s')`` in the backward from the tile ``x`` read: the input streams
    (s' recomputed as stored), or, inverted, the output streams (s rebuilt, ``lerp(u, s', 1 / (1 - beta))`` as
    torch's lerp computes it for weights >= 1/2, the exact rows put back)."""
    if INVERT:
        wgt = 1.0 / tl.maximum(1.0 - beta, 1e-30)
        s = x - (x - u) * (1.0 - wgt)[:, None]
        slot = tl.load(SLOT + t * M_IN + rows, mask=in_valid, other=-1)
        s = tl.load(EXACT + slot[:, None] * C + c[None, :], mask=(slot >= 0)[:, None] & cmask[None, :],
                    other=_round(s, ty, ROUND).to(ty)).to(DT)  # the exact rows, else the rebuilt ones
        sp = x
    else:
        s = x
        sp = _round(_merged(s, u, beta, rows, M_IN, GATED), ty, ROUND)
    return s, sp


@triton.jit
def _bwd_tile_sums(s, sp, u, g0, dh, w, q, GATED: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_DH: tl.constexpr):
    """Per-stream row sums of one column tile: Σs'², Σs'·w, Σs'·dh (pool, with dh) and Σs², Σs·q,
    Σ dS'·(u - s), Σ dh·(u - s), Σ w·(u - s), Σ s'·(u - s) (gates)."""
    zero = tl.sum(s * 0.0, axis=1)
    pp = zero
    pw = zero
    pd = zero
    ss = zero
    sq = zero
    gd = zero
    hd = zero
    wd = zero
    pl = zero
    if HAS_DH:
        pp = tl.sum(sp * sp, axis=1)
        pw = tl.sum(sp * w, axis=1)
        pd = tl.sum(sp * dh, axis=1)
    if GATED:
        ss = tl.sum(s * s, axis=1)
        sq = tl.sum(s * q, axis=1)
        lerp = u - s
        if HAS_DOUT:
            gd = tl.sum(g0 * lerp, axis=1)
        if HAS_DH:
            hd = tl.sum(dh * lerp, axis=1)
            wd = tl.sum(w * lerp, axis=1)
            pl = tl.sum(sp * lerp, axis=1)
    return pp, pw, pd, ss, sq, gd, hd, wd, pl


@triton.jit
def _bwd_tile_grads(s, sp, g0, dh, w, q, beta, a, coef, k, cz, kq, rows, M_IN: tl.constexpr, GATED: tl.constexpr,
                    HAS_DOUT: tl.constexpr, HAS_DH: tl.constexpr):
    """One column tile's (dS, du) and its parameter-gradient terms (Σ_i coef_i s'_i, Σ_i cz_i s_i)."""
    g = g0 if HAS_DOUT else s * 0.0
    dw = tl.sum(sp * 0.0, axis=0)
    if HAS_DH:
        g = g + a[:, None] * dh + coef[:, None] * w - k[:, None] * sp
        dw = tl.sum(coef[:, None] * sp, axis=0)
    if GATED:
        du = tl.sum(beta[:, None] * g, axis=0)
        ds = (1.0 - beta)[:, None] * g + cz[:, None] * q - kq[:, None] * s
        dq = tl.sum(cz[:, None] * s, axis=0)
    else:
        du = tl.sum(tl.where((rows == M_IN)[:, None], g, 0.0), axis=0)
        ds = g
        dq = dw
    return ds, du, dw, dq


@triton.jit
def _bwd_coefficients(a, beta, pp, pw, pd, ss, sq, gd, hd, wd, pl, C, inv_sqrt_c, eps, GATED: tl.constexpr,
                      COMPETITIVE: tl.constexpr, HAS_DH: tl.constexpr):
    """The per-stream coefficients of the gradients from the row sums: (coef, k) of the pool, dbeta, and
    (dz, df, cz, kq) of the gates."""
    coef = pp * 0.0
    k = pp * 0.0
    if HAS_DH:
        coef, k = _pool_backward(a, pp, pw, pd, C, inv_sqrt_c, eps)
    dz = pp * 0.0
    df = tl.sum(dz, axis=0)
    cz = dz
    kq = dz
    if GATED:
        dbeta = gd + a * hd + coef * wd - k * pl
        dz, df, cz, kq = _gate_backward(beta, dbeta, ss, sq, C, inv_sqrt_c, eps, COMPETITIVE)
    return coef, k, dz, df, cz, kq


@triton.jit
def _bwd_tile_loads(s_tok, u_tok, do_tok, dh_tok, W, Q, c, cmask, rows, in_valid, out_valid, GATED: tl.constexpr,
                    HAS_DOUT: tl.constexpr, HAS_DH: tl.constexpr, DT: tl.constexpr):
    """Columns ``c`` of one token's backward inputs: the streams read (s, or inverted s'), u, w, q, dS' and dh
    (what is absent: a placeholder, not read)."""
    x = tl.load(s_tok[:, None] + c[None, :], mask=in_valid[:, None] & cmask[None, :], other=0.0).to(DT)
    u = _vector(u_tok, rows, c, cmask, DT)
    w = _vector(W, rows, c, cmask, DT)
    q = _vector(Q, rows, c, cmask, DT) if GATED else w
    g0 = (tl.load(do_tok[:, None] + c[None, :], mask=out_valid[:, None] & cmask[None, :], other=0.0).to(DT)
          if HAS_DOUT else x)
    dh = _vector(dh_tok, rows, c, cmask, DT) if HAS_DH else u
    return x, u, w, q, g0, dh


@triton.jit
def _add_partial(row, value, rows, c, keep, cmask):
    """``row[c] = value (+ row[c] where keep)``: a parameter-gradient partial accumulated in place, read and
    written in the stream tile's layout (:func:`_vector`; the store from the tile's first row only)."""
    acc = _vector(row, rows, c, keep, value.dtype) + value[None, :]
    tl.store(row + (rows * 0)[:, None] + c[None, :], acc, mask=(rows == 0)[:, None] & cmask[None, :])


@triton.jit
def _mgr_bwd_kernel(S, U, BETA, A, W, Q, DOUT, DH, DS, DU, SREC, SLOT, EXACT, DQP, DWP, DCP, DFP, T, C,
                    s_st, s_sm, u_st, do_st, do_sm, dh_st, inv_sqrt_c, eps,
                    M_IN: tl.constexpr, M_OUT: tl.constexpr, GATED: tl.constexpr, COMPETITIVE: tl.constexpr,
                    ROUND: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_DH: tl.constexpr, INVERT: tl.constexpr,
                    DELIVER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, SINGLE: tl.constexpr,
                    DT: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    in_valid = rows < M_IN
    out_valid = rows < M_OUT
    s_rows = rows.to(tl.int64) * s_sm
    do_rows = rows.to(tl.int64) * do_sm
    ds_rows = rows.to(tl.int64) * C
    ty = DS.dtype.element_ty
    uty = DU.dtype.element_ty
    dc_acc = tl.zeros([BLOCK_M], dtype=DT)
    df_acc = tl.zeros([BLOCK_M], dtype=DT)
    p64 = pid.to(tl.int64)
    zero64 = p64 * 0  # 64-bit token offsets (the loop variable is int32 when compiled)
    if SINGLE:
        cmask, imask, omask, w, q = _single_tile(cols, C, rows, in_valid, out_valid, W, Q, GATED, DT)
        dw_acc = tl.zeros([BLOCK_C], dtype=DT)
        dq_acc = tl.zeros([BLOCK_C], dtype=DT)
        for t0 in range(pid, T, nprog):
            t = zero64 + t0
            x = tl.load(S + t * s_st + s_rows[:, None] + cols[None, :], mask=imask, other=0.0).to(DT)
            u = _vector(U + t * u_st, rows, cols, cmask, DT)
            beta = tl.load(BETA + t * M_IN + rows, mask=in_valid, other=0.0).to(DT) if GATED else dc_acc
            a = tl.load(A + t * M_OUT + rows, mask=out_valid, other=0.0).to(DT)
            g0 = (tl.load(DOUT + t * do_st + do_rows[:, None] + cols[None, :], mask=omask, other=0.0).to(DT)
                  if HAS_DOUT else x)
            dh = _vector(DH + t * dh_st, rows, cols, cmask, DT) if HAS_DH else u
            s, sp = _streams_in(x, u, beta, rows, cols, cmask, t, SLOT, EXACT, C, in_valid, ty, M_IN, GATED, ROUND,
                                INVERT, DT)
            pp, pw, pd, ss, sq, gd, hd, wd, pl = _bwd_tile_sums(s, sp, u, g0, dh, w, q, GATED, HAS_DOUT, HAS_DH)
            coef, k, dz, df, cz, kq = _bwd_coefficients(a, beta, pp, pw, pd, ss, sq, gd, hd, wd, pl, C, inv_sqrt_c,
                                                        eps, GATED, COMPETITIVE, HAS_DH)
            ds, du, dw, dq = _bwd_tile_grads(s, sp, g0, dh, w, q, beta, a, coef, k, cz, kq, rows, M_IN, GATED,
                                             HAS_DOUT, HAS_DH)
            offs = t * M_IN * C + ds_rows[:, None] + cols[None, :]
            tl.store(DS + offs, ds.to(ty), mask=imask)
            if DELIVER:
                tl.store(SREC + offs, s.to(ty), mask=imask)
            tl.store(DU + t * C + cols, du.to(uty), mask=cmask)
            dw_acc += dw
            dq_acc += dq
            dc_acc += dz
            df_acc += tl.where(rows == 0, df, 0.0)
        if HAS_DH:
            tl.store(DWP + p64 * C + cols, dw_acc, mask=cmask)
        if GATED:
            tl.store(DQP + p64 * C + cols, dq_acc, mask=cmask)
    else:
        for t0 in range(pid, T, nprog):
            t = zero64 + t0
            s_tok = S + t * s_st + s_rows
            u_tok = U + t * u_st
            do_tok = DOUT + t * do_st + do_rows
            dh_tok = DH + t * dh_st
            beta = tl.load(BETA + t * M_IN + rows, mask=in_valid, other=0.0).to(DT) if GATED else dc_acc
            a = tl.load(A + t * M_OUT + rows, mask=out_valid, other=0.0).to(DT)
            # pass 1: row sums over column tiles
            pp = a * 0.0
            pw = a * 0.0
            pd = a * 0.0
            ss = a * 0.0
            sq = a * 0.0
            gd = a * 0.0
            hd = a * 0.0
            wd = a * 0.0
            pl = a * 0.0
            for c0 in range(0, C, BLOCK_C):
                c = c0 + cols
                cmask = c < C
                x, u, w, q, g0, dh = _bwd_tile_loads(s_tok, u_tok, do_tok, dh_tok, W, Q, c, cmask, rows, in_valid,
                                                     out_valid, GATED, HAS_DOUT, HAS_DH, DT)
                s, sp = _streams_in(x, u, beta, rows, c, cmask, t, SLOT, EXACT, C, in_valid, ty, M_IN, GATED, ROUND,
                                    INVERT, DT)
                pp_, pw_, pd_, ss_, sq_, gd_, hd_, wd_, pl_ = _bwd_tile_sums(s, sp, u, g0, dh, w, q, GATED, HAS_DOUT,
                                                                             HAS_DH)
                pp += pp_
                pw += pw_
                pd += pd_
                ss += ss_
                sq += sq_
                gd += gd_
                hd += hd_
                wd += wd_
                pl += pl_
            coef, k, dz, df, cz, kq = _bwd_coefficients(a, beta, pp, pw, pd, ss, sq, gd, hd, wd, pl, C, inv_sqrt_c,
                                                        eps, GATED, COMPETITIVE, HAS_DH)
            dc_acc += dz
            df_acc += tl.where(rows == 0, df, 0.0)
            # pass 2: gradients over column tiles; the program's parameter-gradient rows accumulate in place
            for c0 in range(0, C, BLOCK_C):
                c = c0 + cols
                cmask = c < C
                x, u, w, q, g0, dh = _bwd_tile_loads(s_tok, u_tok, do_tok, dh_tok, W, Q, c, cmask, rows, in_valid,
                                                     out_valid, GATED, HAS_DOUT, HAS_DH, DT)
                s, sp = _streams_in(x, u, beta, rows, c, cmask, t, SLOT, EXACT, C, in_valid, ty, M_IN, GATED, ROUND,
                                    INVERT, DT)
                ds, du, dw, dq = _bwd_tile_grads(s, sp, g0, dh, w, q, beta, a, coef, k, cz, kq, rows, M_IN, GATED,
                                                 HAS_DOUT, HAS_DH)
                offs = t * M_IN * C + ds_rows[:, None] + c[None, :]
                tl.store(DS + offs, ds.to(ty), mask=in_valid[:, None] & cmask[None, :])
                if DELIVER:
                    tl.store(SREC + offs, s.to(ty), mask=in_valid[:, None] & cmask[None, :])
                tl.store(DU + t * C + c, du.to(uty), mask=cmask)
                keep = cmask & (c * 0 + t > p64)  # the first token of the program starts its rows
                if HAS_DH:
                    _add_partial(DWP + p64 * C, dw, rows, c, keep, cmask)
                if GATED:
                    _add_partial(DQP + p64 * C, dq, rows, c, keep, cmask)
    if GATED:
        tl.store(DCP + p64 * BLOCK_M + rows, dc_acc)
        tl.store(DFP + p64 * BLOCK_M + rows, df_acc)


@triton.jit
def _mgr_partials_kernel(DWP, DQP, DCP, DFP, DW, DQ, DB, DF, P, C, M_IN: tl.constexpr, HAS_DH: tl.constexpr,
                         GATED: tl.constexpr, COMPETITIVE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, DT: tl.constexpr):
    """The step backward's second launch: the parameters' gradients from the per-program partials, in their own
    dtypes (dw: zeros without dh); program 0 also sums the gate and forget biases' (gated merges)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    prow = tl.arange(0, BLOCK_P)
    acc_w = tl.zeros([BLOCK_C], dtype=DT)
    acc_q = tl.zeros([BLOCK_C], dtype=DT)
    for p0 in range(0, P, BLOCK_P):
        pm = (p0 + prow < P)[:, None] & cmask[None, :]
        offs = (p0 + prow).to(tl.int64)[:, None] * C + cols[None, :]
        if HAS_DH:
            acc_w += tl.sum(tl.load(DWP + offs, mask=pm, other=0.0), axis=0)
        if GATED:
            acc_q += tl.sum(tl.load(DQP + offs, mask=pm, other=0.0), axis=0)
    tl.store(DW + cols, acc_w.to(DW.dtype.element_ty), mask=cmask)
    if GATED:
        tl.store(DQ + cols, acc_q.to(DQ.dtype.element_ty), mask=cmask)
        if pid == 0:
            rows = tl.arange(0, BLOCK_M)
            acc_b = tl.zeros([BLOCK_M], dtype=DT)
            acc_f = tl.zeros([BLOCK_M], dtype=DT)
            for p0 in range(0, P, BLOCK_P):
                pm = (p0 + prow < P)[:, None]
                offs = (p0 + prow).to(tl.int64)[:, None] * BLOCK_M + rows[None, :]
                acc_b += tl.sum(tl.load(DCP + offs, mask=pm, other=0.0), axis=0)
                if COMPETITIVE:
                    acc_f += tl.sum(tl.load(DFP + offs, mask=pm, other=0.0), axis=0)
            tl.store(DB + rows, acc_b.to(DB.dtype.element_ty), mask=rows < M_IN)
            if COMPETITIVE:
                tl.store(DF + rows, acc_f.to(DF.dtype.element_ty), mask=rows < 1)


# ----------------------------------------------------------------------------------------------
# launch code: what runs, as data (benchmarks/kernels_aot.py compiles exactly these launches ahead of time)
# ----------------------------------------------------------------------------------------------
def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _tl_dtype(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


def _layout(streams: Tensor, gate_query: Optional[Tensor]):
    """``(lead, m, C, m_out, gated, compute dtype)`` of a step on streams ``(*lead, m, C)``: a gated merge
    (``gate_query`` given) keeps ``m_out = m`` streams, an accumulating one appends u (``m_out = m + 1``)."""
    lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    gated = gate_query is not None
    return lead, m, c, (m if gated else m + 1), gated, _compute_dtype(streams)


def _token_view(t: Tensor, lead_dims: int) -> tuple[Tensor, int]:
    """``t`` (copied only when its features are strided or its leading dims have no single token stride) and
    its token stride."""
    stride = token_stride(t, lead_dims)
    if stride is None or (t.shape[-1] > 1 and t.stride(-1) != 1):
        t = t.contiguous()
        stride = token_stride(t, lead_dims)
    return t, stride


def _stream_view(t: Tensor, lead_dims: int) -> tuple[Tensor, int, int]:
    """Streams ``(*lead, m, C)``: the tensor (copied only when it must be), token stride, stream stride."""
    t, stride = _token_view(t, lead_dims)
    return t, stride, t.stride(-2)


def _check(streams: Tensor, u: Tensor, max_streams: int = 8) -> None:
    if streams.dim() < 2:
        raise ValueError(f"streams must be (..., m, C), got {tuple(streams.shape)}")
    if streams.shape[-2] > max_streams:
        raise ValueError(f"the fused MGR kernel supports up to {max_streams} streams, got {streams.shape[-2]}")
    if u.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"u must have shape {tuple(streams.shape[:-2] + streams.shape[-1:])}, got {tuple(u.shape)}")
    if not u.is_floating_point() or (u.dtype == torch.float64) != (streams.dtype == torch.float64):
        raise TypeError(f"u dtype {u.dtype} does not go with the streams dtype {streams.dtype}")


def _meta(tile: StreamTile, m: int, m_out: int, gated: bool, competitive: bool, streams: Tensor, cd) -> dict:
    return dict(M_IN=m, M_OUT=m_out, GATED=gated, COMPETITIVE=competitive, ROUND=streams.dtype != cd,
                BLOCK_M=tile.block_m, BLOCK_C=tile.block_c, SINGLE=tile.single, DT=_tl_dtype(cd),
                num_warps=1 if interpreter_mode() else tile.num_warps, maxnreg=tile.max_regs)


class Inversion(NamedTuple):
    """The fallback inversion's settings for one gated step's forward: ``gain`` the running error gain entering it
    ((*lead, m) in the compute dtype, None: none yet), ``top_p`` the budget of rows saved exactly (a fraction of the
    merge's token x stream rows, allocated up front), ``threshold`` and ``max_gain`` what makes a row need it."""
    gain: Optional[Tensor]
    top_p: float
    threshold: float
    max_gain: float


class ExactRows(NamedTuple):
    """What an inverted step's forward saves besides u, beta, a: the running ``gain`` after it ((*lead, m)), each
    row's ``slot`` in ``exact`` ((*lead, m) int32, -1: rebuilt in the backward) and the ``exact`` rows (budget x C,
    the streams' dtype)."""
    gain: Tensor
    slot: Tensor
    exact: Tensor


def exact_budget(rows: int, top_p: float, programs: int) -> int:
    """Exact rows each of ``programs`` programs may save: its share of ``ceil(top_p * rows)``."""
    total = math.ceil(top_p * rows) if top_p > 0 else 0
    return triton.cdiv(total, programs) if total else 0


#: Each call signature's launch geometry, worked out once (the launch table, the views, the persistent grid)
_FORWARD_GEOMETRY = LaunchPlans()
_BACKWARD_GEOMETRY = LaunchPlans()
_PARTIALS_META = LaunchPlans()


class _Geometry(NamedTuple):
    """What a step's launch takes of its call signature: the layout, the views' strides, the tile's meta, the
    persistent grid (programs), its residency key; ``budget`` exact rows per program (inverted forward)."""
    lead: tuple
    m: int
    c: int
    m_out: int
    gated: bool
    cd: torch.dtype
    t: int
    strides: tuple
    meta: dict
    programs: int
    residency: Optional[tuple]
    budget: int
    block_m: int


def _geometry(plans: LaunchPlans, key: tuple, make):
    """The geometry of ``key`` (``make()`` the first time; kept once the persistent grid's residency is known, so
    that later launches take the compiled kernel's, ``kernels/tiles.py``)."""
    geo = make()
    if residency_known(geo.residency):
        plans.put(key, geo)
    return geo


def _views_ok(lead_dims: int, *tensors) -> bool:
    """Every tensor (its first ``lead_dims`` dims the tokens) is walked through its strides (no copy: a feature
    stride of 1, one token stride)."""
    return all(t is None or _token_view(t, lead_dims)[0] is t for t in tensors)


def forward_launch(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
                   gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float,
                   out: Tensor, h: Tensor, beta: Tensor, a: Tensor, arch: Optional[int] = None,
                   inversion: Optional[Inversion] = None) -> tuple[Launch, Optional[ExactRows]]:
    """The forward kernel's launch writing ``out, h, beta, a`` (contiguous, shapes of :func:`step_forward`) for
    target ``arch`` (compute capability; None: the streams' device's), and with ``inversion`` (a gated step) the
    :class:`ExactRows` it allocates and writes."""
    gated = gate_query is not None
    invert = inversion is not None and gated
    has_gain = invert and inversion.gain is not None
    key = (streams.shape, streams.stride(), u.stride(), streams.dtype, u.dtype, streams.device, gated,
           forget_bias is not None, invert, has_gain, inversion.top_p if invert else None, arch)
    geo = _FORWARD_GEOMETRY.get(key)
    if geo is None and not _views_ok(streams.dim() - 2, streams, u):  # copied to rows it walks (not kept: new key)
        nl = streams.dim() - 2
        streams, u = _stream_view(streams, nl)[0], _token_view(u, nl)[0]
        key = None

    def make() -> _Geometry:
        lead, m, c, m_out, _, cd = _layout(streams, gate_query)
        t = math.prod(lead)
        tile = mgr_tile(c, m_out, streams.element_size(), "forward", gated,
                        arch if arch is not None else device_arch(streams.device))
        meta = dict(_meta(tile, m, m_out, gated, forget_bias is not None, streams, cd), INVERT=invert,
                    HAS_GAIN=has_gain)
        residency = residency_key(_mgr_fwd_kernel, streams.device, meta)
        programs = persistent_programs(t, tile, streams.device, residency=residency)
        budget = exact_budget(t * m, inversion.top_p, programs) if invert else 0
        strides = (token_stride(streams, len(lead)), streams.stride(-2), token_stride(u, len(lead)))
        return _Geometry(tuple(lead), m, c, m_out, gated, cd, t, strides, meta, programs, residency, budget,
                         tile.block_m)

    if geo is None:
        geo = _geometry(_FORWARD_GEOMETRY, key, make) if key is not None else make()
    w = next_query.contiguous()
    q = gate_query.contiguous() if gated else w
    cb = gate_bias.contiguous() if gated else w
    fb = (forget_bias if forget_bias.dim() == 1 else forget_bias.reshape(1)).contiguous() \
        if forget_bias is not None else w
    saved = None
    inv = (0.0, 0.0, 0)
    if invert:
        dev = streams.device
        saved = ExactRows(torch.empty((*geo.lead, geo.m), dtype=geo.cd, device=dev),
                          torch.empty((*geo.lead, geo.m), dtype=torch.int32, device=dev),
                          torch.empty((geo.programs * geo.budget, geo.c), dtype=streams.dtype, device=dev))
        inv = (math.log(inversion.max_gain), inversion.threshold, geo.budget)
    gain_in = inversion.gain.contiguous() if has_gain else beta
    slots = (gain_in, *saved) if saved is not None else (beta, beta, beta, out)
    return Launch(_mgr_fwd_kernel, (geo.programs,),
                  (streams, u, w, q, cb, fb, out, h, beta, a, *slots, geo.t, geo.c, *geo.strides,
                   1.0 / math.sqrt(geo.c), eps, *inv), geo.meta, geo.residency), saved


def step_forward(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
                 gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float,
                 inversion: Optional[Inversion] = None):
    """Fused MGR step forward (one launch, no autograd): merge (append u when ``gate_query`` is None, else gates +
    lerp; competitive gating when ``forget_bias`` is given) then the next AttnPool with ``next_query``.

    Returns ``(streams', h, beta, a, exact)``: beta is (..., 0) for an accumulating merge; ``exact`` the
    :class:`ExactRows` of a gated step with ``inversion``, else None. ``u`` may be of a lower precision than the
    streams (converted in registers)."""
    _check(streams, u)
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    # outputs are allocated with their final shapes (contiguous), so that none of them is a view
    out = torch.empty((*lead, m_out, c), dtype=streams.dtype, device=streams.device)
    h = torch.empty((*lead, c), dtype=streams.dtype, device=streams.device)
    beta = torch.empty((*lead, m if gated else 0), dtype=cd, device=streams.device)
    a = torch.empty((*lead, m_out), dtype=cd, device=streams.device)
    if math.prod(lead) == 0:
        inv = inversion is not None and gated
        exact = ExactRows(beta, beta.to(torch.int32), streams.new_empty((0, c))) if inv else None
        return out, h, beta, a, exact
    launch, exact = forward_launch(streams, u, next_query, gate_query, gate_bias, forget_bias, eps, out, h, beta, a,
                                   inversion=inversion)
    launch.run()
    return out, h, beta, a, exact


class _Partials(NamedTuple):
    """Per-program partial sums of the parameter gradients (every row written by its program: ``empty``)."""
    dw: Tensor
    dq: Tensor
    dc: Tensor
    df: Tensor


def backward_launch(streams: Tensor, u: Tensor, beta: Tensor, a: Tensor, next_query: Tensor,
                    gate_query: Optional[Tensor], forget_bias: Optional[Tensor], grad_out: Optional[Tensor],
                    grad_h: Optional[Tensor], eps: float, ds: Tensor, du: Tensor,
                    arch: Optional[int] = None, exact: Optional[ExactRows] = None,
                    delivered: Optional[Tensor] = None) -> tuple[Launch, _Partials]:
    """The backward kernel's launch writing ``ds, du`` (contiguous) and the partials it allocates, for target
    ``arch`` (compute capability; None: the streams' device's). With ``exact`` (an inverted gated step)
    ``streams`` are the merge's *output* streams, and the kernel rebuilds its inputs (into ``delivered`` when
    given: contiguous, the streams' shape)."""
    gated = gate_query is not None
    invert = exact is not None and gated
    key = (streams.shape, streams.stride(), u.stride(), None if grad_out is None else grad_out.stride(),
           None if grad_h is None else grad_h.stride(), streams.dtype, streams.device, gated,
           forget_bias is not None, invert, delivered is not None, arch)
    geo = _BACKWARD_GEOMETRY.get(key)
    if geo is None and not _views_ok(streams.dim() - 2, streams, u, grad_out, grad_h):
        nl = streams.dim() - 2
        streams, u = _stream_view(streams, nl)[0], _token_view(u, nl)[0]
        grad_out = _stream_view(grad_out, nl)[0] if grad_out is not None else None
        grad_h = _token_view(grad_h, nl)[0] if grad_h is not None else None
        key = None

    def make() -> _Geometry:
        lead, m, c, m_out, _, cd = _layout(streams, gate_query)
        t = math.prod(lead)
        tile = mgr_tile(c, m_out, streams.element_size(), "backward", gated,
                        arch if arch is not None else device_arch(streams.device), invert)
        meta = dict(_meta(tile, m, m_out, gated, forget_bias is not None, streams, cd),
                    HAS_DOUT=grad_out is not None, HAS_DH=grad_h is not None, INVERT=invert,
                    DELIVER=delivered is not None)
        residency = residency_key(_mgr_bwd_kernel, streams.device, meta)
        p = persistent_programs(t, tile, streams.device, MIN_TOKENS_PER_PROGRAM, residency)
        strides = (token_stride(streams, len(lead)), streams.stride(-2), token_stride(u, len(lead)),
                   *((token_stride(grad_out, len(lead)), grad_out.stride(-2)) if grad_out is not None else (0, 0)),
                   token_stride(grad_h, len(lead)) if grad_h is not None else 0)
        return _Geometry(tuple(lead), m, c, m_out, gated, cd, t, strides, meta, p, residency, 0, tile.block_m)

    if geo is None:
        geo = _geometry(_BACKWARD_GEOMETRY, key, make) if key is not None else make()
    p, c, cd, dev = geo.programs, geo.c, geo.cd, streams.device
    parts = _Partials(torch.empty((p, c), dtype=cd, device=dev) if grad_h is not None else None,
                      torch.empty((p, c), dtype=cd, device=dev) if gated else None,
                      torch.empty((p, geo.block_m), dtype=cd, device=dev) if gated else None,
                      torch.empty((p, geo.block_m), dtype=cd, device=dev) if gated else None)
    w = next_query.contiguous()
    q = gate_query.contiguous() if gated else w
    placeholder = ds
    slot, rows = (exact.slot.contiguous(), exact.exact) if invert else (placeholder, placeholder)
    launch = Launch(_mgr_bwd_kernel, (p,),
                    (streams, u, beta.contiguous() if gated else a, a.contiguous(), w, q,
                     grad_out if grad_out is not None else streams, grad_h if grad_h is not None else u, ds, du,
                     delivered if delivered is not None else placeholder, slot, rows,
                     *(x if x is not None else placeholder for x in (parts.dq, parts.dw, parts.dc, parts.df)),
                     geo.t, c, *geo.strides, 1.0 / math.sqrt(c), eps), geo.meta, geo.residency)
    return launch, parts


def partials_launch(parts: Optional[_Partials], c: int, m: int, gated: bool, competitive: bool, block_m: int,
                    dw: Tensor, dq: Optional[Tensor], db: Optional[Tensor], df: Optional[Tensor], cd) -> Launch:
    """The backward's second launch: ``dw`` (and gated ``dq``, ``db``, competitive ``df``) from the step kernel's
    partials (``parts`` None: no token, every gradient 0)."""
    if parts is None:
        parts = _Partials(None, None, None, None)
    p = next((x.shape[0] for x in parts if x is not None), 0)
    has_dh = parts.dw is not None
    key = (c, m, gated, competitive, block_m, cd, has_dh)
    meta = _PARTIALS_META.get(key)
    if meta is None:
        meta = dict(M_IN=m, HAS_DH=has_dh, GATED=gated, COMPETITIVE=competitive, BLOCK_M=block_m,
                    BLOCK_C=PARTIALS_BLOCK_C, BLOCK_P=PARTIALS_BLOCK_P, DT=_tl_dtype(cd),
                    num_warps=1 if interpreter_mode() else 4)
        _PARTIALS_META.put(key, meta)
    return Launch(_mgr_partials_kernel, (triton.cdiv(c, PARTIALS_BLOCK_C),),
                  (parts.dw if has_dh else dw, parts.dq if gated else dw, parts.dc if gated else dw,
                   parts.df if gated else dw, dw, dq if gated else dw, db if gated else dw,
                   df if df is not None else dw, p, c), meta)


def step_backward(streams: Tensor, u: Tensor, beta: Tensor, a: Tensor, next_query: Tensor,
                  gate_query: Optional[Tensor], gate_bias: Optional[Tensor], forget_bias: Optional[Tensor],
                  grad_out: Optional[Tensor], grad_h: Optional[Tensor], eps: float, exact: Optional[ExactRows] = None,
                  deliver: bool = False, du_dtype: Optional[torch.dtype] = None):
    """Fused backward of :func:`step_forward` (two launches, no autograd): ``(d_streams, d_u, d_gate_query,
    d_gate_bias, d_forget_bias, d_next_query, streams_in)``; absent parameters' gradients are None, ``d_u`` has
    ``du_dtype`` (default u's: an accumulating step rebuilt from its output reads u there, in the streams' dtype).
    With ``exact`` (an inverted gated step) ``streams`` are the merge's output and ``streams_in`` its input streams
    rebuilt (``deliver``), else None."""
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    dev = streams.device
    ds = torch.empty((*lead, m, c), dtype=streams.dtype, device=dev)
    du = torch.empty((*lead, c), dtype=du_dtype or u.dtype, device=dev)
    invert = exact is not None and gated
    rebuilt = torch.empty((*lead, m, c), dtype=streams.dtype, device=dev) if invert and deliver else None
    dw = torch.empty_like(next_query, memory_format=torch.contiguous_format)
    dq = torch.empty_like(gate_query, memory_format=torch.contiguous_format) if gated else None
    db = torch.empty_like(gate_bias, memory_format=torch.contiguous_format) if gated else None
    df = torch.empty(1, dtype=forget_bias.dtype, device=dev) if forget_bias is not None else None
    parts = None
    block_m = max(2, triton.next_power_of_2(m_out))
    if math.prod(lead) > 0:
        launch, parts = backward_launch(streams, u, beta, a, next_query, gate_query, forget_bias, grad_out, grad_h,
                                        eps, ds, du, exact=exact if invert else None, delivered=rebuilt)
        launch.run()
        block_m = launch.meta["BLOCK_M"]
    partials_launch(parts, c, m, gated, forget_bias is not None, block_m, dw, dq, db, df, cd).run()
    return (ds, du, dq, db, df.reshape(forget_bias.shape) if df is not None else None, dw, rebuilt)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile sees of the Triton path)
# ----------------------------------------------------------------------------------------------
def _mgr_step(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
              gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op of :func:`step_forward` (no inversion): ``(streams', h, beta, a)``."""
    return step_forward(streams, u, next_query, gate_query, gate_bias, forget_bias, eps)[:4]


def _mgr_step_fake(streams, u, next_query, gate_query, gate_bias, forget_bias, eps):
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    return (streams.new_empty((*lead, m_out, c)), streams.new_empty((*lead, c)),
            streams.new_empty((*lead, m if gated else 0), dtype=cd), streams.new_empty((*lead, m_out), dtype=cd))


def _empty(streams: Tensor) -> Tensor:
    return streams.new_empty((0,), dtype=_compute_dtype(streams))


def _mgr_step_backward(streams: Tensor, u: Tensor, beta: Tensor, a: Tensor, next_query: Tensor,
                       gate_query: Optional[Tensor], gate_bias: Optional[Tensor], forget_bias: Optional[Tensor],
                       grad_out: Optional[Tensor], grad_h: Optional[Tensor], eps: float
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op of :func:`step_backward`: ``(d_streams, d_u, d_gate_query, d_gate_bias, d_forget_bias,
    d_next_query)``; absent parameters get empty tensors."""
    ds, du, dq, db, df, dw, _ = step_backward(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias,
                                              grad_out, grad_h, eps)
    return tuple(x if x is not None else _empty(streams) for x in (ds, du, dq, db, df, dw))


def _mgr_step_backward_fake(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias, grad_out, grad_h,
                            eps):
    gated = gate_query is not None
    # contiguous like the real outputs (empty_like would copy an input's strides)
    return (streams.new_empty(streams.shape), u.new_empty(u.shape),
            gate_query.new_empty(gate_query.shape) if gated else _empty(streams),
            gate_bias.new_empty(gate_bias.shape) if gated else _empty(streams),
            forget_bias.new_empty(forget_bias.shape) if forget_bias is not None else _empty(streams),
            next_query.new_empty(next_query.shape))


def _setup_context(ctx, inputs, output):
    streams, u, next_query, gate_query, gate_bias, forget_bias, eps = inputs
    _, _, beta, a = output
    ctx.save_for_backward(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias)
    ctx.eps = eps
    ctx.mark_non_differentiable(beta, a)


def _grads(backward_op, ctx, grad_out, grad_h, _grad_beta, _grad_a):
    streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias = ctx.saved_tensors
    if gate_query is None:
        beta = a.new_empty((*a.shape[:-1], 0))
    ds, du, dq, db, df, dw = backward_op(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias,
                                         grad_out, grad_h, ctx.eps)
    gated = gate_query is not None
    return (ds, du, dw, dq if gated else None, db if gated else None,
            df if forget_bias is not None else None, None)


mgr_step, mgr_step_backward = register_fused_ops(("mgr_step", "mgr_step_backward"), _mgr_step, _mgr_step_fake,
                                                 _mgr_step_backward, _mgr_step_backward_fake, _setup_context, _grads)
