"""The KromHC nn.Module: one layer's parameters and its coefficients (formula: :mod:`.reference`)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..frame import FrameLayer, pm_one
from .config import KromHCConfig
from .reference import kromhc_coefficients_reference

__all__ = ["KromHCLayer"]


class KromHCLayer(FrameLayer):
    """Layer ``index``'s KromHC parameters. Init (official code): ``kromhc_proj = 0``, ``kromhc_alpha = 0.01``
    each, ``kromhc_norm_gain = 0``; ``kromhc_bias``: b_pre = +1 at stream ``index mod n``, -1 elsewhere; b_post the
    same (``init="residual"``: 0); b_res = (0, -8) per factor (p_k = 0.99966: ``res`` near the identity)."""

    def __init__(self, index: int, dim: int, streams: int, init: str = KromHCConfig.init,
                 eps: float = KromHCConfig.eps):
        super().__init__()
        if streams < 2 or streams & (streams - 1):
            raise ValueError(f"streams must be a power of 2 >= 2 for KromHC, got {streams!r}")
        self.index, self.dim, self.streams, self.init, self.eps = int(index), int(dim), int(streams), init, float(eps)
        n = self.streams
        self.factors = n.bit_length() - 1
        width = 2 * n + 2 * self.factors
        self.kromhc_proj = nn.Parameter(torch.empty(n * dim, width))
        self.kromhc_bias = nn.Parameter(torch.empty(width))
        self.kromhc_alpha = nn.Parameter(torch.empty(3))
        self.kromhc_norm_gain = nn.Parameter(torch.empty(n * dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.streams
        self.kromhc_proj.zero_()
        self.kromhc_alpha.fill_(0.01)
        self.kromhc_norm_gain.zero_()
        b = self.kromhc_bias
        b[:n].copy_(pm_one(n, self.index, b))
        b[n:2 * n].copy_(pm_one(n, self.index, b) if self.init == "paper" else torch.zeros_like(b[:n]))
        b[2 * n:].copy_(torch.tensor([0.0, -8.0], dtype=b.dtype, device=b.device).repeat(self.factors))

    def coefficients(self, streams: Tensor):
        return kromhc_coefficients_reference(streams, self.kromhc_proj, self.kromhc_bias, self.kromhc_alpha,
                                             self.kromhc_norm_gain, self.eps)

    def factor_matrices(self, streams: Tensor) -> Tensor:
        """The 2x2 factors ``(..., K, 2, 2)`` of ``res`` on ``streams`` (diagnostics)."""
        return kromhc_coefficients_reference(streams, self.kromhc_proj, self.kromhc_bias, self.kromhc_alpha,
                                             self.kromhc_norm_gain, self.eps, with_factors=True)[3]

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, init={self.init!r}"
