"""``hc`` (Hyper-Connections, Zhu et al. 2409.19606) and ``mhc`` (Manifold-Constrained HC, Xie et al.
2512.24880) on the common pre/res/post frame (:mod:`..frame`; docs/rules/hc.md): the formulas and their oracles.

Per token, layer j, streams ``S_j (n, C)`` (the formulas; :func:`hc_coefficients_reference` and
:func:`mhc_coefficients_reference` are the oracles)::

    HC   N_s = RMSNorm(S_j[s]) * (1 + gain_j)                       per stream over C
         c_s = A_j[s] + sigma * tanh(N_s @ W_j)                      (n+2,) = [pre_s | res[0..n-1, s] | post_s]
         sigma = (s_alpha x (n+1), s_beta);  static HC ("SHC", dynamic=False): c_s = A_j[s]
    mHC  xf = flatten(S_j);  m = (xf @ Phi_j) / sqrt(mean(xf^2) + eps)       (2n + n^2,) = [pre | post | res]
         pre = sigmoid(a_pre m[:n] + b[:n]);  post = 2 sigmoid(a_post m[n:2n] + b[n:2n])
         res = SK(reshape(a_res m[2n:] + b[2n:], n, n))            row-major, row = output stream
         SK(L): M = exp(L - max L); t_max times: M /= column sums; M /= row sums
         sinkhorn="dsv4": M = softmax over the output index + eps_hc; M /= (row sums + eps_hc);
                          (t_max - 1) times: M /= (column sums + eps_hc); M /= (row sums + eps_hc);
                          pre gets + eps_hc

then ``h_j = sum_s pre[s] S_j[s]``, ``S_{j+1}[t] = sum_s res[t, s] S_j[s] + post[t] u_j``.
Parameters of site j: HC ``hc_static (n, n+2)``, ``hc_dyn (C, n+2)``, ``hc_scale (2,)``,
``hc_norm_gain (C,)``; mHC ``mhc_phi (n*C, 2n+n^2)``, ``mhc_bias (2n+n^2,)``, ``mhc_alpha (3,)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import compute_dtype, rms_norm
from ..frame import gated_pre_post
from .config import HCConfig, MHCConfig

__all__ = ["hc_coefficients_reference", "mhc_coefficients_reference", "sinkhorn", "sinkhorn_dsv4"]


def hc_coefficients_reference(streams: Tensor, static: Tensor, dyn=None, scale=None, gain=None,
                              eps: float = HCConfig.eps):
    """HC coefficients of one layer (the formula in the module docstring). ``streams`` (..., n, C);
    ``static`` A (n, n+2); ``dyn`` W (C, n+2), ``scale`` (2,), ``gain`` (C,) or all None (static HC).
    Returns ``(pre (..., n), res (..., n, n), post (..., n))`` in fp32 (fp64 for fp64 streams)."""
    cd = compute_dtype(streams)
    n = streams.shape[-2]
    c = static.to(cd).expand(*streams.shape[:-1], n + 2)
    if dyn is not None:
        normed = rms_norm(streams, eps) * (1 + gain.to(cd))
        sigma = torch.cat([scale[0:1].to(cd).expand(n + 1), scale[1:2].to(cd)])
        c = c + sigma * torch.tanh(fp32_matmul(normed, dyn.to(cd)))
    return c[..., 0], c[..., 1:n + 1].transpose(-1, -2), c[..., n + 1]


def sinkhorn(logits: Tensor, iters: int = MHCConfig.sinkhorn_iters) -> Tensor:
    """mHC Eq. 9: ``M = exp(L - max L)``, then ``iters`` times ``M /= column sums; M /= row sums`` (rows last:
    every output stream an exact convex combination). ``logits`` (..., n, n), row = output stream."""
    m = torch.exp(logits - logits.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def sinkhorn_dsv4(logits: Tensor, iters: int = MHCConfig.sinkhorn_iters, eps: float = MHCConfig.hc_eps) -> Tensor:
    """DeepSeek-V4's variant (``hc_split_sinkhorn``, transposed to row = output): a softmax over the output index
    plus eps, each output's weights normalised, then ``iters - 1`` times each input's then each output's, eps in
    every denominator."""
    m = torch.softmax(logits, dim=-2) + eps
    m = m / (m.sum(-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-2, keepdim=True) + eps)
        m = m / (m.sum(-1, keepdim=True) + eps)
    return m


def mhc_coefficients_reference(streams: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, eps: float = MHCConfig.eps,
                               iters: int = MHCConfig.sinkhorn_iters, variant: str = MHCConfig.sinkhorn,
                               hc_eps: float = MHCConfig.hc_eps):
    """mHC coefficients of one layer (the formula in the module docstring); fp32 (fp64 for fp64 streams)."""
    cd = compute_dtype(streams)
    n = streams.shape[-2]
    xf = streams.to(cd).flatten(-2)
    m = fp32_matmul(xf, phi.to(cd)) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    pre, post, logits = gated_pre_post(m, alpha, bias, n)
    logits = logits.unflatten(-1, (n, n))
    if variant == "dsv4":
        return pre + hc_eps, sinkhorn_dsv4(logits, iters, hc_eps), post
    return pre, sinkhorn(logits, iters), post
