"""One merge of each rule on the path ``backend="auto"`` picks for a CUDA tensor (the Triton kernels), driven as a
patched model drives it, for :mod:`benchmarks.launch_count` and ``tests/test_launch_counts.py``.

Each case returns ``(forward, backward)`` :class:`~benchmarks.launch_count.Counts` of one merge in the middle of a
chain (not the first, not the last): small shapes (the counts do not depend on them), Triton's interpreter on CPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from benchmarks.launch_count import Counts, count_backward, count_forward, count_merge

__all__ = ["CASES", "rescontroller_case", "mgr_case", "attnres_case"]

TOKENS, C = (2, 3), 40


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def rescontroller_case(stream_dtype=torch.float32, update_dtype=torch.float32) -> tuple[Counts, Counts]:
    """One ResController merge (the module a patched model calls) on its Triton path."""
    from lightning_resctl.rules.rescontroller import ResController

    merge = ResController(backend="triton")
    r = _rand(*TOKENS, C, dtype=stream_dtype).requires_grad_()
    u = _rand(*TOKENS, C, dtype=update_dtype, seed=1).requires_grad_()
    return count_merge(lambda: merge(r, u), (r, u))


def mgr_case(gating="competitive", stream_dtype=torch.float32, update_dtype=None, n=4,
             accumulating=False) -> tuple[Counts, Counts]:
    """One MGR step (the merge and the next merge's pool) in a chain of n + 2 merges on its Triton path, with the
    chain's defaults (fp32 streams: the fallback inversion); ``update_dtype`` bf16 with fp32 streams: a branch
    under autocast. The counted merge: merge n - 2 (the last accumulating one) or n (gated, not the last)."""
    from lightning_resctl.rules.mgr import MGRChain

    merges = n + 2
    chain = MGRChain(C, merges, streams=n, gating=gating, backend="triton").to(stream_dtype)
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(_rand(*p.shape, seed=p.numel()).to(p.dtype))
    x = _rand(*TOKENS, C, dtype=stream_dtype).requires_grad_()
    weights = [torch.nn.Parameter(_rand(C, seed=10 + k).to(stream_dtype)) for k in range(merges)]
    counted = n - 2 if accumulating else n
    streams, h = chain.start(x)
    fwd = bwd_inputs = bwd_outputs = None
    for k in range(merges):
        u = torch.tanh(h) * weights[k]
        if update_dtype is not None:
            u = u.to(update_dtype)
        if k == counted:
            s_in = streams
            fwd, (streams, h) = count_forward(lambda s=streams, u=u, k=k: chain.step(k, s, u))
            bwd_inputs, bwd_outputs = (s_in, u), (streams, h)
        else:
            streams, h = chain.step(k, streams, u)
    loss = (h.float() * _rand(*h.shape, seed=99)).sum()
    bwd = count_backward(bwd_outputs, bwd_inputs, loss.backward)
    return fwd, bwd


def attnres_case(method="attnres", stream_dtype=torch.float32, update_dtype=None) -> tuple[Counts, Counts]:
    """One AttnRes merge (the rule's step, as a patched model's site runs it) in a chain of 6 merges, on the Triton
    path; the counted merge: merge 4 (for Block AttnRes with block size 2: the first merge of a block)."""
    from lightning_resctl.rules import make_rule

    rule = make_rule(method, {"backend": "triton", **({"block_size": 2} if method == "attnres-block" else {})})
    merges = 6
    chain = rule.build_chain(C, merges).to(stream_dtype)
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(_rand(*p.shape, seed=p.numel()).to(p.dtype) * 0.5)
    x = _rand(*TOKENS, C, dtype=stream_dtype).requires_grad_()
    weights = [torch.nn.Parameter(_rand(C, seed=10 + k).to(stream_dtype)) for k in range(merges)]
    state = rule.start(chain, x)
    h = x
    fwd = bwd_inputs = bwd_outputs = None
    for k in range(merges):
        u = torch.tanh(h) * weights[k]
        if update_dtype is not None:
            u = u.to(update_dtype)
        if k == 4:
            state_in = state
            fwd, (state, h) = count_forward(lambda s=state, u=u, k=k: rule.step(chain, k, s, u, k + 1))
            bwd_inputs, bwd_outputs = (state_in, u), (h,)
        else:
            state, h = rule.step(chain, k, state, u, k + 1)
    loss = (h.float() * _rand(*h.shape, seed=99)).sum()
    bwd = count_backward(bwd_outputs, bwd_inputs, loss.backward)
    return fwd, bwd


#: name -> a function returning (forward, backward) counts
CASES: dict[str, Callable[[], tuple[Counts, Counts]]] = {
    "rescontroller fp32": lambda: rescontroller_case(),
    "rescontroller fp32 stream, bf16 update": lambda: rescontroller_case(update_dtype=torch.bfloat16),
    "rescontroller bf16": lambda: rescontroller_case(torch.bfloat16, torch.bfloat16),
    "mgr n=4 competitive fp32 (inverted)": lambda: mgr_case("competitive"),
    "mgr n=4 independent fp32 (inverted)": lambda: mgr_case("independent"),
    "mgr n=4 competitive fp32, bf16 update": lambda: mgr_case("competitive", update_dtype=torch.bfloat16),
    "mgr n=4 competitive bf16": lambda: mgr_case("competitive", torch.bfloat16),
    "mgr n=4 independent bf16": lambda: mgr_case("independent", torch.bfloat16),
    "mgr n=4 accumulating fp32": lambda: mgr_case("competitive", accumulating=True),
    "attnres fp32": lambda: attnres_case("attnres"),
    "attnres fp32 stream, bf16 update": lambda: attnres_case("attnres", update_dtype=torch.bfloat16),
    "attnres-block fp32": lambda: attnres_case("attnres-block"),
    "attnres-block fp32 stream, bf16 update": lambda: attnres_case("attnres-block", update_dtype=torch.bfloat16),
}
