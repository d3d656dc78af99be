"""Compiled CPU regions: a rule's torch-path math as one inductor region per direction.

:class:`CompiledRegion` compiles a function per call signature (traced by :mod:`lightning_resctl.runtime.tracer`,
compiled before the call returns or in the background process of :mod:`lightning_resctl.runtime.background`);
:class:`CompiledMath` holds a rule's math functions and their regions for a :func:`~.backends.torch_mode`.
:func:`wait_for_compiles` and :func:`region_calls` are for benchmarks and tests.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from typing import Optional

import torch
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode
from torch.utils._pytree import treespec_loads

from .backends import COMPILE_ENV, cpu_compile_available
from .log import rank_zero_line
from .tracer import (
    COMPILE_LOCK,
    COMPILED_DEVICES,
    ambient,
    compiling,
    compiling_elsewhere,
    flatten_signature,
    guard_from_text,
    trace_region,
    unflatten_output,
)

__all__ = ["CompiledMath", "CompiledRegion", "wait_for_compiles", "region_calls"]

#: Sizes up to this tell background compiles of one signature apart (:meth:`CompiledRegion._submit`); ours.
_SMALL_SIZE = 16


class CompiledMath:
    """A rule's torch-path math functions (e.g. forward and backward) and their :class:`CompiledRegion` s, made
    on first use (one set per process, shared by every model): ``CompiledMath(fwd, bwd)(mode)`` returns the
    callables for a :func:`torch_mode` — the plain functions for "eager" (or without a C++ compiler), the regions
    for "compiled", the regions' :meth:`CompiledRegion.background` for "background"."""

    def __init__(self, *fns, rule: Optional[str] = None):
        self.fns = fns
        self.rule = rule  # the rule's name, for the notices the regions print (what the user passed as method=)
        self.regions: Optional[tuple] = None

    def __call__(self, mode: str) -> tuple:
        if mode not in ("compiled", "background") or torch.compiler.is_compiling() or not cpu_compile_available():
            return self.fns
        if self.regions is None:
            self.regions = tuple(CompiledRegion(fn, rule=self.rule) for fn in self.fns)
        if mode == "compiled":
            return self.regions
        return tuple(region.background for region in self.regions)


def _under_a_tracer() -> bool:
    """``torch.jit.trace`` (and the ONNX exporter built on it), ``torch.export`` or FX symbolic tracing is
    recording the ops: they must see the eager math, not a call into compiled code. FX's flag is process-wide: a
    region's trace or compile in another thread sets it too, and does not count (:func:`~.tracer.compiling`)."""
    return (torch.jit.is_tracing() or torch.compiler.is_exporting()
            or (fx_symbolic_trace.is_fx_symbolic_tracing() and not compiling_elsewhere()))


def _plain_call(tensors: list) -> bool:
    """Whether compiled code may stand in for the eager math here: plain tensors on CPU / CUDA, no autograd to
    record, no dispatch or function mode active (e.g. Lightning's FLOP counter, a fake-tensor mode), no tracer
    recording (:func:`_under_a_tracer`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type not in COMPILED_DEVICES
           for t in tensors):
        return False
    return (_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()
            and not _under_a_tracer())


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

    casts = [f"autocast {d} {str(dt).replace('torch.', '')}" for d, (on, dt) in zip(COMPILED_DEVICES, ambient) if on]
    return "(" + ", ".join(one(k) for k in key) + ")" + ("".join(" under " + c for c in casts))


class CompiledRegion:
    """``fn`` (pure tensor math: no in-place update of its inputs) compiled by inductor, and called without
    dynamo.

    Calls are grouped by signature: the arguments' structure and non-tensor values (baked into the graph as
    constants), each tensor's dtype, device type and rank (strided views are passed as contiguous copies), and the
    autocast state. A signature is traced with symbolic sizes (``make_fx``, :func:`~.tracer.trace_region`) and compiled
    (inductor); the trace's assumptions about sizes (:func:`~.tracer.guard_text`) are checked on every call, so one
    compile serves every batch size and sequence length it holds for, and another size pattern compiles its own
    graph. The check is a few integer comparisons (dynamo's per-call guard evaluation costs tens of microseconds,
    which a training step pays per merge).

    Two ways to call it, sharing the compiled graphs:

    * ``region(*args)`` compiles a new signature before returning (seconds, more with a cold inductor cache;
      a one-line notice says so the first time in a process);
    * ``region.background(*args)`` never waits for a compiler: a new signature is queued to one background
      process per Python process (:mod:`lightning_resctl.runtime.background`; lower CPU priority, the same
      inductor cache) and ``fn`` runs eagerly until its graph is ready, then the compiled graph is loaded at the
      next call of that signature. :func:`wait_for_compiles` waits for the queue (benchmarks).
      ``fn`` must be importable by its module and qualified name; others compile as ``region(*args)`` does.

    Every trace and compile of the process holds :data:`COMPILE_LOCK` (:func:`~.tracer.compiling`), so first calls
    from several threads compile one after another. Falls back to eager ``fn``, always with the same result:

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

    def __init__(self, fn, max_graphs: int = 16, rule: Optional[str] = None):
        self.fn = fn
        self.math = f"the {rule} rule's math" if rule else "the merge rule's math"  # how the notices name it
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
        key = flatten_signature(args, tensors)
        if key is None or not _plain_call(tensors):
            return None
        sig = (key, ambient())
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
        return unflatten_output(outs, out_spec)

    # ------------------------------------------------------------------ compiling before returning
    def _compile_now(self, sig, args, tensors):
        from torch._inductor.compile_fx import compile_fx

        with compiling():
            entry = self._lookup(sig, tensors)  # another thread may have compiled it meanwhile
            if entry is not None or sig in self._failed_sigs:
                return entry
            if not self._room():
                return None
            _notice("compile", f"lightning_resctl: compiling {self.math} with inductor before the first "
                               "step continues; the first compile in a process takes seconds, more with a cold "
                               "cache (backend='torch-eager' or LIGHTNING_RESCTL_COMPILE=0 skips compiling)")
            t0 = time.perf_counter()
            try:
                graph, examples, text, out_spec = trace_region(self.fn, args, tensors)
                guard = guard_from_text(text)
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
            _notice("background", f"lightning_resctl: compiling {self.math} in a background process; "
                                  "the first steps run it eagerly (same results, slower) until it is ready")
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
                    entry = (compiled, (treespec_loads(tree), kinds, constants), guard_from_text(result["guard"]))
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
    from . import background

    return background.compiler_for(fn)


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
