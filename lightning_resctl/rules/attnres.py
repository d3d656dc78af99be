"""``attnres`` (Full Attention Residuals) and ``attnres-block`` (Block AttnRes), Kimi Team 2603.15031, as chain
rules (docs/rules/attnres.md).

The depth pool (per token; :func:`attnres_pool_reference` is the oracle)::

    RMSNorm(v) = v / sqrt(mean(v^2) + eps)                  over C, no affine; all in fp32, also under autocast
    z_i   = (q * g) . RMSNorm(V_i)                          no 1/sqrt(C), no temperature
    alpha = softmax_i(z);   h = sum_i alpha_i V_i           the raw sources are mixed

Sources after merge k (t = k+1 updates, block size S; Full = S = 1): ``b_0 = x`` (the chain input), completed
blocks ``b_m = sum_{i=(m-1)S}^{mS-1} u_i``, and the partial block ``P = sum_{i=cS}^{t-1} u_i`` only when
``t mod S != 0`` (an empty partial is absent). Site k returns the pool of its sources with its own query
``w_k`` (= the query of sub-layer k+1; the last site's is the output query); in general, what sub-layer j
reads is pooled with site j-1's query.

Training path (:class:`AttnResRule`): the sources are kept as a tuple of the existing tensors (the updates
themselves, fp32 copies only for half-precision streams). A source's key logits depend only on the source and on
the (input-independent) queries, so they are computed once, when the source is complete, for every site that will
read it: ``Z_i = (V_i @ [q_j g_j]_{j >= first_i}^T) * rms_i`` (one matmul per source; site j takes column j).
Only the partial block (Block AttnRes) changes from merge to merge and gets its one logit per merge. Each merge
then stacks its m logits, takes the softmax and accumulates ``h = sum_i alpha_i V_i`` over the existing tensors —
autograd saves only views of the sources, the logits and the m weights per token, never an (m, C) stack per merge
(that would be O(K^2 C) memory for Full AttnRes). The weighted sum reads every source at every merge: Full
AttnRes costs O(K^2) passes over (..., C) by construction, its logits O(K) (docs/rules/attnres.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from ..runtime.autograd import autocast_off, fp32_matmul
from ._common import check_bool, check_eps, compute_dtype, rms_norm
from .base import ChainRule, check_int

__all__ = ["AttnResConfig", "BlockAttnResConfig", "AttnResRule", "BlockAttnResRule", "AttnResChain", "AttnResMerge",
           "AttnResState", "attnres_pool_reference", "attnres_sources_reference", "attnres_chain_reference",
           "default_block_size", "num_sources"]


# ---------------------------------------------------------------------------------------------- references
def attnres_pool_reference(sources: Tensor, query: Tensor, gain: Optional[Tensor] = None, eps: float = 1e-6
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
                            gains: Optional[Sequence[Tensor]] = None, block_size: int = 1, eps: float = 1e-6
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


# ---------------------------------------------------------------------------------------------- modules
class AttnResMerge(nn.Module):
    """Site ``index``'s parameters: ``pool_query`` (C,) = w, zeros (paper §5); ``key_norm_weight`` (C,) = g, ones
    (only with ``key_norm_affine``)."""

    def __init__(self, index: int, dim: int, key_norm_affine: bool = True):
        super().__init__()
        self.index, self.dim, self.key_norm_affine = int(index), int(dim), bool(key_norm_affine)
        self.pool_query = nn.Parameter(torch.empty(dim))
        if self.key_norm_affine:
            self.key_norm_weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.pool_query.zero_()
        if self.key_norm_affine:
            self.key_norm_weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.dim}, key_norm_affine={self.key_norm_affine}"


class AttnResChain(nn.Module):
    """One AttnRes chain: ``merges[k]`` (site k's query), the block size S (1 = Full AttnRes) and the key-norm eps."""

    def __init__(self, dim: int, num_merges: int, block_size: int = 1, key_norm_affine: bool = True,
                 eps: float = 1e-6):
        super().__init__()
        self.dim, self.num_merges, self.block_size = int(dim), int(num_merges), int(block_size)
        self.eps = float(eps)
        self.merges = nn.ModuleList(AttnResMerge(k, dim, key_norm_affine) for k in range(num_merges))

    def reset_parameters(self) -> None:
        for m in self.merges:
            m.reset_parameters()

    @property
    def max_sources(self) -> int:
        return max(num_sources(t, self.block_size) for t in range(1, self.num_merges + 1))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_merges={self.num_merges}, block_size={self.block_size}"


class AttnResState(NamedTuple):
    """Completed blocks (b_0 = x first) with their key logits, the partial block (None: empty), the number of
    update positions passed (``t`` = position of the last merge that ran + 1) and every site's query ``q * g``
    stacked ``(K, C)`` (computed once per forward).

    ``logits[i]``: block i's logits for the sites from the one where it was completed on, as a tuple of
    ``(..., 1)`` columns (``logits[i][j - first[i]]`` is site j's); ``first[i]`` that site."""

    blocks: tuple
    logits: tuple
    first: tuple
    partial: Optional[Tensor]
    t: int
    queries: Tensor

    def sources(self) -> list:
        return list(self.blocks) + ([] if self.partial is None else [self.partial])


def _rms(v: Tensor, eps: float) -> Tensor:
    return torch.rsqrt((v * v).mean(-1, keepdim=True) + eps)


def _site_queries(chain: AttnResChain, dtype: torch.dtype) -> Tensor:
    """Every site's ``q * g`` stacked ``(K, C)`` in ``dtype``."""
    q = torch.stack([m.pool_query for m in chain.merges]).to(dtype)
    if chain.merges[0].key_norm_affine:
        q = q * torch.stack([m.key_norm_weight for m in chain.merges]).to(dtype)
    return q


def _block_logits(chain: AttnResChain, v: Tensor, queries: Tensor, first: int) -> tuple:
    """Logits of a completed source ``v`` for sites ``first..K-1``: ``(v . w_j) * rms(v)`` as ``(..., 1)``
    columns (one matmul for all of them)."""
    z = fp32_matmul(v, queries[first:].mT) * _rms(v, chain.eps)
    return z.unsqueeze(-1).unbind(-2)


def _pool(chain: AttnResChain, j: int, state: AttnResState) -> tuple[Tensor, Tensor]:
    """Pool the state's sources with site j's query, over the existing tensors. Returns ``(h, alpha)`` in the
    compute dtype."""
    z = [cols[j - f] for cols, f in zip(state.logits, state.first)]
    srcs = state.blocks
    if state.partial is not None:
        p = state.partial
        z.append((p * state.queries[j]).sum(-1, keepdim=True) * _rms(p, chain.eps))
        srcs = srcs + (p,)
    alpha = torch.softmax(torch.cat(z, dim=-1), dim=-1)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (alpha, *srcs))):
        # nothing to differentiate (no_grad / inference_mode / frozen): the plain sum. Dynamo mis-traces a
        # setup_context-style Function's forward when no graph is recorded ("'Function' object is not subscriptable").
        return _depth_mix(alpha, srcs), alpha
    mix = _DepthMix if torch.compiler.is_compiling() else _DepthMixWithJvp  # dynamo does not trace a custom jvp
    return mix.apply(alpha, *srcs), alpha


def _depth_mix(alpha: Tensor, sources: Sequence[Tensor]) -> Tensor:
    """``h = sum_i alpha[..., i] V_i`` (the forward of :class:`_DepthMix`)."""
    h = sources[0] * alpha[..., 0:1]
    for i in range(1, len(sources)):
        h.addcmul_(sources[i], alpha[..., i:i + 1])
    return h


class _DepthMix(torch.autograd.Function):
    """``h = sum_i alpha[..., i] V_i`` over the existing source tensors, as one autograd node per merge.

    Saves ``alpha`` and the sources (no copy). Backward ``d_alpha_i = dh . V_i``, ``dV_i = alpha_i dh``: one read
    of each source and one write of its gradient, where autograd of the unrolled sum would write a temporary
    per source as well. Differentiable again (its backward is torch ops); vmap works; forward-mode AD: see
    :class:`_DepthMixWithJvp`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(alpha, *sources):
        return _depth_mix(alpha, sources)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        alpha, *sources = ctx.saved_tensors
        d_alpha = None
        with autocast_off(grad.device.type):  # vecdot in the sources' dtype (autocast would run it in bf16)
            if ctx.needs_input_grad[0]:
                d_alpha = torch.stack([torch.linalg.vecdot(grad, v) for v in sources], dim=-1)
        weights = alpha.unsqueeze(-1).unbind(-2)
        return (d_alpha, *(grad * a if need else None for a, need in zip(weights, ctx.needs_input_grad[1:])))


class _DepthMixWithJvp(_DepthMix):
    """:class:`_DepthMix` with forward-mode AD (eager only: dynamo does not trace a custom ``jvp``)."""

    @staticmethod
    def jvp(ctx, d_alpha, *d_sources):
        alpha, *sources = ctx.saved_tensors
        out = None
        for i, (v, dv) in enumerate(zip(sources, d_sources)):
            for a, t in ((alpha[..., i:i + 1], dv), (None if d_alpha is None else d_alpha[..., i:i + 1], v)):
                if a is not None and t is not None:
                    out = t * a if out is None else out.addcmul_(t, a)
        return out


def _advance(chain: AttnResChain, k: int, state: AttnResState, u: Optional[Tensor]) -> AttnResState:
    """Merge ``u`` (None: dropped) as merge k: close a partial block left over from an earlier block (merges that
    did not run in this forward), add u to the partial, close it at a block boundary. A block closed here is read
    from site k on: its logits are computed for sites k..K-1."""
    s = chain.block_size
    blocks, logits, first, p = state.blocks, state.logits, state.first, state.partial

    def close(p):
        return blocks + (p,), logits + (_block_logits(chain, p, state.queries, k),), first + (k,)

    if p is not None and (state.t - 1) // s != k // s:
        (blocks, logits, first), p = close(p), None
    if u is not None:
        p = u if p is None else p + u
    t = k + 1
    if p is not None and t % s == 0:
        (blocks, logits, first), p = close(p), None
    return AttnResState(blocks, logits, first, p, t, state.queries)


# ---------------------------------------------------------------------------------------------- rules
@dataclass
class AttnResConfig:
    """Options of ``attnres`` (Full AttnRes; docs/rules/attnres.md).

    key_norm_affine: give each site a key-norm weight g (ones) besides its query (False: none).
    eps: key RMSNorm epsilon (>= 0).
    """

    key_norm_affine: bool = True
    eps: float = 1e-6


@dataclass
class BlockAttnResConfig:
    """Options of ``attnres-block`` (docs/rules/attnres.md).

    block_size: S >= 1 merges per block (None: ``num_blocks`` or the default ``2 * max(1, floor(K/16 + 1/2))``).
    num_blocks: N >= 1 blocks, S = ceil(K / N) (exclusive with block_size).
    key_norm_affine, eps: as for ``attnres``.
    """

    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    key_norm_affine: bool = True
    eps: float = 1e-6


class AttnResRule(ChainRule):
    Config = AttnResConfig
    description = "Full Attention Residuals: each sub-layer reads a softmax-weighted mix of all earlier updates"
    identity_at_init = True  # pre-norm models, up to the norms' eps (docs/rules/attnres.md); Block AttnRes too
    chain_attr = "_resctl_attnres"

    def validate(self, config):
        check_bool("key_norm_affine", config.key_norm_affine)
        check_eps("eps", config.eps)

    def block_size(self, num_merges: int) -> int:
        return 1

    def summary(self):
        return "full"

    def build_chain(self, dim, num_merges):
        c = self.config
        return AttnResChain(dim, num_merges, self.block_size(num_merges), c.key_norm_affine, c.eps)

    # ---- runtime
    def start(self, chain, x):
        v = x.to(compute_dtype(x))
        queries = _site_queries(chain, v.dtype)
        return AttnResState((v,), (_block_logits(chain, v, queries, 0),), (0,), None, 0, queries)

    def _read(self, chain, state, next_k, dtype):
        h, _ = _pool(chain, next_k - 1, state)
        return state, h.to(dtype)

    def step(self, chain, k, state, u, next_k):
        state = _advance(chain, k, state, u.to(compute_dtype(u)))
        return self._read(chain, state, next_k, u.dtype)

    def skip(self, chain, k, state, next_k):
        """Ablation *(choice)*: the update is not added to any source (Full: no new source); block boundaries stay
        where they are."""
        dtype = state.blocks[0].dtype
        return self._read(chain, _advance(chain, k, state, None), next_k, dtype)

    def streams(self, chain, state):
        """The current sources stacked ``(..., m, C)`` (diagnostics only: a copy)."""
        return torch.stack(state.sources(), dim=-2) if isinstance(state, AttnResState) else state

    def weights(self, chain, k: int, state: AttnResState, u: Tensor) -> Tensor:
        """alpha ``(..., m)`` of site k: its query over the sources after merging ``u`` into ``state``."""
        _, alpha = _pool(chain, k, _advance(chain, k, state, u.to(compute_dtype(u))))
        return alpha

    # ---- diagnostics
    def make_stats(self, num_depths, model):
        from ._stats import AttnResStats

        sizes = [m.max_sources for m in model.modules() if isinstance(m, AttnResChain)]
        return AttnResStats(num_depths, max(sizes) if sizes else num_depths + 1)

    def observe(self, stats, depth, site, position, stream, update, state):
        if not isinstance(state, AttnResState):
            return
        d = site.dim
        u = update.detach()
        if d != -1 and d != u.dim() - 1:
            u = u.movedim(d, -1)
        u = u.reshape(state.blocks[0].shape)
        stats.update(depth, alpha=self.weights(site.chain_module, int(position), state, u))


class BlockAttnResRule(AttnResRule):
    Config = BlockAttnResConfig
    description = "Block Attention Residuals: sub-layers read a softmax-weighted mix of block sums of updates"
    chain_attr = "_resctl_attnres_block"

    def validate(self, config):
        super().validate(config)
        check_int("block_size", config.block_size, 1, allow_none=True)
        check_int("num_blocks", config.num_blocks, 1, allow_none=True)
        if config.block_size is not None and config.num_blocks is not None:
            raise ValueError(f"block_size and num_blocks are exclusive, got block_size={config.block_size!r} and "
                             f"num_blocks={config.num_blocks!r}")

    def block_size(self, num_merges):
        c = self.config
        if c.block_size is not None:
            return c.block_size
        if c.num_blocks is not None:
            return math.ceil(num_merges / c.num_blocks)
        return default_block_size(num_merges)

    def summary(self):
        c = self.config
        if c.block_size is not None:
            return f"block_size={c.block_size}"
        return f"num_blocks={c.num_blocks}" if c.num_blocks is not None else "block_size=default"
