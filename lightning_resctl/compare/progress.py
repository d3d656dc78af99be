"""One progress line for the whole job (all runs), with the method, the seed and an ETA.

On a terminal the line is rewritten in place; otherwise (a log file, CI) a full line is printed at
most every ``interval_s`` seconds and at the end of every run. The ETA divides the elapsed training
time by the training steps done and multiplies by the steps left (validation and ablation time is
thereby spread over the steps).
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from lightning.pytorch.callbacks import Callback

__all__ = ["JobProgress", "ProgressCallback", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75 -> '1m15s'``, ``3700 -> '1h01m'``, ``9 -> '9s'``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


class JobProgress:
    """The job's progress over ``total_runs`` runs of ``steps_per_run`` training steps each (0: unknown, e.g. runs
    bounded by epochs; then the ETA is left out)."""

    def __init__(self, total_runs: int, steps_per_run: int, *, enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = 30.0, clock=time.perf_counter):
        self.total_runs, self.steps_per_run = total_runs, steps_per_run
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started: float | None = None
        self.train_started: float | None = None
        self.run_index = 0
        self.method = ""
        self.seed = 0
        self.step = 0
        self.steps_done = 0      # completed steps of finished runs
        self.loss: float | None = None
        self.phase = ""
        self._last_print = -float("inf")
        self._width = 0

    # ---------------------------------------------------------------- state
    def start(self) -> None:
        self.started = self.clock()

    def start_run(self, index: int, method: str, seed: int) -> None:
        if self.train_started is None:
            self.train_started = self.clock()
        self.run_index, self.method, self.seed = index, method, seed
        self.step, self.loss, self.phase = 0, None, ""
        self.show(force=True)

    def update(self, step: int, loss: float | None = None, phase: str = "") -> None:
        self.step = step
        if loss is not None:
            self.loss = loss
        self.phase = phase
        self.show()

    def end_run(self) -> None:
        self.steps_done += self.steps_per_run
        self.step = 0
        self.phase = "done"
        if self.tty:  # in a log, the job prints its own line per finished run
            self.show(force=True)

    # ---------------------------------------------------------------- text
    @property
    def fraction(self) -> float:
        if self.steps_per_run <= 0:  # steps per run unknown (epoch-based runs): count finished runs
            return min(1.0, (self.run_index - 1) / self.total_runs) if self.total_runs else 1.0
        total = self.total_runs * self.steps_per_run
        return min(1.0, (self.steps_done + self.step) / total) if total else 1.0

    def eta_s(self) -> float | None:
        done = self.steps_done + self.step
        if self.train_started is None or done == 0 or self.steps_per_run <= 0:
            return None
        elapsed = self.clock() - self.train_started
        return elapsed / done * (self.total_runs * self.steps_per_run - done)

    def line(self) -> str:
        elapsed = self.clock() - (self.started if self.started is not None else self.clock())
        eta = self.eta_s()
        parts = [f"[resctl] run {self.run_index}/{self.total_runs}: {self.method}, seed {self.seed}",
                 f"step {self.step}/{self.steps_per_run}" if self.steps_per_run > 0 else f"step {self.step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.phase and self.phase != "done":
            parts.append(self.phase)
        parts.append(f"total {100 * self.fraction:.0f}%")
        parts.append(f"elapsed {format_duration(elapsed)}")
        parts.append("ETA " + (format_duration(eta) if eta is not None else "--"))
        return " | ".join(parts)

    def show(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self.tty:
            if not force and now - self._last_print < 0.2:
                return
            text = self.line()
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            if not force and now - self._last_print < self.interval_s:
                return
            self.stream.write(self.line() + "\n")
        self._last_print = now
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a whole line (above the progress line on a terminal)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        print(text, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


class ProgressCallback(Callback):
    """Feeds a :class:`JobProgress` from one Lightning run."""

    def __init__(self, progress: JobProgress):
        self.progress = progress

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.progress.update(trainer.global_step, float(loss.detach()) if loss is not None else None)

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.progress.update(trainer.global_step, phase="validating")
