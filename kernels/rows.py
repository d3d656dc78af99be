"""Strided row views for the kernels: how a tensor's leading dims map to rows without copying it."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from torch import Tensor

__all__ = ["RowGrid", "row_grid", "token_stride"]

#: CUDA's limit on the second and third grid dimensions.
MAX_GRID_YZ = 65535


class RowGrid(NamedTuple):
    """Rows of tensors ``(*lead, C)`` as ``outer x inner`` rows: row ``(b, p)`` of tensor k starts at
    ``b * strides[k][0] + p * strides[k][1]`` elements; ``strides[k][2]`` is its feature stride."""
    outer: int
    inner: int
    strides: tuple[tuple[int, int, int], ...]


def _groups(shape: Sequence[int], strides_list: Sequence[Sequence[int]]) -> list[list]:
    """``shape``'s dims merged where every tensor's strides allow it: ``[size, strides]`` per group,
    outermost first, each group's strides those of its innermost dim; dims of size 1 are dropped."""
    groups: list[list] = []
    for i, size in enumerate(shape):
        if size == 1:
            continue
        st = [s[i] for s in strides_list]
        if groups and all(prev == size * cur for prev, cur in zip(groups[-1][1], st)):
            groups[-1][0] *= size
            groups[-1][1] = st
        else:
            groups.append([size, st])
    return groups


def row_grid(*tensors: Tensor) -> Optional[RowGrid]:
    """The rows of same-shaped tensors ``(*lead, C)`` as at most two strided levels, or None when their strides
    need more (the caller then copies). A contiguous or column-sliced tensor needs one level, a channels-first
    tensor moved to features-last two (batch, pixels)."""
    groups = _groups(tensors[0].shape[:-1], [t.stride()[:-1] for t in tensors])
    if len(groups) > 2 or (len(groups) == 2 and groups[0][0] > MAX_GRID_YZ):
        return None
    while len(groups) < 2:
        groups.insert(0, [1, [0] * len(tensors)])
    (outer, so), (inner, si) = groups
    return RowGrid(outer, inner, tuple((a, b, t.stride(-1)) for a, b, t in zip(so, si, tensors)))


def token_stride(t: Tensor, lead_dims: int) -> Optional[int]:
    """The one stride that steps through the first ``lead_dims`` dims of ``t`` as a flat token index (0 when
    there is at most one token), or None when no single stride does."""
    groups = _groups(t.shape[:lead_dims], [t.stride()[:lead_dims]])
    if len(groups) > 1:
        return None
    return groups[0][1][0] if groups else 0
