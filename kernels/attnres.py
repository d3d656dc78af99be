"""Fused Triton kernels of the AttnRes depth pool (Full and Block AttnRes): one launch per merge forward, two
backward.

The rule (per token; ``lightning_resctl.rules.attnres.reference`` states it and is the oracle)::

    r_i = 1 / sqrt(mean(V_i^2) + eps)      z_i = (q * g) . V_i * r_i      alpha = softmax(z)      h = sum_i alpha_i V_i

The sources of merge k (block size S; Full AttnRes: S = 1) live in one buffer per chain and forward, ``V (T, K + 1,
C)`` in the compute dtype: slot 0 holds the chain input x (written by merge 0), slot j + 1 the partial block after
merge j, ``P_{j+1} = P_j + u_j`` (``P_j`` only when merge j continues a block: ``j % S != 0``). Merge k's sources are
the completed blocks, slots ``0, S, 2S, ..., (k // S) S``, and its own partial ``P_{k+1}``.

* forward (:func:`merge_forward`): per token, one read of each source and of u (and of ``P_k``), one write of
  ``P_{k+1}`` and of h (in u's dtype); an online softmax (one pass over the sources); saves the log-sum-exp.
* backward (:func:`merge_backward`, two launches): per token, one read of each source and of dh: ``a_i = dh . V_i``,
  ``alpha_i`` from the saved log-sum-exp, ``dz_i = alpha_i (a_i - sum_j alpha_j a_j)``; the gradient of every source
  accumulates in a buffer ``dV`` (T, K + 1, C) as ``alpha_i dh + dz_i r_i (q * g)``, and the term along the source
  itself, ``-(z_i r_i^2 / C) dz_i V_i``, as the scalar ``D_i += dz_i z_i`` (T, K + 1): no second read of the sources.
  Merge k's own partial is complete when its backward runs (every later reader's backward ran before): its gradient
  ``g = dV_{k+1} - (r V)_{k+1} r_{k+1} D_{k+1} / C`` is u_k's (written in u's dtype) and, inside a block, carries to
  ``P_k`` (its first gradient: ``dV_k = g``); merge 0 returns x's. The parameter-gradient partials (programs x C)
  are summed by a second kernel into the query's and key-norm weight's gradients. The first backward to run (the
  last merge, whose sources are every completed block) writes ``dV`` and ``D`` instead of adding to them, and a
  partial inside a block gets its first gradient from the carry: no zero fill.

Rows of magnitude >= 2^32 have their sum of squares taken of V / k (k a power of two; no overflow of the squares,
bitwise the same below the threshold), so ``r`` is right for rows near 1e20 in fp32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._env import interpreter_mode
from .tiles import ATTNRES_MAX_COLS, Launch, LaunchPlans, attnres_tile, device_arch, persistent_programs

__all__ = ["ChainBuffers", "new_buffers", "merge_forward", "merge_backward", "forward_launch", "backward_launch",
           "partials_launch", "Launch", "ATTNRES_MAX_COLS"]

#: Rows whose max-abs reaches this have their sum of squares taken of V / k (k a power of two).
SCALE_THRESHOLD = 2.0 ** 32
#: Fewest tokens per backward program: the parameter-gradient partials are (programs x C), summed by a second kernel.
MIN_TOKENS_PER_PROGRAM = 8
#: Columns and partial rows of one program of the partials' sum.
PARTIALS_BLOCK_C, PARTIALS_BLOCK_P = 256, 16


@triton.jit
def _rsqrt_mean_sq(v, cmask, C, eps, THRESHOLD: tl.constexpr):
    """``1 / sqrt(mean(v^2) + eps)`` of a row, and ``r * v``: the squares of a row of max-abs >= THRESHOLD taken of
    v / k (k a power of two), so neither overflows for rows near 1e20."""
    mx = tl.max(tl.where(cmask, tl.abs(v), 0.0), axis=0)
    big = (mx >= THRESHOLD) & (mx < float("inf"))
    inv_k = tl.where(big, tl.exp2(-tl.floor(tl.log2(tl.where(big, mx, 1.0)))), 1.0)
    vs = v * inv_k
    r = inv_k / tl.sqrt(tl.sum(vs * vs, axis=0) / C + eps * inv_k * inv_k)
    return r, vs * (r / inv_k)


@triton.jit
def _query(Q, G, cols, cmask, HAS_G: tl.constexpr, DT: tl.constexpr):
    w = tl.load(Q + cols, mask=cmask, other=0.0).to(DT)
    if HAS_G:
        w = w * tl.load(G + cols, mask=cmask, other=0.0).to(DT)
    return w


@triton.jit
def _attnres_fwd_kernel(X, U, V, Q, G, H, LSE, T, C, x_st, u_st, v_st, k, S, n_closed, prev_open, eps,
                        FIRST: tl.constexpr, HAS_G: tl.constexpr, BLOCK_C: tl.constexpr, DT: tl.constexpr,
                        THRESHOLD: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = _query(Q, G, cols, cmask, HAS_G, DT)
    zero64 = pid.to(tl.int64) * 0
    vty = V.dtype.element_ty
    for t0 in range(pid, T, nprog):
        t = zero64 + t0
        row = V + t * v_st
        if FIRST:  # slot 0: the chain input
            x = tl.load(X + t * x_st + cols, mask=cmask, other=0.0).to(DT)
            tl.store(row + cols, x.to(vty), mask=cmask)
        p = tl.load(U + t * u_st + cols, mask=cmask, other=0.0).to(DT)
        if prev_open != 0:
            p += tl.load(row + k * C + cols, mask=cmask, other=0.0).to(DT)
        tl.store(row + (k + 1) * C + cols, p.to(vty), mask=cmask)
        # online softmax over the completed blocks (slots 0, S, 2S, ...) and the partial p
        l_run = tl.sum(w * 0.0, axis=0)
        m_run = l_run - float("inf")
        acc = w * 0.0
        for i in range(0, n_closed + 1):
            if FIRST:
                v = x
            else:
                v = tl.load(row + i * S * C + cols, mask=cmask, other=0.0).to(DT)
            r, rv = _rsqrt_mean_sq(v, cmask, C, eps, THRESHOLD)
            z = tl.sum(w * rv, axis=0)
            m_new = tl.maximum(m_run, z)
            scale = tl.exp(m_run - m_new)
            e = tl.exp(z - m_new)
            acc = acc * scale + e * v
            l_run = l_run * scale + e
            m_run = m_new
        r, rv = _rsqrt_mean_sq(p, cmask, C, eps, THRESHOLD)
        z = tl.sum(w * rv, axis=0)
        m_new = tl.maximum(m_run, z)
        scale = tl.exp(m_run - m_new)
        e = tl.exp(z - m_new)
        acc = acc * scale + e * p
        l_run = l_run * scale + e
        tl.store(H + t * C + cols, (acc / l_run).to(H.dtype.element_ty), mask=cmask)
        tl.store(LSE + t, m_new + tl.log(l_run))


@triton.jit
def _pick(vec, sidx, i):
    """``vec[i]`` of a register vector (i a run-time index)."""
    return tl.sum(tl.where(sidx == i, vec, 0.0), axis=0)


@triton.jit
def _add_slot(DVrow, D2row, slot, C, cols, cmask, value, d2, FIRST: tl.constexpr):
    """Slot ``slot``'s gradient += ``value`` and its scalar D += ``d2`` (the first backward writes them)."""
    if FIRST:
        tl.store(DVrow + slot * C + cols, value, mask=cmask)
        tl.store(D2row + slot, d2)
    else:
        old = tl.load(DVrow + slot * C + cols, mask=cmask, other=0.0)
        tl.store(DVrow + slot * C + cols, old + value, mask=cmask)
        tl.store(D2row + slot, tl.load(D2row + slot) + d2)


@triton.jit
def _attnres_bwd_kernel(V, DV, D2, DH, Q, G, LSE, DU, DX, DWP, T, C, v_st, d2_st, dh_st, k, S, n_closed, prev_open,
                        eps, FIRST: tl.constexpr, MERGE0: tl.constexpr, HAS_G: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, DT: tl.constexpr, THRESHOLD: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    sidx = tl.arange(0, BLOCK_S)
    w = _query(Q, G, cols, cmask, HAS_G, DT)
    p64 = pid.to(tl.int64)
    zero64 = p64 * 0
    dw_acc = w * 0.0
    n_src = n_closed + 2  # the completed blocks and the partial
    for t0 in range(pid, T, nprog):
        t = zero64 + t0
        row = V + t * v_st
        dvrow = DV + t * v_st
        d2row = D2 + t * d2_st
        dh = tl.load(DH + t * dh_st + cols, mask=cmask, other=0.0).to(DT)
        lse = tl.load(LSE + t)
        # pass 1 (one read of each source): alpha_i, a_i = dh . V_i, r_i, z_i; sum_i alpha_i a_i r_i V_i and
        # sum_i alpha_i r_i V_i for the query's gradient
        alphas = tl.zeros([BLOCK_S], dtype=DT)
        avals = tl.zeros([BLOCK_S], dtype=DT)
        rvals = tl.zeros([BLOCK_S], dtype=DT)
        zvals = tl.zeros([BLOCK_S], dtype=DT)
        acc1 = w * 0.0
        acc2 = w * 0.0
        rv_p = w * 0.0  # r V of the partial (slot k + 1), kept for its own gradient
        rv_x = w * 0.0  # (merge 0) r V of x
        for i in range(0, n_src):
            slot = tl.where(i < n_src - 1, i * S, k + 1)
            v = tl.load(row + slot * C + cols, mask=cmask, other=0.0).to(DT)
            r, rv = _rsqrt_mean_sq(v, cmask, C, eps, THRESHOLD)
            z = tl.sum(w * rv, axis=0)
            alpha = tl.exp(z - lse)
            a = tl.sum(dh * v, axis=0)
            alphas = tl.where(sidx == i, alpha, alphas)
            avals = tl.where(sidx == i, a, avals)
            rvals = tl.where(sidx == i, r, rvals)
            zvals = tl.where(sidx == i, z, zvals)
            acc1 += (alpha * a) * rv
            acc2 += alpha * rv
            if MERGE0:
                if i == 0:
                    rv_x = rv
            rv_p = rv
        sa = tl.sum(alphas * avals, axis=0)
        dw_acc += acc1 - sa * acc2
        dzs = alphas * (avals - sa)
        # pass 2 (no source read): each source's gradient and scalar D
        g_p = w * 0.0
        d2_p = tl.sum(w * 0.0, axis=0)
        for i in range(0, n_src):
            slot = tl.where(i < n_src - 1, i * S, k + 1)
            alpha = _pick(alphas, sidx, i)
            dz = _pick(dzs, sidx, i)
            value = alpha * dh + (dz * _pick(rvals, sidx, i)) * w
            d2 = dz * _pick(zvals, sidx, i)
            if i < n_src - 1:
                if MERGE0:  # x: its gradient is complete (merge 0's backward is the last)
                    old = tl.load(dvrow + cols, mask=cmask, other=0.0) if not FIRST else value * 0.0
                    old_d2 = tl.load(d2row) if not FIRST else d2 * 0.0
                    gx = old + value - rv_x * _pick(rvals, sidx, i) * (old_d2 + d2) / C
                    tl.store(DX + t * C + cols, gx.to(DX.dtype.element_ty), mask=cmask)
                else:
                    _add_slot(dvrow, d2row, slot, C, cols, cmask, value, d2, FIRST)
            else:
                g_p = value
                d2_p = d2
        # the partial P_{k+1}: complete now; its gradient is u_k's and, inside a block, P_k's too
        old = tl.load(dvrow + (k + 1) * C + cols, mask=cmask, other=0.0) if not FIRST else g_p * 0.0
        old_d2 = tl.load(d2row + k + 1) if not FIRST else d2_p * 0.0
        r_p = _pick(rvals, sidx, n_src - 1)
        g = old + g_p - rv_p * r_p * (old_d2 + d2_p) / C
        tl.store(DU + t * C + cols, g.to(DU.dtype.element_ty), mask=cmask)
        if prev_open != 0:  # P_{k+1} = P_k + u_k: P_k (read by no pool but merge k - 1's) gets its first gradient
            _add_slot(dvrow, d2row, k, C, cols, cmask, g, d2_p * 0.0, True)
    tl.store(DWP + p64 * C + cols, dw_acc, mask=cmask)


@triton.jit
def _attnres_partials_kernel(DWP, Q, G, DQ, DG, P, C, HAS_G: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_P: tl.constexpr, DT: tl.constexpr):
    """The backward's second launch: ``dw = sum of the partials``; ``dq = dw * g``, ``dg = dw * q`` (key-norm
    weight), in the parameters' dtypes."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    prow = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_C], dtype=DT)
    for p0 in range(0, P, BLOCK_P):
        pm = (p0 + prow < P)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(DWP + (p0 + prow).to(tl.int64)[:, None] * C + cols[None, :], mask=pm, other=0.0),
                      axis=0)
    if HAS_G:
        q = tl.load(Q + cols, mask=cmask, other=0.0).to(DT)
        g = tl.load(G + cols, mask=cmask, other=0.0).to(DT)
        tl.store(DQ + cols, (acc * g).to(DQ.dtype.element_ty), mask=cmask)
        tl.store(DG + cols, (acc * q).to(DG.dtype.element_ty), mask=cmask)
    else:
        tl.store(DQ + cols, acc.to(DQ.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------
# launch code: what runs, as data (benchmarks/kernels_aot.py compiles exactly these launches ahead of time)
# ----------------------------------------------------------------------------------------------
def _tl_dtype(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


class ChainBuffers(NamedTuple):
    """One chain's sources for one forward: ``V`` (T, K + 1, C) in the compute dtype (slot 0: x; slot j + 1: the
    partial after merge j), ``block`` the block size S; ``grads`` a one-element list holding ``(dV, D)`` once the
    first backward allocated them (None before)."""
    V: Tensor
    block: int
    grads: list


def new_buffers(x: Tensor, num_merges: int, block: int, dtype: torch.dtype) -> ChainBuffers:
    """The buffers of a chain of ``num_merges`` merges over tokens of ``x`` (..., C): one allocation, no kernel."""
    c = x.shape[-1]
    return ChainBuffers(torch.empty((x.numel() // max(c, 1), num_merges + 1, c), dtype=dtype, device=x.device),
                        block, [None])


def _meta(tile, first: bool, has_g: bool, cd, **more) -> dict:
    return dict(FIRST=first, HAS_G=has_g, BLOCK_C=tile.block_c, DT=_tl_dtype(cd), THRESHOLD=SCALE_THRESHOLD,
                num_warps=1 if interpreter_mode() else tile.num_warps, maxnreg=tile.max_regs, **more)


def _rows(t: Tensor) -> tuple[Tensor, int]:
    """``t`` (..., C) as rows: the tensor (copied when its rows have no single stride or its features are strided)
    and its row stride."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if flat.shape[-1] > 1 and flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.stride(0)


#: Each call signature's launch geometry (grid, meta), worked out once
_GEOMETRY = LaunchPlans()


def forward_launch(x: Tensor, u: Tensor, bufs: ChainBuffers, k: int, query: Tensor, gain: Optional[Tensor],
                   eps: float, h: Tensor, lse: Tensor, arch: Optional[int] = None) -> Launch:
    """Merge ``k``'s forward launch: writes ``P_{k+1}`` into the buffer (and x into slot 0 at merge 0), ``h`` and
    ``lse`` (for target ``arch``; None: the tensors' device's)."""
    V = bufs.V
    t, slots, c = V.shape
    s = bufs.block
    x2, x_st = _rows(x)
    u2, u_st = _rows(u)
    key = (True, V.shape, V.dtype, u.dtype, V.device, k == 0, gain is not None, arch)
    geo = _GEOMETRY.get(key)
    if geo is None:
        tile = attnres_tile(c, min(V.element_size(), u.element_size()), "forward",  # 16 bytes of u per thread
                            arch if arch is not None else device_arch(V.device))
        geo = ((persistent_programs(t, tile, V.device),), _meta(tile, k == 0, gain is not None, V.dtype))
        _GEOMETRY.put(key, geo)
    return Launch(_attnres_fwd_kernel, geo[0],
                  (x2, u2, V, query, gain if gain is not None else query, h, lse, t, c, x_st, u_st, slots * c, k, s,
                   k // s, int(k % s != 0), eps), geo[1])


def merge_forward(x: Tensor, u: Tensor, bufs: ChainBuffers, k: int, query: Tensor, gain: Optional[Tensor],
                  eps: float) -> tuple[Tensor, Tensor]:
    """Merge ``k`` of a chain (one launch, no autograd): adds u to the partial block, pools the sources with
    ``query * gain``. Returns ``(h (shape and dtype of u), lse (T,) in the compute dtype)``."""
    V = bufs.V
    h = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    lse = torch.empty(V.shape[0], dtype=V.dtype, device=V.device)
    if V.shape[0]:
        forward_launch(x, u, bufs, k, query, gain, eps, h, lse).run()
    return h, lse


def backward_launch(bufs: ChainBuffers, k: int, grad_h: Tensor, lse: Tensor, query: Tensor, gain: Optional[Tensor],
                    eps: float, du: Tensor, dx: Optional[Tensor], first: bool,
                    arch: Optional[int] = None) -> tuple[Launch, Tensor]:
    """Merge ``k``'s backward launch (``first``: the first backward of the chain writes the gradient buffers) and
    the per-program partials it allocates."""
    V = bufs.V
    dv, d2 = bufs.grads[0]
    t, slots, c = V.shape
    s = bufs.block
    dh2, dh_st = _rows(grad_h)
    n_closed = k // s
    key = (False, V.shape, V.dtype, grad_h.dtype, V.device, k == 0, first, n_closed, gain is not None, arch)
    geo = _GEOMETRY.get(key)
    if geo is None:
        tile = attnres_tile(c, min(V.element_size(), grad_h.element_size()), "backward",
                            arch if arch is not None else device_arch(V.device))
        geo = (persistent_programs(t, tile, V.device, MIN_TOKENS_PER_PROGRAM),
               _meta(tile, first, gain is not None, V.dtype, MERGE0=k == 0,
                     BLOCK_S=triton.next_power_of_2(n_closed + 2)))
        _GEOMETRY.put(key, geo)
    programs, meta = geo
    partials = torch.empty((programs, c), dtype=V.dtype, device=V.device)
    return Launch(_attnres_bwd_kernel, (programs,),
                  (V, dv, d2, dh2, query, gain if gain is not None else query, lse, du,
                   dx if dx is not None else du, partials, t, c, slots * c, slots, dh_st, k, s, n_closed,
                   int(k % s != 0), eps), meta), partials


def partials_launch(partials: Tensor, query: Tensor, gain: Optional[Tensor], d_query: Tensor,
                    d_gain: Optional[Tensor]) -> Launch:
    """The backward's second launch: the query's (and key-norm weight's) gradient from the partials."""
    p, c = partials.shape
    key = (gain is not None, partials.dtype)
    meta = _GEOMETRY.get(key)
    if meta is None:
        meta = dict(HAS_G=gain is not None, BLOCK_C=PARTIALS_BLOCK_C, BLOCK_P=PARTIALS_BLOCK_P,
                    DT=_tl_dtype(partials.dtype), num_warps=1 if interpreter_mode() else 2)  # 4 fp32 of q, g / thread
        _GEOMETRY.put(key, meta)
    return Launch(_attnres_partials_kernel, (triton.cdiv(c, PARTIALS_BLOCK_C),),
                  (partials, query, gain if gain is not None else query, d_query,
                   d_gain if d_gain is not None else d_query, p, c), meta)


def merge_backward(bufs: ChainBuffers, k: int, grad_h: Optional[Tensor], lse: Tensor, query: Tensor,
                   gain: Optional[Tensor], eps: float, u_meta: tuple, x_meta: Optional[tuple]):
    """Merge ``k``'s backward (two launches, no autograd): accumulates its sources' gradients into the chain's
    buffers (allocated by the first backward, which writes them) and returns ``(du, dx or None, d_query, d_gain or
    None)``: du of u's shape and dtype (``u_meta``: (shape, dtype); the complete gradient of merge k's partial), dx
    (merge 0, ``x_meta``: x's, complete), the parameters' in their dtypes."""
    V = bufs.V
    t, slots, c = V.shape
    first = bufs.grads[0] is None
    if first:
        bufs.grads[0] = (torch.empty_like(V), torch.empty((t, slots), dtype=V.dtype, device=V.device))
    du = torch.empty(u_meta[0], dtype=u_meta[1], device=V.device)
    dx = torch.empty(x_meta[0], dtype=x_meta[1], device=V.device) if x_meta is not None else None
    if grad_h is None:  # (h unused: its gradient is 0; the sources' still flow)
        grad_h = torch.zeros(u_meta[0], dtype=u_meta[1], device=V.device)
    d_query = torch.empty_like(query, memory_format=torch.contiguous_format)
    d_gain = torch.empty_like(gain, memory_format=torch.contiguous_format) if gain is not None else None
    if t:
        launch, partials = backward_launch(bufs, k, grad_h, lse, query, gain, eps, du, dx, first)
        launch.run()
    else:
        partials = V.new_empty((0, c))
    partials_launch(partials, query, gain, d_query, d_gain).run()
    return du, dx, d_query, d_gain

