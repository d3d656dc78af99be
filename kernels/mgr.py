"""Fused Triton kernels of one Multi-Gate-Residual step and their ``torch.library`` registration.

One step = merge k (gates + lerp for a gated merge, append for an accumulating one) followed by the
AttnPool of merge k+1. The math (and its torch reference) is in :mod:`lightning_resctl.mgr`.

Forward, per token (one program): reads S (m x C) and u (C) once, writes S' (m' x C), h (C) and the
fp32 gates beta (m) and pool weights a (m') — ~(n+1)·C reads and (n+1)·C writes.
Backward, per token: reads S, u, beta, a, dS', dh; writes dS, du; per-program partial sums of the
parameter gradients (dq, dw, dc, df) are reduced in torch.

Ops: ``lightning_resctl::mgr_step`` (with ``register_fake`` and ``register_autograd``) and
``lightning_resctl::mgr_step_backward`` (with ``register_fake``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_resctl._triton import interpreter_mode


@triton.jit
def _mgr_fwd_kernel(S, U, W, Q, CB, FB, OUT, H, BETA, A, C, inv_sqrt_c, eps,
                    M_IN: tl.constexpr, M_OUT: tl.constexpr, GATED: tl.constexpr, COMPETITIVE: tl.constexpr,
                    ROUND: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    in_valid = rows < M_IN
    out_valid = rows < M_OUT
    s = tl.load(S + t * M_IN * C + rows[:, None] * C + cols[None, :],
                mask=in_valid[:, None] & cmask[None, :], other=0.0).to(DT)
    u = tl.load(U + t * C + cols, mask=cmask, other=0.0).to(DT)
    if GATED:
        q = tl.load(Q + cols, mask=cmask, other=0.0).to(DT)
        r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / C + eps)
        z = tl.sum(s * q[None, :], axis=1) * r * inv_sqrt_c + tl.load(CB + rows, mask=in_valid, other=0.0).to(DT)
        if COMPETITIVE:
            f = tl.load(FB).to(DT)
            z = tl.where(in_valid, z, float("-inf"))
            mx = tl.maximum(tl.max(z, axis=0), f)
            e = tl.exp(z - mx)
            beta = e / (tl.exp(f - mx) + tl.sum(e, axis=0))
        else:
            beta = tl.where(in_valid, 1.0 / (1.0 + tl.exp(-z)), 0.0)
        tl.store(BETA + t * M_IN + rows, beta, mask=in_valid)
        sp = s + beta[:, None] * (u[None, :] - s)
    else:
        sp = tl.where((rows == M_IN)[:, None], u[None, :], s)
    omask = out_valid[:, None] & cmask[None, :]
    tl.store(OUT + t * M_OUT * C + rows[:, None] * C + cols[None, :], sp.to(OUT.dtype.element_ty), mask=omask)
    if ROUND:
        sp = sp.to(OUT.dtype.element_ty).to(DT)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(DT)
    r2 = 1.0 / tl.sqrt(tl.sum(sp * sp, axis=1) / C + eps)
    y = tl.where(out_valid, tl.sum(sp * w[None, :], axis=1) * r2 * inv_sqrt_c, float("-inf"))
    ey = tl.exp(y - tl.max(y, axis=0))
    a = ey / tl.sum(ey, axis=0)
    tl.store(A + t * M_OUT + rows, a, mask=out_valid)
    h = tl.sum(a[:, None] * sp, axis=0)
    tl.store(H + t * C + cols, h.to(H.dtype.element_ty), mask=cmask)


@triton.jit
def _mgr_bwd_kernel(S, U, BETA, A, W, Q, DOUT, DH, DS, DU, DQP, DWP, DCP, DFP, T, C, inv_sqrt_c, eps,
                    M_IN: tl.constexpr, M_OUT: tl.constexpr, GATED: tl.constexpr, COMPETITIVE: tl.constexpr,
                    ROUND: tl.constexpr,
                    HAS_DOUT: tl.constexpr, HAS_DH: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, DT: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    in_valid = rows < M_IN
    out_valid = rows < M_OUT
    imask = in_valid[:, None] & cmask[None, :]
    omask = out_valid[:, None] & cmask[None, :]
    w = tl.load(W + cols, mask=cmask, other=0.0).to(DT)
    dw_acc = tl.zeros([BLOCK_C], dtype=DT)
    dq_acc = tl.zeros([BLOCK_C], dtype=DT)
    dc_acc = tl.zeros([BLOCK_M], dtype=DT)
    df_acc = tl.zeros([BLOCK_M], dtype=DT)
    if GATED:
        q = tl.load(Q + cols, mask=cmask, other=0.0).to(DT)
    zero64 = pid.to(tl.int64) * 0  # 64-bit token offsets (the loop variable is int32 when compiled)
    for t0 in range(pid, T, nprog):
        t = zero64 + t0
        s = tl.load(S + t * M_IN * C + rows[:, None] * C + cols[None, :], mask=imask, other=0.0).to(DT)
        u = tl.load(U + t * C + cols, mask=cmask, other=0.0).to(DT)
        if GATED:
            beta = tl.load(BETA + t * M_IN + rows, mask=in_valid, other=0.0).to(DT)
            sp = s + beta[:, None] * (u[None, :] - s)
        else:
            sp = tl.where((rows == M_IN)[:, None], u[None, :], s)
        if ROUND:
            sp = sp.to(DS.dtype.element_ty).to(DT)
        a = tl.load(A + t * M_OUT + rows, mask=out_valid, other=0.0).to(DT)
        if HAS_DOUT:
            g = tl.load(DOUT + t * M_OUT * C + rows[:, None] * C + cols[None, :], mask=omask, other=0.0).to(DT)
        else:
            g = tl.zeros([BLOCK_M, BLOCK_C], dtype=DT)
        if HAS_DH:
            dh = tl.load(DH + t * C + cols, mask=cmask, other=0.0).to(DT)
            da = tl.sum(sp * dh[None, :], axis=1)
            dy = a * (da - tl.sum(a * da, axis=0))
            r2 = 1.0 / tl.sqrt(tl.sum(sp * sp, axis=1) / C + eps)
            p2 = tl.sum(sp * w[None, :], axis=1)
            coef = dy * r2 * inv_sqrt_c
            g = g + a[:, None] * dh[None, :] + coef[:, None] * w[None, :] - (coef * p2 * r2 * r2 / C)[:, None] * sp
            dw_acc += tl.sum(coef[:, None] * sp, axis=0)
        if GATED:
            du = tl.sum(beta[:, None] * g, axis=0)
            dbeta = tl.sum(g * (u[None, :] - s), axis=1)
            if COMPETITIVE:
                sb = tl.sum(beta * dbeta, axis=0)
                dz = beta * (dbeta - sb)
                df_acc += tl.where(rows == 0, -(1.0 - tl.sum(beta, axis=0)) * sb, 0.0)
            else:
                dz = dbeta * beta * (1.0 - beta)
            dc_acc += dz
            r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / C + eps)
            pq = tl.sum(s * q[None, :], axis=1)
            cz = dz * r * inv_sqrt_c
            ds = (1.0 - beta)[:, None] * g + cz[:, None] * q[None, :] - (cz * pq * r * r / C)[:, None] * s
            dq_acc += tl.sum(cz[:, None] * s, axis=0)
        else:
            ds = g
            du = tl.sum(tl.where((rows == M_IN)[:, None], g, 0.0), axis=0)
        tl.store(DS + t * M_IN * C + rows[:, None] * C + cols[None, :], ds.to(DS.dtype.element_ty), mask=imask)
        tl.store(DU + t * C + cols, du.to(DU.dtype.element_ty), mask=cmask)
    p64 = pid.to(tl.int64)
    tl.store(DWP + p64 * C + cols, dw_acc, mask=cmask)
    if GATED:
        tl.store(DQP + p64 * C + cols, dq_acc, mask=cmask)
        tl.store(DCP + p64 * BLOCK_M + rows, dc_acc)
        tl.store(DFP + p64 * BLOCK_M + rows, df_acc)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _tl_dtype(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


def _blocks(m_out: int, c: int, backward: bool = False) -> tuple[int, int, int]:
    """Tile (BLOCK_M streams x BLOCK_C features) and warps; the backward holds ~4 tiles live, so it gets more
    warps (sm_90: 8x2048 fwd 87 regs/thread at 16 warps; bwd 4x2048 ~128 regs at 16 warps)."""
    block_m = max(2, triton.next_power_of_2(m_out))
    block_c = triton.next_power_of_2(c)
    elems = block_m * block_c
    if backward:
        num_warps = 4 if elems <= 1024 else (8 if elems <= 4096 else 16)
    else:
        num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return block_m, block_c, num_warps


def _layout(streams: Tensor, gate_query: Optional[Tensor]):
    """``(lead, m, C, m_out, gated, compute dtype)`` of a step on streams ``(*lead, m, C)``: a gated merge
    (``gate_query`` given) keeps ``m_out = m`` streams, an accumulating one appends u (``m_out = m + 1``)."""
    lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    gated = gate_query is not None
    return lead, m, c, (m if gated else m + 1), gated, _compute_dtype(streams)


def _token_rows(streams: Tensor, u: Tensor) -> tuple[Tensor, Tensor, int]:
    """Contiguous token-major ``(T, m, C)`` streams, ``(T, C)`` u, and the token count T."""
    s2 = streams.reshape(-1, *streams.shape[-2:]).contiguous()
    return s2, u.reshape(-1, u.shape[-1]).contiguous(), s2.shape[0]


def _check(streams: Tensor, u: Tensor, max_streams: int = 8) -> None:
    if streams.dim() < 2:
        raise ValueError(f"streams must be (..., m, C), got {tuple(streams.shape)}")
    if streams.shape[-2] > max_streams:
        raise ValueError(f"the fused MGR kernel supports up to {max_streams} streams, got {streams.shape[-2]}")
    if u.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"u must have shape {tuple(streams.shape[:-2] + streams.shape[-1:])}, got {tuple(u.shape)}")
    if u.dtype != streams.dtype:
        raise TypeError(f"u dtype {u.dtype} does not match the streams dtype {streams.dtype}")


def _fwd_impl(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
              gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float):
    _check(streams, u)
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    s2, u2, t = _token_rows(streams, u)
    # outputs are allocated with their final shapes (contiguous), so that none of them is a view
    out = torch.empty((*lead, m_out, c), dtype=streams.dtype, device=streams.device)
    h = torch.empty((*lead, c), dtype=streams.dtype, device=streams.device)
    beta = torch.empty((*lead, m if gated else 0), dtype=cd, device=streams.device)
    a = torch.empty((*lead, m_out), dtype=cd, device=streams.device)
    if t > 0:
        block_m, block_c, num_warps = _blocks(m_out, c)
        w = next_query.contiguous()
        q = gate_query.contiguous() if gated else w
        cb = gate_bias.contiguous() if gated else w
        fb = forget_bias.reshape(1).contiguous() if forget_bias is not None else w
        _mgr_fwd_kernel[(t,)](
            s2, u2, w, q, cb, fb, out, h, beta, a, c, 1.0 / math.sqrt(c), eps,
            M_IN=m, M_OUT=m_out, GATED=gated, COMPETITIVE=forget_bias is not None, ROUND=streams.dtype != cd,
            BLOCK_M=block_m, BLOCK_C=block_c, DT=_tl_dtype(cd), num_warps=num_warps)
    return out, h, beta, a


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(t: int, device: torch.device) -> int:
    """Programs of the backward grid (each loops over tokens and keeps partial parameter gradients)."""
    if interpreter_mode() or device.type != "cuda":
        return max(1, min(t, 4))
    return max(1, min(t, 4 * _sm_count(device.index)))


def _bwd_impl(streams: Tensor, u: Tensor, beta: Tensor, a: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
              gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], grad_out: Optional[Tensor],
              grad_h: Optional[Tensor], eps: float):
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    s2, u2, t = _token_rows(streams, u)
    beta2 = beta.reshape(t, -1).contiguous() if gated else a
    a2 = a.reshape(t, m_out).contiguous()
    ds = torch.empty((*lead, m, c), dtype=streams.dtype, device=streams.device)
    du = torch.empty((*lead, c), dtype=u.dtype, device=u.device)
    block_m, block_c, num_warps = _blocks(m_out, c, backward=True)
    p = _num_programs(t, streams.device)
    dwp = torch.zeros((p, c), dtype=cd, device=streams.device)
    dqp = torch.zeros((p, c), dtype=cd, device=streams.device)
    dcp = torch.zeros((p, block_m), dtype=cd, device=streams.device)
    dfp = torch.zeros((p, block_m), dtype=cd, device=streams.device)
    if t > 0:
        go = grad_out.reshape(t, m_out, c).contiguous() if grad_out is not None else s2
        gh = grad_h.reshape(t, c).contiguous() if grad_h is not None else u2
        _mgr_bwd_kernel[(p,)](
            s2, u2, beta2, a2, next_query.contiguous(), gate_query.contiguous() if gated else u2, go, gh,
            ds, du, dqp, dwp, dcp, dfp, t, c, 1.0 / math.sqrt(c), eps,
            M_IN=m, M_OUT=m_out, GATED=gated, COMPETITIVE=forget_bias is not None, ROUND=streams.dtype != cd,
            HAS_DOUT=grad_out is not None, HAS_DH=grad_h is not None,
            BLOCK_M=block_m, BLOCK_C=block_c, DT=_tl_dtype(cd), num_warps=num_warps)
    dw = dwp.sum(0).to(next_query.dtype)
    def empty():
        return streams.new_empty((0,), dtype=cd)

    if gated:
        dq = dqp.sum(0).to(gate_query.dtype)
        db = dcp.sum(0)[:m].to(gate_bias.dtype)
        df = dfp.sum().to(forget_bias.dtype) if forget_bias is not None else empty()
    else:
        dq, db, df = empty(), empty(), empty()
    return ds, du, dq, db, df, dw


# ----------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("lightning_resctl::mgr_step", mutates_args=())
def mgr_step(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
             gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fused MGR step: merge (append u when ``gate_query`` is None, else gates + lerp; competitive gating when
    ``forget_bias`` is given) then the next AttnPool with ``next_query``.

    Returns ``(streams', h, beta, a)``; beta is (..., 0) for an accumulating merge."""
    return _fwd_impl(streams, u, next_query, gate_query, gate_bias, forget_bias, eps)


@mgr_step.register_fake
def _(streams, u, next_query, gate_query, gate_bias, forget_bias, eps):
    lead, m, c, m_out, gated, cd = _layout(streams, gate_query)
    return (streams.new_empty((*lead, m_out, c)), streams.new_empty((*lead, c)),
            streams.new_empty((*lead, m if gated else 0), dtype=cd), streams.new_empty((*lead, m_out), dtype=cd))


@torch.library.custom_op("lightning_resctl::mgr_step_backward", mutates_args=())
def mgr_step_backward(streams: Tensor, u: Tensor, beta: Tensor, a: Tensor, next_query: Tensor,
                      gate_query: Optional[Tensor], gate_bias: Optional[Tensor], forget_bias: Optional[Tensor],
                      grad_out: Optional[Tensor], grad_h: Optional[Tensor], eps: float
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fused backward of :func:`mgr_step`: ``(d_streams, d_u, d_gate_query, d_gate_bias, d_forget_bias,
    d_next_query)``; absent parameters get empty tensors."""
    return _bwd_impl(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias, grad_out, grad_h, eps)


@mgr_step_backward.register_fake
def _(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias, grad_out, grad_h, eps):
    cd = _compute_dtype(streams)
    gated = gate_query is not None

    def empty():
        return streams.new_empty((0,), dtype=cd)

    # contiguous like the real outputs (empty_like would copy an input's strides)
    return (streams.new_empty(streams.shape), u.new_empty(u.shape),
            gate_query.new_empty(gate_query.shape) if gated else empty(),
            gate_bias.new_empty(gate_bias.shape) if gated else empty(),
            forget_bias.new_empty(forget_bias.shape) if forget_bias is not None else empty(),
            next_query.new_empty(next_query.shape))


def _setup_context(ctx, inputs, output):
    streams, u, next_query, gate_query, gate_bias, forget_bias, eps = inputs
    _, _, beta, a = output
    ctx.save_for_backward(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias)
    ctx.eps = eps
    ctx.mark_non_differentiable(beta, a)


def _backward(ctx, grad_out, grad_h, _grad_beta, _grad_a):
    streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias = ctx.saved_tensors
    ds, du, dq, db, df, dw = mgr_step_backward(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias,
                                               grad_out, grad_h, ctx.eps)
    gated = gate_query is not None
    return (ds, du, dw, dq if gated else None, db if gated else None,
            df if forget_bias is not None else None, None)


mgr_step.register_autograd(_backward, setup_context=_setup_context)


def mgr_step_forward_raw(streams, u, next_query, gate_query, gate_bias, forget_bias, eps):
    """The op without autograd (used inside the chain's inversion-aware autograd.Function)."""
    return mgr_step(streams, u, next_query, gate_query, gate_bias, forget_bias, eps)


def mgr_step_backward_raw(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias, grad_out, grad_h, eps):
    """Backward op with empty placeholders mapped back to None."""
    if gate_query is None:
        beta = a.new_empty((*a.shape[:-1], 0))
    ds, du, dq, db, df, dw = mgr_step_backward(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias,
                                               grad_out, grad_h, eps)
    gated = gate_query is not None
    return (ds, du, dq if gated else None, db if gated else None, df if forget_bias is not None else None, dw)
