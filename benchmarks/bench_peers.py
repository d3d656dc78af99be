"""Residual rules side by side in one nanoGPT training step: step-time ratio and saved-bytes ratio to plain.

    python benchmarks/bench_peers.py [--threads N] [--reps 15] [--layers 12 --C 256 --T 64 --batch 8]
                                     [--compile default,reduce-overhead | none]

One process, one copy of the same initial weights per variant; every repetition runs one training step
(forward, loss, backward, AdamW step) of each variant in a rotating order (interleaved, so slow phases of a
shared machine hit every variant alike); the table reports the median wall-clock step time of each variant
divided by the plain model's median. The first step of each variant is timed apart ("first step"): it holds
one-time costs such as the compile of a fused CPU region. Saved bytes: activations saved for backward by one
loss (each storage once, parameters left out), divided by plain's.

Variants: ``plain`` (the model as written), the project's rules installed with ``patch_residuals`` (``add``,
``rescontroller``, ``mgr`` n=4 independent and competitive, and every other name of
``lightning_resctl.merge_rules()`` when the registry exists), and peers wired by hand into the same GPT:
MLBricks' ResController (its torch path; non-commercial licence, used only if ``mlbricks`` is importable) and
the ``hyper-connections`` package's HC and mHC (n=4). A peer that is not installed, or a variant that fails to
build, is listed with the reason instead of a ratio.

Compiled columns (``--compile``, default "default"): every variant, the peers too, also runs as a whole-model
``torch.compile(model, mode=...)`` (the same weights and optimizer), timed in the same interleaved rotation; its
ratio is to the compiled plain model, "vs eager" is its time over the variant's own eager step, and "compile s" is
its first step (the compile) beside the ratio to plain's. "none": eager only.

Thread count: the machine's default (``torch.get_num_threads()``) unless ``--threads`` is given.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_resctl  # noqa: E402
from benchmarks.models import (  # noqa: E402
    NanoGPT,
    add_step_arguments,
    wire_hyper_connections,
    wire_merges,
)
from step_bench import (  # noqa: E402
    build_rows,
    compile_modes,
    compiled_rows,
    ratio,
    rule_installer,
    time_interleaved,
)

STREAMS = 4
# the project's variants listed first, in this order: (label, method name, patch options)
OWN = [
    ("add", "add", {}),
    ("rescontroller", "rescontroller", {}),
    ("rescontroller (torch-eager)", "rescontroller", {"backend": "torch-eager"}),
    ("mgr n=4 independent", "mgr", {"streams": STREAMS, "gating": "independent"}),
    ("mgr n=4 competitive", "mgr", {"streams": STREAMS, "gating": "competitive"}),
]
# registry names already covered by OWN
COVERED = {"add", "rescontroller", "mgr", "mgr-independent", "mgr-competitive"}


def registry_names() -> list[str] | None:
    """Names of ``lightning_resctl.merge_rules()``, or None when this version has no registry."""
    fn = getattr(lightning_resctl, "merge_rules", None)
    if fn is None:
        try:
            from lightning_resctl import rules as rules_mod  # noqa: F401
            fn = getattr(rules_mod, "merge_rules", None)
        except ImportError:
            fn = None
    if fn is None:
        return None
    rules = fn()
    return list(rules.keys() if isinstance(rules, dict) else rules)


def mlbricks_installer():
    try:
        from mlbricks.residualbrick import ResController as MLBricksResController
    except Exception as err:  # noqa: BLE001 - any import failure means "absent"
        return None, f"absent (mlbricks not importable: {type(err).__name__})"

    def install(model):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            merge = MLBricksResController(0.18, backend="pytorch")
        model.mlbricks_merge = merge
        return wire_merges(model, merge)
    return install, None


def hc_installer(kind: str):
    try:
        import hyper_connections  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return None, f"absent (hyper-connections not importable: {type(err).__name__})"
    return (lambda model: wire_hyper_connections(model, kind, STREAMS)), None


def variants(example) -> list[tuple[str, object, str | None]]:
    """(label, installer or None, note) for every variant after plain."""
    out = [(label, rule_installer(method, opts, example), None) for label, method, opts in OWN]
    inst, note = mlbricks_installer()
    out.insert(3, ("MLBricks ResController (torch path)", inst, note))
    for kind, label in (("hc", "hyper-connections HC n=4"), ("mhc", "hyper-connections mHC n=4")):
        inst, note = hc_installer(kind)
        out.append((label, inst, note))
    names = registry_names()
    if names is None:
        out.append(("(merge_rules registry)", None, "absent in this version: only the methods above"))
    else:
        for name in names:
            if name in COVERED:
                continue
            out.append((f"{name} (lightning_resctl)", rule_installer(name, {"streams": STREAMS}, example), None))
    return out


def run(args) -> list[dict]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    base = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=args.layers, n_head=args.heads,
                   n_embd=args.C).to(device)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0)).to(device)
    only = [o.strip() for o in args.only.split(",")] if args.only else None
    chosen = [v for v in variants(idx[:2]) if only is None or v[0] in only]
    rows = build_rows(base, chosen)
    for mode in args.compile:
        rows += compiled_rows(rows, mode)
    return time_interleaved(rows, idx, reps=args.reps, warmup=args.warmup, dtype=args.dtype)


def _column(rows: list[dict], mode) -> dict:
    """``{label: row}`` of the rows of one column (``mode`` None: eager)."""
    return {r["label"]: r for r in rows if r.get("mode") == mode}


def report(rows: list[dict], args) -> str:
    eager = _column(rows, None)
    plain = eager["plain"]
    head = (f"nanoGPT {args.layers} layers, C={args.C}, T={args.T}, batch {args.batch}, training step (fwd+bwd+AdamW), "
            f"{args.dtype} {args.device}, threads={torch.get_num_threads()}, {args.reps} interleaved reps, median "
            f"wall clock; torch {torch.__version__}")
    print(head)
    try:
        import importlib

        rc_mod = importlib.import_module("lightning_resctl.rules.rescontroller.ops")

        fns = rc_mod._math_fns.regions
        if fns:
            fails = [f.failed for f in fns if f.failed]
            print("ResController compiled CPU regions (compiled in the background): "
                  f"graphs forward {fns[0].num_graphs}, backward {fns[1].num_graphs}"
                  + (f"; FELL BACK: {fails}" if fails else ""))
        else:
            print("ResController compiled CPU region: not used (no C++ compiler, LIGHTNING_RESCTL_COMPILE=0 or GPU)")
    except Exception:  # noqa: BLE001
        pass
    print(f"plain: {plain['median'] * 1e3:.1f} ms/step, {plain['saved'] / 2**20:.1f} MiB saved for backward"
          if plain.get("median") else f"plain: {plain['note']}")
    print(f"{'variant':<40}{'step ratio':>11}{'saved ratio':>12}{'ms/step':>9}{'first step s':>13}  note")
    md_head = "| variant | step-time ratio to plain | saved-bytes ratio |"
    md_sep = "|---|---|---|"
    for mode in args.compile:
        md_head += (f" compiled ({mode}): step-time ratio to compiled plain | saved-bytes ratio | vs its eager step |"
                    f" compile s (ratio to plain's) |")
        md_sep += "---|---|---|---|"
    md = [md_head, md_sep]
    for label, r in eager.items():
        t, b = ratio(r, plain, "median"), ratio(r, plain, "saved")
        if t is None:
            print(f"{label:<40}{'-':>11}{'-':>12}{'-':>9}{'-':>13}  {r['note']}")
            line = f"| {label} | {r['note']} | – |"
        else:
            peak = ratio(r, plain, "peak")
            note = (r["note"] or "") + (f" peak memory {r['peak'] / 2**20:.0f} MiB = {peak:.3f}x plain's"
                                        if peak is not None else "")
            print(f"{label:<40}{t:>11.3f}{b:>12.3f}{r['median'] * 1e3:>9.1f}{r['first']:>13.2f}  {note}")
            line = f"| {label} | {t:.3f}× | {b:.3f}× |"
        for mode in args.compile:
            line += " " + _compiled_cells(label, r, _column(rows, mode), mode)
        md.append(line)
    table = "\n".join(md)
    print("\nMarkdown (README):\n")
    print(table)
    return table


def _compiled_cells(label: str, eager_row: dict, column: dict, mode: str) -> str:
    """The compiled column's cells of one variant (printed on a line of their own too)."""
    row, plain = column.get(label, {}), column.get("plain", {})
    t, b = ratio(row, plain, "median"), ratio(row, plain, "saved")
    if t is None:
        note = row.get("note") or eager_row.get("note") or "not run"
        print(f"  compiled ({mode}): {note}")
        return f"{note} | – | – | – |"
    own, compile_ratio, peak = ratio(row, eager_row, "median"), ratio(row, plain, "first"), ratio(row, plain, "peak")
    print(f"  compiled ({mode}): step ratio {t:.3f}, saved ratio {b:.3f}, {row['median'] * 1e3:.1f} ms/step, "
          f"vs its eager step {own:.3f}, compile (first step) {row['first']:.1f} s = {compile_ratio:.2f}x plain's"
          + (f", peak memory {row['peak'] / 2**20:.0f} MiB = {peak:.3f}x compiled plain's" if peak is not None
             else ""))
    return f"{t:.3f}× | {b:.3f}× | {own:.3f}× | {row['first']:.1f} s ({compile_ratio:.2f}×) |"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave the machine's)")
    add_step_arguments(p)
    p.add_argument("--only", default="", help="comma-separated variant labels to run (default: all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    p.add_argument("--compile", type=compile_modes, default=["default"],
                   help="comma-separated torch.compile modes for the compiled columns (default: 'default'; "
                        "'none': eager only)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report(run(args), args)


if __name__ == "__main__":
    main()
