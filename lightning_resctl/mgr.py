"""Multi-Gate Residuals (MGR): n gated streams per token instead of one residual stream.

Math (per token; streams ``S`` have layout ``(..., n, C)``, the n streams of a token contiguous;
``RMSNorm(x) = x / sqrt(mean(x^2) + 1e-6)`` over C, no parameters, fp32)::

    AttnPool     a_i = softmax_i( w . RMSNorm(s_i) / sqrt(C) ),     h = sum_i a_i s_i
    branch       u   = F(h)                                         (the user's sub-layer)
    gates        z_i = q . RMSNorm(s_i) / sqrt(C)
                 independent: beta_i = sigmoid(z_i + b_i)
                 competitive: beta   = softmax([f, z_1 + c_1, ..., z_n + c_n])[1:]
    lerp         s'_i = (1 - beta_i) s_i + beta_i u

A chain of ``num_merges`` merges starts with one stream (the chain input x); the first n-1 merges
*accumulate* (append their branch output as a new stream, no gate); merges n-1.. are gated. The chain
ends with an output AttnPool whose result has the shape of x. Gate math always runs in fp32.

Hand-written model (one chain over all sub-layers of a transformer)::

    chain = MGRChain(dim=C, num_merges=2 * n_layer, streams=4)
    run = chain.begin(x)                          # x: (B, T, C)
    for blk in blocks:
        run.write(blk.attn(blk.ln1(run.read())))   # read(): pooled input of the current merge
        run.write(blk.mlp(blk.ln2(run.read())))    # write(u): merge u into the streams
    y = run.end()                                 # output pool, shape of x

The same chain is driven one merge at a time by :mod:`lightning_resctl.surgery` through
``streams, h = chain.start(x)`` and ``streams, h = chain.step(k, streams, u)``.

Backends: ``"torch"`` (fused torch ops, closed-form backward), ``"triton"`` (one fused kernel per merge:
gates + lerp + the next merge's pool, and a fused backward; ``torch.library`` ops), ``"reference"``
(plain torch ops differentiated by autograd — the oracle), ``"auto"`` (triton on CUDA, torch otherwise).

Fallback inversion (``invert``): the backward recomputes each merge's input streams from its output,
``s_i = (s'_i - beta_i u) / (1 - beta_i)``, instead of saving them (merge l+1's backward hands its
reconstructed input to merge l as that merge's output). Rows (token, stream) are saved exactly where
beta is in the top ``invert_top_p`` fraction of the merge, above ``invert_threshold``, or where the
error gain ``prod 1/(1 - beta)`` accumulated since the last exact row would exceed ``invert_max_gain``
(our addition: it bounds the error growth over deep chains). ``invert="auto"`` enables it for fp32/fp64
streams in eager mode; it is off under ``torch.compile`` and for half-precision streams (the inversion
of a rounded bf16/fp16 output is not accurate). Saved for backward per gated merge and token: about
(n+1)·C values without inversion (input streams and u), about (1 + top_p·n)·C with it (u and the exact
rows), plus a few fp32 numbers per stream. A merge's output is only dropped when the next step receives
that very tensor unchanged; otherwise it is kept (as if saved), so any driving order stays correct.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from ._triton import kernel_module, triton_available, triton_runs_on
from .memory import saved_tensor_bytes  # re-exported: it lived here first

__all__ = [
    "MGRChain", "MGRMerge", "MGRPool", "MGRRun", "MGRInit", "mgr_bias_init", "rms_norm",
    "attn_pool_reference", "mgr_gates_reference", "mgr_merge_reference", "mgr_step_reference",
    "saved_tensor_bytes",
]

RMS_EPS = 1e-6
L_BASE = 21
B_BASE = -3.0
GATINGS = ("independent", "competitive")
BACKENDS = ("auto", "torch", "triton", "reference")


# ----------------------------------------------------------------------------------------------
# torch reference (the oracle the kernels, the fused torch path and the inversion are tested against)
# ----------------------------------------------------------------------------------------------
def rms_norm(x: Tensor, eps: float = RMS_EPS) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (fp64 stays fp64), no parameters."""
    x = x.double() if x.dtype == torch.float64 else x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def attn_pool_reference(streams: Tensor, query: Tensor, eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
    """AttnPool ``a_i = softmax_i(query . RMSNorm(s_i) / sqrt(C))``, ``h = sum_i a_i s_i``.

    ``streams`` (..., m, C), ``query`` (C,). Returns ``(h (..., C) in the streams' dtype, a (..., m) fp32)``.
    """
    cd = _compute_dtype(streams)
    c = streams.shape[-1]
    a = torch.softmax(rms_norm(streams, eps) @ query.to(cd) / math.sqrt(c), dim=-1)
    h = (a.unsqueeze(-1) * streams.to(cd)).sum(-2)
    return h.to(streams.dtype), a


def mgr_gates_reference(streams: Tensor, gate_query: Tensor, gate_bias: Tensor, forget_bias: Optional[Tensor] = None,
                        gating: str = "competitive", eps: float = RMS_EPS) -> tuple[Tensor, Optional[Tensor]]:
    """Gates of one merge: ``z_i = q . RMSNorm(s_i) / sqrt(C)``;
    independent ``beta_i = sigmoid(z_i + b_i)``; competitive ``softmax([f, z_i + c_i])``.

    Returns ``(beta (..., n), forget (...) or None)`` in fp32 (the forget gate ``1 - sum beta`` for
    competitive gating).
    """
    cd = _compute_dtype(streams)
    c = streams.shape[-1]
    z = rms_norm(streams, eps) @ gate_query.to(cd) / math.sqrt(c) + gate_bias.to(cd)
    if gating == "independent":
        return torch.sigmoid(z), None
    f = forget_bias.to(cd).expand(z.shape[:-1]).unsqueeze(-1)
    p = torch.softmax(torch.cat([f, z], dim=-1), dim=-1)
    return p[..., 1:], p[..., 0]


def mgr_merge_reference(streams: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                        forget_bias: Optional[Tensor] = None, gating: str = "competitive",
                        eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
    """One gated merge ``s'_i = (1 - beta_i) s_i + beta_i u`` (fp32 math). Returns ``(streams', beta)``."""
    beta, _ = mgr_gates_reference(streams, gate_query, gate_bias, forget_bias, gating, eps)
    cd = beta.dtype
    s = streams.to(cd)
    out = s + beta.unsqueeze(-1) * (u.to(cd).unsqueeze(-2) - s)
    return out.to(streams.dtype), beta


def mgr_step_reference(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor] = None,
                       gate_bias: Optional[Tensor] = None, forget_bias: Optional[Tensor] = None,
                       gating: str = "competitive", eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
    """One step of a chain: the merge (append ``u`` when ``gate_query`` is None — an accumulating merge —
    else gate + lerp), then the next AttnPool with ``next_query``. Returns ``(streams', h_next)``."""
    if gate_query is None:
        out = torch.cat([streams, u.unsqueeze(-2)], dim=-2)
    else:
        out, _ = mgr_merge_reference(streams, u, gate_query, gate_bias, forget_bias, gating, eps)
    h, _ = attn_pool_reference(out, next_query, eps)
    return out, h


# ----------------------------------------------------------------------------------------------
# depth-aware bias initialisation
# ----------------------------------------------------------------------------------------------
class MGRInit(NamedTuple):
    """Initial gate parameters: ``gate_bias`` value (all streams), ``forget_bias`` value (competitive) or None,
    the resulting ``beta_init`` of every gate, and ``note`` (str when clamped or degenerate, else None)."""
    gate_bias: float
    forget_bias: Optional[float]
    beta_init: float
    note: Optional[str]


def mgr_bias_init(num_gated: int, streams: int, gating: str = "competitive", b_base: float = B_BASE,
                  l_base: int = L_BASE, beta_init_max: float = 0.5) -> MGRInit:
    """Depth-aware gate-bias init so that every gate starts at ``beta = sigmoid(b_base) * sqrt(l_base / L)``.

    With ``g = sqrt(L / l_base) * (exp(-b_base) + 1)`` (L = ``num_gated``):
    competitive ``f = ln(g - n)``, ``c_i = 0``; independent ``b_i = -ln(g - 1)``.
    When the log's argument is <= 0 (very shallow chains) ``beta_init`` is clamped to ``beta_init_max``
    (independent) or ``beta_init_max / n`` (competitive: the streams then take ``beta_init_max`` in total)
    and ``note`` says so.
    """
    n = int(streams)
    if gating not in GATINGS:
        raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")
    if not 0.0 < beta_init_max < 1.0:
        raise ValueError(f"beta_init_max must be in (0, 1), got {beta_init_max!r}")
    if num_gated <= 0:
        note = (f"MGR chain has no gated merges (num_merges <= streams - 1 = {n - 1}); "
                "all merges accumulate, no gate bias to initialise")
        return MGRInit(0.0, 0.0 if gating == "competitive" else None, 0.0, note)
    g = math.sqrt(num_gated / l_base) * (math.exp(-b_base) + 1.0)
    target = 1.0 / g
    if gating == "competitive":
        if g - n > 0:
            return MGRInit(0.0, math.log(g - n), target, None)
        beta = beta_init_max / n
        note = (f"MGR competitive gate init clamped: ln(sqrt(L/L_base)*(exp(-b_base)+1) - n) undefined for "
                f"L={num_gated}, n={n} (argument {g - n:.3g} <= 0); beta_init = beta_init_max/n = {beta:.4g} "
                f"instead of sigmoid(b_base)*sqrt(L_base/L) = {target:.4g}")
        return MGRInit(0.0, math.log(1.0 / beta - n), beta, note)
    if g - 1 > 0:
        return MGRInit(-math.log(g - 1.0), None, target, None)
    beta = beta_init_max
    note = (f"MGR independent gate init clamped: -ln(sqrt(L/L_base)*(exp(-b_base)+1) - 1) undefined for "
            f"L={num_gated} (argument {g - 1:.3g} <= 0); beta_init = beta_init_max = {beta:.4g} "
            f"instead of {target:.4g}")
    return MGRInit(-math.log(1.0 / beta - 1.0), None, beta, note)


# ----------------------------------------------------------------------------------------------
# fused torch path: forward and closed-form backward of one step (merge + next pool)
# ----------------------------------------------------------------------------------------------
def _gates_from_logits(z: Tensor, forget_bias: Optional[Tensor]) -> Tensor:
    if forget_bias is None:
        return torch.sigmoid(z)
    f = forget_bias.to(z.dtype).reshape(1, 1).expand(z.shape[0], 1)
    return torch.softmax(torch.cat([f, z], dim=-1), dim=-1)[:, 1:]


def _rsqrt_mean_sq(x: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim (one pass, no temporary)."""
    c = x.shape[-1]
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square_().div_(c).add_(eps))


def _torch_step_forward(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
                        gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float):
    """streams (..., m, C), u (..., C).

    Returns ``out (..., m', C), h (..., C)`` (fresh tensors, not views) and, flattened over the leading dims,
    ``beta (T, m) | None, a (T, m'), stats`` where ``stats`` holds the per-row fp32 quantities the closed-form
    backward reuses: ``(r, q.s, r', w.s')`` (r, q.s None when accumulating), r = 1/rms."""
    lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    cd = _compute_dtype(streams)
    inv = 1.0 / math.sqrt(c)
    if gate_query is None:
        out = torch.cat([streams, u.unsqueeze(-2)], dim=-2)
        beta = r = pq = None
    else:
        s = streams.to(cd).reshape(-1, m, c)
        r = _rsqrt_mean_sq(s, eps)
        pq = s @ gate_query.to(cd)
        z = pq * r * inv + gate_bias.to(cd)
        beta = _gates_from_logits(z, forget_bias)
        full = streams.to(cd)
        out = torch.lerp(full, u.to(cd).unsqueeze(-2).expand_as(full), beta.reshape(*lead, m, 1)).to(streams.dtype)
    of = out.to(cd).reshape(-1, out.shape[-2], c)
    r2 = _rsqrt_mean_sq(of, eps)
    p2 = of @ next_query.to(cd)
    a = torch.softmax(p2 * r2 * inv, dim=-1)
    h = torch.empty((*lead, c), dtype=cd, device=streams.device)
    torch.bmm(a.unsqueeze(1), of, out=h.view(-1, 1, c))
    return out, h.to(streams.dtype), beta, a, (r, pq, r2, p2)


def _torch_step_backward(streams: Tensor, u: Optional[Tensor], beta: Optional[Tensor], a: Tensor,
                         out: Optional[Tensor], stats, next_query: Tensor, gate_query: Optional[Tensor],
                         forget_bias: Optional[Tensor], grad_out: Optional[Tensor], grad_h: Optional[Tensor],
                         eps: float):
    """Closed-form backward of :func:`_torch_step_forward` (flat shapes). ``out`` and ``stats`` may be None
    (recomputed). Returns ``(d_streams, d_u, d_gate_query, d_gate_bias, d_forget_bias, d_next_query)``.

    Pool: ``G_i = dS'_i + a_i dh + k_i (w - (w.s'_i) r'_i^2 s'_i / C)`` with ``k = a (da - sum a da) r' / sqrt(C)``,
    ``da_i = dh.s'_i``; lerp: ``dS_i = (1 - beta_i) G_i + cz_i (q - (q.s_i) r_i^2 s_i / C)``,
    ``du = sum beta_i G_i``, ``dbeta_i = G_i.(u - s_i)``, ``cz = dz r / sqrt(C)`` with dz the gate-logit grads."""
    t, m, c = streams.shape
    cd = _compute_dtype(streams)
    inv = 1.0 / math.sqrt(c)
    gated = gate_query is not None
    s = streams.to(cd)
    if out is None:
        if gated:
            out = torch.lerp(s, u.to(cd).unsqueeze(1).expand_as(s), beta.unsqueeze(-1)).to(streams.dtype)
        else:
            out = torch.cat([streams, u.unsqueeze(1)], dim=1)
    of = out.to(cd)
    r, pq, r2, p2 = stats if stats is not None else (None, None, None, None)
    # --- next pool: h = sum a_i s'_i, a = softmax(w . RMSNorm(s'_i) / sqrt(C))
    if grad_h is not None:
        dh = grad_h.to(cd)
        wq = next_query.to(cd)
        if r2 is None:
            r2 = _rsqrt_mean_sq(of, eps)
            p2 = of @ wq
        da = torch.linalg.vecdot(of, dh.unsqueeze(1))  # (batched matvecs via bmm are slow on CPU)
        coef = a * (da - (a * da).sum(-1, keepdim=True)) * r2 * inv
        left = torch.stack([a, coef], dim=-1)                              # (T, m', 2)
        right = torch.stack([dh, wq.expand_as(dh)], dim=1)                 # (T, 2, C)
        base = grad_out.to(cd) if grad_out is not None else torch.zeros_like(of)
        g = torch.baddbmm(base, left, right)
        g.addcmul_((coef * p2 * r2 * r2 / -c).unsqueeze(-1), of)
        d_next = (coef.reshape(1, -1) @ of.reshape(-1, c)).reshape(c).to(next_query.dtype)
    else:
        g = grad_out.to(cd).clone() if grad_out is not None else torch.zeros_like(of)
        d_next = torch.zeros_like(next_query)
    if not gated:
        du = g[:, m].to(u.dtype if u is not None else streams.dtype)
        return g[:, :m].to(streams.dtype), du, None, None, None, d_next
    # --- lerp + gates
    uf = u.to(cd)
    du = torch.bmm(beta.unsqueeze(1), g).squeeze(1)
    dbeta = torch.linalg.vecdot(g, uf.unsqueeze(1)) - torch.linalg.vecdot(g, s)
    if forget_bias is None:
        dz = dbeta * beta * (1.0 - beta)
        d_forget = None
    else:
        sb = (beta * dbeta).sum(-1, keepdim=True)
        dz = beta * (dbeta - sb)
        d_forget = (-(1.0 - beta.sum(-1)) * sb.squeeze(-1)).sum().to(forget_bias.dtype)
    q = gate_query.to(cd)
    if r is None:
        r = _rsqrt_mean_sq(s, eps)
        pq = s @ q
    cz = dz * r * inv
    ds = g.mul_((1.0 - beta).unsqueeze(-1))
    ds.addcmul_(cz.unsqueeze(-1), q)
    ds.addcmul_((cz * pq * r * r / -c).unsqueeze(-1), s)
    d_q = (cz.reshape(1, -1) @ s.reshape(-1, c)).reshape(c).to(gate_query.dtype)
    d_bias = dz.sum(0)
    return ds.to(streams.dtype), du.to(u.dtype), d_q, d_bias, d_forget, d_next


_KERNELS = None


def _kernels():
    """``lightning_resctl.kernels.mgr`` (imported once, eagerly by the chain, so compiled code only reads it)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = kernel_module("mgr")
    return _KERNELS


def _step_forward(backend: str, streams, u, next_query, gate_query, gate_bias, forget_bias, eps):
    if backend == "triton":
        out, h, beta, a = _kernels().mgr_step_forward_raw(streams, u, next_query, gate_query, gate_bias, forget_bias,
                                                          eps)
        t = a.numel() // a.shape[-1] if a.dim() else 1
        beta = beta.reshape(t, -1) if gate_query is not None else None
        return out, h, beta, a.reshape(t, -1), None
    return _torch_step_forward(streams, u, next_query, gate_query, gate_bias, forget_bias, eps)


def _step_backward(backend: str, streams, u, beta, a, out, stats, next_query, gate_query, gate_bias, forget_bias,
                   grad_out, grad_h, eps):
    if backend == "triton":
        return _kernels().mgr_step_backward_raw(streams, u, beta, a, next_query, gate_query, gate_bias, forget_bias,
                                                grad_out, grad_h, eps)
    return _torch_step_backward(streams, u, beta, a, out, stats, next_query, gate_query, forget_bias, grad_out,
                                grad_h, eps)


# ----------------------------------------------------------------------------------------------
# fallback inversion: chain-level state shared by the merges of one forward pass
# ----------------------------------------------------------------------------------------------
class _InvertRun:
    """State of one forward pass of a chain with inversion.

    * ``outputs[k]``: (weakref to merge k's output, detached alias, version) until merge k+1 claims it — an
      unclaimed output stays alive here (exactly as if saved) and is used by merge k's backward.
    * ``slots[k]``: merge k's output streams as reconstructed by the backward of the merge that claimed it.
    * ``gain``: per (token, stream) log of the error gain accumulated since the last exact row.
    """

    def __init__(self, top_p: float, threshold: float, max_gain: float):
        self.top_p, self.threshold, self.log_max_gain = top_p, threshold, math.log(max_gain)
        self.outputs: dict[int, tuple] = {}
        self.slots: dict[int, Tensor] = {}
        self.gain: Optional[Tensor] = None

    def claim(self, streams: Tensor) -> Optional[int]:
        for k, (ref, _, version) in list(self.outputs.items()):
            if ref() is streams and streams._version == version:
                del self.outputs[k]
                return k
        return None

    def exact_mask(self, beta: Tensor) -> Tensor:
        """Rows (token, stream) to save exactly; updates the running error gain."""
        step = -torch.log1p(-beta.clamp(max=1.0 - 1e-7))
        gain = step if self.gain is None or self.gain.shape != beta.shape else self.gain + step
        mask = (beta > self.threshold) | (gain > self.log_max_gain)
        kp = int(math.ceil(self.top_p * beta.numel())) if self.top_p > 0 else 0
        if kp > 0:
            idx = torch.topk(beta.reshape(-1), min(kp, beta.numel()), sorted=False).indices
            mask.view(-1)[idx] = True
        self.gain = gain.masked_fill(mask, 0.0)
        return mask


class _MGRStepFn(torch.autograd.Function):
    """One step (merge + next pool) with a closed-form backward; optionally with fallback inversion.

    ``cfg = (backend, eps, run, k, last)``; ``run`` is the chain's :class:`_InvertRun` or None (save the input
    streams as usual)."""

    @staticmethod
    def forward(ctx, streams, u, next_query, gate_query, gate_bias, forget_bias, cfg):
        backend, eps, run, k, last = cfg
        lead = streams.shape[:-2]
        m, c = streams.shape[-2], streams.shape[-1]
        s2 = streams.reshape(-1, m, c)
        u2 = u.reshape(-1, c)
        out, h, beta, a, stats = _step_forward(backend, streams, u, next_query, gate_query, gate_bias, forget_bias,
                                               eps)
        ctx.cfg = cfg
        ctx.shapes = (lead, m, c)
        stats = stats if stats is not None else (None, None, None, None)
        params = (next_query, gate_query, gate_bias, forget_bias)
        gated = gate_query is not None
        if run is None:
            ctx.save_for_backward(s2, u2, beta, a, *stats, *params)
            return out, h
        ctx.deliver = run.claim(streams)
        if gated:
            mask = run.exact_mask(beta)
            exact = s2[mask]
        else:
            mask = exact = None
        saved_out = out if last else None
        ctx.save_for_backward(u2 if gated else None, beta, a, mask, exact, saved_out, *stats, *params)
        if not last:
            run.outputs[k] = (weakref.ref(out), out.detach(), out._version)
        ctx.run = run
        return out, h

    @staticmethod
    def backward(ctx, grad_out, grad_h):
        backend, eps, run, k, last = ctx.cfg
        lead, m, c = ctx.shapes
        if run is None:
            s2, u2, beta, a, r, pq, r2, p2, next_query, gate_query, gate_bias, forget_bias = ctx.saved_tensors
            out2 = None
        else:
            (u2, beta, a, mask, exact, saved_out, r, pq, r2, p2,
             next_query, gate_query, gate_bias, forget_bias) = ctx.saved_tensors
            out2 = _MGRStepFn._output_streams(run, k, saved_out).reshape(-1, m + (gate_query is None), c)
            if gate_query is None:
                s2 = out2[:, :m]
                u2 = out2[:, m]
            else:
                cd = _compute_dtype(out2)
                # s = (s' - beta u) / (1 - beta) = lerp(u, s', 1 / (1 - beta)); exact rows where beta is large
                wgt = (1.0 - beta.to(cd)).clamp_min(1e-30).reciprocal_().unsqueeze(-1)
                s2 = torch.lerp(u2.to(cd).unsqueeze(1).expand_as(out2), out2.to(cd), wgt)
                s2[mask] = exact.to(cd)
                s2 = s2.to(out2.dtype)
            if ctx.deliver is not None:
                run.slots[ctx.deliver] = s2.reshape(*lead, m, c)
        if grad_out is not None:
            grad_out = grad_out.reshape(-1, grad_out.shape[-2], c)
        if grad_h is not None:
            grad_h = grad_h.reshape(-1, c)
        stats = None if r2 is None else (r, pq, r2, p2)
        ds, du, dq, db, df, dw = _step_backward(backend, s2, u2, beta, a, out2, stats, next_query, gate_query,
                                                gate_bias, forget_bias, grad_out, grad_h, eps)
        return ds.reshape(*lead, m, c), du.reshape(*lead, c), dw, dq, db, df, None

    @staticmethod
    def _output_streams(run: "_InvertRun", k: int, saved_out: Optional[Tensor]) -> Tensor:
        """Merge k's output streams in the backward: reconstructed by the merge that consumed them, or kept."""
        out = run.slots.pop(k, None)
        if out is not None:
            return out
        if saved_out is not None:
            return saved_out
        kept = run.outputs.get(k)  # never claimed by a later merge: kept like a saved tensor
        if kept is None:
            raise RuntimeError(
                f"MGR inversion: the output streams of merge {k} are not available in the backward (the merge "
                "that consumed them did not run its backward). Build the chain with invert=False for this use.")
        _, out, version = kept
        if out._version != version:
            raise RuntimeError(f"MGR inversion: the output streams of merge {k} were modified in place after the "
                               "step; build the chain with invert=False for this use.")
        return out


class _TieZeroGrad(torch.autograd.Function):
    """Identity on ``x`` that gives ``p`` an exact zero gradient (merge 0's pool sees one stream, so its
    softmax is 1 whatever its query: the true gradient is 0; this keeps the parameter 'used' for DDP)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.p_meta = (p.shape, p.dtype, p.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.p_meta
        return g, torch.zeros(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------
class MGRPool(nn.Module):
    """The chain's output AttnPool: ``y = sum_i a_i s_i``, ``a = softmax_i(pool_query . RMSNorm(s_i) / sqrt(C))``.

    ``pool_query`` (C,) is zero-initialised: at init the output is the uniform mean of the streams."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = int(dim)
        self.pool_query = nn.Parameter(torch.zeros(self.dim))

    def forward(self, streams: Tensor) -> Tensor:
        """``streams`` (..., m, C) -> pooled (..., C)."""
        return attn_pool_reference(streams, self.pool_query)[0]

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class MGRMerge(nn.Module):
    """Merge ``index`` of an MGR chain (its parameters; :class:`MGRChain` runs it).

    Parameters: ``pool_query`` (C,) — the AttnPool that builds this merge's branch input; gated merges
    (``accumulating`` False, i.e. ``index >= streams - 1``) also ``gate_query`` (C,), ``gate_bias`` (n,) and,
    for ``gating="competitive"``, ``forget_bias`` (). Queries are zero-initialised; biases come from
    :func:`mgr_bias_init`.
    """

    def __init__(self, index: int, dim: int, streams: int, gating: str = "competitive", *,
                 accumulating: bool = False, init: Optional[MGRInit] = None):
        super().__init__()
        self.index, self.dim, self.streams, self.gating = int(index), int(dim), int(streams), gating
        self.accumulating = bool(accumulating)
        self.pool_query = nn.Parameter(torch.zeros(self.dim))
        if not self.accumulating:
            init = init or MGRInit(0.0, 0.0, 0.0, None)
            self.gate_query = nn.Parameter(torch.zeros(self.dim))
            self.gate_bias = nn.Parameter(torch.full((self.streams,), float(init.gate_bias)))
            if gating == "competitive":
                self.forget_bias = nn.Parameter(torch.tensor(float(init.forget_bias or 0.0)))

    def gate_params(self):
        """``(gate_query, gate_bias, forget_bias or None)``; all None for an accumulating merge.

        ``forget_bias`` is returned 0-d. The parameter itself is 0-d as the spec lists it, or (1,) after
        :meth:`make_shardable` (FSDP2's ``fully_shard`` refuses 0-d parameters).
        """
        if self.accumulating:
            return None, None, None
        forget = getattr(self, "forget_bias", None)
        return self.gate_query, self.gate_bias, None if forget is None else forget.reshape(())

    def make_shardable(self) -> None:
        """Store a 0-d ``forget_bias`` as a (1,) parameter (same value, same name) so that FSDP2 can shard it."""
        forget = getattr(self, "forget_bias", None)
        if forget is not None and forget.dim() == 0:
            self.forget_bias = nn.Parameter(forget.detach().reshape(1), requires_grad=forget.requires_grad)

    def extra_repr(self) -> str:
        kind = "accumulating" if self.accumulating else f"gating={self.gating}"
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, {kind}"


class MGRRun:
    """One forward pass through an :class:`MGRChain` for hand-written models (see the module docstring).

    ``read()`` -> the pooled input h of the current merge (shape of x); ``write(u)`` merges the branch output
    u (shape of x) and advances; ``end()`` -> the output pool once every merge was written. ``streams`` holds
    the current stream tensor (..., min(k+1, n), C)."""

    def __init__(self, chain: "MGRChain", x: Tensor):
        self.chain = chain
        self.index = 0
        self.streams, self._h = chain.start(x)

    def read(self) -> Tensor:
        """The pooled input of merge ``index`` (after the last merge: the output pool)."""
        return self._h

    def write(self, u: Tensor) -> Tensor:
        """Merge branch output ``u`` as merge ``index``; returns the next pooled input."""
        if self.index >= self.chain.num_merges:
            raise RuntimeError(f"MGR chain used past its end: write() called after all {self.chain.num_merges} "
                               "merges; call end()")
        self.streams, self._h = self.chain.step(self.index, self.streams, u)
        self.index += 1
        return self._h

    def end(self) -> Tensor:
        """The chain's output (output AttnPool of the final streams), shape of x."""
        if self.index != self.chain.num_merges:
            raise RuntimeError(f"MGR chain ended early: end() after {self.index} of {self.chain.num_merges} merges")
        return self._h


class MGRChain(nn.Module):
    """A Multi-Gate-Residual chain of ``num_merges`` merges over ``streams`` (n >= 2) streams of width ``dim``.

    Args:
        dim: feature width C (streams are (..., n, C), features last).
        num_merges: merges in the chain; the first ``streams - 1`` accumulate, the rest are gated
            (``num_gated`` = L of the depth-aware init).
        streams: n >= 2.
        gating: ``"competitive"`` (softmax with a forget logit; gates sum to < 1) or ``"independent"``.
        invert: fallback inversion in the backward: True, False or ``"auto"`` (fp32/fp64 eager only).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"``.
        b_base, l_base, beta_init_max: the depth-aware init (see :func:`mgr_bias_init`).
        invert_top_p, invert_threshold, invert_max_gain: which rows the inversion saves exactly.
        eps: RMSNorm epsilon.

    Runtime: ``start(x) -> (streams, h0)``; ``step(k, streams, u) -> (streams', h_next)``; ``begin(x)`` ->
    :class:`MGRRun`; ``forward(x, branches)`` runs the whole chain with a sequence of branch callables.
    """

    def __init__(self, dim: int, num_merges: int, streams: int = 4, gating: str = "competitive", invert="auto",
                 backend: str = "auto", *, b_base: float = B_BASE, l_base: int = L_BASE, beta_init_max: float = 0.5,
                 invert_top_p: float = 0.05, invert_threshold: float = 0.5, invert_max_gain: float = 8.0,
                 eps: float = RMS_EPS):
        super().__init__()
        if not isinstance(streams, int) or isinstance(streams, bool) or streams < 2:
            raise ValueError(f"streams must be an int >= 2, got {streams!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(num_merges, int) or num_merges < 1:
            raise ValueError(f"num_merges must be a positive int, got {num_merges!r}")
        if gating not in GATINGS:
            raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")
        if invert not in (True, False, "auto"):
            raise ValueError(f"invert must be True, False or 'auto', got {invert!r}")
        if not 0.0 <= invert_top_p <= 1.0:
            raise ValueError(f"invert_top_p must be in [0, 1], got {invert_top_p!r}")
        if not 0.0 < invert_threshold <= 1.0:
            raise ValueError(f"invert_threshold must be in (0, 1], got {invert_threshold!r}")
        if not invert_max_gain > 1.0:
            raise ValueError(f"invert_max_gain must be > 1, got {invert_max_gain!r}")
        self.set_backend(backend)
        self.dim, self.num_merges, self.streams, self.gating = dim, num_merges, streams, gating
        self.invert = invert
        self.invert_top_p, self.invert_threshold, self.invert_max_gain = invert_top_p, invert_threshold, invert_max_gain
        self.eps = float(eps)
        self.num_gated = max(num_merges - (streams - 1), 0)
        self.init = mgr_bias_init(self.num_gated, streams, gating, b_base, l_base, beta_init_max)
        self.init_note: Optional[str] = self.init.note
        self.b_base, self.l_base, self.beta_init_max = b_base, l_base, beta_init_max
        self.merges = nn.ModuleList(
            MGRMerge(k, dim, streams, gating, accumulating=k < streams - 1, init=self.init) for k in range(num_merges))
        self.output_pool = MGRPool(dim)
        self._run_ref: Optional[weakref.ref] = None
        self._run_keep: Optional[_InvertRun] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_run_ref"] = None  # per-forward inversion state is not part of the module
        state["_run_keep"] = None
        return state

    # ---- configuration
    def set_backend(self, name: str) -> None:
        """Choose ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"``."""
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
        if name == "triton" and not triton_available():
            raise RuntimeError("backend='triton' needs a CUDA device or TRITON_INTERPRET=1")
        if name == "triton" or (name == "auto" and torch.cuda.is_available() and triton_available()):
            _kernels()  # import (and register the ops) outside any torch.compile trace
        self.backend = name

    def resolved_backend(self, tensor: Optional[Tensor] = None) -> str:
        """The backend used for ``tensor``: "auto" -> "triton" on CUDA when Triton is available (n <= 8),
        else "torch"."""
        if self.backend != "auto":
            return self.backend
        if tensor is not None and tensor.is_cuda and self.streams <= 8 and triton_runs_on(tensor):
            return "triton"  # the fused kernel holds up to 8 streams
        return "torch"

    def inverts(self, tensor: Tensor) -> bool:
        """True when a step on ``tensor`` uses the fallback inversion: not with ``invert=False``, without grad
        mode, under ``torch.compile``, on the reference backend, inside a backward pass (checkpoint
        recomputation) or while other saved-tensor hooks are active (activation checkpointing, offloading:
        they decide what is kept); ``invert="auto"`` also needs fp32/fp64 streams."""
        if self.invert is False or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if self.resolved_backend(tensor) == "reference" or torch._C._current_graph_task_id() != -1:
            return False
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is not None and not getattr(hooks[0], "_mgr_transparent", False):
            return False
        if self.invert == "auto":
            return tensor.dtype in (torch.float32, torch.float64)
        return True

    def next_query(self, k: int) -> Tensor:
        """The pool query read after merge k: merge k+1's ``pool_query``, or the output pool's after the last."""
        return self.merges[k + 1].pool_query if k + 1 < self.num_merges else self.output_pool.pool_query

    def stream_count(self, k: int) -> int:
        """Streams entering merge k: ``min(k + 1, n)`` (k == num_merges: streams after the chain)."""
        return min(k + 1, self.streams)

    # ---- checks
    def _check_index(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"merge index k must be an int, got {type(k).__name__}")
        if not 0 <= k < self.num_merges:
            past = " (the chain is used past its end)" if k >= self.num_merges else ""
            raise IndexError(f"merge index k={k} out of range for a chain of {self.num_merges} merges: "
                             f"valid 0..{self.num_merges - 1}{past}")
        return k

    def _check_streams(self, k: int, streams: Tensor, name: str = "streams") -> None:
        if not isinstance(streams, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(streams).__name__}")
        want = self.stream_count(k)
        if streams.dim() < 2 or streams.shape[-1] != self.dim or streams.shape[-2] != want:
            raise ValueError(f"{name} entering merge {k} must have shape (..., {want}, {self.dim}) "
                             f"(min(k+1, n) streams, features last), got {tuple(streams.shape)}")
        if not streams.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {streams.dtype}")

    def _check_update(self, streams: Tensor, u: Tensor) -> None:
        """u: same leading dims, C, dtype (cast under autocast) and device as the streams."""
        if not isinstance(u, Tensor):
            raise TypeError(f"u must be a Tensor, got {type(u).__name__}")
        want = tuple(streams.shape[:-2]) + (self.dim,)
        if tuple(u.shape) != want:
            raise ValueError(f"u must have shape {want} (the streams' leading dims and C), got {tuple(u.shape)}")
        if u.dtype != streams.dtype:
            raise TypeError(f"u dtype {u.dtype} does not match the streams dtype {streams.dtype}")
        if u.device != streams.device:
            raise ValueError(f"u is on {u.device}, the streams on {streams.device}")

    # ---- runtime
    def start(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Begin a chain: ``streams = x[..., None, :]`` (one stream), ``h0 = x`` (merge 0's pool of one stream)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (..., {self.dim}) (features last), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be floating point, got {x.dtype}")
        if self.inverts(x):
            run = _InvertRun(self.invert_top_p, self.invert_threshold, self.invert_max_gain)
            self._run_ref = weakref.ref(run)
            self._run_keep = run  # held until the first step hands it to the graph
        return x.unsqueeze(-2), x

    def _current_run(self, streams: Tensor) -> Optional[_InvertRun]:
        if not self.inverts(streams):
            return None
        run = self._run_ref() if self._run_ref is not None else None
        if run is None:  # a chain driven without start() (or after the graph was freed): begin a new run
            run = _InvertRun(self.invert_top_p, self.invert_threshold, self.invert_max_gain)
            self._run_ref = weakref.ref(run)
        return run

    def step(self, k: int, streams: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """Merge k: append ``u`` (k < n-1) or gate + lerp it into the streams, then the pool of merge k+1
        (the output pool after the last merge). Returns ``(streams', h_next)``; fused on the Triton path."""
        k = self._check_index(k)
        self._check_streams(k, streams)
        if (isinstance(u, Tensor) and u.dtype != streams.dtype and u.is_floating_point()
                and torch.is_autocast_enabled(streams.device.type)):
            u = u.to(streams.dtype)  # under autocast a branch returns low precision; the streams keep theirs
        self._check_update(streams, u)
        merge = self.merges[k]
        wq = self.next_query(k)
        gq, gb, fb = merge.gate_params()
        backend = self.resolved_backend(streams)
        if k == 0 and torch.is_grad_enabled() and merge.pool_query.requires_grad:
            u = _TieZeroGrad.apply(u, merge.pool_query)
        if backend == "reference":
            return mgr_step_reference(streams, u, wq, gq, gb, fb, self.gating, self.eps)
        run = self._current_run(streams)
        if run is not None:
            self._run_keep = None
        if run is None and backend == "triton":
            out, h, _, _ = _kernels().mgr_step(streams, u, wq, gq, gb, fb, self.eps)
            return out, h
        cfg = (backend, self.eps, run, k, k == self.num_merges - 1)
        return _MGRStepFn.apply(streams, u, wq, gq, gb, fb, cfg)

    def skip(self, k: int, streams: Tensor) -> tuple[Tensor, Tensor]:
        """Ablation of merge k's branch: gated merges leave the streams unchanged; accumulating merges append a
        zero stream (keeping the stream count). Returns ``(streams', h_next)`` with the next pool applied."""
        k = self._check_index(k)
        self._check_streams(k, streams)
        if self.merges[k].accumulating:
            streams = torch.cat([streams, torch.zeros_like(streams[..., :1, :])], dim=-2)
        h, _ = attn_pool_reference(streams, self.next_query(k), self.eps)
        return streams, h

    def begin(self, x: Tensor) -> MGRRun:
        """Start a hand-driven pass: ``run = chain.begin(x)``; then ``run.read()`` / ``run.write(u)`` per merge
        and ``y = run.end()``."""
        return MGRRun(self, x)

    def forward(self, x: Tensor, branches: Sequence[Callable[[Tensor], Tensor]]) -> Tensor:
        """Run the whole chain: merge k's branch is ``branches[k]`` (called on the pooled input)."""
        if len(branches) != self.num_merges:
            raise ValueError(f"branches must hold num_merges={self.num_merges} callables, got {len(branches)}")
        run = self.begin(x)
        for f in branches:
            run.write(f(run.read()))
        return run.end()

    # ---- diagnostics (torch, no grad needed)
    def gate_values(self, k: int, streams: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """Gates of merge k on the streams entering it: ``(beta (..., n) fp32, forget (...) or None)``.

        Raises ValueError for an accumulating merge (k < n-1), which has no gates."""
        k = self._check_index(k)
        self._check_streams(k, streams)
        merge = self.merges[k]
        if merge.accumulating:
            raise ValueError(f"merge k={k} is an accumulating merge (k < streams-1 = {self.streams - 1}) and has no "
                             "gates; check MGRMerge.accumulating")
        gq, gb, fb = merge.gate_params()
        return mgr_gates_reference(streams, gq, gb, fb, self.gating, self.eps)

    def pool_weights(self, k: int, streams: Tensor) -> Tensor:
        """Softmax weights ``a (..., min(k+1, n))`` of merge k's AttnPool on the streams entering merge k
        (``k == num_merges``: the output pool on the final streams)."""
        if k == self.num_merges:
            self._check_streams(k, streams)
            return attn_pool_reference(streams, self.output_pool.pool_query, self.eps)[1]
        k = self._check_index(k)
        self._check_streams(k, streams)
        return attn_pool_reference(streams, self.merges[k].pool_query, self.eps)[1]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_merges={self.num_merges}, streams={self.streams}, gating={self.gating}, "
                f"num_gated={self.num_gated}, invert={self.invert}, backend={self.backend}")
