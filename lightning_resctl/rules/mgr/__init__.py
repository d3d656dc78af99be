"""Multi-Gate Residuals (MGR): n gated streams per token instead of one residual stream.

The math (AttnPool read, independent / competitive gates, the per-stream lerp, the depth-aware
gate-bias init) is stated once, in :mod:`.reference`, the oracle every other path
is tested against.

A chain of ``num_merges`` merges starts with one stream (the chain input x); the first n-1 merges
*accumulate* (append their branch output as a new stream, no gate); merges n-1.. are gated. The chain
ends with an output AttnPool whose result has the shape of x. Gate math always runs in fp32.

Hand-written model (one chain over all sub-layers of a transformer)::

    chain = MGRChain(dim=C, num_merges=2 * n_layer, streams=4)
    run = chain.begin(x)                          # x: (B, T, C)
    for blk in blocks:
        run.write(blk.attn(blk.ln1(run.read())))   # read(): pooled input of the current merge
        run.write(blk.mlp(blk.ln2(run.read())))    # write(u): merge u into the streams
    y = run.end()                                 # output pool, shape of x

The same chain is driven one merge at a time by :mod:`lightning_resctl.surgery` through
``streams, h = chain.start(x)`` and ``streams, h = chain.step(k, streams, u)``.

Backends: ``"torch"`` (fused torch ops, closed-form backward), ``"triton"`` (one fused kernel per merge:
gates + lerp + the next merge's pool, and a fused backward; ``torch.library`` ops), ``"reference"``
(plain torch ops differentiated by autograd — the oracle), ``"auto"`` (triton on CUDA, torch otherwise).
The torch and Triton paths have a closed-form backward: double backward, forward-mode AD and the ``torch.func``
transforms (``vmap``, ``grad``, ...) raise a RuntimeError naming ``"reference"``, which supports them. All
gate and pool math runs in fp32 also under ``torch.autocast`` (the branches keep autocast).

Fallback inversion (``invert``): the backward recomputes each merge's input streams from its output,
``s_i = (s'_i - beta_i u) / (1 - beta_i)``, instead of saving them (merge l+1's backward hands its
reconstructed input to merge l as that merge's output). Rows (token, stream) that need saving exactly (beta
above ``invert_threshold``, or the error gain ``prod 1/(1 - beta)`` accumulated since the row's last exact save
past ``invert_max_gain``: our addition, it bounds the error growth over deep chains) are saved within a budget of
``ceil(invert_top_p * rows)`` per merge, fixed before the step (static shapes; past it a row is rebuilt:
:mod:`.inversion`). ``invert="auto"`` enables it for fp32/fp64 streams, eager and, for a patched model, under
``torch.compile`` (the rule's state then carries the rebuilt streams through autograd: :class:`~.ops.MGRState`);
it is off for half-precision streams (the inversion of a rounded bf16/fp16 output is not accurate) and under
activation checkpointing. Saved for backward per gated merge and token: about (n+1)·C values without inversion
(input streams and u), about (1 + top_p·n)·C with it (u and the exact rows), plus a few fp32 numbers per
stream. In eager code a merge's output is only dropped when the next step receives that very tensor unchanged;
otherwise it is kept (as if saved), so any driving order stays correct.

One home (the same shape as every rule): :mod:`.config` (options, defaults, checks), :mod:`.reference` (the oracle
and the init formulas), :mod:`.ops` (the fused step: torch path, Triton dispatch, autograd Function),
:mod:`.inversion` (fallback-inversion runtime), :mod:`.modules` (MGRPool, MGRMerge, MGRChain, MGRRun),
:mod:`.stats` (diagnostics), :mod:`.rule` (the registered rules ``mgr``, ``mgr-competitive``, ``mgr-independent``).
Kernels: ``lightning_resctl.kernels.mgr``.
"""
from __future__ import annotations

from ..common import BACKENDS
from .config import GATINGS, MGRConfig
from .modules import MGRChain, MGRMerge, MGRPool, MGRRun
from .reference import (
                        B_BASE,
                        L_BASE,
                        MGRInit,
                        attn_pool_reference,
                        mgr_bias_init,
                        mgr_gates_reference,
                        mgr_merge_reference,
                        mgr_step_reference,
)
from .rule import MGRRule

__all__ = [
    "MGRConfig", "MGRRule", "MGRChain", "MGRMerge", "MGRPool", "MGRRun", "MGRInit", "mgr_bias_init",
    "attn_pool_reference", "mgr_gates_reference", "mgr_merge_reference", "mgr_step_reference",
    "BACKENDS", "GATINGS", "L_BASE", "B_BASE",
]
