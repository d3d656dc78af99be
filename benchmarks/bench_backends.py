"""The default backend's steady state against ``backend="torch-compiled"``: is the background compile's code the
code the training loop would compile itself?

Each backend runs in its own fresh process (the compiled regions are process-wide, so two backends in one process
would share their graphs): plain and each rule, one nanoGPT training step each, interleaved
(:func:`step_bench.time_interleaved`, which waits for the background compiles after the first step), and the
regions' eager calls during the timed steps (:func:`lightning_resctl.runtime.regions.region_calls`; 0 = every merge ran
compiled code). Prints the median step time of each rule over plain, per backend, and the first (eager) step's
ratio beside it.

    python benchmarks/bench_backends.py --rules mgr-competitive,mgr-independent,rescontroller

Timings: only on a quiet machine (nothing else running).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.models
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.models import NanoGPT, add_step_arguments  # noqa: E402
from step_bench import build_rows, ratio, rule_installer, time_interleaved  # noqa: E402

BACKENDS = ("auto", "torch-compiled")


def run_one(args, backend: str) -> dict:
    """Plain and every rule with ``backend``, in this process: ``{label: {median, first, eager}}``."""
    from lightning_resctl.runtime.regions import region_calls

    torch.manual_seed(0)
    base = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=args.layers, n_head=args.heads, n_embd=args.C)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0))
    variants = [(name, rule_installer(name, {"backend": backend}, idx[:2]), None) for name in args.rules]
    rows = build_rows(base, variants)
    eager_before: list = []
    rows = time_interleaved(rows, idx, reps=args.reps, warmup=args.warmup,
                            before_timing=lambda: eager_before.append(_eager(region_calls())))
    out = {r["label"]: {"median": r.get("median"), "first": r.get("first"), "note": r.get("note")} for r in rows}
    out["_eager_calls_total"] = _eager(region_calls()) - eager_before[0]
    return out


def _eager(calls: dict) -> int:
    return sum(e for _, _, e in calls.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(p, layers=12, C=256, reps=15)
    p.add_argument("--rules", default="mgr-competitive,mgr-independent,rescontroller",
                   help="comma-separated rule names")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave the machine's)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "backend,json path": one backend (child)
    args = p.parse_args(argv)
    args.rules = [r for r in args.rules.split(",") if r]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        backend, path = args.one.split(",", 1)
        with open(path, "w") as f:
            json.dump(run_one(args, backend), f)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in BACKENDS:
            path = os.path.join(tmp, f"{backend}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{backend},{path}"] + [
                a for a in (argv if argv is not None else sys.argv[1:])]
            subprocess.run(cmd, check=True)
            with open(path) as f:
                results[backend] = json.load(f)
    print(f"{args.layers} layers, C={args.C}, T={args.T}, batch {args.batch}: step time over plain "
          "(steady state after wait_for_compiles; first step in brackets), each backend in a fresh process")
    print("| rule | " + " | ".join(BACKENDS) + " |")
    print("|---|" + "---|" * len(BACKENDS))
    for rule in args.rules:
        cells = []
        for backend in BACKENDS:
            res = results[backend]
            steady, first = ratio(res[rule], res["plain"], "median"), ratio(res[rule], res["plain"], "first")
            cells.append(f"{steady:.2f}x ({first:.2f}x)" if steady and first else (res[rule].get("note") or "-"))
        print(f"| {rule} | " + " | ".join(cells) + " |")
    print("eager region calls in the timed steps: " +
          ", ".join(f"{b} {results[b]['_eager_calls_total']}" for b in BACKENDS))


if __name__ == "__main__":
    main()
