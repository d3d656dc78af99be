"""Cost of a rule in the at-scale recipe: per-block ``torch.compile`` with activation checkpointing, patched vs plain.

    python benchmarks/bench_recipe.py [--layers 12] [--C 256] [--T 64] [--batch 8] [--reps 15]
                                      [--rules NAMES] [--backend inductor] [--threads N]

The 12-layer nanoGPT of ``lightning_resctl/compare/nanogpt.py`` (C=256, 4 heads, T=64, batch 8 unless given), in
one process on CPU, fp32, built as the recipe builds it: patched with ``patch_residuals`` (plain: not patched),
then, by ResidualParallelStrategy's own per-block code (``lightning_resctl.distributed.recipe.wrap_blocks``), each
block compiled on its own (``block.compile(backend=...)``) and wrapped in ``checkpoint_wrapper`` (non-reentrant
``torch.utils.checkpoint`` around the compiled block). One training step
(forward, next-token loss, backward, AdamW) of every variant, interleaved, median wall clock over ``--reps`` after
the first step (its compile time, shown apart) and ``--warmup`` steps; peak memory: the allocator's peak over the
forward and backward of one loss beyond what it held before (``torch.profiler`` memory events, as
``bench_checkpoint_memory.py`` measures it). Each block of a patched model compiles its own graphs (its merges are
other positions of the chain), and the rules' merges share code objects, so dynamo's ``recompile_limit`` is raised
to 4 graphs per block per rule measured. Prints one markdown table: ms/step, step time / plain, peak MiB,
peak / plain, first step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint_memory import allocator_figures  # noqa: E402
from bench_scaling import _names, default_rules  # noqa: E402
from benchmarks.models import NanoGPT, add_step_arguments  # noqa: E402
from lightning_resctl.distributed.blocks import find_blocks  # noqa: E402
from lightning_resctl.distributed.recipe import wrap_blocks  # noqa: E402
from step_bench import build_rows, ratio, rule_installer, time_interleaved  # noqa: E402

MIB = 2 ** 20


def recipe(install, backend: str):
    """An installer: ``install`` (the patch, or nothing for plain), then what ResidualParallelStrategy does per
    block (its blocks found as it finds them, each compiled, then checkpointed around the compiled block)."""

    def build(model):
        model = install(model) if install is not None else model
        wrap_blocks(model, find_blocks(model), "blocks", {"backend": backend})
        return model
    return build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p)
    p.add_argument("--rules", type=_names, default=None, help="comma-separated rule names (default: every rule)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the blocks (default: inductor)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave the machine's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rules = args.rules or default_rules()
    # the rules' merges share code objects (one resume frame of the chain's merge): graphs per block for every rule
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * args.layers * len(rules))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           8 * args.layers * len(rules))
    torch.manual_seed(0)
    base = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=args.layers, n_head=args.heads, n_embd=args.C)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0))
    variants = [(name, recipe(rule_installer(name, {}, idx[:2]), args.backend), None) for name in rules]
    rows = build_rows(base, variants, lr=1e-4)
    rows[0]["model"] = recipe(None, args.backend)(rows[0]["model"])  # plain: the same parameters, its AdamW kept
    time_interleaved(rows, idx, reps=args.reps, warmup=args.warmup)
    for r in rows:
        if r["model"] is not None:
            r["model"].zero_grad(set_to_none=True)
            r["peak"] = allocator_figures(r["model"], idx)[1]
    plain = rows[0]
    print(f"{args.layers}-layer nanoGPT, C={args.C}, {args.heads} heads, T={args.T}, batch {args.batch}, fp32, CPU, "
          f"{torch.get_num_threads()} threads; blocks compiled ({args.backend}) and checkpointed; "
          f"median of {args.reps} steps")
    print("| model | ms/step | step time / plain | peak MiB | peak / plain | first step (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["model"] is None or r.get("median") is None:
            print(f"| {r['label']} | {r['note']} | | | | |")
            continue
        step, peak = ratio(r, plain, "median"), ratio(r, plain, "peak")
        print(f"| {r['label']} | {r['median'] * 1e3:.1f} | {step:.3f}× | {r['peak'] / MIB:.1f} | {peak:.3f}× | "
              f"{r['first']:.1f} |")


if __name__ == "__main__":
    main()
