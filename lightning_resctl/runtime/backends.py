"""Backend names, written once, and the one resolver every merge rule uses.

Every rule with a fused path accepts the same names (:data:`BACKENDS`):

* ``"auto"``   — the Triton kernels for CUDA tensors when Triton works, else the torch path; while dynamo traces
  (``torch.compile`` of the model or of its blocks) the torch path, which the compiler fuses with its neighbours
  (the kernels' ``torch.library`` ops are opaque to it);
* ``"torch"``  — the torch path (fused torch ops with a closed-form backward; under a whole-model
  ``torch.compile`` the compiler traces them; under a training-mode ``torch.export``, the rule's oracle:
  :func:`exporting_for_training`);
* ``"triton"`` — the fused Triton kernels (``"native"`` is an alias, for users coming from MLBricks);
* ``"torch-eager"`` / ``"torch-compiled"`` — the torch path with its per-merge math run op by op, or as one
  inductor-compiled region per direction (:class:`~lightning_resctl.runtime.regions.CompiledRegion`), compiled
  before the first call returns. ``"torch"`` (and ``"auto"`` off CUDA) uses the same regions on CPU when a C++
  compiler is present (:func:`cpu_compile_available`; ``LIGHTNING_RESCTL_COMPILE=0`` turns it off), compiled in a
  background process while the math runs eagerly (:func:`torch_mode`); a signature whose compile fails runs
  eagerly, with a warning.

ResController and MGR also accept ``"reference"``, their plain-autograd oracle (:data:`RULE_BACKENDS`).
:func:`resolve_backend` turns a name into what a call on a tensor runs.
"""
from __future__ import annotations

import functools
import os
import shutil
from typing import Optional

import torch

from .triton import triton_runs_on

__all__ = ["BACKENDS", "RULE_BACKENDS", "ALIASES", "COMPILE_ENV", "check_backend", "resolve_backend",
           "cpu_compile_available", "torch_mode", "exporting_for_training"]

#: Backend names every rule with a fused path accepts.
BACKENDS = ("auto", "torch", "triton", "native", "torch-eager", "torch-compiled")
#: :data:`BACKENDS` plus "reference": the rule's plain-autograd oracle (double backward, forward-mode AD and the
#: torch.func transforms work there). ResController and MGR accept these.
RULE_BACKENDS = BACKENDS + ("reference",)
#: Alias -> canonical backend name.
ALIASES = {"native": "triton"}
#: Set to "0" to keep the torch path eager on CPU (same as backend="torch-eager").
COMPILE_ENV = "LIGHTNING_RESCTL_COMPILE"


def check_backend(name, accepted: tuple = BACKENDS) -> str:
    """Validate a backend name against ``accepted`` and return its canonical form ("native" -> "triton").

    TypeError for a non-string, ValueError (naming the accepted names) for an unknown one."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be one of {accepted}, got {name!r} ({type(name).__name__})")
    if name not in accepted:
        raise ValueError(f"backend must be one of {accepted}, got {name!r}")
    return ALIASES.get(name, name)


def resolve_backend(backend: str, tensor: Optional[torch.Tensor], *, triton_fits: bool = True) -> str:
    """The backend a call on ``tensor`` runs, for a canonical name (:func:`check_backend`):

    * ``"auto"`` -> ``"triton"`` for a CUDA tensor when Triton runs on CUDA here and ``triton_fits`` (the rule's
      kernels serve this call, e.g. MGR's up to 8 streams), else ``"torch"``; without a tensor, the same for a
      CUDA tensor when a CUDA device is present (a model on the GPU); ``"torch"`` while dynamo traces (its math
      traced into the compiled graph, not an opaque kernel op);
    * ``"triton"`` on a tensor whose device Triton cannot run on: ValueError naming the device;
    * any other name as it is (``"torch"``, ``"torch-eager"``, ``"torch-compiled"``, a rule's ``"reference"``)."""
    if backend == "auto":
        if torch.compiler.is_compiling():
            return "torch"
        on_cuda = torch.cuda.is_available() if tensor is None else tensor.is_cuda
        return "triton" if (on_cuda and triton_fits and triton_runs_on("cuda")) else "torch"
    if backend == "triton" and tensor is not None and not triton_runs_on(tensor.device.type):
        raise ValueError(
            f"backend='triton' cannot run on {tensor.device} tensors here (Triton needs a CUDA device, or "
            f"TRITON_INTERPRET=1 for CPU tensors); use backend='torch' or 'auto'"
        )
    return backend


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

    * "eager" — op by op (``"torch-eager"``; ``"torch"`` off CPU or without a C++ compiler; always under an
      outer ``torch.compile``, which traces the math itself);
    * "compiled" — one inductor region per direction, compiled before the call returns (``"torch-compiled"``);
    * "background" — the same regions, compiled in a background process while the math runs eagerly
      (``"torch"`` on CPU when :func:`cpu_compile_available`): the first steps never wait for a compiler."""
    if backend == "torch-eager" or torch.compiler.is_compiling():
        return "eager"
    if backend == "torch-compiled":
        return "compiled"
    on_cpu = tensor is None or tensor.device.type == "cpu"
    return "background" if on_cpu and cpu_compile_available() else "eager"


def exporting_for_training(*tensors) -> bool:
    """Whether ``torch.export`` is recording a program whose outputs autograd will differentiate (grad mode on, one
    of ``tensors`` requires grad). A closed-form ``autograd.Function``'s backward is not part of an exported
    program (torch.export records its forward under no_grad, or refuses its ``out=`` ops), so a rule's torch path
    then records its plain-autograd oracle (``backend="reference"``): the same math, differentiated by autograd."""
    return (torch.compiler.is_exporting() and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))
