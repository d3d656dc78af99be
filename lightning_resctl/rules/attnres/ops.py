"""The AttnRes training path: the depth pool over the existing source tensors (formula: :mod:`.reference`).

The sources are kept as a tuple of the existing tensors (the updates
themselves, fp32 copies only for half-precision streams). A source's key logits depend only on the source and on
the (input-independent) queries, so they are computed once, when the source is complete, for every site that will
read it: ``Z_i = (V_i @ [q_j g_j]_{j >= first_i}^T) * rms_i`` (one matmul per source; site j takes column j).
Only the partial block (Block AttnRes) changes from merge to merge and gets its one logit per merge. Each merge
then stacks its m logits, takes the softmax and accumulates ``h = sum_i alpha_i V_i`` over the existing tensors —
autograd saves only views of the sources, the logits and the m weights per token, never an (m, C) stack per merge
(that would be O(K^2 C) memory for Full AttnRes). The weighted sum reads every source at every merge: Full
AttnRes costs O(K^2) passes over (..., C) by construction, its logits O(K) (docs/rules/attnres.md).

In blocks compiled one by one, Block AttnRes (``attnres-block``) keeps a state of one structure at every merge instead
(:class:`BlockState`): its completed blocks stacked ``(..., m, C)``, so that the blocks share their graphs at any
depth (a growing tuple is a new graph per length; dynamo makes ``m`` a dynamic size). A block closes every S merges,
so m stays small (about 8 with the default S) and the stacks it leaves are few: the completed blocks' key logits are
taken per merge (one pass over m sources, as the weighted sum is), their rms once per block.

Every function takes the :class:`~.modules.AttnResChain` as ``chain`` (its sites' queries, block size and eps);
the modules sit over these ops, which do not import them.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ...runtime.autograd import autocast_off, fp32_matmul, refuse_second_derivative
from ...runtime.backends import resolve_backend
from ...runtime.triton import load_kernels
from ..common import check_rule_backend, compute_dtype

__all__ = ["AttnResState", "site_queries", "block_logits", "pool", "advance", "BlockState", "block_start",
           "block_advance", "block_pool", "TritonState", "uses_triton", "triton_start", "triton_step",
           "triton_to_sources"]


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


def site_queries(chain, dtype: torch.dtype) -> Tensor:
    """Every site's ``q * g`` stacked ``(K, C)`` in ``dtype``."""
    q = torch.stack([m.pool_query for m in chain.merges]).to(dtype)
    if chain.merges[0].key_norm_affine:
        q = q * torch.stack([m.key_norm_weight for m in chain.merges]).to(dtype)
    return q


def block_logits(chain, v: Tensor, queries: Tensor, first: int) -> tuple:
    """Logits of a completed source ``v`` for sites ``first..K-1``: ``(v . w_j) * rms(v)`` as ``(..., 1)``
    columns (one matmul for all of them)."""
    z = fp32_matmul(v, queries[first:].mT) * _rms(v, chain.eps)
    return z.unsqueeze(-1).unbind(-2)


def pool(chain, j: int, state: AttnResState) -> tuple[Tensor, Tensor]:
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


def advance(chain, k: int, state: AttnResState, u: Optional[Tensor]) -> AttnResState:
    """Merge ``u`` (None: dropped) as merge k: close a partial block left over from an earlier block (merges that
    did not run in this forward), add u to the partial, close it at a block boundary. A block closed here is read
    from site k on: its logits are computed for sites k..K-1."""
    s = chain.block_size
    blocks, logits, first, p = state.blocks, state.logits, state.first, state.partial

    def close(p):
        return blocks + (p,), logits + (block_logits(chain, p, state.queries, k),), first + (k,)

    if p is not None and (state.t - 1) // s != k // s:
        (blocks, logits, first), p = close(p), None
    if u is not None:
        p = u if p is None else p + u
    t = k + 1
    if p is not None and t % s == 0:
        (blocks, logits, first), p = close(p), None
    return AttnResState(blocks, logits, first, p, t, state.queries)


# ---------------------------------------------------------------------------------------------- Block AttnRes
class BlockState(NamedTuple):
    """Block AttnRes's state entering a merge, one structure at any depth: the completed blocks stacked
    ``(..., m, C)`` (b_0 = x first), their key rms ``(..., m)``, the partial block (zeros while empty: adding an
    update to it is exact) and whether it holds any update (``open``)."""

    blocks: Tensor
    rms: Tensor
    partial: Tensor
    open: bool

    def sources(self) -> list:
        return list(self.blocks.unbind(-2)) + ([self.partial] if self.open else [])


def block_start(chain, v: Tensor) -> BlockState:
    """The state entering the first merge: ``x`` (in the compute dtype) the only completed block."""
    return BlockState(v.unsqueeze(-2), _rms(v, chain.eps), torch.zeros_like(v), False)


def block_advance(chain, state: BlockState, u: Optional[Tensor], closes: bool) -> BlockState:
    """Add ``u`` (None: dropped) to the partial block; ``closes``: the partial is complete after this merge (a block
    boundary, or the next merge that runs is in a later block) and joins the stack. With an update the result's
    structure depends on ``closes`` only (the incoming ``open`` is not read: one graph for every such merge)."""
    p = state.partial if u is None else state.partial + u
    is_open = u is not None or state.open
    if not (closes and is_open):
        return BlockState(state.blocks, state.rms, p, is_open and not closes)
    # the empty partial as p - p (zeros, exact for finite p): a tensor with p's requires_grad, so that every merge
    # with an update sees a state of one structure (zeros_like would differ from an open partial in requires_grad)
    return BlockState(torch.cat([state.blocks, p.unsqueeze(-2)], -2), torch.cat([state.rms, _rms(p, chain.eps)], -1),
                      p - p, False)


def block_pool(state: BlockState, query: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Pool the state's sources with a site's ``query`` (``q * g``): ``(h, alpha)`` in the compute dtype. Autograd
    saves the stack (no copy), the partial and the m + 1 weights per token."""
    b = state.blocks
    z = (b * query).sum(-1) * state.rms
    p = state.partial
    if state.open:
        z = torch.cat([z, (p * query).sum(-1, keepdim=True) * _rms(p, eps)], -1)
    alpha = torch.softmax(z, dim=-1)
    m = b.shape[-2]
    h = (alpha[..., :m].unsqueeze(-1) * b).sum(-2)
    if state.open:
        h = h + alpha[..., m:] * p
    return h, alpha


# ---------------------------------------------------------------------------------------------- the Triton path
class TritonState(NamedTuple):
    """A chain's state on the Triton path (``kernels/attnres.py``): its sources in one buffer per forward (``bufs``:
    slot 0 x, slot j + 1 the partial block after merge j), the chain input ``x``, the last merge's ``carry`` (an
    output of one element the next merge takes as input: autograd then runs the merges' backwards in reverse order,
    each after every later reader of its sources) and ``t``, the merges run so far."""

    bufs: Any
    x: Tensor
    carry: Optional[Tensor]
    t: int

    def sources(self) -> list:
        """The sources entering merge ``t``: x, the completed blocks, the partial (views of the buffer)."""
        v, s = self.bufs.V, self.bufs.block
        shape = self.x.shape
        out = [self.x.to(v.dtype)] + [v[:, i * s].reshape(shape) for i in range(1, self.t // s + 1)]
        return out + ([v[:, self.t].reshape(shape)] if self.t % s else [])


def uses_triton(chain, x: Tensor) -> bool:
    """Whether a chain starting at ``x`` runs on the Triton kernels: its backend resolves to them for ``x`` (CUDA,
    Triton working), outside ``torch.compile`` (which traces the torch path), rows of at most the kernels' width,
    and no saved-tensor hooks (activation checkpointing, offloading: they decide what is kept), ``torch.func``
    transform or forward-mode AD active (the torch path supports them)."""
    if resolve_backend(check_rule_backend(chain.backend), x) != "triton":
        return False
    if torch.compiler.is_compiling() or not x.is_floating_point() or x.dim() == 0:
        return False
    if torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0:
        return False
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return False
    return 0 < x.shape[-1] <= load_kernels("attnres").ATTNRES_MAX_COLS


def triton_start(chain, x: Tensor) -> TritonState:
    """The state entering the first merge: the buffers of this forward (one allocation; merge 0 writes x)."""
    bufs = load_kernels("attnres").new_buffers(x, chain.num_merges, chain.block_size, compute_dtype(x))
    return TritonState(bufs, x, None, 0)


class _TritonMerge(torch.autograd.Function):
    """Merge k on the Triton kernels (one launch forward, two backward): ``(h, carry)`` from ``u`` and the site's
    query (and key-norm weight); merge 0 also takes x, the others the previous merge's carry. Saves the log-sum-exp
    per token (the sources are in the chain's buffer)."""

    @staticmethod
    def forward(ctx, u, query, gain, x, carry, cfg):
        bufs, k, eps = cfg
        ctx.set_materialize_grads(False)
        h, lse = load_kernels("attnres").merge_forward(x if x is not None else u, u, bufs, k, query, gain, eps)
        ctx.save_for_backward(lse, query, gain)
        ctx.cfg = cfg
        ctx.metas = ((u.shape, u.dtype), (x.shape, x.dtype) if x is not None else None)
        ctx.carried = carry is not None
        return h, lse.new_empty(())  # the carry (one element, the compute dtype: its gradient is made alike)

    @staticmethod
    def backward(ctx, grad_h, _grad_carry):
        refuse_second_derivative("attnres (Triton kernels)", "backend='torch'")
        lse, query, gain = ctx.saved_tensors
        bufs, k, eps = ctx.cfg
        u_meta, x_meta = ctx.metas
        du, dx, dq, dg = load_kernels("attnres").merge_backward(bufs, k, grad_h, lse, query, gain, eps, u_meta,
                                                                x_meta)
        carry = lse.new_empty(()) if ctx.carried else None  # (read by nothing: the order is what it carries)
        return du, dq, dg, dx, carry, None


def triton_step(chain, k: int, state: TritonState, u: Tensor) -> tuple[TritonState, Tensor]:
    """Merge ``u`` as merge ``k`` (the next in order) and pool the sources with site k's query: ``(state, h)``, h in
    u's dtype."""
    site = chain.merges[k]
    gain = site.key_norm_weight if site.key_norm_affine else None
    h, carry = _TritonMerge.apply(u, site.pool_query, gain, state.x if k == 0 else None, state.carry,
                                  (state.bufs, k, chain.eps))
    return TritonState(state.bufs, state.x, carry, k + 1), h


def triton_to_sources(chain, state: TritonState) -> AttnResState:
    """The same sources as the torch path's state (views of the buffer), for a forward that leaves the merges'
    order (a merge skipped or not run): gradients do not flow through the views, so only without grad mode."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "attnres on the Triton kernels: a merge ran out of order or was skipped (an ablation, a merge that does "
            "not run in this mode) while gradients are recorded; the kernels keep the sources for the backward in "
            "merge order. Use backend='torch' for this model, or run such forwards under torch.no_grad()")
    queries = site_queries(chain, state.bufs.V.dtype)
    s, t = chain.block_size, state.t
    *blocks, partial = state.sources() if t % s else (*state.sources(), None)
    first = tuple(0 if i == 0 else i * s - 1 for i in range(len(blocks)))  # block i closed at merge i S - 1
    logits = tuple(block_logits(chain, b, queries, f) for b, f in zip(blocks, first))
    return AttnResState(tuple(blocks), logits, first, partial, t, queries)
