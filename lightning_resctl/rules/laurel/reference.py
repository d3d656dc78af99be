"""``laurel`` and ``laurel-pa``: LAuReL, the Learned Augmented Residual Layer (Menghani, Kumar, Kumar; ICML 2025,
arXiv 2411.07501), docs/rules/laurel.md: the formula and its torch oracles.

Per token, merge i: ``x_i`` the stream entering it, ``u_i = f(x_i)`` the update (P Eq. 2:
``x_{i+1} = alpha f(x_i) + g(x_i, x_{i-1}, ..)``)::

    x_{i+1} = alpha u_i + beta (x_i + L_i)                                             (every variant)
    RW:  (alpha, beta) = (2 sigmoid(a), 2 sigmoid(b))  or  softmax(a, b)  ("rw_norm"; without RW: 1, 1)
         a, b scalars, or per channel (rw_per_dim)
    LR:  L_i = B A x_i                              A (r, C) down, B (C, r) up: W = BA + I (Eq. 3, 5)
    PA:  L_i = sum_{j=0}^{k-1} gamma_{i,j} h_{i,j}(x_{i-j})              (Eq. 4, 6; terms before x_0 dropped)
         h_{i,j} = B_j A_j (a low-rank pair per j, with LR: Eq. 6) or the identity (PA alone)
    lr_norm (Gemma 3n's deployed block): each low-rank term ``B A x`` through RMSNorm with a learned weight

Init: RW a = b = 0; B = 0 and A column-orthogonal (``A[j, i] = 1/sqrt(rC)`` where ``i mod r = j``, the paper's LLM
runs; Xavier: its ResNet runs); gamma = 0 for the identity h, 1 for low-rank h (B = 0 already zeroes the term, and
gamma = 0 with B = 0 would leave both without a gradient). With ``rw_norm="sigmoid"`` every variant is the plain
residual ``x + u`` at init, exactly; ``"softmax"`` gives ``(x + u) / 2``. The explicit ``x_i`` term is the paper's
``W = BA + I`` of LR; for the identity h it is gamma_{i,0} shifted by 1 (the paper's PA sum with gamma_{i,0} = 1).
All in fp32 (fp64 stays fp64), the result in the stream's dtype.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import compute_dtype
from .config import LaurelConfig

__all__ = ["rw_weights_reference", "low_rank_reference", "laurel_reference", "orthogonal_down_init"]


def rw_weights_reference(rw: Tensor, rw_norm: str = LaurelConfig.rw_norm) -> tuple[Tensor, Tensor]:
    """``(alpha, beta)`` from the logits ``rw (2,)`` or ``(2, C)``: ``2 sigmoid`` each, or a softmax over the two."""
    if rw_norm == "softmax":
        w = torch.softmax(rw, dim=0)
        return w[0], w[1]
    return 2 * torch.sigmoid(rw[0]), 2 * torch.sigmoid(rw[1])


def low_rank_reference(x: Tensor, down: Tensor, up: Tensor, norm_weight: Optional[Tensor] = None,
                       eps: float = LaurelConfig.eps) -> Tensor:
    """``B A x`` (``down`` A ``(r, C)``, ``up`` B ``(C, r)``), through ``RMSNorm(.) * norm_weight`` when given
    (Gemma 3n's ``post_laurel_norm``), in ``x``'s dtype."""
    y = fp32_matmul(fp32_matmul(x, down.to(x.dtype).mT), up.to(x.dtype).mT)
    if norm_weight is not None:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * norm_weight.to(x.dtype)
    return y


def laurel_reference(x: Tensor, u: Tensor, *, rw: Optional[Tensor] = None, rw_norm: str = LaurelConfig.rw_norm,
                     down: Optional[Tensor] = None, up: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
                     gamma: Optional[Tensor] = None, earlier: Sequence[Tensor] = (),
                     eps: float = LaurelConfig.eps) -> Tensor:
    """One LAuReL merge (the formula in the module docstring). ``x``, ``u`` ``(..., C)``; ``rw`` ``(2,)`` / ``(2, C)``
    (None: no RW); ``down (P, r, C)``, ``up (P, C, r)``, ``norm_weight (P, C)`` the low-rank pairs (None: no LR);
    ``gamma (k,)`` (None: no PA) with ``earlier`` = ``(x_{i-1}, .., x_{i-k+1})`` (as many as exist). Returns
    ``x_{i+1}`` in ``x``'s dtype."""
    cd = compute_dtype(x, u)
    xs = x.to(cd)

    def term(j, v):
        if down is None:
            return v
        return low_rank_reference(v, down[j], up[j], None if norm_weight is None else norm_weight[j], eps)

    g = xs
    if gamma is None:
        if down is not None:
            g = g + term(0, xs)
    else:
        for j, v in enumerate([xs, *(h.to(cd) for h in earlier)][:gamma.shape[0]]):
            g = g + gamma[j].to(cd) * term(j, v)
    if rw is None:
        out = u.to(cd) + g
    else:
        alpha, beta = rw_weights_reference(rw.to(cd), rw_norm)
        out = alpha * u.to(cd) + beta * g
    return out.to(x.dtype)


def orthogonal_down_init(rank: int, width: int, dtype=torch.float32, device=None) -> Tensor:
    """The paper's column-orthogonal A (footnote 2) as the down-projection ``(r, C)``: ``1/sqrt(rC)`` at
    ``[i mod r, i]``, 0 elsewhere."""
    a = torch.zeros(rank, width, dtype=dtype, device=device)
    i = torch.arange(width, device=device)
    a[i % rank, i] = 1.0 / math.sqrt(rank * width)
    return a
