"""The mHC-lite nn.Module: one layer's parameters and its coefficients (formula: :mod:`.reference`)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..frame import FrameLayer, pm_one
from .config import MAX_STREAMS, MHCLiteConfig
from .reference import mhc_lite_coefficients_reference, permutation_matrices

__all__ = ["MHCLiteLayer"]


class MHCLiteLayer(FrameLayer):
    """Layer ``index``'s mHC-lite parameters. Init (official code): ``mhcl_phi = 0``, ``mhcl_alpha = 0.01``
    each, ``mhcl_norm_gain = 0``; ``mhcl_bias``: b_pre = +1 at stream ``index mod n``, -1 elsewhere; b_post the
    same (``init="residual"``: 0); b_res = 0 for the identity permutation, -8 for the others."""

    def __init__(self, index: int, dim: int, streams: int, init: str = MHCLiteConfig.init,
                 eps: float = MHCLiteConfig.eps):
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
        b[:n].copy_(pm_one(n, self.index, b))
        b[n:2 * n].copy_(pm_one(n, self.index, b) if self.init == "paper" else torch.zeros_like(b[:n]))
        b[2 * n:].fill_(-8.0)
        b[2 * n] = 0.0
        self.perms.copy_(permutation_matrices(n, self.perms.dtype, self.perms.device))

    def coefficients(self, streams: Tensor):
        return mhc_lite_coefficients_reference(streams, self.mhcl_phi, self.mhcl_bias, self.mhcl_alpha,
                                               self.mhcl_norm_gain, self.perms, self.eps)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, init={self.init!r}"
