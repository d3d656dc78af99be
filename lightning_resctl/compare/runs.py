"""Training: one (method, seed) run (:func:`run_one`) and the whole job (:func:`run_comparison`)."""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger

from .config import CompareConfig
from .cost import measure_cost
from .data import CharCorpus, CharDataModule, load_corpus
from .gpt import CharGPT
from .methods import apply_method, branch_labels
from .progress import JobProgress, ProgressCallback

__all__ = ["RunRecorder", "run_one", "run_comparison", "OutputExistsError", "existing_results"]

#: what a finished job leaves in ``--out`` (and what ``--overwrite`` removes before a new job)
RESULT_FILES = ("summary.md", "summary.json", "cost.json", "val_loss.png", "stream_rms_depth.png",
                "update_ratio_depth.png", "ablation_depth.png")
RESULT_DIRS = ("runs", "tb")


class OutputExistsError(FileExistsError):
    """``--out`` already holds the results of an earlier job and ``--overwrite`` was not given."""


def existing_results(out_dir: Path) -> list[str]:
    """The result files and folders of an earlier job in ``out_dir`` (names, sorted)."""
    out_dir = Path(out_dir)
    return sorted(name for name in (*RESULT_FILES, *RESULT_DIRS) if (out_dir / name).exists())


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new job into an earlier job's results unless ``overwrite``; then clear them."""
    found = existing_results(out_dir)
    if found and not overwrite:
        raise OutputExistsError(
            f"{out_dir} already holds the results of an earlier job ({', '.join(found)}). Pass --overwrite "
            f"to replace them, or choose another folder with --out.")
    for name in found:
        path = Path(out_dir) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    Path(out_dir).mkdir(parents=True, exist_ok=True)


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
    from ..callbacks import ResidualAblationCallback, ResidualControlCallback

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


def build_model(cfg: CompareConfig, vocab_size: int, seed: int) -> CharGPT:
    """The unpatched model of ``cfg``, initialised from ``seed`` (the same weights for every method)."""
    L.seed_everything(seed, workers=True, verbose=False)
    return CharGPT(vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                   n_embd=cfg.n_embd, dropout=cfg.dropout, lr=cfg.lr, weight_decay=cfg.weight_decay,
                   warmup_steps=cfg.warmup_steps, max_steps=cfg.steps)


def run_one(cfg: CompareConfig, corpus: CharCorpus, method: str, seed: int, out_dir: Path,
            progress: JobProgress | None = None) -> dict[str, Any]:
    """Train one (method, seed) and return its measurements as a JSON-ready dict."""
    model = build_model(cfg, len(corpus.vocab), seed)
    params_before = _count_params(model)
    report = apply_method(model, method, cfg.streams)
    sites = len(report.sites) if report is not None else 0
    options = dict(getattr(report, "options", None) or {}) if report is not None else {}
    params_added = _count_params(model) - params_before
    datamodule = CharDataModule(corpus, block_size=cfg.block_size, batch_size=cfg.batch_size,
                                train_steps=cfg.steps, val_batches=cfg.val_batches, seed=seed)

    recorder = RunRecorder(warmup=min(3, max(0, cfg.steps // 5)))
    control, ablation = _depth_callbacks(cfg)
    callbacks = [cb for cb in (recorder, control, ablation, LearningRateMonitor("step")) if cb is not None]
    if progress is not None:
        callbacks.append(ProgressCallback(progress))
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
        enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=False,  # the job's own progress line (method, seed, ETA) replaces it
        deterministic=False)
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    wall = time.perf_counter() - started

    profile = getattr(control, "depth_profile", None) or {}
    if not sites:  # plain: the callback found the merges (through "add" merges it removed at teardown)
        sites = len(profile.get("stream_rms", []))
    loss_increase = getattr(ablation, "loss_increase", None) if ablation is not None else None
    result = {
        "method": method, "seed": seed, "patch_options": options,
        "sites": sites, "branches": branch_labels(report, sites, cfg.n_layer),
        "params": _count_params(model), "params_added": params_added,
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
    (runs_dir / f"{method}_seed{seed}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


@contextlib.contextmanager
def _warnings_once():
    """Within the job, a warning with the same category and text is shown once (Lightning and torch
    re-arm theirs in every Trainer, which would repeat them for every run)."""
    seen: set[tuple[type, str]] = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key in seen:
            return
        seen.add(key)
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = original


@contextlib.contextmanager
def _lightning_quiet(quiet: bool):
    """Lightning's info lines ("GPU available ...", tips, "`Trainer.fit` stopped ...") are printed by
    the first run only: later runs raise its loggers to WARNING (restored afterwards)."""
    if not quiet:
        yield
        return
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def cost_vs_plain(cfg: CompareConfig, corpus: CharCorpus, progress: JobProgress | None = None) -> dict[str, Any] | None:
    """Interleaved step timing of every method of ``cfg`` against plain (see :mod:`.cost`); None when
    ``cfg.cost_steps == 0``."""
    if cfg.cost_steps <= 0:
        return None
    seed = cfg.first_seed
    dm = CharDataModule(corpus, block_size=cfg.block_size, batch_size=cfg.batch_size,
                        train_steps=cfg.cost_warmup + cfg.cost_steps, val_batches=1, seed=seed)
    batches = list(dm.train_dataloader())

    def on_round(i, n):
        if progress is not None and progress.enabled and progress.tty:
            progress.stream.write(f"\r[resctl] cost vs plain: round {i}/{n}")
            progress.stream.flush()

    result = measure_cost(cfg.methods, lambda: build_model(cfg, len(corpus.vocab), seed), batches,
                          warmup=cfg.cost_warmup, streams=cfg.streams, grad_clip=cfg.grad_clip,
                          accelerator=cfg.accelerator, precision=cfg.precision, on_round=on_round)
    if progress is not None and progress.enabled and progress.tty:
        progress.stream.write("\r" + " " * 60 + "\r")
    return result


def run_comparison(cfg: CompareConfig, corpus: CharCorpus | None = None) -> dict[str, Any]:
    """Run every (method, seed) of ``cfg`` and write the summary; returns ``write_summary``'s dict.

    Raises :class:`OutputExistsError` when ``cfg.out`` holds an earlier job's results and
    ``cfg.overwrite`` is False (checked before anything runs)."""
    cfg.validate()
    prepare_out_dir(Path(cfg.out), cfg.overwrite)
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_comparison(cfg, corpus)
    finally:
        torch.set_num_threads(threads)


def _run_comparison(cfg: CompareConfig, corpus: CharCorpus | None) -> dict[str, Any]:
    from .summary import write_summary

    out_dir = Path(cfg.out)
    started = time.perf_counter()
    if corpus is None:
        corpus = load_corpus(text=cfg.text, hf_dataset=cfg.hf_dataset, max_train_chars=cfg.max_train_chars,
                             max_val_chars=cfg.max_val_chars,
                             **({"config": cfg.hf_config, "text_field": cfg.hf_text_field}
                                if cfg.hf_dataset else {}))
    total = len(cfg.methods) * cfg.seeds
    progress = JobProgress(total, cfg.steps, enabled=cfg.progress_bar)
    progress.start()
    say = progress.message
    say(f"[resctl] corpus: {corpus.describe()}")
    say(f"[resctl] model: {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.n_head} heads, T={cfg.block_size}; "
        f"{cfg.steps} steps x {cfg.batch_size} sequences; methods {', '.join(cfg.methods)}; "
        f"seeds {cfg.seed_list()}; {total} runs")
    cost = None
    if cfg.cost_steps > 0:
        say(f"[resctl] cost vs plain: {cfg.cost_steps} timed rounds of one training step per method, interleaved")
        cost = cost_vs_plain(cfg, corpus, progress)
        say("[resctl] cost vs plain (step time, median): " + ", ".join(
            f"{m} {cost['ratio'][m]:.2f}x" for m in cost["ratio"]))
        (out_dir / "cost.json").write_text(json.dumps(cost, indent=1))
    results = []
    with _warnings_once():
        for index, (seed, method) in enumerate(((s, m) for s in cfg.seed_list() for m in cfg.methods), 1):
            progress.start_run(index, method, seed)
            with _lightning_quiet(index > 1):
                results.append(run_one(cfg, corpus, method, seed, out_dir, progress))
            progress.end_run()
            r = results[-1]
            say(f"[resctl] run {index}/{total} done: {method}, seed {seed}: val loss {r['final_val_loss']:.4f}, "
                f"train loss {r['final_train_loss']:.4f}, {r['wall_s']:.1f} s")
    progress.close()
    summary = write_summary(results, cfg, out_dir, corpus_description=corpus.describe(),
                            total_wall_s=time.perf_counter() - started, cost=cost)
    print(f"[resctl] done in {summary['total_wall_s']:.0f} s", flush=True)
    print(f"[resctl] summary:     {summary['files']['summary_md']}", flush=True)
    for name in ("val_loss_png", "stream_rms_png", "update_ratio_png", "ablation_png"):
        if name in summary["files"]:
            print(f"[resctl] plot:        {summary['files'][name]}", flush=True)
    print(f"[resctl] TensorBoard: tensorboard --logdir {out_dir / 'tb'}", flush=True)
    return summary
