"""Backend names and kernel loading shared by the merge rules (ResController and MGR).

Every rule accepts the same names:

* ``"auto"``   — the Triton kernels for CUDA tensors when Triton works, else the torch path;
* ``"torch"``  — the torch path (fused torch ops with a closed-form backward);
* ``"triton"`` — the fused Triton kernels (``"native"`` is an alias, for users coming from MLBricks).

A rule may accept extra names of its own (MGR: ``"reference"``, the plain-autograd oracle).
"""
from __future__ import annotations

from types import ModuleType

import torch

from ._triton import interpreter_mode, kernel_module, triton_available

__all__ = ["BACKENDS", "ALIASES", "check_backend", "load_kernels", "triton_runs_on_device"]

#: Backend names every merge rule accepts.
BACKENDS = ("auto", "torch", "triton", "native")
#: Alias -> canonical backend name.
ALIASES = {"native": "triton"}

_LOADED: dict[str, ModuleType] = {}


def check_backend(name, accepted: tuple = BACKENDS) -> str:
    """Validate a backend name against ``accepted`` and return its canonical form ("native" -> "triton").

    TypeError for a non-string, ValueError (naming the accepted names) for an unknown one."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be one of {accepted}, got {name!r} ({type(name).__name__})")
    if name not in accepted:
        raise ValueError(f"backend must be one of {accepted}, got {name!r}")
    return ALIASES.get(name, name)


def load_kernels(name: str) -> ModuleType:
    """Import ``lightning_resctl.kernels.<name>`` once (registers its ``torch.ops.lightning_resctl`` ops)."""
    module = _LOADED.get(name)
    if module is None:
        module = _LOADED[name] = kernel_module(name)
    return module


@torch.compiler.assume_constant_result
def triton_runs_on_device(device_type: str) -> bool:
    """Whether the Triton kernels run on tensors of ``device_type`` (a constant under ``torch.compile``)."""
    if not triton_available():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreter_mode())
