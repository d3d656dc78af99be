"""The pipeline's arguments and its split: which blocks each stage holds (contiguous, balanced by count or as
``stages=`` says) and which rank runs each stage (stage ``s`` on pipeline rank ``s % pipeline_parallel_size``: one
stage per rank, or several, interleaved)."""
from __future__ import annotations

from typing import Any, Optional

from .torch_pipelining import MULTI_STAGE, SCHEDULES

__all__ = ["PipelineSpec", "check_pipeline_arguments", "split_blocks", "stage_rank"]


class PipelineSpec:
    """The checked pipeline arguments: ``size`` ranks, ``schedule`` (a name of :data:`SCHEDULES`), ``stages_per_rank``,
    ``microbatches`` and ``stages`` (blocks per stage, or None: balanced). ``num_stages`` = size x stages_per_rank."""

    def __init__(self, size: int, schedule: str, microbatches: int, stages: Optional[tuple], stages_per_rank: int):
        self.size, self.schedule, self.microbatches = size, schedule, microbatches
        self.stages, self.stages_per_rank = stages, stages_per_rank
        self.num_stages = size * stages_per_rank

    @property
    def active(self) -> bool:
        """Whether the model is split into stages at all (more than one stage)."""
        return self.num_stages > 1

    def said(self) -> str:
        per = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return f"{self.schedule}, {self.microbatches} microbatches{per}"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_pipeline_arguments(pipeline_parallel_size: Any, schedule: Any, microbatches: Any, stages: Any,
                             stages_per_rank: Any) -> PipelineSpec:
    """The strategy's pipeline arguments, checked on construction (each refusal names its argument).

    ``schedule``: ``"gpipe"``, ``"1f1b"`` (one stage per rank), ``"interleaved-1f1b"`` or ``"looped-bfs"`` (several:
    ``stages_per_rank``, default 2); ``microbatches`` (default: the number of stages); ``stages``: blocks per stage,
    ``pipeline_parallel_size x stages_per_rank`` positive ints (their sum is checked against the model's blocks when
    they are found)."""
    size = _positive_int("pipeline_parallel_size", pipeline_parallel_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    multi = schedule in MULTI_STAGE
    if stages is not None:
        if isinstance(stages, (str, bytes)) or not hasattr(stages, "__len__") or not stages:
            raise TypeError(f"stages must be a list of blocks per stage (positive ints), got {stages!r}")
        stages = tuple(_positive_int(f"stages[{i}]", n) for i, n in enumerate(stages))
        if len(stages) % size:
            raise ValueError(f"stages has {len(stages)} entries, not a multiple of pipeline_parallel_size={size}")
    if stages_per_rank is None:
        stages_per_rank = len(stages) // size if stages is not None else (2 if multi else 1)
    stages_per_rank = _positive_int("stages_per_rank", stages_per_rank)
    if stages is not None and len(stages) != size * stages_per_rank:
        raise ValueError(f"stages has {len(stages)} entries, but pipeline_parallel_size={size} x stages_per_rank="
                         f"{stages_per_rank} stages run")
    if not multi and stages_per_rank != 1:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank} "
                         f"(several: schedule='interleaved-1f1b' or 'looped-bfs')")
    num_stages = size * stages_per_rank
    microbatches = num_stages if microbatches is None else _positive_int("microbatches", microbatches)
    if schedule == "1f1b" and microbatches < size:
        raise ValueError(f"schedule='1f1b' needs microbatches >= pipeline_parallel_size ({size}), got "
                         f"microbatches={microbatches}")
    if multi and microbatches % size:
        raise ValueError(f"schedule={schedule!r} needs microbatches to be a multiple of pipeline_parallel_size "
                         f"({size}), got microbatches={microbatches}")
    return PipelineSpec(size, schedule, microbatches, stages, stages_per_rank)


def split_blocks(num_blocks: int, spec: PipelineSpec) -> list[range]:
    """The block indices of each stage: ``spec.stages`` (refused unless they sum to ``num_blocks``) or balanced by
    count (the first ``num_blocks % num_stages`` stages one block more). More stages than blocks: refused, naming
    the arguments."""
    n = spec.num_stages
    if n > num_blocks:
        per = f" x stages_per_rank={spec.stages_per_rank}" if spec.stages_per_rank > 1 else ""
        raise ValueError(f"pipeline_parallel_size={spec.size}{per} makes {n} stages, more than the model's "
                         f"{num_blocks} blocks: a stage holds at least one block")
    counts = list(spec.stages) if spec.stages is not None else [num_blocks // n + (i < num_blocks % n)
                                                                 for i in range(n)]
    if sum(counts) != num_blocks:
        raise ValueError(f"stages={list(spec.stages)} holds {sum(counts)} blocks, the model has {num_blocks}")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def stage_rank(stage: int, spec: PipelineSpec) -> int:
    """The pipeline rank that runs ``stage`` (torch's loop placement: ``stage % size``)."""
    return stage % spec.size
