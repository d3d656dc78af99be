"""The options of ``attnres`` and ``attnres-block``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..checks import check_bool, check_eps, check_int
from ..common import RMS_EPS, check_rule_backend

__all__ = ["AttnResConfig", "BlockAttnResConfig"]


@dataclass
class AttnResConfig:
    """Options of ``attnres`` (Full AttnRes; docs/rules/attnres.md).

    key_norm_affine: give each site a key-norm weight g (ones) besides its query (False: none).
    eps: key RMSNorm epsilon (>= 0).
    backend: "auto" (the fused Triton kernels for CUDA tensors when Triton works, else torch), "triton" ("native" is
        an alias) or the torch path's names ("torch", "torch-eager", "torch-compiled", "reference": plain torch ops
        under autograd, one path). The backend changes how the math runs, not what it computes.
    """

    key_norm_affine: bool = True
    eps: float = RMS_EPS
    backend: str = "auto"

    def validate(self) -> "AttnResConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_bool("key_norm_affine", self.key_norm_affine)
        check_eps("eps", self.eps)
        check_rule_backend(self.backend)
        return self


@dataclass
class BlockAttnResConfig:
    """Options of ``attnres-block`` (docs/rules/attnres.md).

    block_size: S >= 1 merges per block (None: ``num_blocks`` or the default ``2 * max(1, floor(K/16 + 1/2))``).
    num_blocks: N >= 1 blocks, S = ceil(K / N) (exclusive with block_size).
    key_norm_affine, eps, backend: as for ``attnres``.
    """

    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    key_norm_affine: bool = AttnResConfig.key_norm_affine
    eps: float = AttnResConfig.eps
    backend: str = AttnResConfig.backend

    def validate(self) -> "BlockAttnResConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        AttnResConfig.validate(self)
        check_int("block_size", self.block_size, 1, allow_none=True)
        check_int("num_blocks", self.num_blocks, 1, allow_none=True)
        if self.block_size is not None and self.num_blocks is not None:
            raise ValueError(f"block_size and num_blocks are exclusive, got block_size={self.block_size!r} and "
                             f"num_blocks={self.num_blocks!r}")
        return self
