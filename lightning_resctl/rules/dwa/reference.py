"""``dwa``: DenseFormer's depth-weighted average (Pagliardini, Mohtashami, Fleuret, Jaggi; arXiv 2402.02622),
docs/rules/dwa.md: the formula and its torch oracle.

Blocks ``B_1 .. B_d`` (each a whole block of the model, its residual additions inside it), ``X_0`` the chain input
(the embedding), ``Y_0 = X_0``; per token::

    X_i = B_i(Y_{i-1})                                            the block's output
    Y_i = sum_{m=0}^{i//k} alpha_{i,m} X_{(i mod k) + m k}        if p | i           (the depth-weighted average)
    Y_i = X_i                                                     otherwise
    output: Y_d                                                   (then the model's final norm and head)

``k`` = dilation, ``p`` = period (a "k x p DenseFormer"; 1 x 1 reads every earlier output). The weights
``alpha_i`` (``(i + k) // k`` scalars per averaging block, shared by all tokens and channels) are not normalised
and may be negative; the last one multiplies ``X_i`` itself. Init (paper §3, ``DWAModules._init_weights``):
``alpha_{i,i//k} = 1``, every other 0, so ``Y_i = X_i``: the plain network at step 0, exactly. Schedule
``"grouped"`` (the experiments' model): the blocks in groups of p, the same formula over the groups with period 1.
The history holds the block outputs ``X_j``, never the averages ``Y_j``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..common import compute_dtype
from .config import DWAConfig

__all__ = ["dwa_sources", "dwa_average_reference", "dwa_chain_reference", "dwa_num_weights", "averaging_blocks"]


def dwa_sources(i: int, dilation: int = DWAConfig.dilation) -> list[int]:
    """The block outputs the average after block ``i`` reads, in weight order: ``(i mod k) + m k`` for
    ``m = 0 .. i // k`` (the last one is ``i``)."""
    return list(range(i % dilation, i + 1, dilation))


def dwa_num_weights(i: int, dilation: int = DWAConfig.dilation) -> int:
    """``(i + k) // k``: the weights of the average after block ``i``."""
    return (i + dilation) // dilation


def averaging_blocks(num_blocks: int, period: int = DWAConfig.period) -> list[int]:
    """The blocks ``i`` in ``1 .. d`` followed by an average: ``p | i``."""
    return [i for i in range(1, num_blocks + 1) if i % period == 0]


def dwa_average_reference(history: Sequence[Tensor], alpha: Tensor, i: int,
                          dilation: int = DWAConfig.dilation) -> Tensor:
    """``Y_i = sum_m alpha[m] X_{(i mod k) + m k}`` over ``history = [X_0, .., X_i]``, in the compute dtype (fp32;
    fp64 stays fp64)."""
    srcs = torch.stack([history[j] for j in dwa_sources(i, dilation)], dim=0)
    cd = compute_dtype(srcs, alpha)
    return torch.tensordot(alpha.to(cd), srcs.to(cd), dims=1)


def dwa_chain_reference(x: Tensor, blocks: Sequence[Callable[[Tensor], Tensor]], alphas: dict,
                        dilation: int = DWAConfig.dilation, period: int = DWAConfig.period,
                        schedule: str = DWAConfig.schedule) -> Tensor:
    """A whole DenseFormer (the oracle): ``blocks`` the functions ``B_1 .. B_d``, ``alphas[i]`` the weights of the
    average after block ``i`` (after group ``i`` for ``schedule="grouped"``). Returns ``Y_d``."""
    if schedule == "grouped":
        if len(blocks) % period:
            raise ValueError(f"schedule='grouped' needs a multiple of period={period} blocks, got {len(blocks)}")
        groups = [blocks[g:g + period] for g in range(0, len(blocks), period)]

        def run(fs):
            def group(v):
                for f in fs:
                    v = f(v)
                return v
            return group
        return dwa_chain_reference(x, [run(g) for g in groups], alphas, dilation, 1)
    history, y = [x], x
    for i, block in enumerate(blocks, start=1):
        out = block(y)
        history.append(out)
        y = dwa_average_reference(history, alphas[i], i, dilation).to(out.dtype) if i % period == 0 else out
    return y
