"""The main job: a matched comparison of residual merges on a char-level GPT.

For every seed and every method in ``plain``, ``rescontroller``, ``mgr-independent``,
``mgr-competitive`` (and ``add``, the surgery's own control), :func:`run_comparison` builds the
same :class:`~lightning_resctl.gpt.CharGPT` from the same seed, patches it with
:func:`lightning_resctl.patch_residuals` (``plain`` stays unpatched), and trains it with the
same data order, optimiser, schedule and number of steps. Each run logs to TensorBoard under
``<out>/tb/<method>/seed<seed>`` and is observed by :class:`ResidualControlCallback` (depth
profiles) and, optionally, :class:`ResidualAblationCallback` (loss increase when each merge's
update is skipped). At the end :func:`write_summary` writes ``summary.md``, ``summary.json``
and PNG plots into ``<out>``.

Statistics (stated in ``summary.md`` too): a value's *spread* over seeds is half its range,
``(max - min) / 2``, so with 2 seeds ``mean ± spread`` is exactly the interval of the two runs.
A method's loss is said to *differ from plain beyond the seed spread* only when the ranges of
its per-seed values and plain's do not overlap; otherwise the summary says the difference is
within the seed spread. With one seed there is no spread and no claim is made.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger

from .data import CharCorpus, CharDataModule, load_corpus
from .gpt import CharGPT

__all__ = ["METHODS", "CompareConfig", "RunRecorder", "run_one", "run_comparison", "write_summary",
           "build_parser", "parse_config", "main"]

#: method name -> (patch_residuals method or None for unpatched, extra options).
METHODS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "plain": (None, {}),
    "add": ("add", {}),
    "rescontroller": ("rescontroller", {}),
    "mgr-independent": ("mgr", {"gating": "independent"}),
    "mgr-competitive": ("mgr", {"gating": "competitive"}),
}
DEFAULT_METHODS = ("plain", "rescontroller", "mgr-independent", "mgr-competitive")


@dataclass
class CompareConfig:
    """Everything one comparison depends on. CLI flags and YAML keys use these names
    (dashes or underscores)."""

    # model
    n_layer: int = 16
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64
    dropout: float = 0.0
    # methods and seeds
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    seeds: int = 2
    first_seed: int = 0
    streams: int = 4
    # optimisation
    steps: int = 160
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 16
    grad_clip: float = 1.0
    # evaluation and logging
    eval_every: int = 20
    val_batches: int = 4
    ablation: bool = True
    ablation_batches: int = 1
    log_every_n_steps: int = 20
    depth_images: bool = True
    # hardware
    accelerator: str = "auto"
    precision: str = "32-true"
    threads: int | None = None
    # data
    text: str | None = None
    hf_dataset: str | None = None
    hf_config: str | None = None
    hf_text_field: str = "text"
    max_train_chars: int = 2_000_000
    max_val_chars: int = 250_000
    # output
    out: str = "resctl_runs/compare"
    progress_bar: bool = True

    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    def validate(self) -> "CompareConfig":
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"methods: unknown {unknown}; choose from {sorted(METHODS)}")
        if not self.methods:
            raise ValueError("methods must name at least one method")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods lists a method twice: {self.methods}")
        for name in ("n_layer", "n_embd", "n_head", "block_size", "seeds", "steps", "batch_size",
                     "eval_every", "val_batches", "ablation_batches", "log_every_n_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.streams < 2:
            raise ValueError(f"streams must be >= 2, got {self.streams!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.text is not None and self.hf_dataset is not None:
            raise ValueError("give at most one of text and hf_dataset")
        return self


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RunRecorder(Callback):
    """Records what the summary needs from one run, without depending on any logger.

    * ``train_losses[(step, loss)]`` every training step;
    * ``val_curve[(step, loss)]``: the token-weighted mean of ``validation_step``'s loss over the
      validation batches, at every validation of the fit (sanity checks excluded);
    * ``train_time_s`` / ``train_steps_timed``: wall time between consecutive training-step starts
      (optimizer, logging and callbacks included), leaving out the first ``warmup`` intervals and
      every interval that contains a validation; ``tokens_per_s`` divides tokens by that time.
    """

    def __init__(self, warmup: int = 3):
        self.warmup = warmup
        self.train_losses: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float]] = []
        self.train_time_s = 0.0
        self.train_steps_timed = 0
        self.tokens_timed = 0
        self._last_start: float | None = None
        self._last_tokens = 0
        self._intervals = 0
        self._val_sum = 0.0
        self._val_count = 0

    # --- training time and loss -------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(pl_module.device)
        now = time.perf_counter()
        if self._last_start is not None:
            self._intervals += 1
            if self._intervals > self.warmup:
                self.train_time_s += now - self._last_start
                self.train_steps_timed += 1
                self.tokens_timed += self._last_tokens
        self._last_start = now
        self._last_tokens = int(batch[0].numel())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_losses.append((trainer.global_step, float(loss.detach())))
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            # ask for a validation at the last step too (Lightning runs one when the fit stops)
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        _sync(pl_module.device)
        now = time.perf_counter()
        if self._last_start is not None and self._intervals >= self.warmup:
            self.train_time_s += now - self._last_start
            self.train_steps_timed += 1
            self.tokens_timed += self._last_tokens
        self._last_start = None

    # --- validation ---------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer, pl_module):
        self._val_sum, self._val_count = 0.0, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        tokens = int(batch[1].numel())
        self._val_sum += float(outputs.detach()) * tokens
        self._val_count += tokens

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or not self._val_count:
            return
        self.val_curve.append((trainer.global_step, self._val_sum / self._val_count))

    def on_validation_end(self, trainer, pl_module):
        # a validation interrupts the step-to-step timing: restart it at the next step
        self._last_start = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_timed / self.train_time_s if self.train_time_s > 0 else float("nan")

    def final_train_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at least one step)."""
        if not self.train_losses:
            return float("nan")
        tail = max(1, len(self.train_losses) // 10)
        return sum(v for _, v in self.train_losses[-tail:]) / tail


def _depth_callbacks(cfg: CompareConfig) -> tuple[Callback, Callback | None]:
    """The diagnostics callbacks: ResidualControlCallback (observe only: the model is patched
    before the Trainer sees it; an unpatched "plain" model is observed through "add" merges, which
    leave its outputs bitwise unchanged) and, when enabled, ResidualAblationCallback run once, at the
    final validation."""
    from .callbacks import ResidualAblationCallback, ResidualControlCallback

    class FinalAblation(ResidualAblationCallback):
        """ResidualAblationCallback evaluated only at the validation after the last training step."""

        def on_validation_epoch_end(self, trainer, pl_module):
            if trainer.max_steps > 0 and trainer.global_step < trainer.max_steps:
                return
            super().on_validation_epoch_end(trainer, pl_module)

    control = ResidualControlCallback(method=None, log_every_n_steps=cfg.log_every_n_steps,
                                      depth_images=cfg.depth_images)
    ablation = FinalAblation(every_n_epochs=1, max_batches=cfg.ablation_batches) if cfg.ablation else None
    return control, ablation


def _count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _finite_list(values) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "detach"):
        values = values.detach().cpu().tolist()
    return [float(v) for v in values]


def run_one(cfg: CompareConfig, corpus: CharCorpus, method: str, seed: int, out_dir: Path) -> dict[str, Any]:
    """Train one (method, seed) and return its measurements as a JSON-ready dict."""
    patch_method, options = METHODS[method]
    L.seed_everything(seed, workers=True, verbose=False)
    model = CharGPT(len(corpus.vocab), block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_embd=cfg.n_embd, dropout=cfg.dropout, lr=cfg.lr, weight_decay=cfg.weight_decay,
                    warmup_steps=cfg.warmup_steps, max_steps=cfg.steps)
    params_before = _count_params(model)
    sites = 0
    if patch_method is not None:
        from .surgery import patch_residuals

        if patch_method == "mgr":
            options = {**options, "streams": cfg.streams}
        report = patch_residuals(model, method=patch_method, **options)
        sites = len(report.sites)
    params_added = _count_params(model) - params_before
    datamodule = CharDataModule(corpus, block_size=cfg.block_size, batch_size=cfg.batch_size,
                                train_steps=cfg.steps, val_batches=cfg.val_batches, seed=seed)

    recorder = RunRecorder(warmup=min(3, max(0, cfg.steps // 5)))
    control, ablation = _depth_callbacks(cfg)
    callbacks = [cb for cb in (recorder, control, ablation, LearningRateMonitor("step")) if cb is not None]
    run_dir = out_dir / "tb" / method / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a rerun into the same folder replaces that run's logs
    logger = TensorBoardLogger(save_dir=str(out_dir / "tb"), name=method, version=f"seed{seed}",
                               default_hp_metric=False)
    logger.log_hyperparams({"method": method, "seed": seed, **{k: v for k, v in asdict(cfg).items()
                                                              if k not in ("methods",)}})
    val_every = min(cfg.eval_every, cfg.steps)
    trainer = L.Trainer(
        accelerator=cfg.accelerator, devices=1, precision=cfg.precision, max_steps=cfg.steps,
        max_epochs=1, val_check_interval=val_every, check_val_every_n_epoch=1,
        num_sanity_val_steps=0, log_every_n_steps=cfg.log_every_n_steps,
        gradient_clip_val=cfg.grad_clip or None, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=cfg.progress_bar,
        deterministic=False)
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    wall = time.perf_counter() - started

    profile = getattr(control, "depth_profile", None) or {}
    if not sites:  # plain: the callback found the merges (through "add" merges it removed at teardown)
        sites = len(profile.get("stream_rms", []))
    loss_increase = getattr(ablation, "loss_increase", None) if ablation is not None else None
    result = {
        "method": method, "seed": seed, "patch_method": patch_method, "patch_options": options,
        "sites": sites, "params": _count_params(model), "params_added": params_added,
        "steps": trainer.global_step, "tokens_per_step": cfg.batch_size * cfg.block_size,
        "final_train_loss": recorder.final_train_loss(),
        "final_val_loss": recorder.val_curve[-1][1] if recorder.val_curve else float("nan"),
        "val_curve": recorder.val_curve, "train_curve": recorder.train_losses,
        "tokens_per_s": recorder.tokens_per_s, "train_time_s": recorder.train_time_s, "wall_s": wall,
        "depth_profile": {k: _finite_list(v) for k, v in profile.items()},
        "ablation_loss_increase": _finite_list(loss_increase),
        "tensorboard": str(run_dir),
    }
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / f"{method}_seed{seed}.json").write_text(json.dumps(result, indent=1))
    return result


def run_comparison(cfg: CompareConfig, corpus: CharCorpus | None = None) -> dict[str, Any]:
    """Run every (method, seed) of ``cfg`` and write the summary; returns ``write_summary``'s dict."""
    cfg.validate()
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_comparison(cfg, corpus)
    finally:
        torch.set_num_threads(threads)


def _run_comparison(cfg: CompareConfig, corpus: CharCorpus | None) -> dict[str, Any]:
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if corpus is None:
        corpus = load_corpus(text=cfg.text, hf_dataset=cfg.hf_dataset, max_train_chars=cfg.max_train_chars,
                             max_val_chars=cfg.max_val_chars,
                             **({"config": cfg.hf_config, "text_field": cfg.hf_text_field}
                                if cfg.hf_dataset else {}))
    print(f"[resctl] corpus: {corpus.describe()}", flush=True)
    print(f"[resctl] model: {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.n_head} heads, T={cfg.block_size}; "
          f"{cfg.steps} steps x {cfg.batch_size} sequences; methods {cfg.methods}; seeds {cfg.seed_list()}",
          flush=True)
    results = []
    started = time.perf_counter()
    total = len(cfg.methods) * cfg.seeds
    for seed in cfg.seed_list():
        for method in cfg.methods:
            print(f"[resctl] run {len(results) + 1}/{total}: {method}, seed {seed}", flush=True)
            results.append(run_one(cfg, corpus, method, seed, out_dir))
            r = results[-1]
            print(f"[resctl]   val loss {r['final_val_loss']:.4f}, train loss {r['final_train_loss']:.4f}, "
                  f"{r['tokens_per_s']:.0f} tokens/s, {r['wall_s']:.1f} s", flush=True)
    summary = write_summary(results, cfg, out_dir, corpus_description=corpus.describe(),
                            total_wall_s=time.perf_counter() - started)
    print(f"[resctl] done in {summary['total_wall_s']:.0f} s", flush=True)
    print(f"[resctl] summary:     {summary['files']['summary_md']}", flush=True)
    for name in ("val_loss_png", "stream_rms_png", "update_ratio_png", "ablation_png"):
        if name in summary["files"]:
            print(f"[resctl] plot:        {summary['files'][name]}", flush=True)
    print(f"[resctl] TensorBoard: tensorboard --logdir {out_dir / 'tb'}", flush=True)
    return summary


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------

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
    fig.savefig(path)  # plots.py figures are pyplot-free (Agg canvas): nothing to close
    return str(path)


def write_summary(results: Sequence[dict[str, Any]], cfg: CompareConfig, out_dir: Path,
                  corpus_description: str = "", total_wall_s: float | None = None) -> dict[str, Any]:
    """Aggregate per-run results into ``summary.md``, ``summary.json`` and PNG plots under ``out_dir``."""
    from .plots import curves_figure

    out_dir = Path(out_dir)
    methods = [m for m in cfg.methods if any(r["method"] == m for r in results)]
    per: dict[str, dict[str, Any]] = {}
    for m in methods:
        runs = [r for r in results if r["method"] == m]

        def profile(name, runs=runs):
            return _mean_profile([(r.get("depth_profile") or {}).get(name) for r in runs])

        rms = profile("stream_rms")
        max_ratio = profile("max_over_median")
        per[m] = {
            "seeds": [r["seed"] for r in runs],
            "final_val_loss": _stats([r["final_val_loss"] for r in runs]),
            "final_train_loss": _stats([r["final_train_loss"] for r in runs]),
            "tokens_per_s": _stats([r["tokens_per_s"] for r in runs]),
            "params_added": runs[0]["params_added"],
            "sites": runs[0]["sites"],
            "stream_rms_last_over_first": (rms[-1] / rms[0]) if rms and rms[0] > 0 else float("nan"),
            "max_activation_ratio": max(max_ratio) if max_ratio else float("nan"),
            "profiles": {name: profile(name) for name in ("stream_rms", "update_ratio", "growth",
                                                          "max_over_median", "update_rms", "max_abs")},
            "ablation_loss_increase": _mean_profile([r.get("ablation_loss_increase") for r in runs]),
            "val_curve": _mean_curve([r["val_curve"] for r in runs]),
            "train_curve": _mean_curve([r["train_curve"] for r in runs]),
        }
    baseline = "plain" if "plain" in per else ("add" if "add" in per else None)
    base_tps = per[baseline]["tokens_per_s"]["mean"] if baseline else float("nan")
    for m in methods:
        per[m]["tokens_per_s_ratio"] = (per[m]["tokens_per_s"]["mean"] / base_tps
                                       if baseline and base_tps > 0 else float("nan"))

    files: dict[str, str] = {}
    # --- plots ---------------------------------------------------------------------------------
    curves = {m: per[m]["val_curve"] for m in methods if per[m]["val_curve"][0]}
    if curves:
        files["val_loss_png"] = _save(curves_figure(
            curves, xlabel="step", ylabel="validation loss (nats/char)",
            title=f"validation loss, mean of {cfg.seeds} seed(s)"), out_dir / "val_loss.png")
    for key, family, ylabel, title in (
            ("stream_rms_png", "stream_rms", "stream RMS entering merge", "stream RMS vs depth"),
            ("update_ratio_png", "update_ratio", "update RMS / stream RMS", "update/stream ratio vs depth")):
        curves = {m: (list(range(len(p))), p) for m in methods if (p := per[m]["profiles"][family])}
        if curves:
            files[key] = _save(curves_figure(curves, xlabel="depth (merge index)", ylabel=ylabel,
                                             title=f"{title} (end of training)",
                                             logy=family == "stream_rms"),
                               out_dir / f"{family}_depth.png")
    curves = {m: (list(range(len(p))), p) for m in methods if (p := per[m]["ablation_loss_increase"])}
    if curves:
        files["ablation_png"] = _save(curves_figure(
            curves, xlabel="depth (merge skipped)", ylabel="validation loss increase",
            title="ablation: loss increase when one merge's update is skipped"),
            out_dir / "ablation_depth.png")

    # --- summary.md --------------------------------------------------------------------------
    lines = ["# Residual merge comparison", ""]
    if corpus_description:
        lines += [f"Corpus: {corpus_description}.", ""]
    lines += [f"Model: char-level GPT, {cfg.n_layer} layers ({2 * cfg.n_layer} residual merges), C={cfg.n_embd}, "
              f"{cfg.n_head} heads, context {cfg.block_size}. Training: {cfg.steps} steps of {cfg.batch_size} "
              f"sequences, AdamW lr={cfg.lr}, weight decay {cfg.weight_decay}, warm-up {cfg.warmup_steps} steps "
              f"then cosine; gradient clip {cfg.grad_clip}. Seeds {cfg.seed_list()}: for each seed every method "
              f"starts from the same initial weights and sees the same batches in the same order. MGR uses "
              f"n={cfg.streams} streams. plain is the unpatched model (the diagnostics callback observes it through "
              f"`add` merges, which leave its outputs bitwise unchanged).", ""]
    lines += ["± is the seed spread: half the range of the per-seed values (with 2 seeds, mean ± spread is "
              "exactly the interval between them). Final train loss: mean over the last 10% of steps. Final "
              "val loss: the last validation (every {} steps, {} batches). tokens/s: training throughput, "
              "validation excluded; measured one run after another on the same machine, so it is noisy."
              .format(min(cfg.eval_every, cfg.steps), cfg.val_batches), ""]
    lines += ["| method | final val loss | final train loss | tokens/s | vs plain | stream RMS last/first "
              "| max activation ratio | params added | merges |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        p = per[m]
        lines.append(
            f"| {m} | {_fmt(p['final_val_loss'])} | {_fmt(p['final_train_loss'])} | "
            f"{_fmt(p['tokens_per_s'], 0)} | {p['tokens_per_s_ratio']:.3f}x | "
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
            lines.append("  " + _verdict(per[m]["tokens_per_s"], per["plain"]["tokens_per_s"],
                                         "Throughput (tokens/s)", digits=0))
    lines += ["", "Per-seed values:", "", "| method | seed | final val loss | final train loss | tokens/s |",
              "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['seed']} | {r['final_val_loss']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['tokens_per_s']:.0f} |")
    lines += ["", "Stream RMS last/first: RMS of the stream entering the last merge over that entering the first "
              "(ResidualControlCallback's `stream_rms`, last logged step, mean over seeds). Max activation ratio: "
              "the largest max|x| / median|x| of the stream over depths. For MGR the stream is what the model's own "
              "code sees between merges (the pooled view of the n streams; per-stream values are in TensorBoard "
              "under `resctl/mgr_stream_rms_s<i>`).", ""]
    if files:
        lines += ["## Plots", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in files.values()] + [""]
    lines += [f"TensorBoard logs: `tensorboard --logdir {out_dir / 'tb'}`", ""]
    if total_wall_s is not None:
        lines += [f"Total wall time: {total_wall_s:.0f} s.", ""]
    summary_md = out_dir / "summary.md"
    summary_md.write_text("\n".join(lines))
    files["summary_md"] = str(summary_md)
    summary = {"config": asdict(cfg), "methods": per, "runs": [
        {k: v for k, v in r.items() if k not in ("train_curve",)} for r in results],
        "files": files, "total_wall_s": total_wall_s if total_wall_s is not None else float("nan")}
    summary_json = out_dir / "summary.json"
    summary_json.write_text(json.dumps(summary, indent=1))
    files["summary_json"] = str(summary_json)
    return summary


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def _bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in str(text).split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    return names


def build_parser(prog: str = "python -m lightning_resctl compare") -> argparse.ArgumentParser:
    """The ``compare`` flags. Every flag is also a YAML key of ``--config`` (flags win)."""
    d = CompareConfig()
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train the same char-level GPT with each residual merge (same seeds, data order, "
                    "optimizer, steps) and write summary.md, PNG plots and TensorBoard logs.")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (keys as the flags, "
                   "dashes or underscores); flags given on the command line override it")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", "--depth", dest="n_layer", type=int, default=d.n_layer)
    g.add_argument("--n-embd", "--width", dest="n_embd", type=int, default=d.n_embd)
    g.add_argument("--n-head", "--heads", dest="n_head", type=int, default=d.n_head)
    g.add_argument("--block-size", dest="block_size", type=int, default=d.block_size, help="context length")
    g.add_argument("--dropout", type=float, default=d.dropout)
    g = p.add_argument_group("methods and seeds")
    g.add_argument("--methods", type=_methods, default=d.methods,
                   help=f"comma-separated, from {', '.join(METHODS)}")
    g.add_argument("--seeds", type=int, default=d.seeds, help="number of seeds; every method runs on each")
    g.add_argument("--first-seed", dest="first_seed", type=int, default=d.first_seed)
    g.add_argument("--streams", type=int, default=d.streams, help="MGR streams n")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--batch-size", dest="batch_size", type=int, default=d.batch_size)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", dest="weight_decay", type=float, default=d.weight_decay)
    g.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=d.warmup_steps)
    g.add_argument("--grad-clip", dest="grad_clip", type=float, default=d.grad_clip)
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", dest="eval_every", type=int, default=d.eval_every,
                   help="validate every N steps")
    g.add_argument("--val-batches", dest="val_batches", type=int, default=d.val_batches)
    g.add_argument("--ablation", type=_bool, default=d.ablation, metavar="BOOL",
                   help="run ResidualAblationCallback (loss increase per skipped merge)")
    g.add_argument("--ablation-batches", dest="ablation_batches", type=int, default=d.ablation_batches,
                   help="validation batches per ablated merge")
    g.add_argument("--log-every-n-steps", dest="log_every_n_steps", type=int, default=d.log_every_n_steps)
    g.add_argument("--depth-images", dest="depth_images", type=_bool, default=d.depth_images, metavar="BOOL",
                   help="TensorBoard depth-profile images at every validation")
    g = p.add_argument_group("hardware")
    g.add_argument("--accelerator", "--device", dest="accelerator", default=d.accelerator,
                   help="Lightning accelerator: auto, cpu, gpu, cuda, mps")
    g.add_argument("--precision", default=d.precision, help="Lightning precision, e.g. 32-true, bf16-mixed")
    g.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads (CPU)")
    g = p.add_argument_group("data")
    g.add_argument("--text", default=d.text, metavar="PATH",
                   help="your own text file or folder instead of the standard-library sources")
    g.add_argument("--hf-dataset", dest="hf_dataset", default=d.hf_dataset, metavar="NAME",
                   help="a Hugging Face dataset name (needs `datasets` and network)")
    g.add_argument("--hf-config", dest="hf_config", default=d.hf_config)
    g.add_argument("--hf-text-field", dest="hf_text_field", default=d.hf_text_field)
    g.add_argument("--max-train-chars", dest="max_train_chars", type=int, default=d.max_train_chars)
    g.add_argument("--max-val-chars", dest="max_val_chars", type=int, default=d.max_val_chars)
    g = p.add_argument_group("output")
    g.add_argument("--out", "--output-dir", dest="out", default=d.out)
    g.add_argument("--progress-bar", dest="progress_bar", type=_bool, default=d.progress_bar, metavar="BOOL")
    return p


def _yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise SystemExit(f"--config: no such file: {path!r}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    valid = {f.name for f in fields(CompareConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = {"depth": "n_layer", "width": "n_embd", "heads": "n_head", "device": "accelerator",
                "output_dir": "out"}.get(name, name)
        if name not in valid:
            raise SystemExit(f"--config {path}: unknown option {key!r}; valid: {sorted(valid)}")
        if name == "methods" and isinstance(value, str):
            value = _methods(value)
        out[name] = value
    return out


def parse_config(argv: Sequence[str] | None = None) -> CompareConfig:
    """Flags -> :class:`CompareConfig`; ``--config FILE.yaml`` supplies defaults that flags override."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(pre.config, parser))
    args = vars(parser.parse_args(argv))
    args.pop("config", None)
    cfg = CompareConfig(**args)
    try:
        return cfg.validate()
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_resctl compare [flags]``."""
    cfg = parse_config(argv)
    run_comparison(cfg)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
