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
import re
import shutil
import time
import warnings
from types import ModuleType
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._triton import interpreter_mode, kernel_module, triton_available

__all__ = ["BACKENDS", "ALIASES", "check_backend", "load_kernels", "triton_runs_on_device", "cpu_compile_available",
           "torch_mode", "CompiledRegion", "COMPILE_ENV", "refuse_second_derivative"]

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


def refuse_second_derivative(what: str, oracle: str) -> None:
    """Called first in the backward of a closed-form ``autograd.Function``: a backward with ``create_graph=True``
    (grad mode on) would differentiate math that is not differentiable again, so it raises, naming ``oracle``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what}: its closed-form backward is not differentiable, so a second derivative (a backward with "
            f"create_graph=True) is not available; {oracle} (plain autograd) has one")


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


def _flatten(args, tensors: list) -> Optional[tuple]:
    """Key of ``args`` (nested tuples / lists) for one compiled graph, appending their tensors to ``tensors``;
    None when a value cannot be part of a compiled signature (a type other than tensors, tuples, lists and
    Python scalars / strings / None).

    Tensors by (dtype, device type, rank); other values as they are (they are baked into the graph)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            out.append((a.dtype, a.device.type, a.dim()))
        elif isinstance(a, (tuple, list)):
            inner = _flatten(a, tensors)
            if inner is None:
                return None
            out.append((type(a), inner))
        elif isinstance(a, (int, float, str, bool, type(None))):
            out.append((type(a), a))
        else:
            return None
    return tuple(out)


def _rebuild(template, tensors):
    """``template`` (the first call's arguments) with its tensors replaced, in order, from the iterator ``tensors``."""
    out = []
    for a in template:
        if isinstance(a, torch.Tensor):
            out.append(next(tensors))
        elif isinstance(a, (tuple, list)):
            out.append(type(a)(_rebuild(a, tensors)))
        else:
            out.append(a)
    return out


def _size_guard(examples: list) -> Callable[[list], bool]:
    """A check ``guard(tensors) -> bool`` that the sizes of ``tensors`` satisfy what the symbolic trace assumed of
    its example inputs ``examples`` (fake tensors): sizes it specialized (0, 1, a constant the math fixed, e.g. by
    ``math.sqrt(C)``), sizes it saw equal, and bounds (e.g. ``n >= 2``). Strides and storage offsets are left out:
    the compiled code is only given contiguous tensors, whose strides follow from their sizes."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    code = detect_fake_mode(examples).shape_env.produce_guards_expression(examples, ignore_static=False)
    terms = [t for t in (code.split(" and ") if code else ()) if "stride()" not in t and "storage_offset()" not in t]
    body = " and ".join("(" + _SIZE_REF.sub(r"t[\1].shape[\2]", t) + ")" for t in terms) or "True"
    if "L[" in body:
        raise RuntimeError(f"unexpected guard in the traced graph: {body}")
    return eval(f"lambda t: {body}", dict(SYMPY_INTERP))  # noqa: S307 - built from the trace's own guards


_SIZE_REF = re.compile(r"L\['t(\d+)'\]\.size\(\)\[(\d+)\]")


_COMPILED_DEVICES = ("cpu", "cuda")


def _ambient() -> tuple:
    """Global state a trace bakes into its graph: autocast on / off and its dtype, per device type."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _COMPILED_DEVICES)


def _plain_call(tensors: list) -> bool:
    """Whether compiled code may stand in for the eager math here: plain tensors on CPU / CUDA, no autograd to
    record, and no dispatch or function mode active (e.g. Lightning's FLOP counter, a fake-tensor mode)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type not in _COMPILED_DEVICES
           for t in tensors):
        return False
    return _current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()


class CompiledRegion:
    """``fn`` (pure tensor math: no in-place update of its inputs) compiled by inductor, and called without
    dynamo.

    Calls are grouped by signature: the arguments' structure and non-tensor values (baked into the graph as
    constants), each tensor's dtype, device type and rank (strided views are passed as contiguous copies), and the
    autocast state. The first call of a signature traces ``fn`` with symbolic sizes (``make_fx``) and compiles the
    graph (``compile_fx``); the trace's assumptions about sizes (:func:`_size_guard`) are checked on every call, so one
    compile serves every batch size and sequence length it holds for, and another size pattern compiles its own
    graph. The check is a few integer comparisons (dynamo's per-call guard evaluation costs tens of microseconds,
    which a training step pays per merge).

    Falls back to eager ``fn``, always with the same result:

    * under grad mode with an input that requires grad (autograd then records the eager ops), for tensor
      subclasses or devices other than CPU / CUDA, while a dispatch or function mode is active (a FLOP counter,
      fake tensors), and past ``max_graphs`` compiled graphs (silently: the math is the same, only slower);
    * after a failed compile or run: a warning is issued once and ``fn`` runs eagerly from then on (a genuine
      error of the inputs is then raised by the eager call).

    ``first_call_s`` records the wall time of the first compiled call (which holds the compile)."""

    def __init__(self, fn, max_graphs: int = 8):
        self.fn = fn
        self.max_graphs = max_graphs
        self.entries: dict = {}  # signature -> [(compiled, out_spec, guard), ...]
        self.num_graphs = 0
        self.failed: Optional[str] = None
        self.first_call_s: Optional[float] = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if self.failed is not None:
            return self.fn(*args)
        tensors: list = []
        key = _flatten(args, tensors)
        if key is None or not _plain_call(tensors):
            return self.fn(*args)
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # the compiled code reads rows
        graphs = self.entries.setdefault((key, _ambient()), [])
        for entry in graphs:
            if entry[2](tensors):
                return self._run(entry, args, tensors)
        if self.num_graphs >= self.max_graphs:
            return self.fn(*args)
        t0 = time.perf_counter()
        entry = self._compile(args, tensors)
        if entry is None:
            return self.fn(*args)
        graphs.append(entry)
        self.num_graphs += 1
        out = self._run(entry, args, tensors)
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - t0
        return out

    def _run(self, entry, args, tensors):
        compiled, out_spec, _ = entry
        try:
            outs = compiled(*tensors)
        except Exception as err:  # noqa: BLE001 - any failure of the compiled code: fall back to the eager math
            self._fail(err)
            return self.fn(*args)
        return tree_unflatten(list(outs), out_spec)

    def _compile(self, args, tensors):
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        spec: list = []

        def flat(*ts):
            leaves, out_spec = tree_flatten(self.fn(*_rebuild(args, iter(ts))))
            spec.append(out_spec)
            return tuple(leaves)

        try:
            graph = make_fx(flat, tracing_mode="symbolic")(*tensors)
            examples = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
            guard = _size_guard(examples)
            if not guard(tensors):
                raise RuntimeError("the trace's size guard rejects its own example inputs")
            return compile_fx(graph, examples), spec[-1], guard
        except Exception as err:  # noqa: BLE001 - any compiler failure: fall back to the eager math
            self._fail(err)
            return None

    def _fail(self, err: BaseException) -> None:
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        self.failed = msg
        warnings.warn(f"lightning_resctl: compiling {self.fn.__name__} failed ({msg}); running the torch "
                      f"path eagerly (set {COMPILE_ENV}=0 or backend='torch-eager' to skip the attempt)",
                      RuntimeWarning, stacklevel=4)
