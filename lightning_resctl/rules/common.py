"""Primitives every rule shares, written once: the parameter-free RMS norm, the compute dtype, the backend names
the rules accept."""
from __future__ import annotations

import torch
from torch import Tensor

from ..runtime.backends import RULE_BACKENDS, check_backend

__all__ = ["RMS_EPS", "rms_norm", "compute_dtype", "BACKENDS", "check_rule_backend"]

#: Epsilon of the parameter-free RMS norm (MGR's AttnPool and gates, the baselines' key norms).
RMS_EPS = 1e-6

#: The backend names a rule accepts (the runtime's, plus "reference": plain autograd over the rule's torch oracle).
BACKENDS = RULE_BACKENDS


def check_rule_backend(name) -> str:
    """A rule's backend name (one of :data:`BACKENDS`) in its canonical form ("native" -> "triton")."""
    return check_backend(name, BACKENDS)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when a tensor is fp64, else fp32 (the dtype every rule's math runs in, also under autocast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rms_norm(x: Tensor, eps: float = RMS_EPS) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (fp64 stays fp64), no parameters."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

