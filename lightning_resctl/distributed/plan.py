"""The tensor-parallel plan given to :class:`~lightning_resctl.distributed.ResidualParallelStrategy`: checked against
the model (every entry must name a module), and read for the layout of the residual stream between blocks
(sharded on the sequence or replicated), which :func:`~lightning_resctl.parallelize_residuals` must be told."""
from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any, Optional

from torch import nn

__all__ = ["check_plan_argument", "resolve_plan", "sequence_parallel_of"]

SEQUENCE_DIM = 1  # batch-first streams (B, T, C): the sequence is dimension 1, as SequenceParallel's default


def check_plan_argument(plan: Any) -> None:
    """``plan`` must be None, a mapping ``{module path pattern: ParallelStyle}`` or a callable
    ``(module, tp_mesh) -> mapping``: checked on construction, before any process starts."""
    if plan is None or callable(plan):
        return
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict {{module path pattern: ParallelStyle}} or a callable (module, tp_mesh) "
                        f"-> dict, got {type(plan).__name__}")
    _check_entries(plan)


def _check_entries(plan: Mapping) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not plan:
        raise ValueError("plan is empty: give at least one {module path pattern: ParallelStyle} entry, or plan=None "
                         "for data parallel only")
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"plan's keys must be module paths (e.g. 'h.*.mlp.c_fc'), got {key!r}")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan[{key!r}] must be a ParallelStyle (ColwiseParallel(), SequenceParallel(), ...), got "
                            f"{type(style).__name__}")


def _names_a_module(module: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` matches a module path of ``module`` the way ``parallelize_module`` reads it (each dotted
    part an ``fnmatch`` pattern of a child's name)."""
    level = [module]
    for atom in pattern.split("."):
        level = [child for m in level for name, child in m.named_children() if fnmatch(name, atom)]
        if not level:
            return False
    return True


def resolve_plan(plan: Any, module: nn.Module, tp_mesh: Any) -> dict:
    """The plan as a dict for ``parallelize_module(module, tp_mesh, plan)`` (a callable called with ``module`` and
    ``tp_mesh``); ValueError naming the first entry that names no module of ``module`` (``parallelize_module``
    would only warn and leave that part of the model replicated)."""
    given = plan(module, tp_mesh) if callable(plan) and not isinstance(plan, Mapping) else plan
    if not isinstance(given, Mapping):
        raise TypeError(f"plan(module, tp_mesh) must return a dict {{module path pattern: ParallelStyle}}, got "
                        f"{type(given).__name__}")
    _check_entries(given)
    for key in given:
        if not _names_a_module(module, key):
            children = ", ".join(repr(n) for n, _ in module.named_children())
            raise ValueError(f"plan[{key!r}] names no module of {type(module).__name__} (paths are relative to the "
                             f"LightningModule, whose children are {children})")
    return dict(given)


def _layouts(style: Any) -> list:
    out: list = []
    for attr in ("input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts",
                 "sequence_sharding"):
        value = getattr(style, attr, None) or ()
        out += list(value) if isinstance(value, (tuple, list)) else [value]
    for attr in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
        out += list((getattr(style, attr, None) or {}).values())
    return [layout for layout in out if layout is not None]


def _says(style: Any) -> Optional[bool]:
    """True: ``style`` shards a tensor on the sequence; False: it is a known style that does not; None: unknown."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, SequenceParallel):
        return True
    if isinstance(style, PrepareModuleInputOutput):
        parts = [_says(style.prepare_module_input), _says(style.prepare_module_output)]
        return True if True in parts else (False if parts == [False, False] else None)
    if not isinstance(style, (ColwiseParallel, RowwiseParallel, PrepareModuleInput, PrepareModuleOutput)):
        return None
    dims = [layout.dim for layout in _layouts(style) if isinstance(layout, Shard)]
    if SEQUENCE_DIM in dims:
        return True
    if any(d == 0 for d in dims):  # the batch, or a sequence-first stream: cannot tell
        return None
    return False


def sequence_parallel_of(plan: Mapping) -> Optional[bool]:
    """Whether the residual stream between blocks is sharded on the sequence under ``plan``: True when a style of
    it shards on the sequence (``SequenceParallel``, ``ColwiseParallel(input_layouts=Shard(1))``,
    ``RowwiseParallel(output_layouts=Shard(1))``, ``PrepareModuleInput`` / ``Output`` with ``Shard(1)``); False
    when every style is a ``ColwiseParallel`` / ``RowwiseParallel`` / ``PrepareModule*`` sharding no sequence (the
    stream replicated); None when it cannot be told (another style, or ``Shard(0)``)."""
    verdicts = [_says(style) for style in plan.values()]
    if True in verdicts:
        return True
    if all(v is False for v in verdicts):
        return False
    return None
