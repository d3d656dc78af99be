"""Where a chain merge's bookkeeping runs: the checkpoint phase (a checkpointed region's forward, its recomputation
in backward, or neither), and whether dynamo is tracing the merge, inside a higher-order op's body or not.

* :func:`bookkeeping_in_eager_code` — eager code (the merge runs eagerly, or at a graph break in a block compiled
  on its own and checkpointed from outside), or traced with the live run (whole-model compile, a checkpoint dynamo
  traces, a block compiled on its own without checkpointing or checkpointed by :func:`checkpoint_block`);
* :func:`checkpoint_block` — the ``checkpoint_fn`` of ``checkpoint_wrapper`` around a block compiled on its own (the
  recipe's order): the chains' state is kept at the block, so the compiled block traces the live run, with no graph
  break, in its forward and in its recomputation alike;
* :func:`counting` / :func:`counting_merge` / :func:`checking` — whether a module's merge tally is kept in this trace.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["bookkeeping_in_eager_code", "checkpoint_block", "checkpoint_frame", "checkpoint_phase", "checking",
           "counting", "counting_merge", "inside_reentrant_checkpoint"]


class _BlockCheckpoint:
    """How many :func:`checkpoint_block` regions are running their block now (a guard of the block's graphs)."""

    depth = 0


def checkpoint_phase() -> Optional[str]:
    """``"recompute"`` while backward recomputes a non-reentrant checkpointed region (its recomputation hooks are
    on top, or a backward pass runs), ``"region"`` while other saved-tensor hooks decide what is kept (a
    checkpointed region's forward, offloading; not the observing ones marked ``_mgr_transparent``), else None —
    also inside :func:`checkpoint_block`, which keeps the chains' state at the block."""
    if _BlockCheckpoint.depth:
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", ""):
        return "recompute"
    if torch._C._current_graph_task_id() != -1:
        return "recompute"
    if hooks is not None and not getattr(hooks[0], "_mgr_transparent", False):
        return "region"
    return None


def checkpoint_frame() -> Any:
    """The checkpointed region (``torch.utils.checkpoint``'s frame object) whose saved-tensor hooks are on top,
    found through the hook's closure, or None: the region's first chain state is also kept on it, so a
    recomputation finds it when the region's input comes back as a new tensor (offloading hooks around the
    checkpoint, e.g. HF's ``offload=True``)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = getattr(hooks[0], "__wrapped__", hooks[0]) if hooks is not None else None
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, weakref.ref):
            value = value()
        if type(value).__name__ == "_CheckpointFrame":
            return value
    return None


def inside_reentrant_checkpoint() -> bool:
    """True when ``torch.utils.checkpoint``'s reentrant ``CheckpointFunction`` is on the call stack."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "forward" and f.f_code.co_filename.replace("\\", "/").endswith(
                "torch/utils/checkpoint.py"):
            return True
        f = f.f_back
    return False


def _output_graph() -> Any:
    """The output graph dynamo is building now (its ``current_tracer`` is a higher-order op's body while dynamo
    traces one), or None on a torch without it."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx().output
    except (ImportError, AttributeError):  # another torch: count as outside (the side effect is then traced)
        return None


def _in_higher_order_op() -> bool:
    graph = _output_graph()
    return graph is not None and graph.current_tracer.parent is not None


#: the higher-order op bodies (their subtracers) in which dynamo traced the start of a patched module's call
_CALLS_STARTED_IN: "weakref.WeakSet" = weakref.WeakSet()


@torch.compiler.assume_constant_result
def _call_started_in_higher_order_op() -> bool:
    """True while dynamo traces the body of a higher-order op (``torch.utils.checkpoint`` inside a compiled model),
    where it refuses side effects; the body is noted (a module's call started there). A constant of the trace."""
    inside = _in_higher_order_op()
    if inside:
        _CALLS_STARTED_IN.add(_output_graph().current_tracer)
    return inside


@torch.compiler.assume_constant_result
def _traced_in_higher_order_op() -> bool:
    """True while dynamo traces the body of a higher-order op; a constant of the trace (no guard)."""
    return _in_higher_order_op()


@torch.compiler.assume_constant_result
def _merge_traced_in_its_calls_op() -> bool:
    """True while dynamo traces a merge in a higher-order op's body in which a patched module's call started (the
    merge's module: its hooks and its merges inside one checkpoint)."""
    return _in_higher_order_op() and _output_graph().current_tracer in _CALLS_STARTED_IN


def counting() -> bool:
    """Whether a module's merge tally (:mod:`.tally`) is cleared at the start of this call: always, except in a
    checkpointed region traced into a compiled model (a higher-order op's body), where a side effect would make
    dynamo give up the whole frame (run it eagerly); the module's merges and the end of its call are then traced in
    the same body and leave the tally alone too."""
    return not torch.compiler.is_compiling() or not _call_started_in_higher_order_op()


def counting_merge() -> bool:
    """Whether a merge marks its module's tally: as :func:`counting`. A merge traced in a higher-order op whose
    module's call started outside it (transformers' layers checkpoint their ``forward``, not their hooks) marks it:
    dynamo then runs that checkpoint eagerly (or keeps the mark, with
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``), and the end of the call checks it."""
    return not torch.compiler.is_compiling() or not _merge_traced_in_its_calls_op()


def checking() -> bool:
    """Whether the end of a module's call checks its tally: as :func:`counting`."""
    return not torch.compiler.is_compiling() or not _traced_in_higher_order_op()


@torch.compiler.assume_constant_result
def _phase_when_traced() -> Optional[str]:
    """The checkpoint phase while dynamo traces a merge (baked into the graph as a constant)."""
    return checkpoint_phase()


def bookkeeping_in_eager_code() -> Optional[bool]:
    """Where a chain merge's bookkeeping runs. False: eager code, the merge itself runs eagerly. True: a graph
    dynamo traces inside a checkpointed region (a block compiled on its own under ``torch.utils.checkpoint``):
    the bookkeeping (saved-tensor hooks, tensor-keyed weak mappings: nothing dynamo traces) runs eagerly at a
    graph break before and after the merge's math, so that it reads the checkpoint phase when the graph runs and
    the math's graph is the same in the forward and in its recomputation. None: a graph traced outside any
    region (whole-model compile, ``fullgraph=True`` without checkpointing around the compiled code) or in a block
    that :func:`checkpoint_block` checkpoints: the bookkeeping of the live run is traced into the graph."""
    if not torch.compiler.is_compiling():
        return False
    if _BlockCheckpoint.depth:  # (a guard: the block's graphs under checkpoint_block are its own)
        return None
    return None if _phase_when_traced() is None else True


def _chain_sites(block: nn.Module) -> list:
    """The merge sites of chain rules in ``block``: the modules holding a :class:`~.chain_run.ChainRun` (a parallel
    block's first addition holds a ``ParallelRun``, a per-merge rule's site none)."""
    return [m for m in block.modules() if hasattr(m.__dict__.get("_run"), "cursor")]


def checkpoint_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, **kwargs)``, with the chains of the
    block's merges kept at the block: what ``checkpoint_wrapper(block, checkpoint_fn=checkpoint_block)`` runs around
    a block compiled on its own (ResidualParallelStrategy's order).

    The forward notes where each chain stands entering the block (:meth:`~.chain_run.ChainRun.cursor`); the
    recomputation in backward puts the chains back there, runs the block, and puts back what they held. Inside, the
    merges read and write the live run as outside any checkpoint — traced into the block's graph, the same graph in
    the forward and in its recomputation, without the graph break per merge that a checkpoint this function does
    not run needs (:func:`bookkeeping_in_eager_code`). On a step whose diagnostics observe the merges (an observer
    set), the block runs eagerly, forward and recomputation (``torch.compiler.set_stance("force_eager")``): the
    observers' Python state never picks another compiled graph for the recomputation than the forward ran. Where
    dynamo traces this function (a whole-model compile), it is the plain checkpoint (a higher-order op of the
    graph)."""
    sites = [] if torch.compiler.is_compiling() else _chain_sites(block)
    if not sites:
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    runs = {}
    for site in sites:
        runs.setdefault(id(site._run), (site._run, []))[1].append(site)
    runs = [(run, tuple(own)) for run, own in runs.values()]
    entered = [run.cursor(own) for run, own in runs]
    observed = any(site.observer is not None for site in sites)
    forward_done = []

    def region(*a: Any, **k: Any) -> Any:
        live = [run.cursor(own) for run, own in runs] if forward_done else None
        if live is not None:
            for (run, own), cursor in zip(runs, entered):
                run.restore(cursor, own)
        _BlockCheckpoint.depth += 1
        try:
            with torch.compiler.set_stance("force_eager") if observed else contextlib.nullcontext():
                return block(*a, **k)
        finally:
            _BlockCheckpoint.depth -= 1
            forward_done.append(True)
            if live is not None:
                for (run, own), cursor in zip(runs, live):
                    run.restore(cursor, own)

    return checkpoint(region, *args, use_reentrant=False, **kwargs)
