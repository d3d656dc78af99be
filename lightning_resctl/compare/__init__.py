"""The main job: does a residual merge help *my* model? A matched, resumable, shardable comparison.

For every seed and every method — ``plain`` (the model as written) or any registered merge rule
(:func:`lightning_resctl.merge_rules`) — the job trains the user's LightningModule on the user's data with the
user's Trainer settings: every method of a seed starts from the same initial weights (the model is built once per
seed), sees the same batches in the same order and uses the same optimizer (the model's ``configure_optimizers``);
the method is applied by :class:`~lightning_resctl.ResidualControlCallback`. It compares the monitored validation
metric seed by seed, checks how far each method starts from plain, measures the training-step cost next to
plain's, and writes ``summary.md``, ``summary.json``, PNG plots and TensorBoard logs.

Entry points: :func:`lightning_resctl.compare` (Python), ``lightning-resctl compare`` (command line, built on
LightningCLI) and ``lightning-resctl summarize`` (merge the folders of shards). With no model given, the built-in
byte-level GPT (:class:`~lightning_resctl.compare.gpt.CharGPT`) on the standard-library corpus
(:class:`~lightning_resctl.compare.data.CharDataModule`) is compared.

After ``import lightning_resctl`` the name ``lightning_resctl.compare`` is the *function* (as
``lightning_resctl.rescontroller`` is); the submodules are imported as ``from lightning_resctl.compare import cli``,
``from lightning_resctl.compare.gpt import CharGPT`` or ``importlib.import_module("lightning_resctl.compare.cli")``
(``import lightning_resctl.compare.cli as cli`` would look the submodule up on the function and fail). This package
module imports nothing heavy: ``import lightning_resctl`` stays cheap.

Modules, one job each:

* :mod:`.api` — :func:`compare`, the Python entry point;
* :mod:`.cli` — the command line (LightningCLI), ``summarize``;
* :mod:`.options` — :class:`CompareOptions`, the ``compare:`` section;
* :mod:`.methods` — method names and what the merge-rule registry says about them;
* :mod:`.job` — the plan of runs, shards, resume, the whole job;
* :mod:`.run` — one (method, seed) run; :mod:`.recorder` — what it records, its seeding and exact resume;
* :mod:`.fairness` — how far each method starts from plain at init;
* :mod:`.cost` — the interleaved "cost vs plain" measurement;
* :mod:`.records` — the output folder, run records, merging folders;
* :mod:`.preemption` — SIGTERM: the run in progress saves its checkpoint, the job says how to resume, exit 143;
* :mod:`.events` — a resumed run's TensorBoard events: what the stopped fit logged after its checkpoint is dropped;
* :mod:`.stats`, :mod:`.summary`, :mod:`.plots` — paired statistics, verdicts, ``summary.md`` and plots;
* :mod:`.progress` — the job's single progress line with its ETA;
* :mod:`.gpt`, :mod:`.data` — the built-in model and data.
"""
from __future__ import annotations

from .api import compare, summarize

__all__ = ["compare", "summarize"]
