"""MGR reference math: the torch oracle every other path (fused torch ops, Triton kernels, inversion) is
tested against, and the depth-aware gate-bias initialisation.

Formulas (per token; streams ``S`` have layout ``(..., n, C)``, the n streams of a token contiguous;
``RMSNorm(x) = x / sqrt(mean(x^2) + 1e-6)`` over C, no parameters; all of it in fp32 — fp64 stays fp64 —
also under ``torch.autocast``)::

    AttnPool     a_i = softmax_i( w . RMSNorm(s_i) / sqrt(C) ),     h = sum_i a_i s_i
    branch       u   = F(h)                                         (the user's sub-layer)
    gates        z_i = q . RMSNorm(s_i) / sqrt(C)
                 independent: beta_i = sigmoid(z_i + b_i)
                 competitive: beta   = softmax([f, z_1 + c_1, ..., z_n + c_n])[1:]
    lerp         s'_i = (1 - beta_i) s_i + beta_i u

    depth-aware init (L gated merges):  g = sqrt(L / l_base) * (exp(-b_base) + 1)
                 competitive f = ln(g - n), c_i = 0;   independent b_i = -ln(g - 1)
                 (every gate then starts at beta = sigmoid(b_base) * sqrt(l_base / L))
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import RMS_EPS, compute_dtype, rms_norm
from .config import MGRConfig

__all__ = ["L_BASE", "B_BASE", "MGRInit", "mgr_bias_init", "attn_pool_reference", "mgr_gates_reference",
           "mgr_merge_reference", "mgr_step_reference"]

#: the depth-aware init's reference depth and base logit (the paper's GPT-2-small setting; MGRConfig's defaults)
L_BASE = MGRConfig.l_base
B_BASE = MGRConfig.b_base


def attn_pool_reference(streams: Tensor, query: Tensor, eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
    """AttnPool ``a_i = softmax_i(query . RMSNorm(s_i) / sqrt(C))``, ``h = sum_i a_i s_i``.

    ``streams`` (..., m, C), ``query`` (C,). Returns ``(h (..., C) in the streams' dtype, a (..., m) fp32)``.
    """
    cd = compute_dtype(streams)
    c = streams.shape[-1]
    a = torch.softmax(fp32_matmul(rms_norm(streams, eps), query.to(cd)) / math.sqrt(c), dim=-1)
    h = (a.unsqueeze(-1) * streams.to(cd)).sum(-2)
    return h.to(streams.dtype), a


def mgr_gates_reference(streams: Tensor, gate_query: Tensor, gate_bias: Tensor, forget_bias: Optional[Tensor] = None,
                        gating: str = MGRConfig.gating, eps: float = RMS_EPS) -> tuple[Tensor, Optional[Tensor]]:
    """Gates of one merge: ``z_i = q . RMSNorm(s_i) / sqrt(C)``;
    independent ``beta_i = sigmoid(z_i + b_i)``; competitive ``softmax([f, z_i + c_i])``.

    Returns ``(beta (..., n), forget (...) or None)`` in fp32 (the forget gate ``1 - sum beta`` for
    competitive gating).
    """
    cd = compute_dtype(streams)
    c = streams.shape[-1]
    z = fp32_matmul(rms_norm(streams, eps), gate_query.to(cd)) / math.sqrt(c) + gate_bias.to(cd)
    if gating == "independent":
        return torch.sigmoid(z), None
    f = forget_bias.to(cd).expand(z.shape[:-1]).unsqueeze(-1)
    p = torch.softmax(torch.cat([f, z], dim=-1), dim=-1)
    return p[..., 1:], p[..., 0]


def mgr_merge_reference(streams: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                        forget_bias: Optional[Tensor] = None, gating: str = MGRConfig.gating,
                        eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
    """One gated merge ``s'_i = (1 - beta_i) s_i + beta_i u`` (fp32 math). Returns ``(streams', beta)``."""
    beta, _ = mgr_gates_reference(streams, gate_query, gate_bias, forget_bias, gating, eps)
    cd = beta.dtype
    s = streams.to(cd)
    out = s + beta.unsqueeze(-1) * (u.to(cd).unsqueeze(-2) - s)
    return out.to(streams.dtype), beta


def mgr_step_reference(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor] = None,
                       gate_bias: Optional[Tensor] = None, forget_bias: Optional[Tensor] = None,
                       gating: str = MGRConfig.gating, eps: float = RMS_EPS) -> tuple[Tensor, Tensor]:
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


def mgr_bias_init(num_gated: int, streams: int, gating: str = MGRConfig.gating, b_base: float = B_BASE,
                  l_base: int = L_BASE, beta_init_max: float = MGRConfig.beta_init_max) -> MGRInit:
    """Depth-aware gate-bias init so that every gate starts at ``beta = sigmoid(b_base) * sqrt(l_base / L)``.

    With ``g = sqrt(L / l_base) * (exp(-b_base) + 1)`` (L = ``num_gated``):
    competitive ``f = ln(g - n)``, ``c_i = 0``; independent ``b_i = -ln(g - 1)``.
    When the log's argument is <= 0 (very shallow chains) ``beta_init`` is clamped to ``beta_init_max``
    (independent) or ``beta_init_max / n`` (competitive: the streams then take ``beta_init_max`` in total)
    and ``note`` says so.
    """
    n = int(streams)
    MGRConfig(gating=gating, beta_init_max=beta_init_max).validate()
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

