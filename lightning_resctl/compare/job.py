"""The whole comparison: :func:`run_job` plans the (method, seed) runs (all of them, or one shard), skips those a
resumed job has finished, checks how far each method starts from plain, measures the cost column, trains the
rest (:mod:`.run`), and writes the summary (:mod:`.summary`).

The command line (:mod:`.cli`) and the Python API (:func:`lightning_resctl.compare`) differ only in how they
describe the model, the data and the Trainer: both hand :func:`run_job` a :class:`JobInputs`.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .cost import autocast_for, measure_cost, resolve_device
from .fairness import InitProbe, RefusedError, init_difference
from .methods import PLAIN
from .options import CompareOptions
from .preemption import EXIT_SIGTERM, JobStopped, sigterm_stops_job
from .progress import JobProgress, ProgressCallback
from .records import JobFolder, planned_runs
from .run import job_trainer_settings, train_run
from .summary import SummaryTable, describe_chosen, describe_set, write_summary

__all__ = ["JobInputs", "run_job", "init_fingerprint", "module_identity", "stable"]


@dataclass
class JobInputs:
    """What the job needs to build each run, and how to recognise the job again (resume, shards).

    Attributes:
        make_model: returns a fresh LightningModule at init; the job seeds the RNG before calling it, once per seed
            (every method of that seed trains a copy of that one model).
        make_datamodule: returns the LightningDataModule a run uses (a fresh one, or the same one every time), or
            None when the model brings its own dataloaders.
        make_trainer_kwargs: returns the user's Trainer arguments (fresh callback / logger objects every call).
        identity: the model, data and Trainer settings as JSON-able values (part of the job's fingerprint); a
            ``"model": None`` entry is filled from the first seed's model (:func:`module_identity`).
        resume: how to resume the job, said when it stops on SIGTERM (the command line gives its exact command).
        trainer_chosen: the Trainer settings the entry point chose because the user's did not set them (the command
            line's and the API's defaults), said before the first run and written to job.json and summary.md.
    """

    make_model: Callable[[], L.LightningModule]
    make_datamodule: Callable[[], L.LightningDataModule | None]
    make_trainer_kwargs: Callable[[], dict[str, Any]]
    identity: dict[str, Any]
    resume: str = "call lightning_resctl.compare again with the same arguments and resume=True"
    trainer_chosen: dict[str, Any] = field(default_factory=dict)


def stable(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every process: numbers, strings and containers as they are,
    other objects as their class path plus their saved hyperparameters, if any (never a memory address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): stable(v) for k, v in value.items()}
    return module_identity(value)


def module_identity(obj: Any) -> dict[str, Any]:
    """``{"class": "pkg.Class", "hparams": {...}}`` of a module, datamodule or callback (hparams when it saved any)."""
    if obj is None:
        return {}
    cls = type(obj)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    hparams = {k: v for k, v in dict(getattr(obj, "hparams", None) or {}).items() if not str(k).startswith("_")}
    if hparams:
        out["hparams"] = stable(hparams)
    return out


def init_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of a model's state: equal for the same initial weights."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if isinstance(value, torch.Tensor):
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _is_rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0


@contextlib.contextmanager
def _warnings_once():
    """Within the job, a warning with the same category and text is shown once (Lightning and torch re-arm
    theirs in every Trainer, which would repeat them for every run)."""
    seen: set[tuple[type, str]] = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in seen:
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
    """Lightning's info lines ("GPU available ...", tips) are printed by the first run only."""
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


def _describe_module(obj: Any) -> str:
    """``ClassName(arg=value, ...)`` from the object's saved hyperparameters (its class name alone otherwise)."""
    if obj is None:
        return ""
    describe = getattr(obj, "describe", None)
    if callable(describe):
        return str(describe())
    hparams = dict(getattr(obj, "hparams", {}) or {})
    args = ", ".join(f"{k}={v}" for k, v in hparams.items() if not str(k).startswith("_"))
    return f"{type(obj).__name__}({args})"


def _describe_trainer(kwargs: dict[str, Any]) -> str:
    """The Trainer arguments that differ from Lightning's defaults."""
    defaults = {k: p.default for k, p in inspect.signature(L.Trainer.__init__).parameters.items()}
    shown = [f"{k}={v}" for k, v in kwargs.items() if k in defaults and defaults[k] != v and k not in ("callbacks",)]
    return ", ".join(shown) or "Lightning's defaults"


class _Job:
    def __init__(self, inputs: JobInputs, opts: CompareOptions):
        self.inputs, self.opts = inputs, opts
        self.methods, self.seeds = opts.method_list(), opts.seed_list()
        self.folder = JobFolder(opts.out)
        self.trainer_kwargs = inputs.make_trainer_kwargs()
        self.device = resolve_device(self.trainer_kwargs.get("accelerator", "auto"))
        self.autocast = autocast_for(self.device, self.trainer_kwargs.get("precision", "32-true"))
        self._references: dict[int, tuple[L.LightningModule, str]] = {}
        self._plain_probe: dict[int, Any] = {}
        self._probe: InitProbe | None = None
        self._datamodule = None

    # ------------------------------------------------------------------ builders
    def reference(self, seed: int) -> tuple[L.LightningModule, str]:
        """The seed's initial model (built once, then copied for every method) and its fingerprint."""
        if seed not in self._references:
            self._references.clear()  # one seed at a time: runs are ordered seed by seed
            self._plain_probe.clear()
            seed_everything(seed, workers=True, verbose=False)
            model = self.inputs.make_model()
            self._references[seed] = (model, init_fingerprint(model))
        return self._references[seed]

    def datamodule(self):
        if self._datamodule is None:
            self._datamodule = self.inputs.make_datamodule()
            if self._datamodule is not None:
                self._datamodule.prepare_data()
                self._datamodule.setup("fit")
        return self._datamodule

    def probe(self, seed: int) -> InitProbe:
        if self._probe is None:
            dm = self.datamodule()
            source = dm if dm is not None else self.reference(seed)[0]
            try:
                batch = next(iter(source.val_dataloader()))
            except Exception as err:  # noqa: BLE001 - say what the job needs
                raise ValueError(f"the compare job needs validation data (it compares the monitored validation "
                                 f"metric): {type(source).__name__}.val_dataloader() failed: {err}") from err
            self._probe = InitProbe(batch, self.device, self.autocast)
        return self._probe

    def init_check(self, method: str, seed: int) -> dict[str, Any]:
        model, _ = self.reference(seed)
        probe = self.probe(seed)
        if seed not in self._plain_probe:
            self._plain_probe[seed] = probe(copy.deepcopy(model), {n for n, _ in model.named_parameters()})
        return init_difference(model, method, self.opts.options.get(method), probe, plain=self._plain_probe[seed])

    # ------------------------------------------------------------------ cost
    def cost(self, progress: JobProgress) -> dict[str, Any] | None:
        opts = self.opts
        shard = opts.shard_pair()
        if opts.cost_rounds <= 0 or (shard is not None and shard[0] != 1):
            return None
        if opts.resume and self.folder.cost() is not None:
            return self.folder.cost()
        reference, _ = self.reference(self.seeds[0])
        dm = self.datamodule()
        source = dm if dm is not None else reference
        seed_everything(self.seeds[0], workers=True, verbose=False)
        batches, iterator = [], iter(source.train_dataloader())
        for _ in range(opts.cost_rounds):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        progress.message(f"[resctl] cost vs plain: {len(batches)} timed rounds of one training step per method, "
                         "interleaved, after untimed warm-up rounds")

        last = [time.perf_counter()]

        def on_round(i, n):
            if not progress.enabled:
                return
            if progress.tty:
                progress.stream.write(f"\r[resctl] cost vs plain: round {i}/{n}")
                progress.stream.flush()
            elif time.perf_counter() - last[0] >= progress.interval_s:  # a log: a line every interval
                last[0] = time.perf_counter()
                progress.message(f"[resctl] cost vs plain: round {i}/{n}")

        started = time.perf_counter()
        result = measure_cost(self.methods, reference, batches, options=opts.options, warmup=opts.cost_warmup,
                              device=self.device, precision=self.trainer_kwargs.get("precision", "32-true"),
                              gradient_clip_val=self.trainer_kwargs.get("gradient_clip_val"), on_round=on_round)
        result["wall_s"] = time.perf_counter() - started  # part of the job's total wall time (see write_summary)
        if progress.enabled and progress.tty:
            progress.stream.write("\r" + " " * 60 + "\r")
        progress.message("[resctl] cost vs plain (step time, median and interquartile range): " + ", ".join(
            f"{m} {result['ratio'][m]:.2f}x ({result['iqr'][m][0]:.2f}-{result['iqr'][m][1]:.2f})"
            + ("" if result["reliable"][m] else " unreliable") for m in result["ratio"]))
        if _is_rank_zero():
            self.folder.write_cost(result)
        return result

    # ------------------------------------------------------------------ the job
    def run(self) -> SummaryTable:
        """The job (see :func:`run_job`); on SIGTERM anywhere in it, :meth:`stopped`."""
        self._runs: list[tuple[str, int]] = []
        self._todo: list[tuple[str, int]] = []
        self._running: tuple[int, str, int] | None = None  # (index, method, seed) of the run in progress
        self._progress: JobProgress | None = None
        try:
            return self._run()
        except SIGTERMException:
            self.stopped()

    def stopped(self) -> None:
        """Say where the job stopped and how to resume it (rank zero), and raise :class:`JobStopped`."""
        if self._progress is not None:
            self._progress.close()
        if _is_rank_zero():
            runs = self._runs
            finished = sum(self.folder.read_record(m, s) is not None for m, s in runs)
            where = "between runs" if runs else "before its first run"
            if self._running is not None:
                index, method, seed = self._running
                saved = self.folder.checkpoint(method, seed)
                where = f"in run {index}/{len(self._todo)} ({method}, seed {seed}), " + (
                    f"which is saved in {saved}" if saved.is_file() else "which starts over when resumed")
            done = f"; {finished} of {len(runs)} runs finished" if runs else ""
            print(f"[resctl] SIGTERM: the job stopped {where}{done}; exit status {EXIT_SIGTERM}", flush=True)
            print(f"[resctl] resume with: {self.inputs.resume}", flush=True)
        raise JobStopped(self.inputs.resume) from None

    def _run(self) -> SummaryTable:
        opts = self.opts
        started = time.perf_counter()
        identity = {**self.inputs.identity, "compare": opts.identity()}
        if identity.get("model", "") is None:
            identity["model"] = module_identity(self.reference(self.seeds[0])[0])
        rank_zero = _is_rank_zero()  # under a multi-process strategy every rank runs the job; rank zero writes
        if rank_zero:
            self.folder.prepare(identity, opts.shard, overwrite=opts.overwrite, resume=opts.resume)
        runs = self._runs = planned_runs(self.methods, self.seeds, opts.shard_pair())
        todo = self._todo = [(m, s) for m, s in runs if self.folder.read_record(m, s) is None]
        max_steps = int(self.trainer_kwargs.get("max_steps") or -1)
        progress = self._progress = JobProgress(len(todo), max(max_steps, 0), enabled=opts.progress_bar and rank_zero)
        progress.start()

        def say(text: str) -> None:
            if rank_zero:
                progress.message(text)

        reference, _ = self.reference(self.seeds[0] if not todo else todo[0][1])
        dm = self.datamodule()
        about = {"data": _describe_module(dm) if dm is not None else "the model's own dataloaders",
                 "model": f"{_describe_module(reference)}; {sum(p.numel() for p in reference.parameters()):,} "
                          "parameters",
                 "trainer": _describe_trainer(self.trainer_kwargs),
                 "trainer_chosen": dict(self.inputs.trainer_chosen), "trainer_set": job_trainer_settings(opts)}
        if rank_zero:
            manifest = self.folder.manifest()
            manifest["about"] = about
            (self.folder.path / "job.json").write_text(json.dumps(manifest, indent=1, default=str))
        say(f"[resctl] data: {about['data']}")
        say(f"[resctl] model: {about['model']}")
        say(f"[resctl] trainer: {about['trainer']}")
        if about["trainer_chosen"]:
            say(f"[resctl] trainer: {describe_chosen(about['trainer_chosen'])}")
        say(f"[resctl] trainer: {describe_set(about['trainer_set'])}")
        say(f"[resctl] methods {', '.join(self.methods)}; seeds {self.seeds}; "
            + (f"shard {opts.shard}: " if opts.shard else "") + f"{len(runs)} runs"
            + (f", {len(runs) - len(todo)} finished already (resume)" if len(todo) < len(runs) else ""))
        if not todo:
            say(f"[resctl] all {len(runs)} runs of this job are finished: nothing to train; the summary is written "
                "again from the folder (the same files)")
        cost = self.cost(progress) if rank_zero else None
        with _warnings_once():
            for index, (method, seed) in enumerate(todo, 1):
                self._running = (index, method, seed)
                record = self.one(index, method, seed, progress)
                if rank_zero:
                    self.folder.write_record(record)
                self._running = None
                if record["status"] == "done":
                    say(f"[resctl] run {index}/{len(todo)} done: {method}, seed {seed}: {record['monitor']} "
                        f"{record['final']:.4f}, {record['wall_s']:.1f} s"
                        + (" (resumed from its checkpoint)" if record["resumed"] else ""))
                else:
                    say(f"[resctl] run {index}/{len(todo)}: method {method} {record['status']}: {record['reason']}")
        progress.close()
        if not rank_zero:
            return SummaryTable([], "", {}, self.folder.path)
        manifest = self.folder.manifest() or {"fingerprint": "", "identity": identity, "about": about}
        table = write_summary(manifest, self.folder.records(), cost if cost is not None else self.folder.cost(),
                              self.folder.path)
        say(f"[resctl] done: {time.perf_counter() - started:.0f} s in this process")
        say(f"[resctl] summary:     {self.folder.path / 'summary.md'}")
        if opts.shard:
            say("[resctl] this folder holds one shard: merge all shards' folders with "
                "`lightning-resctl summarize OUT1 OUT2 ...`")
        say(f"[resctl] TensorBoard: tensorboard --logdir {self.folder.tensorboard_dir()}")
        return table

    def one(self, index: int, method: str, seed: int, progress: JobProgress) -> dict[str, Any]:
        base = {"method": method, "seed": seed, "options": self.opts.options.get(method, {})}
        try:
            fair = self.init_check(method, seed)
        except RefusedError as err:
            return {**base, "status": "refused", "reason": str(err)}
        reference, fp = self.reference(seed)
        progress.start_run(index, method, seed)
        try:
            with _lightning_quiet(index > 1):
                record = train_run(method, seed, reference, self.inputs.make_datamodule(),
                                   self.inputs.make_trainer_kwargs(), self.opts, self.folder,
                                   extra_callbacks=[ProgressCallback(progress)], init_fingerprint=fp,
                                   init_difference=fair)
        except Exception as err:
            if method == PLAIN:
                raise  # plain failing is the user's setup failing: nothing to compare against
            progress.end_run()
            return {**base, "status": "failed", "reason": f"{type(err).__name__}: {err}"}
        progress.end_run()
        return record


def run_job(inputs: JobInputs, opts: CompareOptions) -> SummaryTable:
    """Run (or resume, or run one shard of) the comparison described by ``inputs`` and ``opts``; write the output
    folder; return the summary table. See :func:`lightning_resctl.compare` for what is compared and how.

    On SIGTERM the run in progress saves its checkpoint, the job says how to resume (``inputs.resume``) and raises
    :class:`~.preemption.JobStopped` (a ``SystemExit`` with status 143)."""
    opts.validate()
    threads = torch.get_num_threads()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    try:
        with sigterm_stops_job():
            return _Job(inputs, opts).run()
    finally:
        torch.set_num_threads(threads)
