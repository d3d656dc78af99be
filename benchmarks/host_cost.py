"""What one merge costs on the host besides its kernels: Python calls, dispatcher ops, allocations, autograd nodes.

A GPU training step at GPT-2-small width spends ~10 µs of device time per merge and pass; a merge whose host code
takes longer leaves the GPU waiting. This measures the host side of one merge, forward and backward, on CPU with tiny
tensors, the kernels' launches stubbed out (what is left is the rule's own Python, its argument checks, its
allocations and the autograd bookkeeping; a Triton launch adds 6-13 µs on a GPU, docs gpu.md, whatever the rule):

* ``python benchmarks/host_cost.py`` — deterministic counts per merge: Python function calls (``sys.setprofile``),
  split into the package's own and torch's, aten ops (dispatches) and allocations, beside a plain residual add's
  forward + backward through the same autograd engine;
* ``python benchmarks/host_cost.py --time`` — wall clock of the same calls (median of many, µs), as a ratio to the
  plain add's forward + backward (goal, issue 55: <= 2x). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path on CPU tensors (its launches are stubbed here)

import torch  # noqa: E402

__all__ = ["stub_launches", "python_calls", "merge_steps", "plain_step", "main"]


@contextlib.contextmanager
def stub_launches():
    """Every Triton launch returns at once (nothing runs, nothing is written): the host code around it remains."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
    for cls, _ in saved:
        cls.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for cls, run in saved:
            cls.run = run


def python_calls(fn: Callable[[], None]) -> Counter:
    """Python function calls made while ``fn()`` runs, by where their code lives: "package" (lightning_resctl and
    its kernels), "torch", "other"; and "builtin" (C functions called from Python)."""
    counts: Counter = Counter()
    package = str(ROOT)

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            counts["package" if path.startswith(package) and "benchmarks" not in path else
                   "torch" if f"{os.sep}torch{os.sep}" in path else "other"] += 1
        elif event == "c_call":
            counts["builtin"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def _tiny(dtype=torch.float32, c=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, c, generator=g).to(dtype)


def plain_step():
    """A plain residual add, forward + backward (the yardstick)."""
    r, u = _tiny().requires_grad_(), _tiny(seed=1).requires_grad_()
    g = _tiny(seed=2)

    def step():
        out = r + u
        torch.autograd.backward(out, g)
    return step


def merge_steps() -> dict:
    """name -> a function running one merge forward + backward on the Triton path (launches to be stubbed): the
    merge in the middle of a chain, its inputs made before."""
    from lightning_resctl.rules import make_rule
    from lightning_resctl.rules.mgr import MGRChain
    from lightning_resctl.rules.rescontroller import ResController

    steps = {}
    merge = ResController(backend="triton")
    r, u = _tiny().requires_grad_(), _tiny(seed=1).requires_grad_()
    g = _tiny(seed=2)

    def rescontroller():
        torch.autograd.backward(merge(r, u), g)
    steps["rescontroller"] = rescontroller

    for invert in (False, True):
        chain = MGRChain(16, 6, streams=4, backend="triton", invert=invert)
        s = torch.randn(2, 4, 16, requires_grad=True)
        uu = _tiny(seed=1).requires_grad_()
        position = 4

        def mgr(chain=chain, s=s, uu=uu, position=position):
            chain.start(s[:, 0])  # a forward's run (the inversion's), as the chain's first merge makes it
            out, h = chain.step(position, s, uu)
            torch.autograd.backward((out, h), (torch.ones_like(out), torch.ones_like(h)))
        steps[f"mgr n=4 competitive{' inverted' if invert else ''}"] = mgr

    for method in ("attnres", "attnres-block"):
        rule = make_rule(method, {"backend": "triton", **({"block_size": 2} if method == "attnres-block" else {})})
        chain = rule.build_chain(16, 4)
        x = _tiny().requires_grad_()

        def attnres(rule=rule, chain=chain, x=x):
            state = rule.start(chain, x)
            state, h = rule.step(chain, 0, state, _tiny(seed=3).requires_grad_(), 1)
            torch.autograd.backward(h, torch.ones_like(h))
        steps[method] = attnres
    return steps


def _time(fn: Callable[[], None], reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time", action="store_true", help="also the wall clock per merge (run on a quiet machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    plain = plain_step()
    with stub_launches():
        steps = merge_steps()
        base = python_calls(plain)
        print("one merge, forward + backward, tiny CPU tensors, Triton launches stubbed (their host code not counted)")
        head = f"{'':<36}{'package':>9}{'torch':>7}{'builtin':>9}"
        print(head + ("   µs     / plain add" if args.time else ""))
        plain_us = _time(plain) if args.time else None
        print(f"{'plain add (yardstick)':<36}{base['package']:>9}{base['torch']:>7}{base['builtin']:>9}"
              + (f"{plain_us:>7.1f}  1.00x" if args.time else ""))
        for name, step in steps.items():
            step()  # (first call: imports, caches)
            calls = python_calls(step)
            line = f"{name:<36}{calls['package']:>9}{calls['torch']:>7}{calls['builtin']:>9}"
            if args.time:
                us = _time(step)
                line += f"{us:>7.1f}  {us / plain_us:.2f}x"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
