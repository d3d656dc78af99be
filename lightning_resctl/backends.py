"""Backend names and kernel loading shared by the merge rules (ResController and MGR).

Every rule accepts the same names:

* ``"auto"``   — the Triton kernels for CUDA tensors when Triton works, else the torch path;
* ``"torch"``  — the torch path (fused torch ops with a closed-form backward);
* ``"triton"`` — the fused Triton kernels (``"native"`` is an alias, for users coming from MLBricks);
* ``"torch-eager"`` / ``"torch-compiled"`` — the torch path with its per-merge math run op by op, or as one
  inductor-compiled region per direction (:class:`CompiledRegion`), compiled before the first call returns.
  ``"torch"`` (and ``"auto"`` off CUDA) uses the same regions on CPU when a C++ compiler is present
  (:func:`cpu_compile_available`; ``LIGHTNING_RESCTL_COMPILE=0`` turns it off), compiled in a background process
  while the math runs eagerly (:func:`torch_mode`); a signature whose compile fails runs eagerly, with a warning.

A rule may accept extra names of its own (MGR: ``"reference"``, the plain-autograd oracle).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import threading
import time
import warnings
import weakref
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_loads

from ._logging import rank_zero_line
from ._triton import interpreter_mode, kernel_module, triton_available

__all__ = ["BACKENDS", "ALIASES", "check_backend", "load_kernels", "triton_runs_on_device", "cpu_compile_available",
           "torch_mode", "CompiledMath", "CompiledRegion", "COMPILE_ENV", "COMPILE_LOCK", "refuse_second_derivative",
           "trace_region", "wait_for_compiles", "region_calls", "opaque_under_compile", "op_outputs"]

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


def opaque_under_compile() -> bool:
    """Whether a rule's torch path runs as one opaque op (``torch.library.custom_op``) per direction: under
    ``torch.compile`` but not ``torch.export`` (whose programs must stay plain aten ops). Dynamo, AOTAutograd and
    inductor then do not trace the per-merge math (which ran at every merge site of the model: about twice the
    graph of the unpatched model); at run time the op runs the math as :func:`torch_mode` says for the backend (the
    compiled regions on CPU)."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def op_outputs(fn, *args, fake: bool = False) -> tuple:
    """``fn(*args)`` (a tuple of tensors and None) as a custom op's implementation returns it: run without autograd
    (the op's registered backward differentiates it), None replaced by an empty tensor, every output contiguous
    (the eager math and its compiled region may lay a view out differently; the fake implementation must say what
    the real one returns), and every output that shares storage with an input or an earlier output copied (an op
    returns fresh tensors). ``fake=True``: for the op's fake implementation, which runs ``fn`` on fake tensors."""
    with torch.no_grad():
        outs = fn(*args)
    first = next(a for a in args if isinstance(a, torch.Tensor))
    taken = set() if fake else {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    fresh = []
    for t in outs:
        if t is None:
            t = first.new_empty((0,))
        elif not fake and t.untyped_storage().data_ptr() in taken:
            t = t.clone(memory_format=torch.contiguous_format)
        t = t.contiguous()
        if not fake:
            taken.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return tuple(fresh)


class CompiledMath:
    """A rule's torch-path math functions (e.g. forward and backward) and their :class:`CompiledRegion` s, made
    on first use (one set per process, shared by every model): ``CompiledMath(fwd, bwd)(mode)`` returns the
    callables for a :func:`torch_mode` — the plain functions for "eager" (or without a C++ compiler), the regions
    for "compiled", the regions' :meth:`CompiledRegion.background` for "background"."""

    def __init__(self, *fns):
        self.fns = fns
        self.regions: Optional[tuple] = None

    def __call__(self, mode: str) -> tuple:
        if mode not in ("compiled", "background") or torch.compiler.is_compiling() or not cpu_compile_available():
            return self.fns
        if self.regions is None:
            self.regions = tuple(CompiledRegion(fn) for fn in self.fns)
        if mode == "compiled":
            return self.regions
        return tuple(region.background for region in self.regions)


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


def _rebuild(template, tensors, slot=torch.Tensor):
    """``template`` (a call's arguments) with its ``slot`` instances (tensors) replaced, in order, from the
    iterator ``tensors``."""
    out = []
    for a in template:
        if isinstance(a, slot):
            out.append(next(tensors))
        elif isinstance(a, (tuple, list)):
            out.append(type(a)(_rebuild(a, tensors, slot)))
        else:
            out.append(a)
    return out


def _guard_text(examples: list) -> str:
    """The sizes of ``examples`` (the fake tensors of a symbolic trace) that the trace assumed, as a Python
    expression over ``t`` (the list of tensors of a call): sizes it specialized (0, 1, a constant the math fixed,
    e.g. by ``math.sqrt(C)``), sizes it saw equal, and bounds (e.g. ``n >= 2``). Strides and storage offsets are
    left out: the compiled code is only given contiguous tensors, whose strides follow from their sizes."""
    from torch._guards import detect_fake_mode

    code = detect_fake_mode(examples).shape_env.produce_guards_expression(examples, ignore_static=False)
    terms = [t for t in (code.split(" and ") if code else ()) if "stride()" not in t and "storage_offset()" not in t]
    body = " and ".join("(" + _SIZE_REF.sub(r"t[\1].shape[\2]", t) + ")" for t in terms) or "True"
    if "L[" in body:
        raise RuntimeError(f"unexpected guard in the traced graph: {body}")
    return body


def _guard_from_text(body: str) -> Callable[[list], bool]:
    """``guard(tensors) -> bool`` from :func:`_guard_text` (a few integer comparisons per call)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return eval(f"lambda t: {body}", dict(SYMPY_INTERP))  # noqa: S307 - built from a trace's own guards


_SIZE_REF = re.compile(r"L\['t(\d+)'\]\.size\(\)\[(\d+)\]")


def trace_region(fn, args, tensors: list):
    """Trace ``fn(*args)`` (its tensors replaced by ``tensors``, in order) with symbolic sizes (``make_fx``).

    Returns ``(graph, examples, guard_text, out_spec)``: the graph returns the tensors among the flat leaves of
    ``fn``'s output (:func:`_unflatten` with ``out_spec`` rebuilds the output, its other leaves — None, Python
    scalars — as they were), ``examples`` are its fake inputs, ``guard_text`` the sizes it assumed
    (:func:`_guard_text`). Call it holding :data:`COMPILE_LOCK`."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec: list = []

    def flat(*ts):
        leaves, tree = tree_flatten(fn(*_rebuild(args, iter(ts))))
        kinds = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
        spec.append((tree, kinds, tuple(None if k else leaf for k, leaf in zip(kinds, leaves))))
        return tuple(leaf for leaf, k in zip(leaves, kinds) if k)

    graph = make_fx(flat, tracing_mode="symbolic")(*tensors)
    examples = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
    return graph, examples, _guard_text(examples), spec[-1]


def _unflatten(outs, out_spec):
    """The output of the traced function from its graph's tensors ``outs`` (see :func:`trace_region`)."""
    tree, kinds, constants = out_spec
    it = iter(outs)
    return tree_unflatten([next(it) if k else c for k, c in zip(kinds, constants)], tree)


_COMPILED_DEVICES = ("cpu", "cuda")
#: Sizes up to this tell background compiles of one signature apart (:meth:`CompiledRegion._submit`); ours.
_SMALL_SIZE = 16


def _ambient() -> tuple:
    """Global state a trace bakes into its graph: autocast on / off and its dtype, per device type."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _COMPILED_DEVICES)


def _under_a_tracer() -> bool:
    """``torch.jit.trace`` (and the ONNX exporter built on it), ``torch.export`` or FX symbolic tracing is
    recording the ops: they must see the eager math, not a call into compiled code."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting() or fx_symbolic_trace.is_fx_symbolic_tracing()


def _plain_call(tensors: list) -> bool:
    """Whether compiled code may stand in for the eager math here: plain tensors on CPU / CUDA, no autograd to
    record, no dispatch or function mode active (e.g. Lightning's FLOP counter, a fake-tensor mode), no tracer
    recording (:func:`_under_a_tracer`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type not in _COMPILED_DEVICES
           for t in tensors):
        return False
    return (_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()
            and not _under_a_tracer())


#: Held around every trace and compile of every region of this process: ``make_fx`` and inductor keep
#: process-wide state (torch.fx's "is tracing" flag, the patcher), so two traces at once corrupt it.
COMPILE_LOCK = threading.RLock()
_REGIONS: "weakref.WeakSet[CompiledRegion]" = weakref.WeakSet()
_NOTICES: set = set()


def _notice(kind: str, msg: str) -> None:
    """``msg`` once per process and ``kind`` on the package logger (INFO; stderr when nothing configured
    logging)."""
    if kind not in _NOTICES:
        _NOTICES.add(kind)
        rank_zero_line(msg)


def _describe(sig) -> str:
    """A signature as a reader sees it: ``(float32 3-d cpu, float32 3-d cpu, 0.18, -1)``, plus the autocast
    state."""
    key, ambient = sig

    def one(k):
        if len(k) == 3 and isinstance(k[0], torch.dtype):
            return f"{str(k[0]).replace('torch.', '')} {k[2]}-d {k[1]}"
        if k[0] in (tuple, list):
            return "(" + ", ".join(one(i) for i in k[1]) + ")"
        return repr(k[1])

    casts = [f"autocast {d} {str(dt).replace('torch.', '')}" for d, (on, dt) in zip(_COMPILED_DEVICES, ambient) if on]
    return "(" + ", ".join(one(k) for k in key) + ")" + ("".join(" under " + c for c in casts))


class CompiledRegion:
    """``fn`` (pure tensor math: no in-place update of its inputs) compiled by inductor, and called without
    dynamo.

    Calls are grouped by signature: the arguments' structure and non-tensor values (baked into the graph as
    constants), each tensor's dtype, device type and rank (strided views are passed as contiguous copies), and the
    autocast state. A signature is traced with symbolic sizes (``make_fx``, :func:`trace_region`) and compiled
    (inductor); the trace's assumptions about sizes (:func:`_guard_text`) are checked on every call, so one
    compile serves every batch size and sequence length it holds for, and another size pattern compiles its own
    graph. The check is a few integer comparisons (dynamo's per-call guard evaluation costs tens of microseconds,
    which a training step pays per merge).

    Two ways to call it, sharing the compiled graphs:

    * ``region(*args)`` compiles a new signature before returning (seconds, more with a cold inductor cache;
      a one-line notice says so the first time in a process);
    * ``region.background(*args)`` never waits for a compiler: a new signature is queued to one background
      process per Python process (:mod:`lightning_resctl._background_compile`; lower CPU priority, the same
      inductor cache) and ``fn`` runs eagerly until its graph is ready, then the compiled graph is loaded at the
      next call of that signature. :func:`wait_for_compiles` waits for the queue (benchmarks).
      ``fn`` must be importable by its module and qualified name; others compile as ``region(*args)`` does.

    Every trace and compile of the process holds :data:`COMPILE_LOCK`, so first calls from several threads
    compile one after another. Falls back to eager ``fn``, always with the same result:

    * under grad mode with an input that requires grad (autograd then records the eager ops), for tensor
      subclasses or devices other than CPU / CUDA, while a dispatch or function mode is active (a FLOP counter,
      fake tensors), and while ``torch.jit.trace`` / ONNX export / ``torch.export`` / FX tracing records the ops;
    * past ``max_graphs`` compiled graphs (a warning, once per region: the math is the same, only slower; MGR with
      n streams needs n + 3 graphs per dtype and size pattern, its accumulating steps specializing on the stream
      count);
    * for a signature whose compile or compiled run failed (a warning, once per signature, naming it; other
      signatures still compile). A genuine error of the inputs is then raised by the eager call.

    ``failed`` maps each failed signature (described) to its error; ``first_call_s`` is the wall time of the
    first call that compiled before returning; ``compiled_calls`` / ``eager_calls`` count the calls each way
    (:func:`region_calls` sums them over the process, for tests and benchmarks)."""

    def __init__(self, fn, max_graphs: int = 16):
        self.fn = fn
        self.max_graphs = max_graphs
        self.entries: dict = {}  # signature -> [(compiled, out_spec, guard), ...]
        self.pending: dict = {}  # (signature, sizes) -> background compile (a Future)
        self._guard_texts: dict = {}  # signature -> the size guards of its graphs (a duplicate compile is dropped)
        self.failed: dict = {}   # described signature -> error
        self._failed_sigs: set = set()
        self.num_graphs = 0
        self.compiled_calls = 0  # calls served by a compiled graph
        self.eager_calls = 0     # calls that ran ``fn`` eagerly (see the class docstring for when)
        self.first_call_s: Optional[float] = None
        self._warned_limit = False
        functools.update_wrapper(self, fn)
        _REGIONS.add(self)

    def __call__(self, *args):
        return self._call(args, False)

    def background(self, *args):
        """Like calling the region, but a signature without a compiled graph runs ``fn`` eagerly while its graph
        is compiled in the background process (see the class docstring)."""
        return self._call(args, True)

    # ------------------------------------------------------------------ call path
    def _call(self, args, background: bool):
        entry = self._entry(args, background)
        if entry is None:
            self.eager_calls += 1
            return self.fn(*args)
        sig, entry, tensors = entry
        self.compiled_calls += 1
        return self._run(sig, entry, args, tensors)

    def _entry(self, args, background: bool):
        """``(signature, compiled entry, contiguous tensors)`` for this call, or None when it runs eagerly."""
        tensors: list = []
        key = _flatten(args, tensors)
        if key is None or not _plain_call(tensors):
            return None
        sig = (key, _ambient())
        if sig in self._failed_sigs:
            return None
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # the compiled code reads rows
        entry = self._lookup(sig, tensors)
        if entry is None and self.pending:  # (a call that compiles before returning waits for them)
            entry = self._collect(sig, tensors, wait=not background)
        if entry is None:
            if background and _background_compiler_for(self.fn, tensors) is not None:
                self._submit(sig, args, tensors)
                return None
            entry = self._compile_now(sig, args, tensors)
        return None if entry is None else (sig, entry, tensors)

    def _lookup(self, sig, tensors):
        for entry in self.entries.get(sig, ()):
            if entry[2](tensors):
                return entry
        return None

    def _room(self) -> bool:
        if self.num_graphs + len(self.pending) < self.max_graphs:
            return True
        if not self._warned_limit:
            self._warned_limit = True
            warnings.warn(f"lightning_resctl: {self.__name__} has compiled its limit of {self.max_graphs} graphs "
                          f"(one per call signature and size pattern); calls needing another graph run eagerly "
                          f"(same result, slower)", RuntimeWarning, stacklevel=5)
        return False

    def _run(self, sig, entry, args, tensors):
        compiled, out_spec, _ = entry
        try:
            outs = compiled(*tensors)
        except Exception as err:  # noqa: BLE001 - any failure of the compiled code: eager for this signature
            self._fail(sig, err)
            self.compiled_calls -= 1
            self.eager_calls += 1
            return self.fn(*args)
        return _unflatten(outs, out_spec)

    # ------------------------------------------------------------------ compiling before returning
    def _compile_now(self, sig, args, tensors):
        from torch._inductor.compile_fx import compile_fx

        with COMPILE_LOCK:
            entry = self._lookup(sig, tensors)  # another thread may have compiled it meanwhile
            if entry is not None or sig in self._failed_sigs:
                return entry
            if not self._room():
                return None
            _notice("compile", f"lightning_resctl: compiling {self.__name__} (and the other merge math) with "
                               "inductor before the call returns; the first compile in a process takes seconds, "
                               "more with a cold cache (backend='torch-eager' or LIGHTNING_RESCTL_COMPILE=0 "
                               "skips compiling)")
            t0 = time.perf_counter()
            try:
                graph, examples, text, out_spec = trace_region(self.fn, args, tensors)
                guard = _guard_from_text(text)
                if not guard(tensors):
                    raise RuntimeError("the trace's size guard rejects its own example inputs")
                entry = (compile_fx(graph, examples), out_spec, guard)
            except Exception as err:  # noqa: BLE001 - any compiler failure: eager for this signature
                self._fail(sig, err)
                return None
            self._add(sig, entry, text)
            if self.first_call_s is None:
                self.first_call_s = time.perf_counter() - t0
            return entry

    # ------------------------------------------------------------------ compiling in the background
    def _add(self, sig, entry, guard_text: str) -> None:
        texts = self._guard_texts.setdefault(sig, set())
        if guard_text not in texts:
            texts.add(guard_text)
            self.entries.setdefault(sig, []).append(entry)
            self.num_graphs += 1

    def _submit(self, sig, args, tensors) -> None:
        """Queue ``sig`` for these sizes: every size pattern of a signature (e.g. MGR's accumulating merges, one
        per stream count) is queued at its first call, so one :func:`wait_for_compiles` after the first step
        covers them all. Which sizes need a graph of their own is only known once traced, so calls are told
        apart by their small sizes (<= :data:`_SMALL_SIZE`: what traces specialize on, e.g. a stream count),
        and large ones (tokens, features) count as one: a changing sequence length queues no extra compile.
        Sizes another pending compile will serve may be compiled twice; the second graph is dropped."""
        key = (sig, tuple(tuple(n if n <= _SMALL_SIZE else -1 for n in t.shape) for t in tensors))
        with COMPILE_LOCK:
            if key in self.pending or not self._room():
                return
            compiler = _background_compiler_for(self.fn, tensors)
            _notice("background", f"lightning_resctl: compiling {self.__name__} (and the other merge math) in a "
                                  "background process; the merges run eagerly until it is ready")
            self.pending[key] = compiler.submit(self.fn, args, sig[1])

    def _collect(self, sig, tensors, wait: bool):
        """Load the finished background compiles of ``sig`` (``wait``: wait for all of them); the entry that
        serves ``tensors``, or None."""
        with COMPILE_LOCK:
            for key in [k for k, f in self.pending.items() if k[0] == sig and (wait or f.done())]:
                future = self.pending.pop(key)
                try:
                    from torch._inductor import CompiledArtifact

                    result = future.result()
                    if "error" in result:
                        raise RuntimeError(result["error"])
                    compiled = CompiledArtifact.load(path=result["path"], format="binary")
                    os.remove(result["path"])
                    tree, kinds, constants = result["spec"]
                    entry = (compiled, (treespec_loads(tree), kinds, constants), _guard_from_text(result["guard"]))
                except Exception as err:  # noqa: BLE001 - any compiler failure: eager for this signature
                    self._fail(sig, err)
                    return None
                self._add(sig, entry, result["guard"])
            return self._lookup(sig, tensors)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for this region's background compiles (at most ``timeout`` seconds); True when none is left.
        Their graphs are loaded at the next call of each signature."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in list(self.pending.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(left)
            except Exception:  # noqa: BLE001 - a timeout; failures are reported when collected
                return False
        return True

    # ------------------------------------------------------------------ failures
    def _fail(self, sig, err: BaseException) -> None:
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        with COMPILE_LOCK:
            if sig in self._failed_sigs:
                return
            self._failed_sigs.add(sig)
            self.failed[_describe(sig)] = msg
        warnings.warn(f"lightning_resctl: compiling {self.__name__} for the call signature {_describe(sig)} failed "
                      f"({msg}); that signature runs the torch path eagerly, others still compile (set "
                      f"{COMPILE_ENV}=0 or backend='torch-eager' to skip compiling)", RuntimeWarning, stacklevel=5)


def _background_compiler_for(fn, tensors):
    """The process's background compiler when ``fn``'s signature can be compiled there (CPU tensors, ``fn``
    importable by name, inductor can save what it compiled), else None."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    from . import _background_compile

    return _background_compile.compiler_for(fn)


def region_calls() -> dict:
    """``{region name: (graphs, compiled calls, eager calls)}`` over every live region of this process (regions of
    one name added up): after :func:`wait_for_compiles`, a steady state whose eager count still grows runs some
    signature eagerly for good."""
    out: dict = {}
    for region in list(_REGIONS):
        g, c, e = out.get(region.__name__, (0, 0, 0))
        out[region.__name__] = (g + region.num_graphs, c + region.compiled_calls, e + region.eager_calls)
    return out


def wait_for_compiles(timeout: Optional[float] = None) -> bool:
    """Wait until every region's background compiles of this process have finished (at most ``timeout``
    seconds); True when none is left. The next call of each signature then runs its compiled graph. For
    benchmarks that time the steady state; training needs no wait."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for region in list(_REGIONS):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not region.wait(left):
            return False
    return True
