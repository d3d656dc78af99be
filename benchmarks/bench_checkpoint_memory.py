"""Activation memory of patched models with and without activation checkpointing (issue 28).

A 12-layer nanoGPT (``benchmarks.models.NanoGPT``, C = 256, 4 heads, T = 256, batch 4, fp32,
CPU) trains one step as plain / rescontroller / mgr n=4 / attnres-block; "ckpt" wraps each block in
``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) after the patch. Per row:

* ``saved MiB``: bytes autograd saves for backward during the forward (``lightning_resctl.runtime.memory.
  saved_tensor_bytes``, parameters excluded; inside a checkpointed region the checkpoint's own hook decides,
  so this counts what is saved outside the regions, the regions' inputs included);
* ``held MiB``: memory the CPU allocator holds at the end of the forward beyond what it held before it (all
  activations kept for backward, the chain states a checkpointed chain keeps for its recomputation included);
* ``peak MiB``: the allocator's peak over forward + backward, beyond what it held before the forward;
* ``held / token / block``: ``held`` per token and per checkpointed block entry in units of one stream vector
  (C fp32 values): plain with checkpointing keeps about 1 (the block's input), a chain rule about its state.

The allocator figures come from ``torch.profiler`` memory events (``profile_memory=True``; allocations and frees
in order). Memory figures, not timings: no clock is read. Usage::

    python benchmarks/bench_checkpoint_memory.py [--layers 12] [--width 256] [--tokens 256] [--batch 4]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks.models

from benchmarks.models import NanoGPT  # noqa: E402
from lightning_resctl import patch_residuals  # noqa: E402
from lightning_resctl.runtime.memory import saved_tensor_bytes  # noqa: E402

METHODS = (("plain", None, {}), ("rescontroller", "rescontroller", {}),
           ("mgr n=4", "mgr", {"streams": 4, "backend": "torch-eager"}), ("attnres-block", "attnres-block", {}))
MIB = 2 ** 20


def build(method, options, args, ckpt: bool):
    torch.manual_seed(0)
    model = NanoGPT(vocab_size=256, block_size=args.tokens, n_layer=args.layers, n_head=4, n_embd=args.width)
    idx = torch.randint(0, 256, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    if method is not None:
        patch_residuals(model, method=method, example_input=(idx[:1, :8],), **options)
    if ckpt:
        for i, block in enumerate(model.h):
            model.h[i] = checkpoint_wrapper(block)
    return model, idx


def loss_fn(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def allocator_figures(model, idx) -> tuple[int, int]:
    """(bytes held at the end of the forward, peak bytes over forward + backward), beyond the start."""
    marks = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.profiler.record_function("forward_end_mark"):
            loss = loss_fn(model, idx)
        loss.backward()
    events = prof.profiler.kineto_results.events()
    for e in events:
        if e.name() == "forward_end_mark":
            marks["end"] = e.start_ns() + e.duration_ns()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    cur = peak = held = 0
    for t, b in mem:
        if t > marks["end"] and not held:
            held = cur
        cur += b
        peak = max(peak, cur)
    return held, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    stream = args.batch * args.tokens * args.width * 4  # one stream vector per token, fp32
    print(f"{args.layers}-layer nanoGPT, C={args.width}, T={args.tokens}, batch {args.batch}, fp32, CPU; "
          f"one stream = {stream / MIB:.2f} MiB")
    print("| model | checkpointing | saved MiB | held MiB | peak MiB | held / token / block (streams) |")
    print("|---|---|---|---|---|---|")
    for name, method, options in METHODS:
        for ckpt in (False, True):
            model, idx = build(method, options, args, ckpt)
            loss_fn(copy.deepcopy(model), idx[:, :8])  # warm-up (lazy inits)
            saved, loss = saved_tensor_bytes(loss_fn, model, idx, exclude=model.parameters())
            del loss
            model.zero_grad(set_to_none=True)
            held, peak = allocator_figures(model, idx)
            per = f"{held / stream / args.layers:.2f}" if ckpt else "-"
            print(f"| {name} | {'per block' if ckpt else 'none'} | {saved / MIB:.1f} | {held / MIB:.1f} | "
                  f"{peak / MIB:.1f} | {per} |")


if __name__ == "__main__":
    main()
