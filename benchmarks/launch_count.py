"""What one merge launches, forward and backward: Triton kernels and the torch ops around them (deterministic).

A merge's cost on a GPU starts with what it launches: every Triton kernel and every torch op that runs a device
kernel (a cast, a reduction, a copy, a fill) costs a launch (5-13 µs from Python, docs gpu.md) before it moves a
byte. This counts them for one call, on any device: the Triton launches (``JITFunction.run`` on a GPU, the
interpreter's ``InterpretedFunction.run`` on CPU, ``TRITON_INTERPRET=1``), and every aten op that reaches the
dispatcher outside a launch, sorted into

* ``kernels``: ops that run a device kernel (everything below that is not a view or an allocation);
* ``allocations``: ``empty`` / ``empty_strided`` / ``new_empty`` (no kernel; host cost only);
* ``views``: ops that only make a view or read metadata, returning no tensor (no kernel, no memory).

:func:`count_merge` runs one forward under a counter and the backward of the merge's autograd node(s) only (the
node's pre- and post-hooks switch the counter on and off, so the branches' and the test's own ops are not counted;
the autograd engine's casts of the node's outputs are). ``python benchmarks/launch_count.py`` prints the table
for every rule on its Triton path (``backend="triton"``: what ``"auto"`` picks for a CUDA tensor), n = 4 for MGR,
fp32 streams (MGR's default inversion on) and bf16 ones, with an fp32 stream and a bf16 update as under autocast.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["Counts", "LaunchCounter", "count_forward", "count_backward", "count_merge", "ALLOCATIONS"]

#: aten ops that allocate without running a kernel
ALLOCATIONS = frozenset({"empty.memory_format", "empty_strided.default", "new_empty.default",
                         "new_empty_strided.default", "empty_like.default"})
#: aten ops that read metadata or make an alias without being a view op of the schema (no kernel)
_NO_KERNEL = frozenset({"detach.default", "alias.default", "lift_fresh.default", "_unsafe_view.default",
                        "sym_size.int", "sym_stride.int", "sym_numel.default", "sym_storage_offset.default",
                        "is_same_size.default", "_local_scalar_dense.default"})


@dataclass
class Counts:
    """What ran: ``triton`` launches by kernel name, ``kernels`` (aten ops that launch a device kernel),
    ``allocations`` and ``views`` by op name."""

    triton: Counter = field(default_factory=Counter)
    kernels: Counter = field(default_factory=Counter)
    allocations: Counter = field(default_factory=Counter)
    views: Counter = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        """Device kernels: Triton launches plus the aten ops that run a kernel."""
        return sum(self.triton.values()) + sum(self.kernels.values())

    def describe(self) -> str:
        def names(c: Counter) -> str:
            return ", ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in sorted(c.items())) or "-"

        return (f"{self.launches} launches (triton: {names(self.triton)}; torch: {names(self.kernels)}); "
                f"{sum(self.allocations.values())} allocations, {sum(self.views.values())} views")


def _triton_classes() -> list:
    """The Triton classes whose ``run`` is one launch (compiled and interpreted)."""
    out = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        out.append(JITFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        out.append(InterpretedFunction)
    return out


class LaunchCounter(TorchDispatchMode):
    """Counts Triton launches and aten ops while ``active`` (a dispatch mode; Triton's ``run`` patched while
    entered). Ops inside a launch (the interpreter's copies to and from the host) are not counted."""

    def __init__(self, active: bool = True):
        super().__init__()
        self.active = active
        self.counts = Counts()
        self._in_launch = 0
        self._patched: list = []

    def __enter__(self):
        for cls in _triton_classes():
            original = cls.run
            counter = self

            def run(kernel, *args, _original=original, **kwargs):
                if counter.active and not counter._in_launch:
                    counter.counts.triton[getattr(kernel, "__name__", str(kernel))] += 1
                counter._in_launch += 1
                try:
                    return _original(kernel, *args, **kwargs)
                finally:
                    counter._in_launch -= 1

            cls.run = run
            self._patched.append((cls, original))
        return super().__enter__()

    @contextlib.contextmanager
    def _reentered(self):
        """This mode pushed again (inside ``__torch_dispatch__`` it is not on the stack), Triton left as patched."""
        from torch.utils._python_dispatch import _pop_mode, _push_mode

        _push_mode(self)
        try:
            yield
        finally:
            _pop_mode()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for cls, original in reversed(self._patched):
                cls.run = original
            self._patched.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func._schema.name.partition("::")
        if namespace not in ("aten", "prims"):  # a custom op (torch.library): count what its kernel runs
            impl = _custom_op_impl(func)
            if impl is not None:
                with self._reentered():
                    return impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.active and not self._in_launch:
            name = f"{op}.{func._overloadname}"
            if name in ALLOCATIONS:
                self.counts.allocations[name] += 1
            elif func.is_view or name in _NO_KERNEL or not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
                self.counts.views[name] += 1  # (an op returning no tensor reads metadata: no kernel)
            else:
                self.counts.kernels[name] += 1
        return out


def _custom_op_impl(func) -> Optional[Callable]:
    """The Python implementation of a ``torch.library.custom_op`` (None for other ops)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    return None if opdef is None else (opdef._backend_fns.get(None) or opdef._init_fn)


def _nodes_of(outputs: Iterable[torch.Tensor], stop: set) -> list:
    """The autograd nodes that produced ``outputs`` and their producers, up to the nodes in ``stop`` (the inputs'
    nodes) and the leaves: the merge's own backward nodes."""
    seen, stack, out = set(), [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            continue
        out.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return out


def count_forward(merge: Callable[[], object]) -> tuple[Counts, object]:
    """``(counts, outputs)`` of one call ``merge()``."""
    with LaunchCounter() as fwd:
        outputs = merge()
    return fwd.counts, outputs


def count_backward(outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor],
                   run_backward: Optional[Callable[[], None]] = None) -> Counts:
    """What the backward of one merge runs: the autograd nodes between its ``outputs`` and its ``inputs`` (the
    merge's own nodes, whatever their number) are counted while they run, during ``run_backward()`` (default: a
    backward of the outputs with random gradients; pass the whole model's backward when the merge's backward needs
    what later merges' backwards hand it, e.g. MGR's inversion)."""
    outputs = [o for o in tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    stop = {t.grad_fn for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    if run_backward is None:
        grads = [torch.randn_like(o) for o in outputs]

        def run_backward():
            torch.autograd.backward(outputs, grads)

    counter = LaunchCounter(active=False)
    handles = []
    for node in _nodes_of(outputs, stop):
        handles.append(node.register_prehook(lambda *a: setattr(counter, "active", True)))
        handles.append(node.register_hook(lambda *a: setattr(counter, "active", False)))
    try:
        with counter:
            run_backward()
    finally:
        for h in handles:
            h.remove()
    return counter.counts


def count_merge(merge: Callable[[], object], inputs: Iterable[torch.Tensor]) -> tuple[Counts, Counts]:
    """``(forward, backward)`` counts of one merge whose outputs ``merge()`` computes from ``inputs``."""
    fwd, outputs = count_forward(merge)
    return fwd, count_backward(outputs, inputs)


def main(argv=None) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks.merge_cases import CASES

    print("Per merge, on the path backend='auto' picks for a CUDA tensor (Triton; on CPU under TRITON_INTERPRET=1):")
    for name, case in CASES.items():
        fwd, bwd = case()
        print(f"{name:<44} forward:  {fwd.describe()}")
        print(f"{'':<44} backward: {bwd.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
