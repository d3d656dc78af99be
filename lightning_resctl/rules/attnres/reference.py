"""The formulas of ``attnres`` (Full Attention Residuals) and ``attnres-block`` (Block AttnRes), Kimi Team
2603.15031 (docs/rules/attnres.md), and their torch oracles.

The depth pool (per token; :func:`attnres_pool_reference` is the oracle)::

    RMSNorm(v) = v / sqrt(mean(v^2) + eps)                  over C, no affine; all in fp32, also under autocast
    z_i   = (q * g) . RMSNorm(V_i)                          no 1/sqrt(C), no temperature
    alpha = softmax_i(z);   h = sum_i alpha_i V_i           the raw sources are mixed

Sources after merge k (t = k+1 updates, block size S; Full = S = 1): ``b_0 = x`` (the chain input), completed
blocks ``b_m = sum_{i=(m-1)S}^{mS-1} u_i``, and the partial block ``P = sum_{i=cS}^{t-1} u_i`` only when
``t mod S != 0`` (an empty partial is absent). Site k returns the pool of its sources with its own query
``w_k`` (= the query of sub-layer k+1; the last site's is the output query); in general, what sub-layer j
reads is pooled with site j-1's query.

The training path (:mod:`.ops`) computes the same pool without stacking the sources; this module is its oracle.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ...runtime.autograd import fp32_matmul
from ..common import RMS_EPS, compute_dtype, rms_norm

__all__ = ["attnres_pool_reference", "attnres_sources_reference", "attnres_chain_reference", "default_block_size",
           "num_sources"]


def attnres_pool_reference(sources: Tensor, query: Tensor, gain: Optional[Tensor] = None, eps: float = RMS_EPS
                           ) -> tuple[Tensor, Tensor]:
    """The depth pool (formula in the module docstring). ``sources`` (..., m, C), ``query``/``gain`` (C,).
    Returns ``(h (..., C) in the sources' dtype, alpha (..., m) fp32/fp64)``."""
    cd = compute_dtype(sources)
    w = query.to(cd) if gain is None else query.to(cd) * gain.to(cd)
    alpha = torch.softmax(fp32_matmul(rms_norm(sources, eps), w), dim=-1)
    h = (alpha.unsqueeze(-1) * sources.to(cd)).sum(-2)
    return h.to(sources.dtype), alpha


def attnres_sources_reference(x: Tensor, updates: Sequence[Tensor], block_size: int) -> list[Tensor]:
    """The sources after ``t = len(updates)`` updates, straight from Eq. 5-6: ``[b_0 = x, b_1 .. b_c]`` plus the
    partial block when ``t mod S != 0``."""
    s, t = block_size, len(updates)
    c = t // s
    out = [x] + [sum(updates[(m - 1) * s:m * s]) for m in range(1, c + 1)]
    if t % s:
        out.append(sum(updates[c * s:t]))
    return out


def attnres_chain_reference(x: Tensor, branches: Sequence, queries: Sequence[Tensor],
                            gains: Optional[Sequence[Tensor]] = None, block_size: int = 1, eps: float = RMS_EPS
                            ) -> tuple[Tensor, list[Tensor]]:
    """A whole AttnRes chain (the oracle): sub-layer 0 reads x; after merge k the sources are recomputed from
    scratch and pooled with ``queries[k]``. Returns ``(output, [h_0, ..., h_{K-1}])``."""
    updates, hs, h = [], [], x
    for k, f in enumerate(branches):
        hs.append(h)
        updates.append(f(h))
        src = torch.stack(attnres_sources_reference(x, updates, block_size), dim=-2)
        h, _ = attnres_pool_reference(src, queries[k], None if gains is None else gains[k], eps)
    return h, hs


def default_block_size(num_merges: int) -> int:
    """``S = 2 * max(1, floor(K/16 + 1/2))`` (K = 54 -> 6, K = 32 -> 4; even, so attention + MLP share a block)."""
    return 2 * max(1, math.floor(num_merges / 16 + 0.5))


def num_sources(t: int, block_size: int) -> int:
    """Sources after ``t`` updates: ``1 + floor(t/S) + (t mod S != 0)``."""
    return 1 + t // block_size + (1 if t % block_size else 0)
