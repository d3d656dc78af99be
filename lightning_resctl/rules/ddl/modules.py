"""The DDL nn.Module: one merge's gate and value parameters and its merge (formula: :mod:`.reference`)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..common import init_generator
from .config import DDLConfig
from .reference import beta_bias_init, ddl_reference

__all__ = ["DDLMerge"]


class DDLMerge(nn.Module):
    """One DDL merge of width ``width`` (``dim``: the stream's feature dim, -1 or 1 for channels-first).

    Parameters: ``ddl_beta_weight (C,)``, ``ddl_beta_bias (1,)``, ``ddl_value_weight (C,)`` and, for
    ``value="code"``, ``ddl_value_bias (1,)``. Init (official ``init_utils``, ``DeepDeltaResidualVdim1``): the weights
    N(0, (0.5/sqrt(C))^2), ``ddl_beta_bias = logit(beta_init / 2)``, ``ddl_value_bias`` U(+-1/sqrt(C)), drawn from
    a generator of its own seeded with ``seed`` (the rule's: :func:`~..common.init_seed`; the global RNG is not
    touched). The options come whole as ``config`` (:class:`~.config.DDLConfig`)."""

    def __init__(self, width: int, config: DDLConfig, dim: int = -1, seed: int = 0):
        super().__init__()
        config.validate()
        self.width, self.dim, self.config, self.seed = int(width), int(dim), config, int(seed)
        self.ddl_beta_weight = nn.Parameter(torch.empty(width))
        self.ddl_beta_bias = nn.Parameter(torch.empty(1))
        self.ddl_value_weight = nn.Parameter(torch.empty(width))
        if config.value == "code":
            self.ddl_value_bias = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        g, C = init_generator(self.seed), self.width
        std = 0.5 / math.sqrt(C)
        self.ddl_beta_weight.copy_(torch.randn(C, generator=g, dtype=torch.float64) * std)
        self.ddl_value_weight.copy_(torch.randn(C, generator=g, dtype=torch.float64) * std)
        self.ddl_beta_bias.fill_(beta_bias_init(self.config.beta_init))
        if self.config.value == "code":
            bound = 1.0 / math.sqrt(C)
            self.ddl_value_bias.copy_((torch.rand(1, generator=g, dtype=torch.float64) * 2 - 1) * bound)

    def forward(self, stream: Tensor, update: Tensor, parts: bool = False):
        """The merged stream (``parts``: with beta, k . x and v, features last)."""
        moved = self.dim not in (-1, stream.dim() - 1)
        if moved:
            stream, update = stream.movedim(self.dim, -1), update.movedim(self.dim, -1)
        c = self.config
        out = ddl_reference(stream, update, self.ddl_beta_weight, self.ddl_beta_bias, self.ddl_value_weight,
                            self.ddl_value_bias if c.value == "code" else None, c.value, c.value_scale, c.k_eps,
                            c.eps, parts=parts)
        if parts:
            return out
        return out.movedim(-1, self.dim) if moved else out

    def extra_repr(self) -> str:
        c = self.config
        return f"width={self.width}, value={c.value!r}, beta_init={c.beta_init}"
