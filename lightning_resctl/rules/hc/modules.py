"""HC and mHC nn.Modules: one layer's parameters and its coefficients (formulas: :mod:`.reference`)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..frame import FrameLayer, pm_one
from .config import HCConfig, MHCConfig
from .reference import hc_coefficients_reference, mhc_coefficients_reference

__all__ = ["HCLayer", "MHCLayer"]


class HCLayer(FrameLayer):
    """Layer ``index``'s HC parameters. Init (paper's static init = Pre-Norm; lucidrains): ``hc_static`` row s =
    ``[delta(s, index mod n) | e_s | 1]``, ``hc_dyn = 0``, ``hc_scale = [0.01, 0.01]``, ``hc_norm_gain = 0``."""

    def __init__(self, index: int, dim: int, streams: int, dynamic: bool = HCConfig.dynamic, eps: float = HCConfig.eps,
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


class MHCLayer(FrameLayer):
    """Layer ``index``'s mHC parameters. Init: ``mhc_phi = 0``; ``mhc_alpha = 0.01`` each; ``mhc_bias``:
    b_pre = +1 at stream ``index mod n``, -1 elsewhere; b_post the same (``init="residual"``: 0); b_res = 0 on
    the diagonal, -8 off it."""

    def __init__(self, index: int, dim: int, streams: int, init: str = MHCConfig.init,
                 sinkhorn: str = MHCConfig.sinkhorn, sinkhorn_iters: int = MHCConfig.sinkhorn_iters,
                 eps: float = MHCConfig.eps, hc_eps: float = MHCConfig.hc_eps):
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
        b[:n].copy_(pm_one(n, self.index, b))
        b[n:2 * n].copy_(pm_one(n, self.index, b) if self.init == "paper" else torch.zeros_like(b[:n]))
        eye = torch.eye(n, dtype=b.dtype, device=b.device)
        b[2 * n:].copy_(((eye - 1) * 8).flatten())

    def coefficients(self, streams: Tensor):
        return mhc_coefficients_reference(streams, self.mhc_phi, self.mhc_bias, self.mhc_alpha, self.eps,
                                          self.sinkhorn_iters, self.sinkhorn, self.hc_eps)

    def extra_repr(self) -> str:
        return (f"index={self.index}, dim={self.dim}, streams={self.streams}, init={self.init!r}, "
                f"sinkhorn={self.sinkhorn!r}, sinkhorn_iters={self.sinkhorn_iters}")
