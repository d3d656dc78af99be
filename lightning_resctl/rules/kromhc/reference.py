"""``kromhc`` (KromHC, Zhou, Gu, Iacovides, Mandic; arXiv 2601.21579; official code wz1119/KromHC ``KromHC``):
mHC with ``H_res`` a Kronecker product of doubly stochastic 2x2 factors (docs/rules/kromhc.md).

Per token, layer j, streams ``S_j (n, C)``, n = 2^K (:func:`kromhc_coefficients_reference` is the oracle)::

    xf   = flatten(S_j)                                         (n*C,)
    N    = xf / sqrt(mean(xf^2) + eps) * (1 + gain_j)           RMSNorm over n*C, gain zero-init
    m    = N @ W_j                                              (2n + 2K,) = [pre | post | res]
    pre  = sigmoid(a_pre m[:n] + b[:n]);   post = 2 sigmoid(a_post m[n:2n] + b[n:2n])
    a_k  = softmax(a_res m[2n+2k : 2n+2k+2] + b[2n+2k : 2n+2k+2])        k = 0 .. K-1, one a_res for all factors
    U_k  = [[p_k, 1 - p_k], [1 - p_k, p_k]],  p_k = a_k[0]               (identity vs swap)
    res  = U_0 kron U_1 kron ... kron U_{K-1}                            U_0 the most significant index

then the common frame ``h_j = sum_s pre[s] S_j[s]``, ``S_{j+1}[t] = sum_s res[t, s] S_j[s] + post[t] u_j``. ``res``
is doubly stochastic by construction (a Kronecker product of doubly stochastic matrices) and symmetric, so the
official code's transpose (``out_t = sum_s H[s, t] S_s``) is the same matrix. Parameters of site j: ``kromhc_proj
(n*C, 2n+2K)`` = [W_pre | W_post | W_res] (official ``dynamic_alpha_fn`` = [W_pre | W_res], ``dynamic_beta_fn`` =
W_post), ``kromhc_bias (2n+2K,)`` = [b_pre | b_post | b_res] (official ``static_alpha`` = [b_pre | b_res],
``static_beta`` = b_post), ``kromhc_alpha (3,)`` = [a_pre, a_post, a_res] (``pre_branch_scale``, ``h_post_scale``,
``residual_scale``), ``kromhc_norm_gain (n*C,)`` (``norm.gamma``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import compute_dtype
from ..frame import gated_pre_post
from .config import KromHCConfig

__all__ = ["kronecker_factors", "kronecker_product", "kromhc_coefficients_reference"]


def kronecker_factors(logits: Tensor) -> Tensor:
    """The 2x2 factors ``(..., K, 2, 2)`` from their logits ``(..., 2K)``: ``p_k = softmax(pair k)[0]``,
    ``U_k = [[p, 1-p], [1-p, p]]``."""
    p = torch.softmax(logits.unflatten(-1, (-1, 2)), dim=-1)[..., 0]
    q = 1 - p
    return torch.stack([torch.stack([p, q], -1), torch.stack([q, p], -1)], -2)


def kronecker_product(factors: Tensor) -> Tensor:
    """``U_0 kron U_1 kron ... kron U_{K-1}`` ``(..., 2^K, 2^K)`` of ``factors (..., K, 2, 2)``."""
    res = factors[..., 0, :, :]
    for k in range(1, factors.shape[-3]):
        u = factors[..., k, :, :]
        res = (res[..., :, None, :, None] * u[..., None, :, None, :]).flatten(-4, -3).flatten(-2, -1)
    return res


def kromhc_coefficients_reference(streams: Tensor, proj: Tensor, bias: Tensor, alpha: Tensor, gain: Tensor,
                                  eps: float = KromHCConfig.eps, with_factors: bool = False):
    """KromHC coefficients of one layer (the formula in the module docstring). Returns ``(pre (..., n), res
    (..., n, n), post (..., n))`` in fp32 (fp64 for fp64 streams); ``with_factors``: and the factors
    ``(..., K, 2, 2)``."""
    cd = compute_dtype(streams)
    n = streams.shape[-2]
    xf = streams.to(cd).flatten(-2)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (1 + gain.to(cd))
    pre, post, logits = gated_pre_post(fp32_matmul(normed, proj.to(cd)), alpha, bias, n)
    factors = kronecker_factors(logits)
    res = kronecker_product(factors)
    return (pre, res, post, factors) if with_factors else (pre, res, post)
