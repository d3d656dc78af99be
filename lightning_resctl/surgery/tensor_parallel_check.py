"""The patch's refusals around tensor parallelism (``torch.distributed.tensor``), where the patch runs: patching a
model that ``parallelize_module`` already parallelized (the patch observes the model's own additions on plain tensors:
patch first), and a forward of a tensor-parallel model whose rule parameters are still plain tensors (each rank would
train its own copy). Putting the rules' parameters on the mesh is the distributed layer's
(``lightning_resctl.distributed.tensor_parallel.parallelize_residuals``)."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from .sites import MergeSite

__all__ = ["tensor_parallel_modules", "refuse_tensor_parallel", "TensorParallelCheck", "rule_modules",
           "rule_parameters"]


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
            "(in Lightning: call lightning_resctl.patch_in_configure_model(self) in configure_model before "
            "parallelize_module), then call lightning_resctl.parallelize_residuals(model, tp_mesh, "
            "sequence_parallel=...) after it")


def rule_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Each module holding a rule's parameters (a per-merge rule's merge module, a chain module), once."""
    seen: set = set()
    for site in (m for m in model.modules() if isinstance(m, MergeSite)):
        for module in (site.merge, site.chain_module):
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield module


def rule_parameters(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, parameter)`` of every parameter the rules added to ``model``."""
    return [(sub, name, p) for module in rule_modules(model) for sub in module.modules()
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

        plain = [p for _, _, p in rule_parameters(module) if not isinstance(p, DTensor)]
        parallel = tensor_parallel_modules(module) if plain else []
        if parallel:
            raise RuntimeError(
                f"the model is tensor parallel (parallelize_module gave DTensor hooks to {parallel[0]!r}), but "
                f"method={self.method!r}'s {len(plain)} parameters are "
                "plain tensors: each rank would train its own copy of them (with sequence parallelism each from its "
                "own tokens). Call lightning_resctl.parallelize_residuals(model, tp_mesh, sequence_parallel=True "
                "when the residual stream between blocks is sharded on the sequence, else False) after "
                "parallelize_module and before building the optimizer")
