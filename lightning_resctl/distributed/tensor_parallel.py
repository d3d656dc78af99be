"""Tensor and sequence parallel (``torch.distributed.tensor``): the rules' parameters on the tensor-parallel mesh.

``parallelize_module`` leaves the residual stream between blocks a plain tensor: the whole stream on every rank
(tensor parallel: ``ColwiseParallel`` / ``RowwiseParallel`` around the branches) or each rank's part of the sequence
(sequence parallel: ``SequenceParallel`` norms, ``RowwiseParallel(output_layouts=Shard(1))``). A rule computes each
token's merge from that token alone, so its merges run on the local tensor as they are; its parameters must be what
the mesh needs. :func:`parallelize_residuals` makes them replicated ``DTensor`` s (as ``SequenceParallel`` does with a
norm's weight) that each merge reads as local tensors whose gradient is declared ``Partial`` (sequence parallel: each
rank's gradient covers its own tokens; DTensor sums them when the gradient is used, in the optimizer step, in
``clip_grad_norm_``, in FSDP2's reduce-scatter) or ``Partial("avg")`` (tensor parallel: every rank's gradient is the
whole, equal up to the last bits: averaged, the ranks' copies stay bitwise equal).

Which of the two the stream is cannot be seen from the stream (a plain tensor either way), so the caller says it.
Refused by the patch itself (:mod:`lightning_resctl.surgery.tensor_parallel_check`), instead of a silently different
network: patching a model that ``parallelize_module`` already parallelized, and a forward of a tensor-parallel model
whose rule parameters are still plain tensors (each rank would train its own copy).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..surgery import MergeSite
from ..surgery.tensor_parallel_check import rule_parameters

__all__ = ["parallelize_residuals"]


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
    sharded on the sequence, each rank's gradient covers its own tokens) or averaged over it (``sequence_parallel=
    False``: the stream is replicated, each rank's gradient is the whole one, the same up to rounding: the average
    keeps the ranks' copies bitwise equal). Call it after ``parallelize_module``, before
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
    for sub, name, p in rule_parameters(model):
        if isinstance(p, DTensor):
            raise RuntimeError(f"the rule's parameter {name!r} is a DTensor already: parallelize_residuals runs once "
                               "per model, before fully_shard")
        sub.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [Replicate()]),
                                                  requires_grad=p.requires_grad))
    # tensor parallel: every rank computes the whole gradient from the same stream, equal up to the last bits (the
    # ranks' matrix products need not round alike): averaged, the copies stay bitwise equal on every rank
    grad_placements = (Partial(),) if sequence_parallel else (Partial("avg"),)
    for site in sites:
        modules = [m for m in (site.merge, site.chain_module) if m is not None]
        if not any(True for m in modules for _ in m.parameters()):
            continue
        local = LocalRuleParameters(modules, grad_placements)
        site.register_forward_pre_hook(local.enter)
        site.register_forward_hook(local.leave, always_call=True)
    return model
