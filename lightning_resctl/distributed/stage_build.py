"""The stages a pipeline rank runs, built from the whole (patched) model.

* :class:`StagePlan`: which blocks each stage holds (:func:`~.stage_split.split_blocks`) and which of the other
  modules it runs (:func:`~.model_parts.observe_placement`);
* :func:`trim_to_rank`: the LightningModule's model cut down, in place, to what this rank holds (its stages' blocks
  and modules; the others removed, or stand-ins without parameters): its state dict names each parameter as the
  whole model does, so a distributed checkpoint's keys are one process's;
* :func:`stage_models`: each stage's model: the trimmed model itself (one stage per rank), or, with several stages
  per rank, a view of it per stage (the modules on the way to the blocks copied shallowly, the same blocks and
  parameters), with a chain run of its own;
* :func:`chain_of`: the one chain whose state crosses the boundaries, checked (one chain, inside the blocks, a rule
  that declares its stage state).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Optional

from torch import nn

from ..rules.base import ChainRule
from ..surgery import MergeSite
from ..surgery.chain_run import ChainEnd, ChainRun, ChainStart
from .model_parts import candidates
from .stage_model import AbsentAfter, AbsentBefore, ChainBoundary
from .stage_split import PipelineSpec, stage_rank

__all__ = ["StagePlan", "chain_of", "trim_to_rank", "stage_models", "refresh_views", "holders_of"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


class StagePlan:
    """The split: ``ranges[s]`` the block indices of stage ``s``; ``keys`` the blocks' keys in their container (at
    ``container`` in the model); ``placement`` / ``called_before`` as :func:`~.model_parts.observe_placement`
    returns them."""

    def __init__(self, spec: PipelineSpec, container: str, keys: list, ranges: list, placement: dict) -> None:
        self.spec, self.container, self.keys, self.ranges = spec, container, list(keys), list(ranges)
        self.called_before = set(placement.pop("called_before", ()))
        self.placement = placement
        self.last = spec.num_stages - 1

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.spec.num_stages) if stage_rank(s, self.spec) == rank]

    def stage_of_block(self, i: int) -> int:
        return next(s for s, r in enumerate(self.ranges) if i in r)

    def runs(self, path: str, stage: int) -> bool:
        """Whether ``stage`` holds the module at ``path`` (a module of :func:`~.model_parts.candidates`)."""
        where = self.placement[path]
        return where == "every" or ("first" in where and stage == 0) or ("last" in where and stage == self.last)

    def stand_in(self, path: str, module: nn.Module) -> nn.Module:
        """What a stage that does not hold ``module`` has in its place."""
        if path in self.called_before:
            return AbsentBefore(module, path)
        return AbsentAfter(path, self.placement[path].replace("+", " and "))

    def said(self) -> str:
        """The split, stage by stage (blocks, and the modules of the first and last stage)."""
        parts = []
        for s, r in enumerate(self.ranges):
            own = [p for p in self.placement if self.placement[p] != "every" and self.runs(p, s)]
            blocks = f"block {r.start}" if len(r) == 1 else f"blocks {r.start}-{r.stop - 1}"
            parts.append(f"stage {s}: {blocks}" + (f" + {', '.join(own)}" if own else ""))
        every = [p for p, w in self.placement.items() if w == "every"]
        return "; ".join(parts) + (f"; every stage: {', '.join(every)}" if every else "")


def chain_of(model: nn.Module, blocks: list) -> Optional[tuple]:
    """``(run, sites)`` of the chain whose state crosses the stage boundaries (None: no chain rule). Refused: chain
    merges outside the blocks, several chains, a rule that declares no stage state (naming it)."""
    inside = {id(m) for _, b in blocks for m in b.modules()}
    sites = [m for m in model.modules() if isinstance(m, MergeSite) and m.rule.kind == "chain"]
    if not sites:
        return None
    outside = [s for s in sites if id(s) not in inside]
    if outside:
        raise ValueError(f"the chain merge at {outside[0].location} ({outside[0].path!r}) is outside the blocks: "
                         "pipeline parallel splits one chain of blocks into stages (block_cls= names the blocks)")
    runs = {id(s.__dict__["_run"]): s.__dict__["_run"] for s in sites}
    if len(runs) != 1:
        raise ValueError(f"the blocks hold {len(runs)} residual chains: pipeline parallel carries one chain's state "
                         "across the stages")
    rule = sites[0].rule
    if type(rule).stage_state is ChainRule.stage_state:
        raise ValueError(f"method={rule.name!r} ({type(rule).__name__}) declares no stage state, so its chain cannot "
                         "cross a pipeline stage boundary: implement ChainRule.stage_state(chain, state) -> tensors "
                         "and stage_state(chain, packed=tensors) -> state")
    return next(iter(runs.values())), sites


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    (root.get_submodule(parent) if parent else root)._modules[name] = module


def trim_to_rank(model: nn.Module, plan: StagePlan, rank: int) -> None:
    """Cut ``model`` down to what pipeline ``rank`` holds (in place): the other stages' blocks removed from their
    container (the kept ones under their own keys), the modules none of its stages runs replaced by stand-ins."""
    stages = plan.stages_of(rank)
    container = model.get_submodule(plan.container)
    keep = {plan.keys[i] for s in stages for i in plan.ranges[s]}
    for key in list(container._modules):
        if key not in keep:
            del container._modules[key]
    for path, module in candidates(model, plan.container):
        if not any(plan.runs(path, s) for s in stages):
            _set(model, path, plan.stand_in(path, module))


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its children, parameters and buffers, with dicts (and hooks) of its own."""
    out = copy.copy(module)
    for attr in ("_modules", "_parameters", "_buffers", *_HOOK_DICTS):
        if attr in out.__dict__:
            out.__dict__[attr] = copy.copy(out.__dict__[attr])
    return out


def _view(model: nn.Module, plan: StagePlan, stage: int) -> tuple[nn.Module, list]:
    """Stage ``stage``'s view of the trimmed ``model``: the modules on the way to the container and to the modules it
    leaves out copied shallowly; returns it and the ``(original, copy)`` pairs."""
    copies: dict = {"": (model, _shallow(model))}

    def copy_of(path: str) -> nn.Module:
        if path not in copies:
            parent_path, _, name = path.rpartition(".")
            parent = copy_of(parent_path)
            original = parent._modules[name]
            copies[path] = (original, _shallow(original))
            parent._modules[name] = copies[path][1]
        return copies[path][1]

    container = copy_of(plan.container)
    container._modules = OrderedDict((plan.keys[i], container._modules[plan.keys[i]]) for i in plan.ranges[stage])
    for path, module in candidates(model, plan.container):
        if not plan.runs(path, stage) and not isinstance(module, (AbsentBefore, AbsentAfter)):
            parent_path, _, name = path.rpartition(".")
            copy_of(parent_path)._modules[name] = plan.stand_in(path, module)
    return copies[""][1], list(copies.values())


def _own_run(pairs: list, run: ChainRun, sites: list) -> ChainRun:
    """A chain run for one view's sites, its start and end hooks on the view's copy of the chain's scope."""
    own = ChainRun(run.index, run.num_merges, run.expected, run.sites, members=sites)
    for site in sites:
        site.__dict__["_run"] = own
    for _, module in pairs:
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = module.__dict__.get(attr, {})
            for key, hook in list(hooks.items()):
                if isinstance(hook, (ChainStart, ChainEnd)) and hook.run is run:
                    hooks[key] = type(hook)(own)
    return own


def stage_models(model: nn.Module, plan: StagePlan, rank: int, chain: Optional[tuple]) -> tuple[dict, list]:
    """``{stage: (stage model, its ChainBoundary or None)}`` for this rank's stages, and the ``(original, copy)``
    module pairs of the views (whose parameters :func:`refresh_views` puts back after a materialization)."""
    stages = plan.stages_of(rank)
    container = model.get_submodule(plan.container)
    out, pairs = {}, []
    for s in stages:
        keys = {plan.keys[i] for i in plan.ranges[s]}
        sites = [m for k in keys for m in container._modules[k].modules()
                 if isinstance(m, MergeSite) and m.rule.kind == "chain"]
        if len(stages) == 1:
            stage_model, run = model, None
            if chain is not None:
                run = chain[0]
                run.members = [m for m in run.members if any(m is x for x in sites)]
        else:
            stage_model, own_pairs = _view(model, plan, s)
            pairs += own_pairs
            run = _own_run(own_pairs, chain[0], sites) if chain is not None else None
        out[s] = (stage_model, ChainBoundary(run, sites) if run is not None and sites else None)
    return out, pairs


def refresh_views(pairs: list) -> None:
    """Each view's copies hold their originals' parameters and buffers again (a materialization from the meta
    device, ``to_empty``, puts new ones in the originals)."""
    for original, copied in pairs:
        copied._parameters.update(original._parameters)
        copied._buffers.update(original._buffers)


def holders_of(module: nn.Module, model_name: str, plan: StagePlan, blocks: list) -> dict:
    """``{names of a parameter (all it has in the LightningModule): the pipeline ranks holding it}``, from the whole
    model: a block's on its stage's rank, a candidate module's on the ranks of the stages that run it, every other
    (a rule's module, the model's own) on every rank."""
    ranks_of = {}
    for i, (_, block) in enumerate(blocks):
        for p in block.parameters():
            ranks_of[id(p)] = {stage_rank(plan.stage_of_block(i), plan.spec)}
    everyone = set(range(plan.spec.size))
    model = getattr(module, model_name)
    for path, cand in candidates(model, plan.container):
        on = {stage_rank(s, plan.spec) for s in range(plan.spec.num_stages) if plan.runs(path, s)}
        for p in cand.parameters():
            ranks_of[id(p)] = ranks_of.get(id(p), set()) | on
    names: dict = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    return {tuple(ns): ranks_of.get(pid, everyone) for pid, (_, ns) in names.items()}
