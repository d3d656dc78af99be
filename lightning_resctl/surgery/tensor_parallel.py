"""Tensor and sequence parallel (``torch.distributed.tensor``): the rules' parameters on the tensor-parallel mesh.

``parallelize_module`` leaves the residual stream between blocks a plain tensor: the whole stream on every rank
(tensor parallel: ``ColwiseParallel`` / ``RowwiseParallel`` around the branches) or each rank's part of the sequence
(sequence parallel: ``SequenceParallel`` norms, ``RowwiseParallel(output_layouts=Shard(1))``). A rule computes each
token's merge from that token alone, so its merges run on the local tensor as they are; its parameters must be what
the mesh needs. :func:`parallelize_residuals` makes them replicated ``DTensor`` s (as ``SequenceParallel`` does with a
norm's weight) that each merge reads as local tensors whose gradient is declared ``Partial`` (sequence parallel: each
rank's gradient covers its own tokens; DTensor sums them when the gradient is used, in the optimizer step, in
``clip_grad_norm_``, in FSDP2's reduce-scatter) or ``Replicate`` (tensor parallel: every rank's gradient is the whole).

Which of the two the stream is cannot be seen from the stream (a plain tensor either way), so the caller says it.
Refused instead of a silently different network: patching a model that ``parallelize_module`` already parallelized
(the patch observes the model's own additions on plain tensors: patch first), and a forward of a tensor-parallel
model whose rule parameters are still plain tensors (each rank would train its own copy).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from .sites import MergeSite

__all__ = ["parallelize_residuals", "tensor_parallel_modules", "refuse_tensor_parallel", "TensorParallelCheck"]


def tensor_parallel_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that ``parallelize_module`` (any ``ParallelStyle``) or ``distribute_module``
    gave forward hooks: the hooks that turn their inputs and outputs into ``DTensor`` s and back."""
    found = []
    for path, module in model.named_modules():
        hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
        if any(_from_dtensor_package(h) for h in hooks):
            found.append(path or type(model).__name__)
    return found


def _from_dtensor_package(hook: Any) -> bool:
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    return code is not None and "torch/distributed/tensor/" in code.co_filename.replace("\\", "/")


def refuse_tensor_parallel(model: nn.Module, method: str) -> None:
    """Raise RuntimeError when ``model`` is tensor parallel already (see :func:`tensor_parallel_modules`): the
    patch must come before ``parallelize_module``."""
    found = tensor_parallel_modules(model)
    if found:
        shown = ", ".join(repr(p) for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise RuntimeError(
            f"patching method={method!r} into a model that parallelize_module already made tensor parallel "
            f"(DTensor hooks on {shown}) is not supported: the patch finds the merges by watching the model's own "
            "additions, which tensor parallelism turns into DTensor redistributions. Patch before parallelize_module "
            "(in Lightning: call lightning_resctl.callbacks.patch_in_configure_model(self) in configure_model before "
            "parallelize_module), then call lightning_resctl.parallelize_residuals(model, tp_mesh, "
            "sequence_parallel=...) after it")


def _rule_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Each module holding a rule's parameters (a per-merge rule's merge module, a chain module), once."""
    seen: set = set()
    for site in (m for m in model.modules() if isinstance(m, MergeSite)):
        for module in (site.merge, site.chain_module):
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield module


def _rule_parameters(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, parameter)`` of every parameter the rules added to ``model``."""
    return [(sub, name, p) for module in _rule_modules(model) for sub in module.modules()
            for name, p in sub._parameters.items() if p is not None]


class TensorParallelCheck:
    """Forward pre-hook of a patched model whose rules have parameters: refuses a forward of a tensor-parallel model
    (:func:`tensor_parallel_modules`) whose rule parameters are plain tensors — :func:`parallelize_residuals` was not
    called, and each rank would train its own copy of the rule. Runs only where ``torch.distributed`` is
    initialized (``parallelize_module`` needs it) and outside ``torch.compile`` tracing."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not (torch.distributed.is_available()
                                                  and torch.distributed.is_initialized()):
            return
        from torch.distributed.tensor import DTensor

        plain = [p for _, _, p in _rule_parameters(module) if not isinstance(p, DTensor)]
        parallel = tensor_parallel_modules(module) if plain else []
        if parallel:
            raise RuntimeError(
                f"the model is tensor parallel (parallelize_module gave DTensor hooks to {parallel[0]!r}), but "
                f"method={self.method!r}'s {len(plain)} parameters are "
                "plain tensors: each rank would train its own copy of them (with sequence parallelism each from its "
                "own tokens). Call lightning_resctl.parallelize_residuals(model, tp_mesh, sequence_parallel=True "
                "when the residual stream between blocks is sharded on the sequence, else False) after "
                "parallelize_module and before building the optimizer")


class LocalRuleParameters:
    """Forward pre-hook and (``always_call``) forward hook of a :class:`MergeSite`: while the site runs, its rule's
    ``DTensor`` parameters are their local tensors, whose gradient is declared ``grad_placements`` (the merge
    computes on the local stream); afterwards the parameters are back."""

    def __init__(self, modules: list, grad_placements: tuple) -> None:
        self.modules = modules
        self.grad_placements = grad_placements
        self.saved: list = []

    def enter(self, site: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import DTensor

        for module in self.modules:
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if isinstance(p, DTensor):
                        self.saved.append((sub, name, p))
                        sub._parameters[name] = p.to_local(grad_placements=self.grad_placements)

    def leave(self, site: nn.Module, args: Any, output: Any) -> None:
        while self.saved:
            sub, name, p = self.saved.pop()
            sub._parameters[name] = p


def parallelize_residuals(model: nn.Module, tp_mesh: Any, *, sequence_parallel: bool) -> nn.Module:
    """Put the residual rules' parameters of a patched ``model`` on the tensor-parallel mesh ``tp_mesh`` (a 1-D
    ``DeviceMesh``): each becomes a replicated ``DTensor`` (rank 0's values), and each merge reads it as a local
    tensor whose gradient is summed over the mesh (``sequence_parallel=True``: the residual stream between blocks is
    sharded on the sequence, each rank's gradient covers its own tokens) or is the whole gradient already
    (``sequence_parallel=False``: the stream is replicated). Call it after ``parallelize_module``, before
    ``fully_shard`` and before building the optimizer. Returns ``model``.

    The order: ``patch_residuals`` (or ``patch_in_configure_model``), ``parallelize_module``,
    ``parallelize_residuals``, ``fully_shard``. ``sequence_parallel`` has no default: a wrong value trains a
    different network (a replicated stream declared sharded sums identical gradients; a sharded one declared
    replicated keeps each rank's own)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if getattr(tp_mesh, "ndim", None) != 1:
        raise ValueError(f"tp_mesh must be the 1-D tensor-parallel DeviceMesh (e.g. mesh['tp']), got {tp_mesh!r}")
    sites = [m for m in model.modules() if isinstance(m, MergeSite)]
    if not sites:
        raise RuntimeError(f"{type(model).__name__} holds no patched residual merge: patch_residuals first")
    for sub, name, p in _rule_parameters(model):
        if isinstance(p, DTensor):
            raise RuntimeError(f"the rule's parameter {name!r} is a DTensor already: parallelize_residuals runs once "
                               "per model, before fully_shard")
        sub.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [Replicate()]),
                                                  requires_grad=p.requires_grad))
    grad_placements = (Partial(),) if sequence_parallel else (Replicate(),)
    for site in sites:
        modules = [m for m in (site.merge, site.chain_module) if m is not None]
        if not any(True for m in modules for _ in m.parameters()):
            continue
        local = LocalRuleParameters(modules, grad_placements)
        site.register_forward_pre_hook(local.enter)
        site.register_forward_hook(local.leave, always_call=True)
    return model
