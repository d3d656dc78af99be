"""The main job: a matched comparison of residual merges on a char-level GPT.

For every seed and every method — ``plain`` (the model as written) or any registered merge rule
(:func:`lightning_resctl.merge_rules`) — :func:`run_comparison` builds the same
:class:`~lightning_resctl.compare.gpt.CharGPT` from the same seed, patches it with
``patch_residuals(model, method=name)`` (``plain`` stays unpatched), and trains it with the same
data order, optimiser, schedule and number of steps. Before the runs it measures each method's
training-step cost next to plain's in one process (interleaved steps, :mod:`.cost`). Each run logs
to TensorBoard under ``<out>/tb/<method>/seed<seed>``; at the end :func:`write_summary` writes
``summary.md``, ``summary.json`` and PNG plots into ``<out>``.

Modules, one job each:

* :mod:`.config` — :class:`CompareConfig`, everything a comparison depends on;
* :mod:`.cli` — the flags, ``--config FILE.yaml``, ``--preset``, :func:`main`;
* :mod:`.methods` — method names from the merge-rule registry and how one is applied;
* :mod:`.runs` — one (method, seed) run and the whole job;
* :mod:`.cost` — the interleaved "cost vs plain" measurement;
* :mod:`.progress` — the job's single progress line with its ETA;
* :mod:`.summary`, :mod:`.plots` — statistics, verdicts, ``summary.md`` and the plots;
* :mod:`.gpt`, :mod:`.data` — the model and the corpus.

Statistics: see :mod:`.summary` (spread = half the range over seeds; a difference to plain is
"beyond the seed spread" only when the per-seed ranges do not overlap).
"""
from __future__ import annotations

from .cli import build_parser, main, parse_config
from .config import CompareConfig
from .methods import DEFAULT_METHODS, PRESETS, available_methods
from .runs import OutputExistsError, RunRecorder, run_comparison, run_one
from .summary import _stats, _verdict, write_summary

__all__ = ["CompareConfig", "RunRecorder", "run_one", "run_comparison", "write_summary", "build_parser",
           "parse_config", "main", "available_methods", "DEFAULT_METHODS", "PRESETS", "OutputExistsError"]
