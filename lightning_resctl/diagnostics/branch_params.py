"""Which parameters feed each merge's update (for ``param_grad_rms``), found once with forward hooks."""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class BranchParameters:
    """The parameters of the modules that ran inside merge d's block (the module holding the addition) since
    the block started or since its previous merge — found on the first observed forward with temporary
    forward hooks (:meth:`trace`, :meth:`merged` from the merge observer, :meth:`finish`).

    For the first merge of a block that is the whole model, modules run before the stream (e.g. an input
    projection) are included. :meth:`grad_sums` reads their gradients.
    """

    def __init__(self) -> None:
        #: ``params[d]``: the parameters of merge d's branch, once :meth:`finish` ran; None before.
        self.params: list[list[nn.Parameter]] | None = None
        self._hooks: list = []
        # modules as insertion-ordered dict keys (not sets, whose order follows memory addresses): the gradient sums
        # add the parameters in the order they ran, the same in every process
        self._pending: dict[int, dict] = {}
        self._owner_of_site: dict[int, int] = {}
        self._modules: dict[int, dict] = {}

    @property
    def tracing(self) -> bool:
        return bool(self._hooks)

    def trace(self, model: nn.Module, sites: list) -> None:
        """Install the hooks that attribute parameter-holding modules to the merge whose update they feed."""
        from lightning_resctl.surgery import MergeSite

        excluded: set[int] = set()
        for m in model.modules():
            if isinstance(m, MergeSite):
                excluded.update(id(x) for x in m.modules())
        for s in sites:
            ch = getattr(s, "chain_module", None)
            if ch is not None:
                excluded.update(id(x) for x in ch.modules())
        owners: dict[int, nn.Module] = {}
        for s in sites:
            owner = _resolve_owner(model, s)
            owners[id(owner)] = owner
            self._owner_of_site[id(s)] = id(owner)

        def reset(oid: int, *_: Any) -> None:
            self._pending[oid] = {}

        for oid, owner in owners.items():
            self._hooks.append(owner.register_forward_pre_hook(functools.partial(reset, oid)))
        for oid, owner in owners.items():  # innermost owner of each parameter-holding module
            for m in owner.modules():
                if id(m) in excluded or not any(True for _ in m.parameters(recurse=False)):
                    continue
                if _innermost_owner(m, owners) != oid:
                    continue

                def mark(mod: nn.Module, *_: Any, _oid: int = oid) -> None:
                    self._pending.setdefault(_oid, {})[mod] = None

                self._hooks.append(m.register_forward_hook(mark))

    def merged(self, site: Any, depth: int) -> None:
        """Merge ``depth`` of ``site`` ran: the modules its block ran since the last merge are its branch."""
        owner = self._owner_of_site.get(id(site))
        if owner is not None:
            self._modules.setdefault(depth, {}).update(self._pending.get(owner, {}))
            self._pending[owner] = {}

    def finish(self, num_depths: int) -> None:
        """Remove the hooks and fix :attr:`params`."""
        self.remove_hooks()
        out = []
        for d in range(num_depths):
            seen: set[int] = set()
            params = []
            for m in self._modules.get(d, ()):
                for p in m.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            out.append(params)
        self.params = out
        self._modules = {}
        self._pending = {}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def grad_sums(self) -> list[tuple[torch.Tensor, int]]:
        """Per depth ``(sum of squared gradient entries (fp64, CPU), number of entries)`` of the branch's
        parameters as they are now, each the whole gradient's on every rank (see :func:`grad_sumsq`)."""
        out = []
        for params in self.params or []:
            sumsq = torch.zeros((), dtype=torch.float64)
            count = 0
            for p in params:
                if p.grad is not None:
                    s, n = grad_sumsq(p.grad)
                    sumsq, count = sumsq + s, count + n
            out.append((sumsq, count))
        return out


def grad_sumsq(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum of squared entries (fp64, CPU), number of entries)`` of the whole gradient ``grad``, the same on every
    rank: a plain tensor as it is (under DDP every rank holds the whole); a ``DTensor`` (FSDP2 shards, tensor
    parallel) reduced first where it is ``Partial`` (sequence parallel: each rank's part of a sum, whose squares do
    not add up), then its local sums added over the mesh dimensions it is sharded on (a collective: every rank
    reads the same gradients in the same order). Summed over ranks, as the metrics are, every parameter then counts
    world-size times, which leaves the RMS as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad.detach().double().square().sum().cpu(), grad.numel()
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    if list(placements) != list(grad.placements):
        grad = grad.redistribute(grad.device_mesh, placements)
    local = grad.to_local().detach().double().square().sum()
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            torch.distributed.all_reduce(local, group=grad.device_mesh.get_group(dim))
    return local.cpu(), grad.numel()


def _resolve_owner(root: nn.Module, site: Any) -> nn.Module:
    """The module whose forward contains the site's addition (``site.path``, relative to the patched model)."""
    path = getattr(site, "path", "") or ""
    if path:
        try:
            return root.get_submodule(path)
        except AttributeError:
            pass
        for name, m in root.named_modules():
            if name.endswith("." + path):
                return m
    return root


def _innermost_owner(module: nn.Module, owners: dict[int, nn.Module]) -> int | None:
    best = None
    best_size = None
    for oid, owner in owners.items():
        mods = list(owner.modules())
        if any(m is module for m in mods) and (best_size is None or len(mods) < best_size):
            best, best_size = oid, len(mods)
    return best
