"""What the job does on SIGTERM, the notice SLURM and Kubernetes send before pre-empting a job: the run in progress
saves its checkpoint, the job says how to resume and stops with :data:`EXIT_SIGTERM`.

During a fit, Lightning's own signal handling does the stopping: its handler marks ``trainer.received_sigterm``
and the loops raise :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` at the end of the training
step (its validation included), where :class:`SigtermCheckpoint` saves the run (``on_exception``). Outside a fit
(the init check, the cost measurement, between runs) :func:`sigterm_stops_job` raises the same exception at once:
there is nothing to save, a finished run's record is written whole or not at all. :class:`~.job` turns it into
:class:`JobStopped`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .recorder import between_epochs

__all__ = ["EXIT_SIGTERM", "JobStopped", "SigtermCheckpoint", "sigterm_stops_job"]

#: The job's exit status after SIGTERM: 128 + 15, what a shell reports for a process SIGTERM ended (a scheduler,
#: an array job or an ``afterok`` dependency reads 0 as success).
EXIT_SIGTERM = 128 + signal.SIGTERM


class JobStopped(SystemExit):
    """The compare job stopped on SIGTERM after saving what a resumed job needs; ``code`` is :data:`EXIT_SIGTERM`
    (uncaught, the process exits with it). ``resume``: how to resume (the command line's exact command)."""

    def __init__(self, resume: str):
        super().__init__(EXIT_SIGTERM)
        self.resume = resume


class SigtermCheckpoint(Callback):
    """Saves the run to ``path`` (the checkpoint ``resume`` restarts it from) when the fit stops on SIGTERM.

    Lightning stops a fit at the end of a training step, or in the middle of a validation; a fit resumed from the
    middle of a validation would skip the rest of it (Lightning fast-forwards it) and record no value for that
    step, so a SIGTERM that comes during a validation takes effect at the validation's end. The file is written
    next to ``path`` first and then renamed over it, so a SIGKILL while saving leaves the previous checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._deferred = False
        self._validated_at: int | None = None  # the global step of the fit's last validation

    @staticmethod
    def _connector(trainer):
        connector = getattr(trainer, "_signal_connector", None)  # where Lightning keeps trainer.received_sigterm
        return connector if hasattr(connector, "received_sigterm") else None

    def on_validation_batch_end(self, trainer, *args, **kwargs) -> None:
        connector = self._connector(trainer)
        if connector is not None and connector.received_sigterm:
            connector.received_sigterm, self._deferred = False, True

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._validated_at = trainer.global_step
        connector = self._connector(trainer)
        if self._deferred and connector is not None:
            connector.received_sigterm, self._deferred = True, False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or not trainer.received_sigterm:
            return  # not Lightning's stop (e.g. sigterm_stops_job's, while the fit was still being set up)
        if trainer.validating or trainer.sanity_checking:
            return  # mid-validation (a Lightning that stops there): the run resumes from its last checkpoint
        epoch_loop = trainer.fit_loop.epoch_loop
        if between_epochs(trainer) and not epoch_loop.restarting:
            # Lightning would resume the next epoch with the finished one's batch count (and end it early); what it
            # does itself when an epoch starts makes the resumed fit begin at that epoch's first batch
            epoch_loop.reset()
        # Lightning stops after the step's end has counted the step for the loggers (``_batches_that_stepped``); a
        # fit resumed from a step that validated skips that validation and counts the step again (it expects the
        # count of a save at the validation's end, before the step was counted; Lightning issue #19367), so that
        # save holds the count as it was then: the resumed fit logs at the uninterrupted fit's steps
        counted_again = self._validated_at == trainer.global_step and not between_epochs(trainer)
        epoch_loop._batches_that_stepped -= counted_again
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            trainer.save_checkpoint(tmp)
        finally:
            epoch_loop._batches_that_stepped += counted_again
        if trainer.is_global_zero:
            os.replace(tmp, self.path)


@contextlib.contextmanager
def sigterm_stops_job():
    """Within: SIGTERM raises SIGTERMException at once while no fit runs (see the module docstring); during a fit
    Lightning's handler, which calls this one after its own, has the fit stop at the end of the step. A handler
    installed before is called too; SIGTERM ignored before stays ignored. (Signals can be handled only in the main
    thread; elsewhere nothing changes.)"""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return

    def handler(signum, frame):
        if callable(previous):
            previous(signum, frame)
        if signal.getsignal(signal.SIGTERM) is handler:  # Lightning's handler replaces this one during a fit
            raise SIGTERMException()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
