"""DWA nn.Modules: :class:`DWAWeights` (one average's weights) and :class:`DWAChain` (one chain: its blocks)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .config import DWAConfig
from .reference import averaging_blocks, dwa_num_weights, dwa_sources

__all__ = ["DWAWeights", "DWAChain"]


class DWAWeights(nn.Module):
    """The weights ``alpha_i`` ``((i + k) // k,)`` of the average after block ``block`` = i; the last multiplies
    ``X_i``. Init (paper §3; ``DWAModules._init_weights``): zeros, the last 1 (the average is ``X_i``)."""

    def __init__(self, block: int, dilation: int = DWAConfig.dilation):
        super().__init__()
        self.block, self.dilation = int(block), int(dilation)
        self.weight = nn.Parameter(torch.empty(dwa_num_weights(self.block, self.dilation)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.weight[-1] = 1.0

    def extra_repr(self) -> str:
        return f"block={self.block}, sources={dwa_sources(self.block, self.dilation)}"


class DWAChain(nn.Module):
    """One DWA chain. ``blocks``: the merges of each of the model's blocks, in order (the surgery's grouping, or
    ``merges_per_block``); with ``schedule="grouped"`` the averages count groups of ``period`` blocks. Holds
    ``averages[str(i)]`` (:class:`DWAWeights`) for each block i followed by an average; ``kept`` the outputs some
    average reads; :attr:`init_note` says in the patch report where the averages are."""

    def __init__(self, dim: int, blocks: tuple, dilation: int = DWAConfig.dilation, period: int = DWAConfig.period,
                 schedule: str = DWAConfig.schedule, grouping: str = "the surgery's grouping"):
        super().__init__()
        blocks = tuple(int(b) for b in blocks)
        if not blocks or min(blocks) < 1:
            raise ValueError(f"blocks must be a non-empty tuple of merge counts >= 1, got {blocks!r}")
        self.dim, self.num_merges, self.model_blocks = int(dim), sum(blocks), blocks
        self.dilation, self.period, self.schedule = int(dilation), int(period), schedule
        if schedule == "grouped":
            if len(blocks) % period:
                raise ValueError(
                    f"schedule='grouped' averages after groups of period={period} blocks, but the chain has "
                    f"{len(blocks)} blocks ({grouping}), not a multiple of {period}: pick a period that divides it, "
                    "or schedule='paper'")
            units = tuple(sum(blocks[g:g + period]) for g in range(0, len(blocks), period))
            every = 1
        else:
            units, every = blocks, period
        ends = [sum(units[:i + 1]) - 1 for i in range(len(units))]
        #: merge position -> the block (1-based) whose last merge it is
        self.block_end = {e: i + 1 for i, e in enumerate(ends)}
        self.num_blocks = len(units)
        avg = averaging_blocks(self.num_blocks, every)
        self.averages = nn.ModuleDict({str(i): DWAWeights(i, self.dilation) for i in avg})
        self.kept = frozenset(j for i in avg for j in dwa_sources(i, self.dilation))
        unit = f"groups of {period} blocks" if schedule == "grouped" else "blocks"
        self.init_note = (
            f"DWA acts per block, not per merge: {len(blocks)} blocks ({grouping}; merges per block: "
            f"{' '.join(map(str, blocks))}); an average over the earlier {unit}' outputs after "
            f"{'each of ' if len(avg) == self.num_blocks else ''}{len(avg)} of {self.num_blocks} {unit} "
            f"(dilation {self.dilation}, period {self.period}, schedule {schedule!r})")

    def reset_parameters(self) -> None:
        for m in self.averages.values():
            m.reset_parameters()

    def weights(self, block: int) -> Optional[Tensor]:
        """The weights of the average after ``block``, or None when none follows it."""
        m = self.averages[str(block)] if str(block) in self.averages else None
        return None if m is None else m.weight

    def blocks_ending(self, k: int, next_k: int) -> list:
        """The blocks whose last merge is one of ``k .. next_k - 1`` (merges after k that do not run), in order."""
        return [self.block_end[e] for e in range(k, max(next_k, k + 1)) if e in self.block_end]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_merges={self.num_merges}, blocks={self.num_blocks}, dilation={self.dilation}, "
                f"period={self.period}, schedule={self.schedule!r}")
