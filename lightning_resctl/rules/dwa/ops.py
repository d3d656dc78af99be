"""The DWA training path: the chain state and the depth-weighted average over the existing block outputs (formula:
:mod:`.reference`).

The history is a tuple of the block outputs themselves (``X_j``, in the stream's dtype; None where no later average
reads it), never a stacked copy: an average reads its sources where they are, accumulates ``sum_m alpha_m X_m`` in
fp32 (fp64 stays fp64) and is one autograd node that saves views of its sources and the weights
(:class:`_DepthAverage`) — the history costs O(d) saved tensors over a chain of d blocks, where stacking it at
every block (``torch.stack`` then ``tensordot``) would save O(d^2). DenseFormer's package writes the outputs into a
preallocated buffer in place for the same reason; the tuple needs no in-place write (which activation
checkpointing and ``torch.compile`` would have to see through). The averages themselves are O(d^2) multiply-adds
over (..., C) for the 1 x 1 DenseFormer by construction (k and p thin them).

Every function takes the :class:`~.modules.DWAChain` as ``chain`` (its blocks, dilation and weights); the modules sit
over these ops, which do not import them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..common import compute_dtype
from .reference import dwa_sources

__all__ = ["DWAState", "dwa_start", "dwa_advance", "depth_average", "check_unwritten"]


class DWAState(NamedTuple):
    """The chain state between merges: the stream inside the current block (the last average ``Y``, plus this
    block's updates so far), the history ``(X_0, .., X_b)`` of the b blocks completed (None where no later average
    reads the output) and, in eager code, each kept output's version counter when it was recorded (the model holds
    some of them: :func:`check_unwritten`)."""

    stream: Tensor
    history: tuple
    versions: tuple = ()


def _version(t: Optional[Tensor]) -> int:
    """``t``'s version counter; -1 where there is none to read (None, a compiled graph, an inference tensor)."""
    return -1 if t is None or torch.compiler.is_compiling() or t.is_inference() else t._version


def check_unwritten(history: tuple, versions: tuple, sources: Sequence[int]) -> None:
    """Raise when the model wrote in place into a recorded block output an average is about to read (a stream
    written in place, ``x += f(x)``, after a block whose output DWA keeps: the chain input, or a block no average
    follows): the average would read the new values. Eager code only (a compiled graph has no version counters)."""
    if not versions or torch.compiler.is_compiling():
        return
    for j in sources:
        if versions[j] != -1 and history[j]._version != versions[j]:  # (-1: recorded in a compiled graph)
            raise RuntimeError(
                f"method='dwa': the model wrote in place into the output of block {j} "
                f"({'the chain input' if j == 0 else 'a block without an average after it'}) after DWA recorded it, "
                "and a later average reads it: write that residual addition out of place (x = x + f(x), not "
                "x += f(x)); DWA keeps the block outputs, not copies")


def dwa_start(chain, x: Tensor) -> DWAState:
    """The state entering the first merge: ``X_0 = x``, the chain input."""
    kept = x if 0 in chain.kept else None
    return DWAState(x, (kept,), () if torch.compiler.is_compiling() or x.is_inference() else (_version(kept),))


def dwa_advance(chain, k: int, next_k: int, state: DWAState, u: Optional[Tensor]) -> DWAState:
    """Merge ``u`` (None: dropped) as merge ``k``, the next merge that runs being ``next_k``: the update is added as
    the plain residual adds it; a block ending at a merge in ``k .. next_k - 1`` records its output (a block whose
    merges all did not run outputs its input) and, where an average follows it, the stream becomes that average."""
    h = state.stream if u is None else state.stream + u
    history, versions = state.history, state.versions
    for i in chain.blocks_ending(k, next_k):
        kept = h if i in chain.kept else None
        history = history + (kept,)
        versions = versions + (_version(kept),) if versions else versions
        weights = chain.weights(i)
        if weights is not None:
            sources = dwa_sources(i, chain.dilation)
            check_unwritten(history, versions, sources)
            h = depth_average(weights, [history[j] for j in sources])
    return DWAState(h, history, versions)


def depth_average(alpha: Tensor, sources: Sequence[Tensor]) -> Tensor:
    """``sum_m alpha[m] sources[m]``, accumulated in fp32 (fp64 stays fp64), returned in the sources' dtype."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (alpha, *sources))):
        # nothing to differentiate (no_grad / inference_mode / frozen): the plain sum (dynamo mis-traces a
        # setup_context-style Function's forward when no graph is recorded)
        return _average(alpha, sources)
    return _DepthAverage.apply(alpha, *sources)


def _average(alpha: Tensor, sources: Sequence[Tensor]) -> Tensor:
    cd = compute_dtype(alpha, *sources)
    a = alpha.to(cd)
    acc = sources[0].to(cd) * a[0]
    for m in range(1, len(sources)):
        acc.addcmul_(sources[m].to(cd), a[m])
    return acc.to(sources[0].dtype)


class _DepthAverage(torch.autograd.Function):
    """``Y = sum_m alpha[m] X_m`` over the existing source tensors, one autograd node per average.

    Saves ``alpha`` and the sources (no copy, whatever their dtype: a half-precision source is converted to fp32
    inside the forward and the backward only). Backward, in fp32: ``d_alpha[m] = sum(dY * X_m)``,
    ``dX_m = alpha[m] dY``. Differentiable again (its backward is torch ops); vmap works."""

    generate_vmap_rule = True

    @staticmethod
    def forward(alpha, *sources):
        return _average(alpha, sources)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        alpha, *sources = ctx.saved_tensors
        cd = compute_dtype(alpha, *sources)
        g = grad.to(cd)
        d_alpha = None
        if ctx.needs_input_grad[0]:
            d_alpha = torch.stack([(g * s.to(cd)).sum() for s in sources]).to(alpha.dtype)
        a = alpha.to(cd)
        return (d_alpha, *((g * a[m]).to(s.dtype) if need else None
                           for m, (s, need) in enumerate(zip(sources, ctx.needs_input_grad[1:]))))
