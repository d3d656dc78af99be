"""Parameters that several pipeline ranks hold: a rule's chain module (its merges on every stage read it), a weight
tied between the embedding (first stage) and the head (last stage), what the model holds outside any module of its
own. Each holder keeps a copy: equal at the start (broadcast from the first holder), and equal after every step, their
gradients summed over the holders (each stage's gradient covers its own merges, or its own use of the tied weight)
before the optimizer steps."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SharedParameters"]

WRAPPED = "_checkpoint_wrapped_module."


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class SharedParameters:
    """``groups``: ``[(process group, source global rank, [names])]`` for the groups this rank is in: each name is a
    shared parameter as the held model names it (any of the names it had in the whole model: a tied weight has
    two); ``root``: the module whose parameters they are (the LightningModule)."""

    def __init__(self, groups: list, root: nn.Module) -> None:
        self.groups = groups
        self.root = root

    @classmethod
    def build(cls, holders: dict, mesh: Any, pp_index: int, root: nn.Module) -> "SharedParameters":
        """``holders``: ``{names (a tuple: every name of one parameter in the whole model): pipeline ranks holding
        it}``. Every rank calls this (it creates the process groups of the rank sets other than the whole pipeline, on
        every rank, in one order)."""
        by_ranks: dict = defaultdict(list)
        for names, ranks in holders.items():
            if len(ranks) > 1:
                by_ranks[tuple(sorted(ranks))].append(names)
        pp = mesh["pipeline_parallel"]
        grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # (pp, the other dims flattened)
        me = dist.get_rank()
        groups = []
        for ranks, names in sorted(by_ranks.items()):
            names = sorted(names)
            if len(ranks) == pp.size():
                if pp_index in ranks:
                    groups.append((pp.get_group(), int(grid[ranks[0]][_column(grid, me)]), names))
                continue
            for column in range(grid.shape[1]):
                members = [int(grid[r][column]) for r in ranks]
                group = dist.new_group(members)
                if me in members:
                    groups.append((group, members[0], names))
        return cls(groups, root)

    def _held(self) -> dict:
        return {name.replace(WRAPPED, ""): p for name, p in self.root.named_parameters(remove_duplicate=False)}

    def _params(self, held: dict, names: list) -> list:
        out = []
        for aliases in names:
            p = next((held[n] for n in aliases if n in held), None)
            if p is None:
                raise RuntimeError(f"the shared parameter {aliases[0]!r} is not held by this pipeline rank")
            out.append(p)
        return out

    def broadcast(self) -> None:
        """Every holder's copy = the first holder's."""
        held = self._held()
        with torch.no_grad():
            for group, src, names in self.groups:
                for p in self._params(held, names):
                    dist.broadcast(_local(p.data), src=src, group=group)

    def all_reduce_grads(self) -> None:
        """Each shared parameter's gradient summed over its holders (a holder without a gradient adds zeros)."""
        held = self._held()
        for group, _, names in self.groups:
            params = self._params(held, names)
            by_dtype: dict = defaultdict(list)
            for p in params:
                by_dtype[p.dtype].append(p)
            for ps in by_dtype.values():
                grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p.data)) for p in ps]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=group)
                offset = 0
                for p, g in zip(ps, grads):
                    part = flat[offset:offset + g.numel()].view_as(g)
                    offset += g.numel()
                    if p.grad is None:
                        p.grad = _like(p, part)
                    else:
                        g.copy_(part)

    def said(self) -> Optional[str]:
        count = sum(len(names) for _, _, names in self.groups)
        if not count:
            return None
        return f"{count} parameter{'s' if count != 1 else ''} on several stages, their gradients summed"


def _column(grid: torch.Tensor, rank: int) -> int:
    return int((grid == rank).nonzero()[0][1])


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` from its local part (a DTensor for a DTensor parameter)."""
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local
