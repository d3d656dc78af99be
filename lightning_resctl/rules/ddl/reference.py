"""``ddl``: Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417), the scalar-value form (d_v = 1),
docs/rules/ddl.md: the formula and its torch oracle.

Per token, each merge (attention and MLP alike): ``x`` the stream, ``h`` the update (the sub-layer's output)::

    c    = RMSNorm(x) = x / sqrt(mean(x^2) + eps)            the normed stream (the block's pre-norm, without its gain)
    k    = h / sqrt(|h|^2 + eps_k^2)                         the direction of the update (unit norm up to eps_k)
    beta = 2 sigmoid(w_beta . c + b_beta)                    a gate in (0, 2)
    v    = w_v . c                                           value="paper" (§3, App. A.1)
    v    = value_scale * sigmoid(w_v . x + b_v)              value="code" (official: on the raw stream, scale 4)
    x'   = x + beta (v - k . x) k  =  (I - beta k k^T) x + beta v k

Only the update's direction is used: the write along k replaces the readout ``k . x`` by v (beta = 1), keeps it
(beta -> 0) or reflects it (beta -> 2). Init (official ``init_utils``): ``w_beta``, ``w_v`` ~ N(0, (0.5/sqrt(C))^2),
``b_beta = logit(beta_0 / 2)`` (beta_0 = 1: b = 0), ``b_v`` ~ U(+-1/sqrt(C)). No init gives ``x + h``: ``ddl`` is
not the plain residual at step 0. All in fp32 (fp64 stays fp64), the result in the stream's dtype. The block's own
RMSNorm gain g would only re-parametrise the gate (``w_beta . (g c) = (g w_beta) . c``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import compute_dtype, rms_norm
from .config import DDLConfig

__all__ = ["ddl_reference", "beta_bias_init"]


def beta_bias_init(beta_init: float = DDLConfig.beta_init) -> float:
    """``logit(beta_0 / 2)``, the probability clamped to [1e-6, 1 - 1e-6] (official ``_logit``)."""
    p = min(max(beta_init / 2.0, 1e-6), 1.0 - 1e-6)
    return math.log(p) - math.log(1.0 - p)


def ddl_reference(x: Tensor, h: Tensor, beta_weight: Tensor, beta_bias: Tensor, value_weight: Tensor,
                  value_bias: Optional[Tensor] = None, value: str = DDLConfig.value,
                  value_scale: float = DDLConfig.value_scale, k_eps: float = DDLConfig.k_eps,
                  eps: float = DDLConfig.eps, parts: bool = False):
    """One DDL merge (the formula in the module docstring). ``x``, ``h`` ``(..., C)``; ``beta_weight``,
    ``value_weight`` ``(C,)``; ``beta_bias``, ``value_bias`` ``(1,)``. Returns ``x'`` in ``x``'s dtype; ``parts``:
    ``(x', beta, k . x, v)`` (the last three ``(..., 1)`` in the compute dtype)."""
    cd = compute_dtype(x, h)
    xs, hs = x.to(cd), h.to(cd)
    c = rms_norm(xs, eps)
    k = hs * torch.rsqrt(hs.square().sum(-1, keepdim=True) + k_eps * k_eps)
    beta = 2 * torch.sigmoid(fp32_matmul(c, beta_weight.to(cd)).unsqueeze(-1) + beta_bias.to(cd))
    if value == "code":
        v = value_scale * torch.sigmoid(fp32_matmul(xs, value_weight.to(cd)).unsqueeze(-1) + value_bias.to(cd))
    else:
        v = fp32_matmul(c, value_weight.to(cd)).unsqueeze(-1)
    proj = (k * xs).sum(-1, keepdim=True)
    out = (xs + beta * (v - proj) * k).to(x.dtype)
    return (out, beta, proj, v) if parts else out
