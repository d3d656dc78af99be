"""What a whole-model ``torch.compile`` sees of each rule: no timing, the compiled graph itself.

    python benchmarks/compiled_graph.py [--layers 12 --C 256 --T 64 --batch 8] [--rules NAMES] [--inductor]
                                        [--saved-by-shape N]

Per rule, for one training step (forward + backward) of the nanoGPT with the rule patched in, compiled whole
(``fullgraph=True``: a graph break raises):

* the ops AOTAutograd hands to the compiler, forward and backward, and any that are not aten / prims ops
  (an opaque op: what inductor cannot fuse with its neighbours);
* the activations the partitioner saves for backward (min-cut rematerialization, inductor's; parameters and
  inputs left out), in bytes, as a ratio to the compiled plain model's;
* ``--saved-by-shape N``: what the saved bytes are, beyond plain's: the N (shape, dtype) groups of saved
  activations with the most bytes more than plain saves of that group, with their count per step;
* ``--inductor``: the kernels inductor generates (forward / backward; C++ kernels on CPU, Triton kernels on
  CUDA, library calls such as ``mm`` apart) and the compile time of the first step, as a ratio to plain's
  (wall clock: run it on a quiet machine).

:class:`GraphCapture` and :func:`opaque_calls` are shared with ``tests/test_region_whole_model_compile.py``.
"""
from __future__ import annotations

import argparse
import operator
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import NanoGPT, add_step_arguments, gpt_loss  # noqa: E402

__all__ = ["GraphCapture", "opaque_calls", "call_count"]


class GraphCapture:
    """A ``torch.compile`` backend that keeps the forward and backward graphs AOTAutograd partitions with the
    partitioner inductor uses (min-cut rematerialization), and runs them as they are (no inductor)."""

    def __init__(self):
        self.forward: list = []
        self.backward: list = []

    def __call__(self, gm, example_inputs):
        def keep(graphs):
            def compiler(graph, _):
                graphs.append(graph)
                return make_boxed_func(graph)
            return compiler
        return aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    def saved(self) -> list:
        """The activations the forward graphs save for their backward graphs (the graphs' own inputs, the
        parameters among them, left out), as fake tensors."""
        return [node.meta["val"] for graph in self.backward for node in graph.graph.nodes
                if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
                and not node.name.startswith(("tangents", "primals"))]

    def saved_bytes(self) -> int:
        """Bytes of :meth:`saved`."""
        return sum(t.numel() * t.element_size() for t in self.saved())

    def saved_by_shape(self) -> dict:
        """``{(shape, dtype): (count, bytes)}`` of :meth:`saved`."""
        groups: dict = {}
        for t in self.saved():
            key = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            count, size = groups.get(key, (0, 0))
            groups[key] = (count + 1, size + t.numel() * t.element_size())
        return groups


def _calls(graphs):
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                yield node.target


def opaque_calls(graphs) -> set:
    """Call targets of ``graphs`` that are not aten / prims ops: what inductor cannot look into."""
    return {str(t) for t in _calls(graphs)
            if not (isinstance(t, torch._ops.OpOverload) and t.namespace in ("aten", "prims"))}


def call_count(graphs) -> int:
    """The number of op calls in ``graphs``."""
    return sum(1 for _ in _calls(graphs))


def _model(args, method):
    torch.manual_seed(0)
    model = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=args.layers, n_head=args.heads, n_embd=args.C)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0))
    if method != "plain":
        from lightning_resctl import patch_residuals

        patch_residuals(model, method=method, example_input=idx[:2])
    return model.to(args.device), idx.to(args.device)


def graph_row(args, method: str) -> dict:
    """The traced graphs of one rule (no inductor)."""
    torch._dynamo.reset()
    model, idx = _model(args, method)
    capture = GraphCapture()
    gpt_loss(torch.compile(model, backend=capture, fullgraph=True), idx).backward()
    return {"fw ops": call_count(capture.forward), "bw ops": call_count(capture.backward),
            "opaque": sorted(opaque_calls(capture.forward + capture.backward)), "saved": capture.saved_bytes(),
            "saved by shape": capture.saved_by_shape()}


def saved_beyond(row: dict, plain: dict, top: int) -> str:
    """The ``top`` (shape, dtype) groups ``row`` saves the most bytes more of than ``plain``: "count x shape dtype
    (+MiB)"."""
    base = plain["saved by shape"]
    extra = sorted(((size - base.get(key, (0, 0))[1], key, count) for key, (count, size) in
                    row["saved by shape"].items()), reverse=True)[:top]
    return ", ".join(f"{count} x {list(shape)} {dtype} ({more / 2**20:+.2f} MiB)"
                     for more, (shape, dtype), count in extra if more > 0)


_KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\(", re.M)
_EXTERN = re.compile(r"extern_kernels\.(\w+)\(")


def inductor_row(args, method: str) -> dict:
    """The kernels inductor generates for one training step, and the compile time (first step)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, idx = _model(args, method)
    compiled = torch.compile(model, fullgraph=True)
    t0 = time.perf_counter()
    _, codes = run_and_get_code(lambda: gpt_loss(compiled, idx).backward())
    seconds = time.perf_counter() - t0
    kernels = [len(_KERNEL.findall(code)) for code in codes]
    extern = [len(_EXTERN.findall(code)) for code in codes]
    return {"kernels": kernels, "library calls": extern, "compile s": seconds}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p)  # the step benchmarks' shape (--reps / --warmup unused: nothing is timed per step)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rules", default="add,rescontroller,mgr-competitive,mgr-independent,attnres,attnres-block,hc,"
                                      "mhc,mhc-lite,dwa,laurel,laurel-pa,ddl,kromhc")
    p.add_argument("--inductor", action="store_true", help="also compile with inductor: kernels, compile time")
    p.add_argument("--saved-by-shape", type=int, default=0, metavar="N",
                   help="the N groups of saved activations (shape, dtype) with the most bytes beyond plain's")
    args = p.parse_args(argv)
    os.environ.setdefault("LIGHTNING_RESCTL_COMPILE", "0")  # no background compile of the eager regions meanwhile
    rules = ["plain"] + [r.strip() for r in args.rules.split(",") if r.strip()]
    print(f"nanoGPT {args.layers} layers, C={args.C}, T={args.T}, batch {args.batch}, {args.device}, one training step "
          f"under torch.compile(fullgraph=True); torch {torch.__version__}")
    head = f"{'rule':<18}{'fw ops':>8}{'bw ops':>8}{'saved MiB':>11}{'saved/plain':>12}"
    if args.inductor:
        head += f"{'kernels fw/bw':>15}{'mm etc. fw/bw':>15}{'compile s':>11}{'/plain':>8}"
    print(head + "  opaque ops")
    plain = {}
    for method in rules:
        row = graph_row(args, method)
        if args.inductor:
            row.update(inductor_row(args, method))
        plain = plain or row
        line = (f"{method:<18}{row['fw ops']:>8}{row['bw ops']:>8}{row['saved'] / 2**20:>11.2f}"
                f"{row['saved'] / plain['saved']:>12.3f}")
        if args.inductor:
            line += (f"{'/'.join(map(str, row['kernels'])):>15}{'/'.join(map(str, row['library calls'])):>15}"
                     f"{row['compile s']:>11.1f}{row['compile s'] / plain['compile s']:>8.2f}")
        print(line + "  " + (", ".join(row["opaque"]) or "none"), flush=True)
        if args.saved_by_shape and row is not plain:
            print(f"{'':<18}saved beyond plain: {saved_beyond(row, plain, args.saved_by_shape) or 'nothing'}")


if __name__ == "__main__":
    main()
