"""``hc`` (Hyper-Connections, Zhu et al. 2409.19606) and ``mhc`` (Manifold-Constrained HC, Xie et al.
2512.24880) as chain rules on the common pre/res/post frame (:mod:`._common`; docs/rules/hc.md).

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

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..runtime.autograd import fp32_matmul
from ._common import FrameRule, check_bool, compute_dtype, gated_pre_post, rms_norm
from .base import check_choice, check_int

__all__ = ["HCConfig", "MHCConfig", "HCRule", "MHCRule", "HCLayer", "MHCLayer", "hc_coefficients_reference",
           "mhc_coefficients_reference", "sinkhorn", "sinkhorn_dsv4", "SINKHORNS", "INITS"]

SINKHORNS = ("paper", "dsv4")
INITS = ("paper", "residual")


# ---------------------------------------------------------------------------------------------- references
def hc_coefficients_reference(streams: Tensor, static: Tensor, dyn=None, scale=None, gain=None, eps: float = 1e-6):
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


def sinkhorn(logits: Tensor, iters: int = 20) -> Tensor:
    """mHC Eq. 9: ``M = exp(L - max L)``, then ``iters`` times ``M /= column sums; M /= row sums`` (rows last:
    every output stream an exact convex combination). ``logits`` (..., n, n), row = output stream."""
    m = torch.exp(logits - logits.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def sinkhorn_dsv4(logits: Tensor, iters: int = 20, eps: float = 1e-6) -> Tensor:
    """DeepSeek-V4's variant (``hc_split_sinkhorn``, transposed to row = output): a softmax over the output index
    plus eps, each output's weights normalised, then ``iters - 1`` times each input's then each output's, eps in
    every denominator."""
    m = torch.softmax(logits, dim=-2) + eps
    m = m / (m.sum(-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-2, keepdim=True) + eps)
        m = m / (m.sum(-1, keepdim=True) + eps)
    return m


def mhc_coefficients_reference(streams: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, eps: float = 1e-6,
                               iters: int = 20, variant: str = "paper", hc_eps: float = 1e-6):
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


# ---------------------------------------------------------------------------------------------- modules
class HCLayer(nn.Module):
    """Layer ``index``'s HC parameters. Init (paper's static init = Pre-Norm; lucidrains): ``hc_static`` row s =
    ``[delta(s, index mod n) | e_s | 1]``, ``hc_dyn = 0``, ``hc_scale = [0.01, 0.01]``, ``hc_norm_gain = 0``."""

    def __init__(self, index: int, dim: int, streams: int, dynamic: bool = True, eps: float = 1e-6,
                 scale_init: float = 0.01):
        super().__init__()
        self.index, self.dim, self.streams, self.dynamic = int(index), int(dim), int(streams), bool(dynamic)
        self.eps, self.scale_init = float(eps), float(scale_init)
        n = self.streams
        self.hc_static = nn.Parameter(torch.empty(n, n + 2))
        if self.dynamic:
            self.hc_dyn = nn.Parameter(torch.empty(dim, n + 2))
            self.hc_scale = nn.Parameter(torch.empty(2))
            self.hc_norm_gain = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.streams
        a = self.hc_static
        a.zero_()
        a[self.index % n, 0] = 1.0
        a[:, 1:n + 1].copy_(torch.eye(n, dtype=a.dtype, device=a.device))
        a[:, n + 1] = 1.0
        if self.dynamic:
            self.hc_dyn.zero_()
            self.hc_scale.fill_(self.scale_init)
            self.hc_norm_gain.zero_()

    def coefficients(self, streams: Tensor):
        if self.dynamic:
            return hc_coefficients_reference(streams, self.hc_static, self.hc_dyn, self.hc_scale, self.hc_norm_gain,
                                             self.eps)
        return hc_coefficients_reference(streams, self.hc_static)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, dynamic={self.dynamic}"


def _pm_one(n: int, j: int, ref: Tensor) -> Tensor:
    """+1 at stream ``j mod n``, -1 elsewhere (FFTYYY's bias init of pre and post)."""
    v = torch.full((n,), -1.0, dtype=ref.dtype, device=ref.device)
    v[j % n] = 1.0
    return v


class MHCLayer(nn.Module):
    """Layer ``index``'s mHC parameters. Init: ``mhc_phi = 0``; ``mhc_alpha = 0.01`` each; ``mhc_bias``:
    b_pre = +1 at stream ``index mod n``, -1 elsewhere; b_post the same (``init="residual"``: 0); b_res = 0 on
    the diagonal, -8 off it."""

    def __init__(self, index: int, dim: int, streams: int, init: str = "paper", sinkhorn: str = "paper",
                 sinkhorn_iters: int = 20, eps: float = 1e-6, hc_eps: float = 1e-6):
        super().__init__()
        self.index, self.dim, self.streams = int(index), int(dim), int(streams)
        self.init, self.sinkhorn, self.sinkhorn_iters = init, sinkhorn, int(sinkhorn_iters)
        self.eps, self.hc_eps = float(eps), float(hc_eps)
        n = self.streams
        self.mhc_phi = nn.Parameter(torch.empty(n * dim, 2 * n + n * n))
        self.mhc_bias = nn.Parameter(torch.empty(2 * n + n * n))
        self.mhc_alpha = nn.Parameter(torch.empty(3))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.streams
        self.mhc_phi.zero_()
        self.mhc_alpha.fill_(0.01)
        b = self.mhc_bias
        b[:n].copy_(_pm_one(n, self.index, b))
        b[n:2 * n].copy_(_pm_one(n, self.index, b) if self.init == "paper" else torch.zeros_like(b[:n]))
        eye = torch.eye(n, dtype=b.dtype, device=b.device)
        b[2 * n:].copy_(((eye - 1) * 8).flatten())

    def coefficients(self, streams: Tensor):
        return mhc_coefficients_reference(streams, self.mhc_phi, self.mhc_bias, self.mhc_alpha, self.eps,
                                          self.sinkhorn_iters, self.sinkhorn, self.hc_eps)

    def extra_repr(self) -> str:
        return (f"index={self.index}, dim={self.dim}, streams={self.streams}, init={self.init!r}, "
                f"sinkhorn={self.sinkhorn!r}, sinkhorn_iters={self.sinkhorn_iters}")


# ---------------------------------------------------------------------------------------------- rules
@dataclass
class HCConfig:
    """Options of ``hc`` (docs/rules/hc.md).

    streams: n >= 1 streams per token (paper: 4).
    dynamic: True = DHC (tanh term), False = static HC (only ``hc_static``).
    reduce: chain output ``"sum"`` over streams (paper, lucidrains) or ``"mean"``.
    eps: RMSNorm epsilon of the per-stream norm (>= 0).
    """

    streams: int = 4
    dynamic: bool = True
    reduce: str = "sum"
    eps: float = 1e-6


class HCRule(FrameRule):
    Config = HCConfig
    description = "Hyper-Connections (dynamic): n streams, per-layer pre/res/post from a tanh projection, identity init"
    identity_at_init = True
    chain_attr = "_resctl_hc"
    stats_prefix = "hc"

    def validate(self, config):
        super().validate(config)
        check_bool("dynamic", config.dynamic)

    def build_layer(self, index, dim):
        c = self.config
        return HCLayer(index, dim, c.streams, c.dynamic, c.eps)


@dataclass
class MHCConfig:
    """Options of ``mhc`` (docs/rules/hc.md).

    streams: n >= 1 streams per token (paper: 4).
    init: ``"paper"`` (FFTYYY biases, post 1.46/0.54) or ``"residual"`` (b_post = 0: post = 1, exact residual at init).
    sinkhorn: ``"paper"`` (Eq. 9) or ``"dsv4"`` (DeepSeek-V4 inference code).
    sinkhorn_iters: t_max >= 1 (20).
    reduce: ``"sum"`` or ``"mean"``.
    eps: RMSNorm epsilon over n*C (>= 0). hc_eps: the dsv4 variant's eps (>= 0).
    """

    streams: int = 4
    init: str = "paper"
    sinkhorn: str = "paper"
    sinkhorn_iters: int = 20
    reduce: str = "sum"
    eps: float = 1e-6
    hc_eps: float = 1e-6


class MHCRule(FrameRule):
    Config = MHCConfig
    description = "Manifold-Constrained Hyper-Connections: sigmoid pre/post, Sinkhorn doubly-stochastic res"
    identity_at_init = {"init": "residual"}
    chain_attr = "_resctl_mhc"
    stats_prefix = "mhc"

    def validate(self, config):
        from ._common import check_eps

        super().validate(config)
        check_choice("init", config.init, INITS)
        check_choice("sinkhorn", config.sinkhorn, SINKHORNS)
        check_int("sinkhorn_iters", config.sinkhorn_iters, 1)
        check_eps("hc_eps", config.hc_eps)

    def build_layer(self, index, dim):
        c = self.config
        return MHCLayer(index, dim, c.streams, c.init, c.sinkhorn, c.sinkhorn_iters, c.eps, c.hc_eps)
