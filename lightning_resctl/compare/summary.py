"""The summary of a comparison: per-method statistics (:mod:`.stats`), the init check (:mod:`.fairness`), the
cost column (:mod:`.cost`), plain-language verdicts, ``summary.md``, ``summary.json``, the PNG plots, and
:class:`SummaryTable`, the table object :func:`lightning_resctl.compare` returns."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .cost import MAX_RELATIVE_IQR
from .fairness import IDENTITY_TOLERANCE
from .methods import PLAIN, describe_method
from .records import _json_safe
from .stats import describe, paired, verdict

__all__ = ["SummaryTable", "write_summary", "describe_chosen", "describe_set"]

DEPTH_PLOTS = ("stream_rms_png", "update_ratio_png", "ablation_png")
PLOT_FILES = {"val_png": "val_metric.png", "stream_rms_png": "stream_rms_depth.png",
              "update_ratio_png": "update_ratio_depth.png", "ablation_png": "ablation_depth.png"}


class SummaryTable:
    """The summary as a table: one row per method (a dict of its numbers), in the job's method order.

    ``table["mgr-competitive"]`` is a row; ``table.rows`` all of them; ``table.to_pandas()`` a DataFrame (needs
    pandas); ``str(table)`` / ``table.to_markdown()`` the table of ``summary.md``; ``table.summary`` everything
    ``summary.json`` holds; ``table.path`` the summary's folder."""

    columns = ("method", "status", "final", "spread", "seeds", "diff_vs_plain", "diff_ci95", "better_seeds",
               "detectable_diff", "seeds_needed",
               "init_output_diff", "init_grad_diff", "init_flagged", "cost_vs_plain", "cost_iqr", "cost_reliable",
               "final_train_loss", "params_added", "merges")

    def __init__(self, rows: Sequence[dict[str, Any]], markdown: str, summary: dict[str, Any], path: Path):
        self.rows = list(rows)
        self._markdown = markdown
        self.summary = summary
        self.path = Path(path)

    def __getitem__(self, method: str) -> dict[str, Any]:
        for row in self.rows:
            if row["method"] == method:
                return row
        raise KeyError(f"no method {method!r} in this summary; methods: {[r['method'] for r in self.rows]}")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_markdown(self) -> str:
        return self._markdown

    def _repr_markdown_(self) -> str:
        return self._markdown

    def __repr__(self) -> str:
        return self._markdown

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` indexed by method (pandas is imported here, not required otherwise)."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(self.columns)).set_index("method")


def describe_chosen(chosen: Mapping[str, Any]) -> str:
    """The Trainer settings the job chose for the user (job.json's ``about.trainer_chosen``), in words."""
    return "the job chose, as you did not set them: " + ", ".join(f"{k}={v}" for k, v in chosen.items())


def describe_set(settings: Mapping[str, str]) -> str:
    """The Trainer settings the job sets for every run (job.json's ``about.trainer_set``), in words."""
    return "the job sets for every run: " + "; ".join(f"{k}: {v}" for k, v in settings.items())


def _fmt(stats: Mapping[str, float], digits: int = 4) -> str:
    if stats["n"] == 0:
        return "n/a"
    if stats["n"] == 1:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['spread']:.{digits}f}"


def _mean_profile(lists: Sequence[Sequence[float] | None]) -> list[float] | None:
    lists = [lst for lst in lists if lst]
    if not lists:
        return None
    depth = min(len(lst) for lst in lists)
    return [sum(lst[d] for lst in lists) / len(lists) for d in range(depth)]


def _describe_safely(method: str) -> str:
    try:
        return describe_method(method)
    except Exception:  # noqa: BLE001 - a description is decoration, never a reason to lose results
        return ""


def _cost_cell(cost: Mapping[str, Any] | None, m: str) -> str:
    if cost is None or m not in cost.get("ratio", {}):
        return "not measured"
    ratio, (q1, q3) = cost["ratio"][m], cost["iqr"][m]
    cell = f"{ratio:.2f}x ({q1:.2f}-{q3:.2f})"
    return cell if cost["reliable"][m] else f"{cell} unreliable"


def _plots(runs_by_method: dict[str, list[dict]], out_dir: Path, monitor: str, n_seeds: int,
           branches: list[str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """The PNG plots (``{key: file name}``) and the markers their depth plots draw (``{kind: marker}``, see
    :func:`~.plots.depth_markers`)."""
    from . import plots
    from .plots import SeedCurves

    files: dict[str, str] = {}
    markers: dict[str, str] = {}

    def band_figure(bands, **kwargs):
        if kwargs.get("depth_axis"):
            for band in bands.values():
                markers.update(plots.depth_markers(branches, band.xs.size))
        return plots.band_figure(bands, **kwargs)
    note = f"mean of {n_seeds} seed(s)" + (", band: range over seeds" if n_seeds > 1 else "")

    def save(fig, key):
        path = out_dir / PLOT_FILES[key]
        fig.savefig(path)
        files[key] = path.name  # in the summary's folder: the record does not depend on where it lies

    curves = {m: SeedCurves.from_curves([r["curve"] for r in runs]) for m, runs in runs_by_method.items()}
    curves = {m: c for m, c in curves.items() if c.xs.size}
    if curves:
        save(band_figure(curves, xlabel="training step", ylabel=monitor, title=f"{monitor} at validation ({note})"),
             "val_png")
    depth_label = "merge depth (0 = first merge)"
    for key, family, ylabel, title in (
            ("stream_rms_png", "stream_rms", "stream RMS entering the merge", "stream RMS vs depth"),
            ("update_ratio_png", "update_ratio", "update RMS / stream RMS", "update/stream ratio vs depth")):
        bands = {m: SeedCurves.from_profiles([(r.get("depth_profile") or {}).get(family) for r in runs])
                 for m, runs in runs_by_method.items()}
        bands = {m: b for m, b in bands.items() if b is not None}
        if bands:
            save(band_figure(bands, xlabel=depth_label, ylabel=ylabel, title=f"{title}, end of training ({note})",
                             logy=family == "stream_rms", depth_axis=True, branches=branches), key)
    bands = {m: SeedCurves.from_profiles([r.get("ablation_loss_increase") for r in runs])
             for m, runs in runs_by_method.items()}
    bands = {m: b for m, b in bands.items() if b is not None}
    if bands:
        save(band_figure(bands, xlabel="merge depth skipped", ylabel="validation loss increase",
                         title=f"ablation: loss increase when one merge's update is skipped ({note})",
                         depth_axis=True, branches=branches), "ablation_png")
    return files, markers


def write_summary(manifest: Mapping[str, Any], records: Sequence[dict[str, Any]], cost: Mapping[str, Any] | None,
                  out_dir: str | Path) -> SummaryTable:
    """Aggregate run records into ``summary.md``, ``summary.json`` and PNG plots under ``out_dir``; returns the
    :class:`SummaryTable`.

    ``manifest``: the job's ``job.json`` (its identity: methods, seeds, mode; its ``about`` texts);
    ``cost``: :func:`~lightning_resctl.compare.cost.measure_cost`'s result, or None when not measured.

    Everything written is a function of these arguments, which the job's folder holds: the total wall time is the
    sum of the runs' own times (a resumed run's includes its fits before the stop) and the cost measurement's."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ident = manifest["identity"]
    job = ident["compare"]
    about = manifest.get("about", {})
    methods, mode = list(job["methods"]), job["mode"]
    seeds = list(range(job["first_seed"], job["first_seed"] + job["seeds"]))
    done = [r for r in records if r.get("status") == "done"]
    monitor = next((r["monitor"] for r in done if r.get("monitor")), job.get("monitor") or "validation metric")
    runs_by_method = {m: sorted((r for r in done if r["method"] == m), key=lambda r: r["seed"]) for m in methods}
    runs_by_method = {m: runs for m, runs in runs_by_method.items() if runs}
    not_run = {r["method"]: r for r in records if r.get("status") in ("refused", "failed")}
    missing = [(m, s) for s in seeds for m in methods
               if not any(r["method"] == m and r["seed"] == s for r in records)]
    plain_by_seed = {r["seed"]: r["final"] for r in runs_by_method.get(PLAIN, [])}

    per: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for m in methods:
        runs = runs_by_method.get(m, [])
        if not runs:
            continue
        finals = {r["seed"]: r["final"] for r in runs}
        stats = describe(finals.values())
        pair = paired(finals, plain_by_seed, mode) if m != PLAIN and plain_by_seed else None
        inits = [r.get("init_difference") or {} for r in runs]
        init_out = max((d.get("output") or 0.0 for d in inits), default=math.nan)
        init_grad = max((d.get("grad_norm") or 0.0 for d in inits), default=math.nan)
        flagged = any(d.get("flagged") for d in inits)
        claimed = any(d.get("identity_claimed") for d in inits)
        profiles = {name: _mean_profile([(r.get("depth_profile") or {}).get(name) for r in runs])
                    for name in ("stream_rms", "update_ratio", "growth", "max_over_median")}
        rms, max_ratio = profiles["stream_rms"], profiles["max_over_median"]
        per[m] = {
            "description": _describe_safely(m), "seeds": sorted(finals), "final": stats,
            "final_train_loss": describe([r["final_train_loss"] for r in runs]), "paired": pair,
            "init_output_diff": init_out, "init_grad_diff": init_grad, "identity_claimed": claimed,
            "init_flagged": flagged,
            "cost": None if cost is None or m not in cost.get("ratio", {}) else {
                k: cost[k][m] for k in ("ratio", "iqr", "range", "reliable", "step_s")},
            "params_added": runs[0]["params_added"], "sites": runs[0]["sites"], "branches": runs[0].get("branches"),
            "stream_rms_last_over_first": (rms[-1] / rms[0]) if rms and rms[0] else math.nan,
            "max_activation_ratio": max(max_ratio) if max_ratio else math.nan,
            "profiles": profiles,
            "ablation_loss_increase": _mean_profile([r.get("ablation_loss_increase") for r in runs]),
            "init_fingerprints": sorted({r.get("init_fingerprint", "") for r in runs}),
        }
        rows.append({
            "method": m, "status": "done", "final": stats["mean"], "spread": stats["spread"], "seeds": stats["n"],
            "diff_vs_plain": pair["mean"] if pair else (0.0 if m == PLAIN else math.nan),
            "diff_ci95": pair["ci"] if pair else None, "better_seeds": (pair["better"], pair["n"]) if pair else None,
            "detectable_diff": pair["detectable"] if pair else None,
            "seeds_needed": pair["seeds_needed"] if pair else None,
            "init_output_diff": init_out, "init_grad_diff": init_grad, "init_flagged": flagged,
            "cost_vs_plain": per[m]["cost"]["ratio"] if per[m]["cost"] else math.nan,
            "cost_iqr": per[m]["cost"]["iqr"] if per[m]["cost"] else None,
            "cost_reliable": per[m]["cost"]["reliable"] if per[m]["cost"] else None,
            "final_train_loss": per[m]["final_train_loss"]["mean"], "params_added": per[m]["params_added"],
            "merges": per[m]["sites"]})
    for m, r in not_run.items():
        rows.append({**{c: None for c in SummaryTable.columns}, "method": m, "status": f"{r['status']}: {r['reason']}"})

    # the same initial weights for every method of a seed (checked across processes and shards)
    by_seed: dict[int, set] = {}
    for r in done:
        by_seed.setdefault(r["seed"], set()).add(r.get("init_fingerprint", ""))
    unmatched = sorted(s for s, fps in by_seed.items() if len(fps) > 1)

    branches = next((p["branches"] for p in per.values() if p["branches"]), None)
    files, markers = _plots(runs_by_method, out_dir, monitor, len(seeds), branches)
    from .plots import describe_markers  # matplotlib: imported when plotting, as _plots does

    # --- summary.md --------------------------------------------------------------------------
    direction = "lower is better" if mode == "min" else "higher is better"
    lines = ["# Residual merge comparison", ""]
    for key, label in (("data", "Data"), ("model", "Model"), ("trainer", "Trainer")):
        if about.get(key):
            lines.append(f"{label}: {about[key]}.")
    if about.get("trainer_chosen"):
        lines.append(f"Trainer: {describe_chosen(about['trainer_chosen'])}.")
    if about.get("trainer_set"):
        lines.append(f"Trainer: {describe_set(about['trainer_set'])}.")
    lines += ["", f"Compared: `{monitor}` at the last validation ({direction}). Seeds {seeds}: for each seed every "
              "method starts from the same initial weights of the unmodified model and sees the same batches in the "
              "same order, with the same optimizer and Trainer settings; the method is applied by "
              "ResidualControlCallback, and plain is the unpatched model (observed through `add` merges, which leave "
              "its outputs bitwise unchanged).", ""]
    lines += ["| method | what the merges compute |", "|---|---|"]
    lines += [f"| {m} | {per[m]['description'] if m in per else _describe_safely(m)} |" for m in methods] + [""]
    for m, r in not_run.items():
        lines.append(f"- **method {m} {r['status']}**: {r['reason']}")
    if missing:
        lines.append(f"- **not run yet** ({len(missing)} runs): "
                     + ", ".join(f"{m} seed {s}" for m, s in missing)
                     + ". Merge the other shards' folders with `lightning-resctl summarize`, or resume the job.")
    if unmatched:
        lines.append(f"- **warning**: the methods of seed(s) {unmatched} did not start from the same initial weights "
                     "(the model's construction is not deterministic under seed_everything): their comparison is "
                     "not matched.")
    if not_run or missing or unmatched:
        lines.append("")
    if cost is not None:
        cost_text = (f"Cost vs plain: a training step's time over plain's, measured in one process before the runs: "
                     f"{cost['rounds']} timed rounds of one step per method in rotating order on the same batch, after "
                     f"{cost['warmup_rounds']} untimed rounds (every batch shape compiled first); median of the "
                     f"per-round ratios, in brackets their interquartile range, 'unreliable' when that range is wider "
                     f"than {100 * cost['max_relative_iqr']:.0f}% of the median (a busy machine: re-measure); "
                     f"device {cost['device']}, timed by {cost['clock']}. ")
    else:
        cost_text = "Cost vs plain: not measured (cost_rounds 0, or a shard that does not measure it). "
    lines += [f"± is the seed spread: half the range of the per-seed values. Start vs plain: relative difference of "
              f"the outputs / of the gradient norm to plain's at init, on the first validation batch; ⚠ marks a rule "
              f"whose docs call it identity at init but that starts more than {IDENTITY_TOLERANCE:g} away. "
              f"{cost_text}Detectable / seeds needed: the smallest difference to plain these seeds could detect with "
              f"80% power (paired t test, 5% two-sided, at the per-seed differences' spread) / about how many seeds "
              f"the observed difference would need. Train loss: mean over the last 10% of steps.", ""]
    table = [f"| method | {monitor} | vs plain, paired by seed | detectable / seeds needed | "
             f"start vs plain (output / grad) | cost vs plain | train loss | stream RMS last/first | params added "
             f"| merges |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        if m not in per:
            continue
        p = per[m]
        pair = p["paired"]
        if m == PLAIN:
            vs = "—"
        elif pair is None or not pair["n"]:
            vs = "plain not run"
        else:
            vs = f"{pair['mean']:+.4f}, better in {pair['better']}/{pair['n']}"
            if pair["ci"] is not None:
                vs += f", 95% CI [{pair['ci'][0]:+.4f}, {pair['ci'][1]:+.4f}]"
        power = "—"
        if pair is not None and pair.get("detectable") is not None:
            need = pair["seeds_needed"]
            power = f"{pair['detectable']:.4f} / {need if need is not None else '—'}"
        start = ("—" if m == PLAIN else f"{p['init_output_diff']:.1e} / {p['init_grad_diff']:.1e}"
                 + (" ⚠" if p["init_flagged"] else ""))
        growth = p["stream_rms_last_over_first"]
        table.append(f"| {m} | {_fmt(p['final'])} | {vs} | {power} | {start} | {_cost_cell(cost, m)} | "
                     f"{_fmt(p['final_train_loss'])} | {f'{growth:.3g}' if math.isfinite(growth) else 'n/a'} | "
                     f"{p['params_added']:,} | {p['sites']} |")
    table += [f"| {m} | {r['status']}: {r['reason']} | | | | | | | | |" for m, r in not_run.items()]
    lines += table
    flagged = [m for m in per if per[m]["init_flagged"]]
    if flagged:
        lines += [""] + [f"- ⚠ **{m}** starts {per[m]['init_output_diff']:.2g} (outputs) / "
                         f"{per[m]['init_grad_diff']:.2g} (gradient norm) away from plain although its docs call it "
                         "identity at init: part of its difference to plain is where it starts, not the rule. (For a "
                         "pre-norm model, a norm eps near the stream's mean square is the usual cause; see the "
                         "rule's docs.)" for m in flagged]
    unreliable = [m for m in per if per[m]["cost"] and not per[m]["cost"]["reliable"]]
    if unreliable:
        lines += ["", f"- The cost ratios of {', '.join(unreliable)} are unreliable: their per-round ratios spread "
                  f"over more than {100 * MAX_RELATIVE_IQR:.0f}% of the median (the machine was busy, or a step is "
                  "too short to time): do not read them as a cost; re-run on a quiet machine or with more "
                  "cost_rounds."]
    lines += ["", "## Is the difference to plain larger than the seed spread?", ""]
    lines += ["The headline is conservative: beyond the seed spread only when the per-seed ranges of the method and "
              "of plain do not overlap. The paired figures use the matching (same init and data per seed): per-seed "
              "differences, how many seeds are better, and with 3 or more seeds a 95% paired t interval of the mean "
              "difference.", ""]
    if PLAIN not in per:
        lines.append("plain was not run: no comparison to plain.")
    elif len(per) == 1:
        lines.append("Only plain was run: nothing to compare.")
    else:
        for m, p in per.items():
            if m == PLAIN:
                continue
            lines.append(f"- **{m}**: " + verdict(p["final"], per[PLAIN]["final"], p["paired"], monitor, mode))
    lines += ["", "Per-seed values:", "", f"| method | seed | {monitor} | train loss | steps | resumed |",
              "|---|---|---|---|---|---|"]
    for m in methods:
        for r in runs_by_method.get(m, []):
            lines.append(f"| {m} | {r['seed']} | {r['final']:.4f} | {r['final_train_loss']:.4f} | {r['steps']} | "
                         f"{'yes' if r.get('resumed') else 'no'} |")
    lines += ["", "Stream RMS last/first: RMS of the stream entering the last merge over that entering the first "
              "(ResidualControlCallback's `stream_rms`, last logged step, mean over seeds). For multi-stream rules the "
              "stream is what the model's own code sees between merges (per-stream values are in TensorBoard).", ""]
    if files:
        lines += ["## Plots", "", "Lines: mean over seeds; shaded band: lowest to highest seed."
                  + (f" {describe_markers(markers)}" if any(k in files for k in DEPTH_PLOTS) else ""), ""]
        lines += [f"![{Path(f).stem}]({Path(f).name})" for f in files.values()] + [""]
    lines += ["TensorBoard logs: `tensorboard --logdir tb` (in this folder).", ""]
    run_wall = sum(r.get("wall_s") or 0.0 for r in done)
    cost_wall = (cost or {}).get("wall_s") or 0.0
    total_wall_s = run_wall + cost_wall
    lines += [f"Total wall time: {total_wall_s:.0f} s (the {len(done)} runs' own times, {run_wall:.0f} s, "
              f"and the cost measurement's, {cost_wall:.0f} s).", ""]
    markdown = "\n".join(lines)
    (out_dir / "summary.md").write_text(markdown)
    files["summary_md"] = "summary.md"
    summary = {"fingerprint": manifest["fingerprint"], "identity": ident, "about": about, "monitor": monitor,
               "mode": mode, "methods": per, "not_run": not_run, "missing": missing, "cost": cost,
               "runs": [{k: v for k, v in r.items() if k != "train_curve"} for r in records],
               "files": files, "total_wall_s": total_wall_s}
    (out_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1, default=str))
    files["summary_json"] = "summary.json"
    return SummaryTable(rows, "\n".join(table), summary, out_dir)
