"""``mhc-lite`` (Yang & Gao 2601.05732; official code FFTYYY/mhc-lite ``MHCLite``): mHC with the Sinkhorn
projection replaced by an exact convex combination of the n! permutation matrices (docs/rules/mhc_lite.md).

Per token, layer j, streams ``S_j (n, C)`` (:func:`mhc_lite_coefficients_reference` is the oracle)::

    xf   = flatten(S_j)                                         (n*C,)
    N    = xf / sqrt(mean(xf^2) + eps) * (1 + gain_j)           RMSNorm over n*C, gain zero-init
    m    = N @ Phi_j                                            (2n + n!,) = [pre | post | res]
    pre  = sigmoid(a_pre m[:n] + b[:n]);   post = 2 sigmoid(a_post m[n:2n] + b[n:2n])
    a    = softmax(a_res m[2n:] + b[2n:])                       weights over the n! permutations
    res  = sum_k a_k P_k,   P_k[t, pi_k(t)] = 1,  pi_k = k-th permutation in lexicographic order (k = 0: I)

then the common frame ``h_j = sum_s pre[s] S_j[s]``, ``S_{j+1}[t] = sum_s res[t, s] S_j[s] + post[t] u_j``.
``res`` is doubly stochastic by construction (no iteration). Parameters of site j: ``mhcl_phi (n*C, 2n+n!)``,
``mhcl_bias (2n+n!,)``, ``mhcl_alpha (3,)``, ``mhcl_norm_gain (n*C,)``; the P_k are a non-persistent buffer.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import compute_dtype
from ..frame import gated_pre_post
from .config import MHCLiteConfig

__all__ = ["permutation_matrices", "mhc_lite_coefficients_reference"]


def permutation_matrices(n: int, dtype=torch.float32, device=None) -> Tensor:
    """``(n!, n, n)``: ``P_k[t, pi_k(t)] = 1`` for the permutations of range(n) in ``itertools.permutations`` order."""
    perms = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long, device=device)
    p = torch.zeros(perms.shape[0], n, n, dtype=dtype, device=device)
    p.scatter_(-1, perms.unsqueeze(-1), 1.0)
    return p


def mhc_lite_coefficients_reference(streams: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, gain: Tensor,
                                    perms: Tensor, eps: float = MHCLiteConfig.eps):
    """mHC-lite coefficients of one layer (the formula in the module docstring). ``perms`` (n!, n, n).
    Returns ``(pre (..., n), res (..., n, n), post (..., n))`` in fp32 (fp64 for fp64 streams)."""
    cd = compute_dtype(streams)
    n = streams.shape[-2]
    xf = streams.to(cd).flatten(-2)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (1 + gain.to(cd))
    pre, post, logits = gated_pre_post(fp32_matmul(normed, phi.to(cd)), alpha, bias, n)
    w = torch.softmax(logits, dim=-1)
    res = fp32_matmul(w, perms.to(cd).flatten(-2)).unflatten(-1, (n, n))
    return pre, res, post
