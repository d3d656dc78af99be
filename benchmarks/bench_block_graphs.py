"""Unique graphs dynamo compiles when identical blocks are compiled one by one (``block.compile()``), per rule, depth.

    python benchmarks/bench_block_graphs.py [--layers 4 8 16] [--rules NAMES] [--ckpt none outside strategy wrapper]
                                            [--C 32] [--T 8] [--batch 2]

A model of ``--layers`` identical pre-norm blocks (two merges each, ``x = x + f(ln(x))``), patched with each rule (and
plain, unpatched), each block compiled on its own with the ``aot_eager`` backend behind a counter, two training steps;
``--ckpt``: ``none`` (each block compiled with ``fullgraph=True``), ``outside`` (non-reentrant
``torch.utils.checkpoint`` around each compiled block), ``strategy`` (the strategy's ``wrap_blocks``:
``checkpoint_wrapper`` around each compiled block, the chains' state kept at the block) or ``wrapper`` (torchtitan's
order: ``checkpoint_wrapper`` first, then the wrapped block compiled with ``fullgraph=True``). Prints one markdown
table per checkpointing mode: the frames dynamo compiled at each depth (recompiles included; a rule that compiles the
same graphs at every depth shows equal counts) — counts, not times. dynamo's recompile limit is raised to 4 per block,
so a rule compiling a graph per block shows its true count instead of stopping at the limit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import PreNormNet  # noqa: E402
from lightning_resctl import get_merge_rule, merge_rules, patch_residuals  # noqa: E402
from lightning_resctl.distributed.recipe import wrap_blocks  # noqa: E402

CKPT_MODES = ("none", "outside", "strategy", "wrapper")


def compile_blocks(model: nn.Module, ckpt: str, backend) -> None:
    """Compile each of ``model.blocks`` on its own with ``backend``. ``ckpt``: ``none`` (fullgraph, no checkpointing),
    ``outside`` (``torch.utils.checkpoint`` around each compiled block), ``strategy`` (ResidualParallelStrategy's own
    ``wrap_blocks``: ``checkpoint_wrapper`` around each compiled block, keeping the chains' state at the block) or
    ``wrapper`` (``checkpoint_wrapper`` first, then the wrapped block compiled with fullgraph, torchtitan's order)."""
    model.ckpt = ckpt == "outside"
    if ckpt == "strategy":
        wrap_blocks(model, [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], "blocks", {"backend": backend})
        return
    for i, b in enumerate(model.blocks):
        if ckpt == "wrapper":
            model.blocks[i] = torch.compile(checkpoint_wrapper(b), backend=backend, fullgraph=True)
        else:
            b.compile(backend=backend, fullgraph=ckpt == "none")


def unique_graphs(method: str, depth: int, ckpt: str, args) -> str:
    """The frames dynamo compiled for two training steps (or the error's first line)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PreNormNet(depth, args.C)
    x = torch.randn(args.batch, args.T, args.C)
    try:
        if method != "plain":
            options = {"backend": "torch-eager"} if "backend" in get_merge_rule(method).option_names() else {}
            patch_residuals(model, method=method, example_input=(x,), **options)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compile_blocks(model, ckpt, counter)
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=ckpt == "wrapper",
                                        recompile_limit=max(8, 4 * depth)):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
        return str(counter.frame_count)
    except Exception as err:  # noqa: BLE001 - listed, not skipped
        return f"failed: {str(err).splitlines()[0][:60]}"
    finally:
        torch._dynamo.reset()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--rules", default=None, help="comma-separated rule names (default: plain and every rule)")
    p.add_argument("--ckpt", nargs="+", choices=CKPT_MODES, default=list(CKPT_MODES))
    p.add_argument("--C", type=int, default=32)
    p.add_argument("--T", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    rules = args.rules.split(",") if args.rules else ["plain", *(m for m in merge_rules() if m != "mgr")]
    for ckpt in args.ckpt:
        print(f"\nunique graphs, blocks compiled one by one (aot_eager), checkpointing: {ckpt}; C={args.C}, "
              f"T={args.T}, batch {args.batch}")
        print("| rule | " + " | ".join(f"{n} blocks" for n in args.layers) + " |")
        print("|---|" + "---|" * len(args.layers))
        for method in rules:
            counts = [unique_graphs(method, n, ckpt, args) for n in args.layers]
            print(f"| {method} | " + " | ".join(counts) + " |", flush=True)


if __name__ == "__main__":
    main()
