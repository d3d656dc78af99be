"""Primitives every rule shares, written once: the parameter-free RMS norm, the compute dtype, the backend names
the rules accept."""
from __future__ import annotations

import torch
from torch import Tensor

from ..runtime.backends import RULE_BACKENDS, check_backend

__all__ = ["RMS_EPS", "rms_norm", "compute_dtype", "BACKENDS", "check_rule_backend", "init_seed", "init_generator"]

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



def init_seed(index: int) -> int:
    """The seed of the random init of a rule's ``index``-th module (in the order the rule built them): torch's
    initial seed (what ``torch.manual_seed`` set) mixed with ``index``, read without drawing from the global RNG."""
    return (torch.initial_seed() + (int(index) + 1) * 0x9E3779B97F4A7C15) % (1 << 63)


def init_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (:func:`init_seed`): a rule's random init follows ``torch.manual_seed``,
    differs per module, is the same again in ``reset_parameters()``, and leaves the global RNG untouched (patching
    does not change what the model draws afterwards)."""
    return torch.Generator().manual_seed(int(seed))
