"""The tracer of the compiled regions: a call's signature (:func:`flatten_signature`, :func:`rebuild_args`), its
symbolic trace (:func:`trace_region`), the sizes the trace assumed (:func:`guard_text`, :func:`guard_from_text`) and
the output rebuilt from the graph's tensors (:func:`unflatten_output`).

Shared by :mod:`lightning_resctl.runtime.regions` (in this process) and :mod:`lightning_resctl.runtime.background`
(the background compiler's child), which import it and not each other.
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["COMPILE_LOCK", "COMPILED_DEVICES", "ambient", "compiling", "compiling_elsewhere", "flatten_signature",
           "rebuild_args", "guard_text", "guard_from_text", "trace_region", "unflatten_output", "set_ambient"]

#: Device types whose tensors a region compiles for.
COMPILED_DEVICES = ("cpu", "cuda")
#: Held around every trace and compile of every region of this process: ``make_fx`` and inductor keep
#: process-wide state (torch.fx's "is tracing" flag, the patcher), so two traces at once corrupt it.
COMPILE_LOCK = threading.RLock()
_COMPILING_THREAD: Optional[int] = None  # the thread inside :func:`compiling`, if any


@contextlib.contextmanager
def compiling():
    """Hold :data:`COMPILE_LOCK` for a trace and compile, marking this thread as the one compiling. torch.fx's
    "is tracing" flag is process-wide: ``make_fx`` and inductor's own passes set it, and it then reads as set in
    every thread (:func:`compiling_elsewhere`)."""
    global _COMPILING_THREAD
    with COMPILE_LOCK:
        outer, _COMPILING_THREAD = _COMPILING_THREAD, threading.get_ident()
        try:
            yield
        finally:
            _COMPILING_THREAD = outer


def compiling_elsewhere() -> bool:
    """Whether another thread of this process is tracing or compiling a region (:func:`compiling`): torch.fx's
    "is tracing" flag may then be its, not a tracer's recording this thread's ops."""
    owner = _COMPILING_THREAD
    return owner is not None and owner != threading.get_ident()


def flatten_signature(args, tensors: list) -> Optional[tuple]:
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
            inner = flatten_signature(a, tensors)
            if inner is None:
                return None
            out.append((type(a), inner))
        elif isinstance(a, (int, float, str, bool, type(None))):
            out.append((type(a), a))
        else:
            return None
    return tuple(out)


def rebuild_args(template, tensors, slot=torch.Tensor):
    """``template`` (a call's arguments) with its ``slot`` instances (tensors) replaced, in order, from the
    iterator ``tensors``."""
    out = []
    for a in template:
        if isinstance(a, slot):
            out.append(next(tensors))
        elif isinstance(a, (tuple, list)):
            out.append(type(a)(rebuild_args(a, tensors, slot)))
        else:
            out.append(a)
    return out


def guard_text(examples: list) -> str:
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


def guard_from_text(body: str) -> Callable[[list], bool]:
    """``guard(tensors) -> bool`` from :func:`guard_text` (a few integer comparisons per call)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return eval(f"lambda t: {body}", dict(SYMPY_INTERP))  # noqa: S307 - built from a trace's own guards


_SIZE_REF = re.compile(r"L\['t(\d+)'\]\.size\(\)\[(\d+)\]")


def trace_region(fn, args, tensors: list):
    """Trace ``fn(*args)`` (its tensors replaced by ``tensors``, in order) with symbolic sizes (``make_fx``).

    Returns ``(graph, examples, guard_text, out_spec)``: the graph returns the tensors among the flat leaves of
    ``fn``'s output (:func:`unflatten_output` with ``out_spec`` rebuilds the output, its other leaves — None, Python
    scalars — as they were), ``examples`` are its fake inputs, ``guard_text`` the sizes it assumed
    (:func:`guard_text`). Call it inside :func:`compiling`."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec: list = []

    def flat(*ts):
        leaves, tree = tree_flatten(fn(*rebuild_args(args, iter(ts))))
        kinds = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
        spec.append((tree, kinds, tuple(None if k else leaf for k, leaf in zip(kinds, leaves))))
        return tuple(leaf for leaf, k in zip(leaves, kinds) if k)

    graph = make_fx(flat, tracing_mode="symbolic")(*tensors)
    examples = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
    return graph, examples, guard_text(examples), spec[-1]


def unflatten_output(outs, out_spec):
    """The output of the traced function from its graph's tensors ``outs`` (see :func:`trace_region`)."""
    tree, kinds, constants = out_spec
    it = iter(outs)
    return tree_unflatten([next(it) if k else c for k, c in zip(kinds, constants)], tree)


def ambient() -> tuple:
    """Global state a trace bakes into its graph: autocast on / off and its dtype, per device type."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in COMPILED_DEVICES)


def set_ambient(state: tuple) -> None:
    """Set the autocast state :func:`ambient` returned (the background compiler traces under its parent's)."""
    for d, (on, dtype) in zip(COMPILED_DEVICES, state):
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dtype)
