"""The Python entry points: :func:`compare` and :func:`summarize` (imported cheaply; Lightning is loaded when
called)."""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["compare", "summarize", "API_TRAINER_DEFAULTS"]

#: Trainer arguments the Python API uses unless ``trainer=`` sets them (Lightning's defaults otherwise).
API_TRAINER_DEFAULTS = {"devices": 1, "num_sanity_val_steps": 0, "enable_model_summary": False}


def _as_factory(obj: Any, what: str) -> tuple[Callable[[], Any], bool]:
    """``(factory, shared)``: a class or callable is called for each new object; an instance is copied (model) or
    reused (datamodule); ``shared`` says it was an instance."""
    import lightning as L

    base = L.LightningModule if what == "model" else L.LightningDataModule
    if isinstance(obj, base):
        if what == "model":
            return (lambda: copy.deepcopy(obj)), True
        return (lambda: obj), True
    if callable(obj):
        def build():
            value = obj()
            if not isinstance(value, base):
                raise TypeError(f"{what}= must return a {base.__name__}, got {type(value).__name__}")
            return value
        return build, False
    raise TypeError(f"{what}= must be a {base.__name__}, a class or a callable returning one, got {type(obj).__name__}")


def compare(model: Any = None, datamodule: Any = None, *, methods: Sequence[str] | str | None = None,
            seeds: int = 2, trainer: Mapping[str, Any] | None = None, out: str | Path = "resctl_runs/compare",
            **options: Any):
    """Compare residual merges on your LightningModule: the Python form of ``lightning-resctl compare``.

    For every seed the model is built once (``seed_everything(seed)`` first) and every method trains a copy of it:
    same initial weights, same batches in the same order, same optimizer (your ``configure_optimizers``), same
    Trainer settings. ``plain`` is your model unpatched; every other method is a registered merge rule, applied by
    :class:`~lightning_resctl.ResidualControlCallback` (the surgery needs ``example_input_array``). The monitored
    validation metric is compared seed by seed (see :mod:`lightning_resctl.compare.stats`); the summary also gives
    each method's distance to plain at init and its training-step cost next to plain's.

    Args:
        model: a LightningModule class or callable returning a fresh one (called once per seed, after seeding), or
            an instance (then every seed starts from its weights; only the data order and dropout change with the
            seed). None: the built-in byte-level GPT (:class:`~lightning_resctl.compare.gpt.CharGPT`).
        datamodule: a LightningDataModule instance (reused by every run), a class or callable (called for every
            run), or None: the built-in standard-library corpus when ``model`` is None too, else the model's own
            dataloaders.
        methods: method names (list or comma-separated), e.g. ``["plain", "mgr-competitive", "rescontroller"]``;
            default: the quick set.
        seeds: number of seeds.
        trainer: your ``lightning.Trainer`` arguments (``max_steps``, ``val_check_interval``, ``accelerator``,
            ``devices``, ``strategy``, ``precision``, ``callbacks``, ...), used for every run; unset ones follow
            :data:`API_TRAINER_DEFAULTS`, then Lightning's defaults. The job adds its callbacks and a TensorBoard
            logger.
        out: output folder (``summary.md``, ``summary.json``, plots, ``runs/``, ``tb/``).
        **options: the other fields of :class:`~lightning_resctl.compare.options.CompareOptions`: ``preset``,
            ``first_seed``, ``options`` (merge-rule options per method), ``monitor``, ``mode``, ``overwrite``,
            ``resume``, ``shard``, ``cost_rounds``, ``ablation``, ...

    Returns:
        :class:`~lightning_resctl.compare.summary.SummaryTable`: one row per method (``table["rescontroller"]``,
        ``table.to_pandas()``); the same numbers are in ``out/summary.json``.

    Raises:
        lightning_resctl.compare.preemption.JobStopped: on SIGTERM, after the run in progress saved its checkpoint
            and the job printed how to resume (this call again with ``resume=True``); a ``SystemExit`` whose
            status, 143, is what the process exits with unless it is caught.
    """
    from .job import JobInputs, module_identity, run_job, stable
    from .options import CompareOptions

    if model is None:
        from .data import CharDataModule
        from .gpt import CharGPT

        model = CharGPT
        if datamodule is None:
            datamodule = CharDataModule
    make_model, _ = _as_factory(model, "model")
    make_data = _as_factory(datamodule, "datamodule")[0] if datamodule is not None else (lambda: None)
    trainer_kwargs = {**API_TRAINER_DEFAULTS, **dict(trainer or {})}
    if "callbacks" in trainer_kwargs:
        user_callbacks = trainer_kwargs["callbacks"]

        def make_trainer_kwargs():
            return {**trainer_kwargs, "callbacks": copy.deepcopy(user_callbacks)}
    else:
        def make_trainer_kwargs():
            return dict(trainer_kwargs)

    probe_dm = make_data()
    identity = {"model": None, "data": module_identity(probe_dm), "trainer": stable(trainer_kwargs)}
    chosen = {k: v for k, v in API_TRAINER_DEFAULTS.items() if k not in dict(trainer or {})}
    inputs = JobInputs(make_model, make_data, make_trainer_kwargs, identity, trainer_chosen=chosen)
    opts = CompareOptions(methods=methods, seeds=seeds, out=str(out), **options)
    return run_job(inputs, opts)


def summarize(*folders: str | Path, out: str | Path | None = None):
    """Merge the run records of one job's folders (e.g. its shards) into one summary, written to ``out`` (default:
    the first folder); returns the :class:`~lightning_resctl.compare.summary.SummaryTable`. Folders of different
    jobs (different model, data, Trainer or compare settings) are refused."""
    from .records import merge_folders
    from .summary import write_summary

    manifest, records, cost = merge_folders(folders)
    return write_summary(manifest, records, cost, Path(out) if out is not None else Path(folders[0]))
