"""The one module that touches ``torch.distributed.pipelining`` beyond its public API (torch 2.13), and the schedules
by name.

Two private points, here only:

* :class:`ResidualPipelineStage` overrides ``_compute_outputs`` and ``_backward_metadata_inference`` (the stage's
  dynamic shape inference on the first step): the stage module is told that its forward is the inference one,
  whose received tensors are ``torch.empty_strided`` buffers (zeroed before a rule reads a structure from them), and
  the loss function that it is called on an inference output (a stand-in loss then, not the user's step);
* :func:`run_microbatches` calls a schedule's ``_step_microbatches`` with the microbatches as the strategy split
  them (each one's model call captured on its own): ``step(arg_mbs=..., kwarg_mbs=...)`` is pytorch PR #188500,
  not in 2.13; what ``step`` does before ``_step_microbatches`` (the stages' ``has_backward``, their runtime
  state cleared) is done here the same way.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

__all__ = ["SCHEDULES", "MULTI_STAGE", "ResidualPipelineStage", "run_microbatches"]

#: ``schedule=`` name -> torch's schedule class
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "looped-bfs": ScheduleLoopedBFS}
#: the schedules that run several stages per rank
MULTI_STAGE = ("interleaved-1f1b", "looped-bfs")


class ResidualPipelineStage(PipelineStage):
    """``PipelineStage`` whose submodule (a :class:`~.stage_model.PipelineStageModule`) knows when it runs the
    shape inference: its ``inferring`` flag is set around the inference forward and the last stage's inference
    backward (the loss function reads the last stage module's flag)."""

    @contextlib.contextmanager
    def _inferring(self):
        self.submod.inferring = True
        try:
            yield
        finally:
            self.submod.inferring = False

    def _compute_outputs(self, *args: Any, module: Any, **kwargs: Any) -> Any:
        with self._inferring():
            return super()._compute_outputs(*args, module=module, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self._inferring():
            return super()._backward_metadata_inference(*args, **kwargs)


def run_microbatches(schedule: Any, stages: list, kwarg_mbs: list, target_mbs: Optional[list],
                     losses: Optional[list], train: bool) -> None:
    """One schedule step over ``kwarg_mbs`` (every stage's keyword inputs per microbatch; the first stage takes no
    positional input) and ``target_mbs`` (what the loss function gets per microbatch; None: no loss), forward and
    backward (``train``) or forward only; the last stage's losses go to ``losses``."""
    saved = schedule._has_backward
    schedule._has_backward = train and saved
    try:
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(None, kwarg_mbs, target_mbs, losses, return_outputs=False)
    finally:
        schedule._has_backward = saved
