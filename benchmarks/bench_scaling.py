"""Cost of every merge rule as the model grows: step-time and saved-bytes ratio to plain over depth x width.

    python benchmarks/bench_scaling.py [--depths 12,24,48] [--widths 128,256,512] [--rules NAMES] [--reps 15]
                                       [--threads N] [--compile default | none] [--out docs/results/bench_scaling_cpu]
    python benchmarks/bench_scaling.py --profile mgr-competitive [--depths 12 --widths 128]

Each cell of the grid (layers x C of the nanoGPT of ``lightning_resctl/compare/nanogpt.py``; T=64, batch 8,
4 heads unless given) is measured in a fresh process, as ``bench_peers.py`` measures one size: one training step
(forward, loss, backward, AdamW) of plain and of every registered rule installed with ``patch_residuals`` (its
default options: n=4 streams for the multi-stream rules), interleaved, median wall clock over ``--reps``; saved
bytes are the activations saved for backward by one loss. The variants of a cell share the plain model's weights
and one AdamW (``step_bench.build_rows(share_weights=True)``: one copy of a 48-layer C=512 model's weights and
optimizer state instead of one per rule). A fresh process per cell gives each size its own compiled CPU regions
(a region keeps at most 8 size patterns) and returns its memory.

Compiled columns (``--compile``, default "default"): plain and every rule also run as a whole-model
``torch.compile(model, mode=...)`` in the same interleaved rotation; their tables give the ratio to the compiled
plain model, and the compile time (the compiled first step) as a ratio to the compiled plain model's.

Output: the step-time and saved-bytes tables (markdown, one column per cell), the issue's goals checked against
them, and a plot ``<out>.png`` (ratio vs depth, one line per rule, one panel per width; step time above, saved
bytes below) beside ``<out>.md`` (the tables with the command and the machine). Threads: the machine's default
(``torch.get_num_threads()``) unless ``--threads`` is given.

``--profile RULE``: no grid; one training step of plain and of RULE at the first depth and width under
``torch.profiler``, the ops by self CPU time, and the op count per merge (RULE minus plain).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.models import NanoGPT, gpt_loss  # noqa: E402
from lightning_resctl.rules import get_merge_rule, merge_rules  # noqa: E402
from step_bench import build_rows, compile_modes, compiled_rows, ratio, rule_installer, time_interleaved  # noqa: E402

#: (rules, width or None for every width, step-time goal, saved-bytes goal or None) — issue 24's goals.
GOALS = [
    (("mgr-competitive", "mgr-independent"), 128, 1.25, 1.2),
    (("mgr-competitive", "mgr-independent"), 256, 1.20, 1.2),
    (("rescontroller",), None, 1.08, None),
]
#: (rules, width or None, step-time goal vs compiled plain, compile-time goal vs plain's) — issue 38's goals for
#: a whole-model torch.compile ("default" mode).
COMPILED_GOALS = [
    (("rescontroller",), 128, 1.05, 1.5),
    (("rescontroller",), 256, 1.03, 1.5),
    (("mgr-competitive", "mgr-independent"), 128, 1.20, 1.5),
    (("mgr-competitive", "mgr-independent"), 256, 1.12, 1.5),
    (("attnres-block",), 256, 1.10, 1.5),
    (("hc",), 256, 1.40, 1.5),
]


def default_rules() -> list[str]:
    """Every registered name, one per distinct rule: a name whose rule class and options equal a later name's
    is left out (``mgr`` is ``mgr-competitive``)."""
    names = list(merge_rules())
    keys = [(get_merge_rule(n).rule_class, sorted(get_merge_rule(n).defaults().items(), key=str)) for n in names]
    return [n for i, n in enumerate(names) if keys[i] not in keys[i + 1:]]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for n in names:
        get_merge_rule(n)  # ValueError naming the registered rules
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=_ints, default=[12, 24, 48], help="layers (2 merges each), comma-separated")
    p.add_argument("--widths", type=_ints, default=[128, 256, 512], help="C, comma-separated")
    p.add_argument("--rules", type=_names, default=None, help="comma-separated rule names (default: every rule)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave the machine's)")
    p.add_argument("--compile", type=compile_modes, default=["default"],
                   help="comma-separated torch.compile modes for the compiled tables (default: 'default'; 'none': "
                        "eager only)")
    p.add_argument("--out", default="docs/results/bench_scaling_cpu",
                   help="path prefix of the written <out>.md and <out>.png ('' writes nothing)")
    p.add_argument("--profile", default=None, metavar="RULE", help="profile one step of RULE instead of the grid")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # "layers,C,json path": one cell (child process)
    return p


def _model_and_batch(args, layers: int, width: int):
    torch.manual_seed(0)
    base = NanoGPT(vocab_size=args.vocab, block_size=args.T, n_layer=layers, n_head=args.heads, n_embd=width)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0))
    return base, idx


# ---------------------------------------------------------------------------------------------- one cell
def run_cell(args, layers: int, width: int) -> dict:
    """Plain and every rule at one size (in this process); ``{label: {median, saved, first, note}}``."""
    base, idx = _model_and_batch(args, layers, width)
    variants = [(name, rule_installer(name, {}, idx[:2]), None) for name in args.rules]
    rows = build_rows(base, variants, share_weights=True)
    for mode in args.compile:
        rows += compiled_rows(rows, mode)
    rows = time_interleaved(rows, idx, reps=args.reps, warmup=args.warmup)
    return {_key(r["label"], r.get("mode")): {k: r.get(k) for k in ("median", "saved", "first", "note")}
            for r in rows}


def _key(label: str, mode=None) -> str:
    """A cell's result key: the label, ``label@mode`` for a compiled row."""
    return label if mode is None else f"{label}@{mode}"


def run_grid(args) -> dict:
    """Every cell in a child process; ``{(layers, C): cell result}``."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for width in args.widths:
            for layers in args.depths:
                path = os.path.join(tmp, f"{layers}_{width}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--cell", f"{layers},{width},{path}",
                       "--rules", ",".join(args.rules), "--heads", str(args.heads), "--T", str(args.T),
                       "--batch", str(args.batch), "--vocab", str(args.vocab), "--reps", str(args.reps),
                       "--warmup", str(args.warmup), "--threads", str(args.threads),
                       "--compile", ",".join(args.compile) or "none"]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0 or not os.path.exists(path):
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
                    results[(layers, width)] = {"plain": {"note": f"cell failed: {tail[0][:120]}"}}
                else:
                    with open(path) as f:
                        results[(layers, width)] = json.load(f)
                plain = results[(layers, width)]["plain"]
                done = f"plain {plain['median'] * 1e3:.1f} ms/step" if plain.get("median") else plain.get("note")
                print(f"  {layers} layers, C={width}: {done} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------- report
def _cell_ratio(cell: dict, label: str, key: str, mode=None):
    row, plain = cell.get(_key(label, mode), {}), cell.get(_key("plain", mode), {})
    return ratio(row, plain, key)


def tables(args, results: dict) -> str:
    cols = [(layers, width) for width in args.widths for layers in args.depths]
    head = "| rule | " + " | ".join(f"C={w}, {d} layers" for d, w in cols) + " |"
    sep = "|---|" + "---|" * len(cols)
    out = []
    kinds = [(None, "median", "Step time vs plain"), (None, "saved", "Saved-for-backward bytes vs plain")]
    for mode in args.compile:
        kinds += [(mode, "median", f"Whole-model torch.compile (mode={mode!r}): step time vs compiled plain"),
                  (mode, "saved", f"torch.compile (mode={mode!r}): saved-for-backward bytes vs compiled plain"),
                  (mode, "first", f"torch.compile (mode={mode!r}): compile time (first step) vs compiled plain's")]
    for mode, key, title in kinds:
        out += [f"**{title}**", "", head, sep]
        if key in ("median", "first"):
            what = "ms/step" if key == "median" else "first step, s"
            ms = [results[c].get(_key("plain", mode), {}).get(key) for c in cols]
            scale = 1e3 if key == "median" else 1.0
            out.append(f"| plain ({what}) | " + " | ".join(f"{m * scale:.1f}" if m else "–" for m in ms) + " |")
        for name in args.rules:
            cells = []
            for c in cols:
                r = _cell_ratio(results[c], name, key, mode)
                note = results[c].get(_key(name, mode), {}).get("note")
                cells.append(f"{r:.3f}×" if r is not None else (note or "–"))
            out.append(f"| `{name}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def goal_lines(args, results: dict) -> list[str]:
    lines = []
    for names, width, step_goal, bytes_goal in GOALS:
        widths = [w for w in args.widths if width is None or w == width]
        for name in names:
            if name not in args.rules or not widths:
                continue
            for key, goal, what in (("median", step_goal, "step time"), ("saved", bytes_goal, "saved bytes")):
                if goal is None:
                    continue
                got = [(d, w, _cell_ratio(results[(d, w)], name, key)) for w in widths for d in args.depths]
                measured = [g for g in got if g[2] is not None]
                if not measured:
                    continue
                worst = max(measured, key=lambda g: g[2])
                where = f"C={width}" if width is not None else "every width"
                verdict = "met" if worst[2] <= goal and len(measured) == len(got) else "MISSED"
                lines.append(f"- `{name}` {what} <= {goal:.2f}x at {where}: worst {worst[2]:.3f}x "
                             f"({worst[0]} layers, C={worst[1]}) -> {verdict}")
    if "default" in args.compile:
        lines += _compiled_goal_lines(args, results, "default")
    return lines


def _compiled_goal_lines(args, results: dict, mode: str) -> list[str]:
    """Issue 38's goals of a whole-model compile: step time vs compiled plain, compile time vs plain's, and never
    slower compiled than eager."""
    lines = []
    for names, width, step_goal, compile_goal in COMPILED_GOALS:
        for name in names:
            cells = [(d, width) for d in args.depths if width in args.widths and name in args.rules]
            for key, goal, what in (("median", step_goal, "compiled step time"),
                                    ("first", compile_goal, "compile time")):
                got = [(d, w, _cell_ratio(results[(d, w)], name, key, mode)) for d, w in cells]
                measured = [g for g in got if g[2] is not None]
                if not measured:
                    continue
                worst = max(measured, key=lambda g: g[2])
                verdict = "met" if worst[2] <= goal and len(measured) == len(got) else "MISSED"
                lines.append(f"- `{name}` {what} <= {goal:.2f}x at C={width}: worst {worst[2]:.3f}x "
                             f"({worst[0]} layers) -> {verdict}")
    for (d, w), cell in sorted(results.items()):
        for name in args.rules:
            own = ratio(cell.get(_key(name, mode), {}), cell.get(name, {}), "median")
            if own is not None and own > 1.0:
                lines.append(f"- `{name}` slower compiled than eager at {d} layers, C={w}: {own:.3f}x its eager step")
    return lines


def plot(args, results: dict, path: str) -> None:
    """Ratio vs depth, one line per rule, one panel per width (step time above, saved bytes below)."""
    import numpy as np
    from matplotlib import image

    from lightning_resctl.diagnostics.plots import curves_figure, figure_to_array

    rows = []
    for key, ylabel in (("median", "step time / plain"), ("saved", "saved bytes / plain")):
        panels = []
        for width in args.widths:
            curves = {}
            for name in args.rules:
                ys = [_cell_ratio(results[(d, width)], name, key) for d in args.depths]
                curves[name] = (args.depths, [float("nan") if y is None else y for y in ys])
            fig = curves_figure(curves, xlabel="layers (2 merges each)", ylabel=ylabel, title=f"C={width}",
                                figsize=(5.0, 4.0), dpi=90)
            ax = fig.axes[0]
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.depths, [str(d) for d in args.depths])
            ax.minorticks_off()
            ax.legend(fontsize=7, loc="upper left")
            panels.append(figure_to_array(fig).transpose(1, 2, 0))
        rows.append(np.concatenate(panels, axis=1))
    image.imsave(path, np.concatenate(rows, axis=0))


def machine_line(args) -> str:
    return (f"nanoGPT T={args.T}, batch {args.batch}, {args.heads} heads, training step (fwd+bwd+AdamW), fp32 cpu, "
            f"threads={args.threads or torch.get_num_threads()}, {args.reps} interleaved reps per cell, median wall "
            f"clock; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs")


# ---------------------------------------------------------------------------------------------- profile
def profile(args) -> None:
    """One step of plain and of ``args.profile`` under torch.profiler: ops by self CPU time, ops per merge."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    layers, width = args.depths[0], args.widths[0]
    base, idx = _model_and_batch(args, layers, width)
    rows = build_rows(base, [(args.profile, rule_installer(args.profile, {}, idx[:2]), None)])
    time_interleaved(rows, idx, reps=1, warmup=max(args.warmup, 2))
    counts = {}
    for r in rows:
        if r["model"] is None:
            raise SystemExit(f"{r['label']}: {r['note']}")
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            r["opt"].zero_grad(set_to_none=True)
            gpt_loss(r["model"], idx).backward()
            r["opt"].step()
        events = prof.key_averages()
        counts[r["label"]] = sum(e.count for e in events if e.key.startswith("aten::"))
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n{r['label']}: {layers} layers, C={width}, one training step under the profiler "
              f"(self CPU total {total / 1e3:.1f} ms; profiler overhead included)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    merges = 2 * layers
    print(f"aten ops per step: plain {counts['plain']}, {args.profile} {counts[args.profile]} "
          f"(+{(counts[args.profile] - counts['plain']) / merges:.1f} per merge, {merges} merges)")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rules is None:
        args.rules = default_rules()
    if args.profile is not None:
        get_merge_rule(args.profile)
        return profile(args)
    if args.cell is not None:
        layers, width, path = args.cell.split(",", 2)
        result = run_cell(args, int(layers), int(width))
        with open(path, "w") as f:
            json.dump(result, f)
        return
    print(machine_line(args), flush=True)
    results = run_grid(args)
    text = tables(args, results)
    goals = goal_lines(args, results)
    print("\n" + text)
    if goals:
        print("Goals (issues 24, 38):\n" + "\n".join(goals))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python benchmarks/bench_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
        body = [f"`{cmd.strip()}`", "", machine_line(args), "", text]
        if goals:
            body += ["Goals (issues 24, 38):", ""] + goals + [""]
        out.with_suffix(".md").write_text("\n".join(body))
        plot(args, results, str(out.with_suffix(".png")))
        print(f"\nwrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
