"""Cost of a rule in the at-scale recipe: per-block ``torch.compile`` with activation checkpointing, patched vs plain.

    python benchmarks/bench_recipe.py [--layers 12 24 48] [--C 256] [--T 64] [--batch 8] [--reps 15]
                                      [--rules NAMES] [--backend inductor] [--threads N] [--device cuda]
                                      [--dtype bf16] [--fullgraph] [--checkpoint none] [--profile N]

The nanoGPT of ``lightning_resctl/compare/nanogpt.py`` (C=256, 4 heads, T=64, batch 8 unless given) at each depth of
``--layers``, in one process, built as the recipe builds it: patched with ``patch_residuals`` (plain: not patched),
then, by ResidualParallelStrategy's own per-block code (``lightning_resctl.distributed.recipe.wrap_blocks``),
each block compiled on its own (``block.compile(backend=...)``) and wrapped in ``checkpoint_wrapper``
(non-reentrant ``torch.utils.checkpoint`` around the compiled block; ``--fullgraph``: the strategy's other order,
``checkpoint_wrapper`` first, then the wrapper compiled with ``fullgraph=True``; ``--checkpoint none``: compiled, not
checkpointed, to tell the two parts of the recipe's cost apart). One training step (forward,
next-token loss, backward, AdamW) of every variant, interleaved, median wall clock over ``--reps`` after
the first step (its compile time, shown apart) and ``--warmup`` steps; peak memory: on CPU the allocator's peak over
the forward and backward of one loss beyond what it held before (``torch.profiler`` memory events, as
``bench_checkpoint_memory.py`` measures it), on CUDA ``torch.cuda.max_memory_allocated`` over the same beyond what
was allocated before. Graphs: the frames dynamo compiled for the variant's blocks in its first step (its backend
counts them; plain compiles one graph per code object whatever the depth). The variants' blocks share code objects
(the block's and the merge site's), and ``attnres`` still compiles a graph per merge position, so dynamo's
``recompile_limit`` is raised to 4 graphs per block per rule measured. Prints one markdown table per depth:
graphs, ms/step, step time / plain, peak MiB, peak / plain, first step. ``--profile N``: then, per variant, three
more steps under ``torch.profiler`` (inductor's CPU kernels recorded by name): its self time by kind (matrix
products, attention, inductor's fused kernels, the optimizer, the rest) beside plain's, and its N largest events:
where a rule's extra time goes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo
import torch._dynamo.testing
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint_memory import allocator_figures, loss_fn  # noqa: E402
from bench_scaling import _names, default_rules  # noqa: E402
from benchmarks.models import NanoGPT, add_step_arguments  # noqa: E402
from lightning_resctl.distributed.blocks import find_blocks  # noqa: E402
from lightning_resctl.distributed.recipe import wrap_blocks  # noqa: E402
from step_bench import autocast_for, build_rows, ratio, rule_installer, time_interleaved, train_step  # noqa: E402

MIB = 2 ** 20
#: --profile: an event's kind, by the first pattern its name contains (the rest: "other")
KINDS = (("fused", ("cpp_fused", "triton_", "cpp_kernel")),  # first: inductor names its kernels by the ops they fuse
         ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::linear", "mkldnn", "gemm")),
         ("attention", ("attention", "sdpa", "flash")),
         ("optimizer", ("_foreach", "adam", "Optimizer")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p.lower() in low for p in patterns):
            return kind
    return "other"


def profile_step(row: dict, idx, dtype: str, steps: int = 3) -> dict:
    """``steps`` training steps of ``row`` (:func:`step_bench.train_step`) under ``torch.profiler``: ``{"total": s,
    "kinds": {kind: s}, "events": [(name, s)]}`` of the self time of its events per step, largest first (device time
    on CUDA; the device's kernels, else the CPU's)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = idx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(row, idx, dtype)
    kinds, events = {}, []
    for e in prof.key_averages():
        t = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / steps
        if t <= 0:
            continue
        kind = kind_of(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + t
        events.append((e.key, t))
    return {"total": sum(kinds.values()), "kinds": kinds, "events": sorted(events, key=lambda f: -f[1])}


def recipe(install, counter, fullgraph: bool = False, checkpoint: str | None = "blocks"):
    """An installer: ``install`` (the patch, or nothing for plain), then what ResidualParallelStrategy does per
    block (its blocks found as it finds them, each compiled with the counting backend ``counter`` and, with
    ``checkpoint="blocks"``, checkpointed: around the compiled block, or inside it with ``fullgraph``)."""

    def build(model):
        model = install(model) if install is not None else model
        options = {"backend": counter, **({"fullgraph": True} if fullgraph else {})}
        wrap_blocks(model, find_blocks(model), checkpoint, options)
        return model
    return build


def peak_bytes(model, idx) -> int:
    """Peak bytes allocated over the forward and backward of one loss, beyond what was allocated before."""
    if idx.device.type != "cuda":
        return allocator_figures(model, idx)[1]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(model, idx).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(args, layers: int, rules: list) -> list[dict]:
    """The rows of one depth: every rule and plain, with their compile counters' graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    device = torch.device(args.device)
    base = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=layers, n_head=args.heads,
                   n_embd=args.C).to(device)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0)).to(device)
    counters = {name: torch._dynamo.testing.CompileCounterWithBackend(args.backend) for name in ["plain", *rules]}
    ckpt = None if args.checkpoint == "none" else args.checkpoint
    variants = [(name, recipe(rule_installer(name, {}, idx[:2]), counters[name], args.fullgraph, ckpt), None)
                for name in rules]
    rows = build_rows(base, variants, lr=1e-4)
    # plain: the same parameters
    rows[0]["model"] = recipe(None, counters["plain"], args.fullgraph, ckpt)(rows[0]["model"])
    time_interleaved(rows, idx, reps=args.reps, warmup=args.warmup, dtype=args.dtype)
    for r in rows:
        r["graphs"] = counters[r["label"]].frame_count
        if r["model"] is not None:
            r["model"].zero_grad(set_to_none=True)
            with autocast_for(device, args.dtype):
                r["peak"] = peak_bytes(r["model"], idx)
            if args.profile:
                r["profile"] = profile_step(r, idx, args.dtype)
    return rows


def print_table(args, layers: int, rows: list[dict]) -> None:
    plain = rows[0]
    where = "inside the compiled block, fullgraph" if args.fullgraph else "around the compiled block"
    how = "not checkpointed" if args.checkpoint == "none" else f"checkpointed ({where})"
    print(f"\n{layers}-layer nanoGPT, C={args.C}, {args.heads} heads, T={args.T}, batch {args.batch}, {args.dtype}, "
          f"{args.device}, {torch.get_num_threads()} threads; blocks compiled ({args.backend}) and {how}; "
          f"median of {args.reps} steps")
    print("| model | graphs | ms/step | step time / plain | peak MiB | peak / plain | first step (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["model"] is None or r.get("median") is None:
            print(f"| {r['label']} | {r['graphs']} | {r['note']} | | | | |")
            continue
        step, peak = ratio(r, plain, "median"), ratio(r, plain, "peak")
        print(f"| {r['label']} | {r['graphs']} | {r['median'] * 1e3:.1f} | {step:.3f}× | {r['peak'] / MIB:.1f} | "
              f"{peak:.3f}× | {r['first']:.1f} |", flush=True)
    if args.profile:
        print_profiles(rows, args.profile)


def print_profiles(rows: list[dict], top: int) -> None:
    """Each variant's profiled step by kind, in ms, and the difference from plain's; then its largest events."""
    plain = rows[0].get("profile")
    kinds = ["matmul", "attention", "fused", "optimizer", "other"]
    print("\nprofiled step (self time, ms per step, mean of 3; in brackets: minus plain's)")
    print("| model | total | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for r in rows:
        prof = r.get("profile")
        if prof is None:
            continue

        def cell(value, base):
            return f"{value * 1e3:.1f}" + ("" if r is rows[0] else f" ({(value - base) * 1e3:+.1f})")

        cells = [cell(prof["kinds"].get(k, 0.0), plain["kinds"].get(k, 0.0)) for k in kinds]
        print(f"| {r['label']} | {cell(prof['total'], plain['total'])} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("profile"):
            largest = r["profile"]["events"][:top]
            print(f"{r['label']}: largest events (self ms): " + "; ".join(
                f"{name if len(name) <= 70 else name[:67] + '...'} {t * 1e3:.1f}" for name, t in largest))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p, depths=True)
    p.add_argument("--rules", type=_names, default=None, help="comma-separated rule names (default: every rule)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the blocks (default: inductor)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave the machine's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    p.add_argument("--fullgraph", action="store_true",
                   help="checkpoint inside the compiled block, compiled with fullgraph=True (the strategy's "
                        "compile={'fullgraph': True})")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile 3 more steps per variant: self time by kind vs plain, and its N largest events")
    p.add_argument("--checkpoint", choices=("blocks", "none"), default="blocks",
                   help="blocks: each block checkpointed, as the recipe does (default); none: compiled only")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rules = args.rules or default_rules()
    if args.profile:
        inductor_config.cpp.enable_kernel_profile = True  # inductor's CPU kernels as profiler events
    deepest = max(args.layers)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * deepest * len(rules))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           8 * deepest * len(rules))
    for layers in args.layers:
        print_table(args, layers, measure(args, layers, rules))


if __name__ == "__main__":
    main()
