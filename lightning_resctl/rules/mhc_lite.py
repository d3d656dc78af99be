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
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..runtime.autograd import fp32_matmul
from ._common import FrameRule, compute_dtype, gated_pre_post
from .base import check_choice
from .hc import INITS, _pm_one

__all__ = ["MHCLiteConfig", "MHCLiteRule", "MHCLiteLayer", "permutation_matrices", "mhc_lite_coefficients_reference",
           "MAX_STREAMS"]

MAX_STREAMS = 6


def permutation_matrices(n: int, dtype=torch.float32, device=None) -> Tensor:
    """``(n!, n, n)``: ``P_k[t, pi_k(t)] = 1`` for the permutations of range(n) in ``itertools.permutations`` order."""
    perms = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long, device=device)
    p = torch.zeros(perms.shape[0], n, n, dtype=dtype, device=device)
    p.scatter_(-1, perms.unsqueeze(-1), 1.0)
    return p


def mhc_lite_coefficients_reference(streams: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, gain: Tensor,
                                    perms: Tensor, eps: float = 1e-6):
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


class MHCLiteLayer(nn.Module):
    """Layer ``index``'s mHC-lite parameters. Init (official code): ``mhcl_phi = 0``, ``mhcl_alpha = 0.01``
    each, ``mhcl_norm_gain = 0``; ``mhcl_bias``: b_pre = +1 at stream ``index mod n``, -1 elsewhere; b_post the
    same (``init="residual"``: 0); b_res = 0 for the identity permutation, -8 for the others."""

    def __init__(self, index: int, dim: int, streams: int, init: str = "paper", eps: float = 1e-6):
        super().__init__()
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in [1, {MAX_STREAMS}] for mHC-lite (n! permutations), got {streams!r}")
        self.index, self.dim, self.streams, self.init, self.eps = int(index), int(dim), int(streams), init, float(eps)
        n = self.streams
        nf = math.factorial(n)
        self.mhcl_phi = nn.Parameter(torch.empty(n * dim, 2 * n + nf))
        self.mhcl_bias = nn.Parameter(torch.empty(2 * n + nf))
        self.mhcl_alpha = nn.Parameter(torch.empty(3))
        self.mhcl_norm_gain = nn.Parameter(torch.empty(n * dim))
        self.register_buffer("perms", permutation_matrices(n), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.streams
        self.mhcl_phi.zero_()
        self.mhcl_alpha.fill_(0.01)
        self.mhcl_norm_gain.zero_()
        b = self.mhcl_bias
        b[:n].copy_(_pm_one(n, self.index, b))
        b[n:2 * n].copy_(_pm_one(n, self.index, b) if self.init == "paper" else torch.zeros_like(b[:n]))
        b[2 * n:].fill_(-8.0)
        b[2 * n] = 0.0
        self.perms.copy_(permutation_matrices(n, self.perms.dtype, self.perms.device))

    def coefficients(self, streams: Tensor):
        return mhc_lite_coefficients_reference(streams, self.mhcl_phi, self.mhcl_bias, self.mhcl_alpha,
                                               self.mhcl_norm_gain, self.perms, self.eps)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, init={self.init!r}"


@dataclass
class MHCLiteConfig:
    """Options of ``mhc-lite`` (docs/rules/mhc_lite.md).

    streams: 1 <= n <= 6 streams per token (n! permutations; official: 4).
    init: ``"paper"`` (official biases) or ``"residual"`` (b_post = 0: post = 1, exact residual at init).
    reduce: ``"sum"`` (official) or ``"mean"``.
    eps: RMSNorm epsilon over n*C (>= 0).
    """

    streams: int = 4
    init: str = "paper"
    reduce: str = "sum"
    eps: float = 1e-6


class MHCLiteRule(FrameRule):
    Config = MHCLiteConfig
    description = "mHC-lite: mHC with res an exact convex combination of the n! permutation matrices"
    identity_at_init = {"init": "residual"}
    chain_attr = "_resctl_mhcl"
    stats_prefix = "mhcl"
    max_streams = MAX_STREAMS

    def too_many_streams(self, n):
        return (f"streams must be <= {MAX_STREAMS} for method={self.name!r}, got {n!r}: res mixes all n! permutation "
                f"matrices ({math.factorial(min(n, 12))}{'+' if n > 12 else ''} for n={n}), and Phi has n*C*(2n+n!) "
                "entries per layer; use method='mhc' or 'hc' for more streams")

    def validate(self, config):
        super().validate(config)
        check_choice("init", config.init, INITS)

    def build_layer(self, index, dim):
        c = self.config
        return MHCLiteLayer(index, dim, c.streams, c.init, c.eps)
