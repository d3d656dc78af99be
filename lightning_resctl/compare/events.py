"""A resumed run's TensorBoard record: what the stopped fit logged after its checkpoint is dropped.

A fit killed without notice (SIGKILL, a lost node) resumes from its last checkpoint, not from where it died: the
events it logged between that checkpoint and its death are logged again by the resumed fit. :class:`TrimEvents`
rewrites the run's earlier event files when the resumed fit starts its first training step, keeping the events
logged at a step before that one, so the run's folder holds every (tag, step) once, as an uninterrupted run's does.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback

__all__ = ["TrimEvents", "event_files", "trim_event_file"]


def event_files(folder: str | Path) -> list[Path]:
    """The TensorBoard event files in ``folder`` (none when it does not exist)."""
    folder = Path(folder)
    return sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []


def trim_event_file(path: str | Path, before_step: int) -> int:
    """Keep the events of ``path`` logged at a step below ``before_step`` (and those that log nothing: the file's
    version header); the file is rewritten in place (through a temporary file). Returns how many were dropped."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    path = Path(path)
    kept, dropped = [], 0
    for raw in RawEventFileLoader(str(path)).Load():  # stops at a record cut short by the kill
        event = Event.FromString(raw)
        if event.HasField("summary") and event.step >= before_step:
            dropped += 1
        else:
            kept.append(raw)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        writer = RecordWriter(f)
        for raw in kept:
            writer.write(raw)
        writer.flush()
    os.replace(tmp, path)
    return dropped


class TrimEvents(Callback):
    """At the resumed fit's first training step, trims ``files`` (the run's event files from before this fit) to
    the events logged before that step's logging step (``_batches_that_stepped``, the step Lightning's loggers
    use)."""

    def __init__(self, files: Sequence[str | Path]):
        self.files = [Path(f) for f in files]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.files:
            return
        files, self.files = self.files, []
        if trainer.is_global_zero:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for path in files:
                trim_event_file(path, step)
