"""The per-block part of the recipe: which blocks are checkpointed, compiling and checkpointing each block in the
order that works for every rule, ``fully_shard`` per block and of the root, and what counts as a model parallelized
already."""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

from ..surgery.phase import checkpoint_block
from ..surgery.tensor_parallel_check import tensor_parallel_modules

__all__ = ["check_checkpointing", "check_compile", "checkpointed", "compile_in_place", "wrap_block", "wrap_blocks",
           "without_checkpoint_wrappers",
           "parallelized_already", "policy_for_precision", "fsdp_said"]


def check_checkpointing(value: Any) -> None:
    """``activation_checkpointing``: None / False (off), ``"blocks"`` (every block), a positive int k (every k-th
    block: blocks 0, k, 2k, ...) or a predicate ``(name, block) -> bool``."""
    if value is None or value is False or value == "blocks" or callable(value):
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    raise ValueError(f"activation_checkpointing must be None, 'blocks', a positive int k (every k-th block) or a "
                     f"predicate (name, block) -> bool, got {value!r}")


def check_compile(value: Any) -> Optional[dict]:
    """``compile``: False (off), True (``block.compile()``) or a dict of ``torch.compile`` options; the options or
    None when off."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"compile must be True, False or a dict of torch.compile options, got {value!r}")


def checkpointed(blocks: list, rule: Any) -> list[bool]:
    """For each ``(name, block)``: whether ``rule`` (see :func:`check_checkpointing`) checkpoints it."""
    if rule is None or rule is False:
        return [False] * len(blocks)
    if rule == "blocks":
        return [True] * len(blocks)
    if isinstance(rule, int):
        return [i % rule == 0 for i in range(len(blocks))]
    return [bool(rule(name, block)) for name, block in blocks]


def _call_in_a_frame_of_ours(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s call, in a frame dynamo starts in (see :func:`compile_in_place`)."""
    return module._call_impl(*args, **kwargs)


def compile_in_place(module: nn.Module, compile_options: dict) -> None:
    """``module.compile(**compile_options)`` (the state-dict keys unchanged), also for a module whose ``forward`` is
    torch.nn's (``nn.TransformerEncoderLayer``, ``nn.Sequential``): ``Module.compile`` starts dynamo at that
    ``forward``, a frame dynamo skips, so it compiles nothing; its call is compiled through a frame of ours instead
    (what ``torch.compile(module)`` does with a frame of its own)."""
    if getattr(type(module).forward, "__module__", "").startswith("torch.nn."):
        module._compiled_call_impl = functools.partial(torch.compile(_call_in_a_frame_of_ours, **compile_options),
                                                       module)
    else:
        module.compile(**compile_options)


def wrap_block(block: nn.Module, checkpoint: bool, compile_options: Optional[dict]) -> nn.Module:
    """The block as it runs: compiled in place (:func:`compile_in_place`: its state-dict keys unchanged) and wrapped in
    ``checkpoint_wrapper`` (non-reentrant; its state-dict hooks drop its prefix). Checkpointed and compiled, the
    checkpoint goes around the compiled block, and keeps a chain rule's state at the block
    (:func:`~lightning_resctl.surgery.phase.checkpoint_block`: the merges trace into the block's graph, no graph
    break); with ``fullgraph=True`` it goes inside (``checkpoint_wrapper`` first, then the wrapper compiled, with
    dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if compile_options is not None and checkpoint and compile_options.get("fullgraph"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        wrapped = checkpoint_wrapper(block)
        compile_in_place(wrapped, compile_options)
        return wrapped
    if compile_options is not None:
        compile_in_place(block, compile_options)
    return checkpoint_wrapper(block, checkpoint_fn=checkpoint_block) if checkpoint else block


def wrap_blocks(module: nn.Module, blocks: list, activation_checkpointing: Any,
                compile_options: Optional[dict]) -> tuple[list[nn.Module], list[bool]]:
    """Each ``(path, block)`` of ``module`` compiled and checkpointed as :func:`wrap_block` does, put in its place;
    the blocks as they now run and which are checkpointed (see :func:`checkpointed`). What the strategy does per
    block before ``fully_shard`` (``benchmarks/bench_recipe.py`` times it)."""
    flags = checkpointed(blocks, activation_checkpointing)
    out = []
    for (name, block), ckpt in zip(blocks, flags):
        wrapped = wrap_block(block, ckpt, compile_options)
        if wrapped is not block:
            parent, _, attr = name.rpartition(".")
            module.get_submodule(parent).register_module(attr, wrapped)
        out.append(wrapped)
    return out, flags


@contextmanager
def without_checkpoint_wrappers(module: nn.Module) -> Iterator[None]:
    """``module`` with each ``checkpoint_wrapper`` replaced by the block it wraps (the same parameters), and put back
    afterwards: the module's names as its state dict has them (Lightning's loader of a one-file checkpoint reads
    ``named_modules``, where the wrapper adds ``_checkpoint_wrapped_module.``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    swapped = []
    for name, sub in list(module.named_modules()):
        if isinstance(sub, CheckpointWrapper) and name:
            parent, _, attr = name.rpartition(".")
            owner = module.get_submodule(parent)
            owner.register_module(attr, sub._checkpoint_wrapped_module)
            swapped.append((owner, attr, sub))
    try:
        yield
    finally:
        for owner, attr, wrapper in reversed(swapped):
            owner.register_module(attr, wrapper)


def parallelized_already(module: nn.Module) -> Optional[str]:
    """What makes ``module`` parallel already (``fully_shard``, ``parallelize_module``, ``DTensor`` parameters), or
    None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = [name or type(module).__name__ for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        return f"fully_shard was applied to {sharded[0]!r}"
    parallel = tensor_parallel_modules(module)
    if parallel:
        return f"parallelize_module gave DTensor hooks to {parallel[0]!r}"
    dtensors = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        return f"its parameter {dtensors[0]!r} is a DTensor"
    return None


def policy_for_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the Trainer's ``precision``: ``"bf16-mixed"`` / ``"16-mixed"`` gather
    the parameters in bf16 / fp16 and reduce the gradients in fp32; anything else casts nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if half is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)


def fsdp_said(dp_mesh: Any, policy: Any) -> str:
    """What FSDP2 does over ``dp_mesh`` with ``policy``, for the strategy's line."""
    if dp_mesh.size() == 1:
        return "no FSDP2 (1 data-parallel rank)"
    dtypes = [f"{what} {str(dtype).replace('torch.', '')}" for what, dtype in
              (("parameters", policy.param_dtype), ("reduce", policy.reduce_dtype)) if dtype is not None]
    return f"FSDP2 over {dp_mesh.size()} ranks ({', '.join(dtypes) or 'no casting'})"
