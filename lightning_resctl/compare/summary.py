"""The summary of a comparison: statistics over seeds, plain-language verdicts, ``summary.md``,
``summary.json`` and the PNG plots.

A value's *spread* over seeds is half its range, ``(max - min) / 2``, so with 2 seeds
``mean ± spread`` is exactly the interval of the two runs. A method's loss is said to *differ from
plain beyond the seed spread* only when the ranges of its per-seed values and plain's do not
overlap; otherwise the summary says the difference is within the seed spread. With one seed there
is no spread and no claim is made.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import CompareConfig
from .methods import describe_method

__all__ = ["write_summary"]

def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        return {"mean": float("nan"), "spread": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    lo, hi = min(finite), max(finite)
    return {"mean": sum(finite) / len(finite), "spread": (hi - lo) / 2, "min": lo, "max": hi, "n": len(finite)}


def _verdict(method_stats: dict[str, float], plain_stats: dict[str, float], what: str, digits: int = 4) -> str:
    """One sentence: is ``method - plain`` beyond the seed spread (the per-seed ranges do not overlap)?"""
    if method_stats["n"] < 2 or plain_stats["n"] < 2:
        return f"{what}: one seed only, so no seed spread to compare against; no claim."
    diff = method_stats["mean"] - plain_stats["mean"]
    if method_stats["max"] < plain_stats["min"]:
        return (f"{what}: lower than plain by {-diff:.{digits}f} on average, beyond the seed spread "
                f"(every seed below every plain seed).")
    if method_stats["min"] > plain_stats["max"]:
        return (f"{what}: higher than plain by {diff:.{digits}f} on average, beyond the seed spread "
                f"(every seed above every plain seed).")
    return (f"{what}: differs from plain by {diff:+.{digits}f} on average, within the seed spread "
            f"(the seed ranges overlap): no difference shown.")


def _mean_profile(lists: Sequence[Sequence[float] | None]) -> list[float] | None:
    lists = [lst for lst in lists if lst]
    if not lists:
        return None
    depth = min(len(lst) for lst in lists)
    return [sum(lst[d] for lst in lists) / len(lists) for d in range(depth)]


def _mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            by_step.setdefault(int(step), []).append(float(value))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(curves))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def _fmt(stats: dict[str, float], digits: int = 4) -> str:
    if stats["n"] == 0:
        return "n/a"
    if stats["n"] == 1:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['spread']:.{digits}f}"


def _save(fig, path: Path) -> str:
    fig.savefig(path)  # Agg-canvas figures, no pyplot: nothing to close
    return str(path)



def _describe_safely(method: str) -> str:
    try:
        return describe_method(method)
    except Exception:  # noqa: BLE001 - a description is decoration, never a reason to lose results
        return ""


def write_summary(results: Sequence[dict[str, Any]], cfg: CompareConfig, out_dir: Path,
                  corpus_description: str = "", total_wall_s: float | None = None,
                  cost: dict[str, Any] | None = None) -> dict[str, Any]:
    """Aggregate per-run results into ``summary.md``, ``summary.json`` and PNG plots under ``out_dir``.

    ``cost``: :func:`lightning_resctl.compare.cost.measure_cost`'s result (the "cost vs plain"
    column), or None when it was not measured."""
    from .plots import SeedCurves, band_figure

    out_dir = Path(out_dir)
    methods = [m for m in cfg.methods if any(r["method"] == m for r in results)]
    per: dict[str, dict[str, Any]] = {}
    bands: dict[str, dict[str, Any]] = {}
    nan = float("nan")
    for m in methods:
        runs = [r for r in results if r["method"] == m]

        def profile(name, runs=runs):
            return _mean_profile([(r.get("depth_profile") or {}).get(name) for r in runs])

        rms = profile("stream_rms")
        max_ratio = profile("max_over_median")
        ratio = (cost or {}).get("ratio", {}).get(m, nan)
        per[m] = {
            "description": _describe_safely(m),
            "seeds": [r["seed"] for r in runs],
            "final_val_loss": _stats([r["final_val_loss"] for r in runs]),
            "final_train_loss": _stats([r["final_train_loss"] for r in runs]),
            "cost_vs_plain": ratio,
            "step_s": (cost or {}).get("step_s", {}).get(m, nan),
            "tokens_per_s": _stats([r["tokens_per_s"] for r in runs]),
            "params_added": runs[0]["params_added"],
            "sites": runs[0]["sites"],
            "branches": runs[0].get("branches"),
            "stream_rms_last_over_first": (rms[-1] / rms[0]) if rms and rms[0] > 0 else nan,
            "max_activation_ratio": max(max_ratio) if max_ratio else nan,
            "profiles": {name: profile(name) for name in ("stream_rms", "update_ratio", "growth",
                                                          "max_over_median", "update_rms", "max_abs")},
            "ablation_loss_increase": _mean_profile([r.get("ablation_loss_increase") for r in runs]),
            "val_curve": _mean_curve([r["val_curve"] for r in runs]),
            "train_curve": _mean_curve([r["train_curve"] for r in runs]),
        }
        bands[m] = {
            "val": SeedCurves.from_curves([r["val_curve"] for r in runs]),
            "stream_rms": SeedCurves.from_profiles([(r.get("depth_profile") or {}).get("stream_rms") for r in runs]),
            "update_ratio": SeedCurves.from_profiles([(r.get("depth_profile") or {}).get("update_ratio")
                                                      for r in runs]),
            "ablation": SeedCurves.from_profiles([r.get("ablation_loss_increase") for r in runs]),
        }
    baseline = "plain" if "plain" in per else None
    base_tps = per[baseline]["tokens_per_s"]["mean"] if baseline else nan
    for m in methods:
        per[m]["tokens_per_s_ratio"] = (per[m]["tokens_per_s"]["mean"] / base_tps
                                       if baseline and base_tps > 0 else nan)
    branches = next((per[m]["branches"] for m in methods if per[m]["branches"]), None)

    files: dict[str, str] = {}
    # --- plots ---------------------------------------------------------------------------------
    seeds_note = f"mean of {cfg.seeds} seed(s)" + (", band: range over seeds" if cfg.seeds > 1 else "")
    curves = {m: b["val"] for m, b in bands.items() if b["val"].xs.size}
    if curves:
        files["val_loss_png"] = _save(band_figure(
            curves, xlabel="training step", ylabel="validation loss (nats/char)",
            title=f"validation loss every {min(cfg.eval_every, cfg.steps)} steps ({seeds_note})"),
            out_dir / "val_loss.png")
    depth_label = "merge depth (0 = first merge)"
    for key, family, ylabel, title in (
            ("stream_rms_png", "stream_rms", "stream RMS entering the merge", "stream RMS vs depth"),
            ("update_ratio_png", "update_ratio", "update RMS / stream RMS", "update/stream ratio vs depth")):
        curves = {m: b[family] for m, b in bands.items() if b[family] is not None}
        if curves:
            files[key] = _save(band_figure(curves, xlabel=depth_label, ylabel=ylabel,
                                           title=f"{title}, end of training ({seeds_note})",
                                           logy=family == "stream_rms", depth_axis=True, branches=branches),
                               out_dir / f"{family}_depth.png")
    curves = {m: b["ablation"] for m, b in bands.items() if b["ablation"] is not None}
    if curves:
        files["ablation_png"] = _save(band_figure(
            curves, xlabel="merge depth skipped", ylabel="validation loss increase",
            title=f"ablation: loss increase when one merge's update is skipped ({seeds_note})",
            depth_axis=True, branches=branches), out_dir / "ablation_depth.png")

    # --- summary.md --------------------------------------------------------------------------
    lines = ["# Residual merge comparison", ""]
    if corpus_description:
        lines += [f"Corpus: {corpus_description}.", ""]
    lines += [f"Model: char-level GPT, {cfg.n_layer} layers ({2 * cfg.n_layer} residual merges, attention and MLP "
              f"alternating), C={cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}. Training: {cfg.steps} "
              f"steps of {cfg.batch_size} sequences, AdamW lr={cfg.lr}, weight decay {cfg.weight_decay}, warm-up "
              f"{cfg.warmup_steps} steps then cosine; gradient clip {cfg.grad_clip}. Seeds {cfg.seed_list()}: for "
              f"each seed every method starts from the same initial weights and sees the same batches in the same "
              f"order. Rules with a `streams` option use n={cfg.streams}. plain is the unpatched model (the "
              f"diagnostics callback observes it through `add` merges, which leave its outputs bitwise unchanged).",
              ""]
    lines += ["| method | what the merges compute |", "|---|---|"]
    lines += [f"| {m} | {per[m]['description']} |" for m in methods] + [""]
    if cost is not None:
        cost_text = (f"cost vs plain: a training step's time over plain's, measured in one process before the runs, "
                     f"{cost['rounds']} rounds of one step per method in rotating order on the same batch, median "
                     f"of the per-round ratios (forward, backward, clipping and optimizer step; no Lightning, no "
                     f"diagnostics); device {cost.get('device', '?')}, timed by {cost.get('clock', 'wall time')}. ")
    else:
        cost_text = "cost vs plain: not measured (--cost-steps 0). "
    lines += ["± is the seed spread: half the range of the per-seed values (with 2 seeds, mean ± spread is "
              "exactly the interval between them). Final train loss: mean over the last 10% of steps. Final "
              f"val loss: the last validation (every {min(cfg.eval_every, cfg.steps)} steps, {cfg.val_batches} "
              f"batches). {cost_text}tokens/s: each run's own training throughput, validation excluded, measured "
              "run after run: on a shared machine it is noise, read the cost column instead.", ""]
    lines += ["| method | final val loss | final train loss | cost vs plain | tokens/s | stream RMS last/first "
              "| max activation ratio | params added | merges |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        p = per[m]
        ratio = p["cost_vs_plain"]
        lines.append(
            f"| {m} | {_fmt(p['final_val_loss'])} | {_fmt(p['final_train_loss'])} | "
            f"{f'{ratio:.2f}x' if math.isfinite(ratio) else 'not measured'} | "
            f"{_fmt(p['tokens_per_s'], 0)} | "
            f"{p['stream_rms_last_over_first']:.3g} | {p['max_activation_ratio']:.3g} | "
            f"{p['params_added']:,} | {p['sites']} |")
    lines += ["", "## Is the difference to plain larger than the seed spread?", ""]
    lines += ["A difference is called beyond the seed spread only when the per-seed ranges of the method and "
              "of plain do not overlap. With a handful of seeds this is a coarse check, not a significance "
              "test.", ""]
    if baseline != "plain":
        lines.append("plain was not among the methods run: no comparison to plain.")
    elif len(methods) == 1:
        lines.append("Only plain was run: nothing to compare.")
    else:
        for m in methods:
            if m == "plain":
                continue
            lines.append(f"- **{m}**: " + _verdict(per[m]["final_val_loss"], per["plain"]["final_val_loss"],
                                                    "validation loss"))
            lines.append("  " + _verdict(per[m]["final_train_loss"], per["plain"]["final_train_loss"],
                                         "Training loss"))
            if cost is not None and m in cost.get("ratios", {}):
                r = cost["ratios"][m]
                lines.append(f"  Cost: a training step takes {per[m]['cost_vs_plain']:.2f}x plain's (median; "
                             f"per-round ratios {min(r):.2f}-{max(r):.2f}x).")
    lines += ["", "Per-seed values:", "", "| method | seed | final val loss | final train loss | tokens/s |",
              "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['seed']} | {r['final_val_loss']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['tokens_per_s']:.0f} |")
    lines += ["", "Stream RMS last/first: RMS of the stream entering the last merge over that entering the first "
              "(ResidualControlCallback's `stream_rms`, last logged step, mean over seeds). Max activation ratio: "
              "the largest max|x| / median|x| of the stream over depths. For multi-stream rules (MGR) the stream is "
              "what the model's own code sees between merges (the pooled view of the n streams; per-stream values "
              "are in TensorBoard under `resctl/mgr_stream_rms_s<i>`).", ""]
    if files:
        lines += ["## Plots", "", "Lines: mean over seeds; shaded band: lowest to highest seed. Depth plots mark "
                  "attention merges with circles and MLP merges with squares.", ""]
        lines += [f"![{Path(f).stem}]({Path(f).name})" for f in files.values()] + [""]
    lines += [f"TensorBoard logs: `tensorboard --logdir {out_dir / 'tb'}`", ""]
    if total_wall_s is not None:
        lines += [f"Total wall time: {total_wall_s:.0f} s.", ""]
    summary_md = out_dir / "summary.md"
    summary_md.write_text("\n".join(lines))
    files["summary_md"] = str(summary_md)
    summary = {"config": asdict(cfg), "methods": per, "cost": cost, "runs": [
        {k: v for k, v in r.items() if k not in ("train_curve",)} for r in results],
        "files": files, "total_wall_s": total_wall_s if total_wall_s is not None else nan}
    summary_json = out_dir / "summary.json"
    summary_json.write_text(json.dumps(summary, indent=1, default=str))
    files["summary_json"] = str(summary_json)
    return summary
