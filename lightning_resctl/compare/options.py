"""The ``compare:`` section of a job: :class:`CompareOptions` (what is compared, how the job runs).

The model, the data and the Trainer settings are the user's (LightningCLI's ``model:``, ``data:``, ``trainer:``);
everything the compare job adds is here. Each field is a command-line flag (``--methods`` or
``--compare.methods``), a key of the YAML ``compare:`` section, and a keyword of :func:`lightning_resctl.compare`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .methods import PLAIN, check_method_options, resolve_methods

__all__ = ["CompareOptions", "HELP", "parse_shard"]

#: The help text of every option (the command line's ``--help``).
HELP = {
    "methods": "list or comma-separated; must include plain (the unpatched model all figures compare with), then "
               "merge rules (default: the preset's, else plain,rescontroller,mgr-independent,mgr-competitive)",
    "preset": "a named method set used when methods is not given: quick or paper",
    "seeds": "number of seeds; for each seed every method starts from the same initial weights and data order",
    "first_seed": "first seed",
    "options": "merge-rule options per method, e.g. {mgr-competitive: {streams: 8}}",
    "monitor": "the logged validation metric compared (default: val_loss or val/loss, else the one logged name "
               "containing 'loss')",
    "mode": "min: lower is better; max: higher is better",
    "out": "output folder",
    "overwrite": "replace the results of an earlier job in out (without it such a folder is an error)",
    "resume": "continue the job in out: finished runs are kept, a run in progress restarts from its last checkpoint",
    "shard": "I/N: run only the I-th of N deterministic subsets of the (method, seed) runs; merge the folders with "
             "`lightning-resctl summarize`",
    "checkpoint_every_min": "save the run in progress (what resume restarts from) at a validation end when this many "
                            "minutes passed since its last save (0: at every validation; null: never, a resumed run "
                            "then starts over) and on SIGTERM (then the job exits with status 143); deleted when the "
                            "run ends",
    "cost_rounds": "timed rounds of the cost-vs-plain measurement (one training step per method per round; 0 skips it)",
    "cost_warmup": "untimed rounds before them (at least one per batch shape the timed rounds use)",
    "ablation": "run ResidualAblationCallback at the last validation (loss increase per skipped merge)",
    "ablation_batches": "validation batches per ablated merge",
    "diagnostics_every_n_steps":
        "logging interval of ResidualControlCallback (default: the Trainer's log_every_n_steps)",
    "depth_images": "TensorBoard depth-profile images at every validation",
    "threads": "torch.set_num_threads for the job (CPU; default: torch's)",
    "progress_bar": "one progress line for the whole job (run, method, seed, step, ETA)",
}


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"2/3"`` -> ``(2, 3)``; None stays None. ValueError naming the value otherwise."""
    if text is None:
        return None
    try:
        i, n = (int(part) for part in str(text).split("/"))
    except ValueError:
        raise ValueError(f"shard must be 'I/N' with integers 1 <= I <= N, got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"shard must be 'I/N' with integers 1 <= I <= N, got {text!r}")
    return i, n


@dataclass
class CompareOptions:
    """What one comparison adds to the user's model, data and Trainer settings (see :data:`HELP`)."""

    methods: Optional[list[str]] = None
    preset: Optional[Literal["quick", "paper"]] = None
    seeds: int = 2
    first_seed: int = 0
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    monitor: Optional[str] = None
    mode: Literal["min", "max"] = "min"
    out: str = "resctl_runs/compare"
    overwrite: bool = False
    resume: bool = False
    shard: Optional[str] = None
    checkpoint_every_min: Optional[float] = 5.0
    cost_rounds: int = 10
    cost_warmup: int = 2
    ablation: bool = True
    ablation_batches: int = 1
    diagnostics_every_n_steps: Optional[int] = None
    depth_images: bool = True
    threads: Optional[int] = None
    progress_bar: bool = True

    def method_list(self) -> list[str]:
        """The methods of the job (``methods``, else the preset's, else the default set)."""
        return resolve_methods(self.methods, self.preset)

    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    def shard_pair(self) -> tuple[int, int] | None:
        return parse_shard(self.shard)

    def validate(self) -> "CompareOptions":
        """Raise ValueError naming the option and its value when something is wrong; returns self."""
        methods = self.method_list()
        if PLAIN not in methods:
            fixed = [PLAIN, *methods]
            raise ValueError(f"methods must include plain (the model unpatched): every figure of the job compares a "
                             f"method with plain of the same seed; got {methods}, give {fixed} "
                             f"(--methods {','.join(fixed)})")
        self.options = check_method_options(self.options, methods)
        for name, minimum in (("seeds", 1), ("first_seed", 0), ("cost_rounds", 0), ("cost_warmup", 0),
                              ("ablation_batches", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name in ("diagnostics_every_n_steps", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        every = self.checkpoint_every_min
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or every < 0):
            raise ValueError(f"checkpoint_every_min must be a number >= 0 or None, got {every!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise ValueError(f"monitor must be a logged metric name or None, got {self.monitor!r}")
        if self.overwrite and self.resume:
            raise ValueError("give at most one of overwrite and resume (overwrite deletes what resume would continue)")
        self.shard_pair()
        return self

    def identity(self) -> dict[str, Any]:
        """The options that define the job's results (a resumed job and every shard must agree on them): not where
        the results go, nor how this process runs."""
        skip = {"out", "overwrite", "resume", "shard", "progress_bar", "threads", "checkpoint_every_min"}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        out["methods"] = self.method_list()
        out.pop("preset")
        return out
