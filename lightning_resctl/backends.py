"""Backend names and kernel loading shared by the merge rules (ResController and MGR).

Every rule accepts the same names:

* ``"auto"``   — the Triton kernels for CUDA tensors when Triton works, else the torch path;
* ``"torch"``  — the torch path (fused torch ops with a closed-form backward);
* ``"triton"`` — the fused Triton kernels (``"native"`` is an alias, for users coming from MLBricks);
* ``"torch-eager"`` / ``"torch-compiled"`` — the torch path with its per-merge math run op by op, or as one
  inductor-compiled region per direction. ``"torch"`` (and ``"auto"`` off CUDA) compiles on CPU when a C++
  compiler is present (:func:`cpu_compile_available`; ``LIGHTNING_RESCTL_COMPILE=0`` turns it off), and falls
  back to eager with a warning if compiling fails.

A rule may accept extra names of its own (MGR: ``"reference"``, the plain-autograd oracle).
"""
from __future__ import annotations

import functools
import os
import shutil
import time
import warnings
from types import ModuleType
from typing import Optional

import torch

from ._triton import interpreter_mode, kernel_module, triton_available

__all__ = ["BACKENDS", "ALIASES", "check_backend", "load_kernels", "triton_runs_on_device", "cpu_compile_available",
           "torch_mode", "CompiledRegion", "COMPILE_ENV"]

#: Backend names every merge rule accepts.
BACKENDS = ("auto", "torch", "triton", "native", "torch-eager", "torch-compiled")
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


# ----------------------------------------------------------------------------------------------
# compiled CPU regions: the torch path's per-merge math as one inductor region
# ----------------------------------------------------------------------------------------------
#: Set to "0" to keep the torch path eager on CPU (same as backend="torch-eager").
COMPILE_ENV = "LIGHTNING_RESCTL_COMPILE"


@functools.lru_cache(maxsize=None)
def _cxx_compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_compile_available() -> bool:
    """True when the torch path may compile its math on CPU: a C++ compiler is on PATH (inductor's CPU
    backend needs one) and ``LIGHTNING_RESCTL_COMPILE`` is not "0"."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return False
    return _cxx_compiler() is not None


def torch_mode(backend: str, tensor) -> str:
    """How the torch path runs for ``backend`` ("torch", "torch-eager", "torch-compiled") on ``tensor``:
    "compiled" (one inductor region per direction) or "eager". "torch" compiles on CPU when
    :func:`cpu_compile_available`; under an outer ``torch.compile`` the math is traced by it either way."""
    if backend == "torch-eager" or torch.compiler.is_compiling():
        return "eager"
    if backend == "torch-compiled":
        return "compiled"
    on_cpu = tensor is None or tensor.device.type == "cpu"
    return "compiled" if on_cpu and cpu_compile_available() else "eager"


def _signature(args) -> tuple:
    """What distinguishes compiled graphs of a call: tensors by (dtype, rank, device), other values as they are."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.dim(), a.device.type))
        elif isinstance(a, (tuple, list)):
            out.append(_signature(a))
        else:
            out.append(a if isinstance(a, (int, float, str, bool, type(None))) else type(a).__name__)
    return tuple(out)


class CompiledRegion:
    """``fn`` compiled by inductor (dynamic shapes) on first use, with an eager fallback.

    If compiling or running the compiled code fails, a warning is issued once, and ``fn`` runs eagerly from then
    on (a genuine error of the inputs is then raised by the eager call); an input signature past dynamo's
    recompile limit runs eagerly without a warning. ``first_call_s`` records the wall time of the first call
    (which holds the compile)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed: Optional[str] = None
        self.first_call_s: Optional[float] = None
        self.eager_keys: set = set()
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if self.failed is not None:
            return self.fn(*args)
        key = _signature(args)
        if key in self.eager_keys:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        first = self.first_call_s is None
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: fall back to the eager math
            msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if "RecompileLimit" in type(err).__name__ or "recompile" in msg.lower():
                # more input signatures (dtype, rank, dim) than dynamo compiles per function: this one stays eager
                self.eager_keys.add(key)
            else:
                self.failed = msg
                warnings.warn(f"lightning_resctl: compiling {self.fn.__name__} failed ({msg}); running the torch "
                              f"path eagerly (set {COMPILE_ENV}=0 or backend='torch-eager' to skip the attempt)",
                              RuntimeWarning, stacklevel=3)
            return self.fn(*args)
        if first:
            self.first_call_s = time.perf_counter() - t0
        return out
