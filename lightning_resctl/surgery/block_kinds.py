"""Blocks compiled one by one: the kinds of block a chain rule makes.

A chain rule's merges trace into the graph of the block that holds them, so blocks compiled one by one compile one
graph per *kind* of block: the values its merges' steps read (:meth:`~lightning_resctl.rules.ChainPosition.graph_key`;
e.g. MGR's first blocks, whose merges accumulate streams, its middle blocks and its last). Each kind costs a whole
block's compile. :func:`rare_blocks` names the blocks whose kind is not the middle blocks' (the most common kind): a
constant number at any depth, which the recipe runs with their branches compiled instead of the whole block
(:func:`~lightning_resctl.distributed.recipe.wrap_block`), so that the only whole-block graph is the middle blocks'.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from torch import nn

from .phase import chain_sites

__all__ = ["block_kind", "rare_blocks"]


def block_kind(block: nn.Module) -> Hashable:
    """What the compiled graph of ``block`` specialises on: each chain merge's position key, per run of it in a
    forward, in training and in eval (``()``: no chain merge)."""
    kind = []
    for site in chain_sites(block):
        site.bind_positions()
        kind.append(tuple(tuple(at.graph_key() for at in site.position_table(training)) for training in (True, False)))
    return tuple(kind)


def rare_blocks(blocks: list[nn.Module]) -> list[bool]:
    """For each block, whether its kind (:func:`block_kind`) differs from the most common one; all False when no two
    blocks have one kind (every block compiles a graph of its own: e.g. Full AttnRes, whose history grows)."""
    kinds = [block_kind(block) for block in blocks]
    common, count = Counter(kinds).most_common(1)[0] if kinds else ((), 0)
    return [count >= 2 and kind != common for kind in kinds]
