"""AttnRes / Block AttnRes on the fused Triton kernels (TRITON_INTERPRET=1 on CPU), against the oracle.

Whole chains through the rule's API (what a patched model's sites call): forward outputs and every gradient (x, the
branches' inputs through u, the queries and key-norm weights) against ``attnres_chain_reference`` in fp64, and
against the torch path in fp32 / with bf16 branch outputs; rows near 1e20; every buffer the backward reads written
(``torch.empty`` poisoned); what falls back to the torch path and what is refused.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_resctl.rules import make_rule
from lightning_resctl.rules.attnres import attnres_chain_reference
from lightning_resctl.rules.attnres.ops import TritonState, uses_triton


def build(method, backend, c=37, merges=7, block=2, dtype=torch.float64, seed=1, affine=True):
    opts = {"backend": backend, "key_norm_affine": affine}
    if method == "attnres-block":
        opts["block_size"] = block
    rule = make_rule(method, opts)
    chain = rule.build_chain(c, merges).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return rule, chain


def branches(c, merges, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, c, generator=g, dtype=torch.float64).to(dtype) / math.sqrt(c) for _ in range(merges)]


def run_rule(rule, chain, x, ws, update_dtype=None):
    """The chain driven as a patched model's sites drive it: ``(output, state types)``."""
    state, h, kinds = rule.start(chain, x), x, []
    for k, w in enumerate(ws):
        u = torch.tanh(h.to(w.dtype) @ w)
        if update_dtype is not None:
            u = u.to(update_dtype)
        kinds.append(type(state).__name__)
        state, h = rule.step(chain, k, state, u, k + 1)
    return h, kinds


def loss_of(y):
    return (y.double() * torch.cos(torch.arange(y.numel(), dtype=torch.float64)).reshape(y.shape)).sum()


def grads(fn, x0, chain):
    chain.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_(True)
    y = fn(x)
    loss_of(y).backward()
    return [y.detach().double(), x.grad.double()] + [p.grad.double() for p in chain.parameters()]


def oracle(chain, block, ws):
    def fn(x):
        fs = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
        queries = [m.pool_query for m in chain.merges]
        gains = [m.key_norm_weight for m in chain.merges] if chain.merges[0].key_norm_affine else None
        y, _ = attnres_chain_reference(x, fs, queries, gains, block, chain.eps)
        return y
    return fn


def close(got, want, tol):
    scale = max(w.abs().max() for w in want)  # a parameter's gradient is a sum over tokens that cancels
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("method, block", [("attnres", 1), ("attnres-block", 2), ("attnres-block", 3)])
def test_chain_matches_the_oracle_in_fp64(method, block):
    """Forward and every gradient equal the oracle's (fp64, C = 37, tokens (2, 3), 5 merges: Block AttnRes ends
    inside a block with S = 2 and 3)."""
    c, merges = 37, 5
    rule, chain = build(method, "triton", c, merges, block)
    ws = branches(c, merges, torch.float64)
    x0 = torch.randn(2, 3, c, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = grads(lambda x: run_rule(rule, chain, x, ws)[0], x0, chain)
    assert set(run_rule(rule, chain, x0, ws)[1]) == {"NoneType", "TritonState"} - {"NoneType"}
    want = grads(oracle(chain, block, ws), x0, chain)
    close(got, want, 1e-11)


def test_chain_without_key_norm_weight():
    c, merges = 20, 5
    rule, chain = build("attnres-block", "triton", c, merges, 2, affine=False)
    ws = branches(c, merges, torch.float64)
    x0 = torch.randn(4, c, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    close(grads(lambda x: run_rule(rule, chain, x, ws)[0], x0, chain),
          grads(oracle(chain, 2, ws), x0, chain), 1e-11)


@pytest.mark.parametrize("method", ["attnres", "attnres-block"])
def test_fp32_matches_the_torch_path(method):
    """fp32: the kernels' results are the torch path's within fp32 rounding."""
    c, merges = 41, 4
    ws = branches(c, merges, torch.float32)
    x0 = torch.randn(2, 3, c, generator=torch.Generator().manual_seed(5))
    results = []
    for backend in ("triton", "torch"):
        rule, chain = build(method, backend, c, merges, 2, torch.float32)
        results.append(grads(lambda x: run_rule(rule, chain, x, ws)[0], x0, chain))
    close(*results, 2e-5)


@pytest.mark.parametrize("method", ["attnres", "attnres-block"])
def test_bf16_update_beside_fp32_sources(method):
    """A bf16 branch output beside fp32 sources (as under autocast): one merge in the middle of a chain reads it as
    it is (no cast kernel) and returns h and du in bf16, the torch path's within bf16 rounding; the sources it
    writes are exact (the bf16 values in fp32)."""
    c, merges, k = 41, 5, 3
    ws = branches(c, merges, torch.float32)
    x = torch.randn(2, 3, c, generator=torch.Generator().manual_seed(5))
    u16 = torch.randn(2, 3, c, generator=torch.Generator().manual_seed(6)).bfloat16()
    seen = []
    for backend in ("triton", "torch"):
        rule, chain = build(method, backend, c, merges, 2, torch.float32)
        state, h = rule.start(chain, x), x
        for j in range(k):
            state, h = rule.step(chain, j, state, torch.tanh(h @ ws[j]), j + 1)
        u = u16.clone().requires_grad_(True)
        state, h = rule.step(chain, k, state, u, k + 1)
        assert h.dtype == torch.bfloat16
        (h.float() * torch.cos(torch.arange(h.numel())).reshape(h.shape)).sum().backward()
        seen.append((h.float(), u.grad))
    (h_t, du_t), (h_r, du_r) = seen
    assert du_t.dtype == torch.bfloat16
    torch.testing.assert_close(h_t, h_r, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(du_t.float(), du_r.float(), rtol=2e-2, atol=2e-2)


def test_rows_near_1e20_match_the_oracle():
    """The sources' sums of squares are taken of V / k for rows of magnitude >= 2^32: rows near 1e20 in fp32 pool
    as the fp64 oracle does (fp32 squares would overflow)."""
    c, merges = 33, 4
    rule, chain = build("attnres-block", "triton", c, merges, 2, torch.float32)
    ws = branches(c, merges, torch.float32)
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 4, c, generator=g)
    x0[0] *= 1e20
    got = grads(lambda x: run_rule(rule, chain, x, ws)[0], x0, chain)
    chain64 = chain.double()
    want = grads(oracle(chain64, 2, [w.double() for w in ws]), x0.double(), chain64)
    assert all(torch.isfinite(t).all() for t in got)
    for a, b in zip(got, want):  # relative to each token's (row's) scale
        err = (a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30) if a.dim() > 1 else \
            (a - b).abs().max() / b.abs().max().clamp_min(1e-30)
        assert (err < 1e-4).all(), err


def test_every_buffer_the_backward_reads_is_written(monkeypatch):
    """The gradient buffers are ``torch.empty``: the first backward writes them and a partial gets its first
    gradient from its block's next merge. With every fresh buffer poisoned with NaN the results are the oracle's."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    c, merges = 21, 5
    rule, chain = build("attnres-block", "triton", c, merges, 3)
    ws = branches(c, merges, torch.float64)
    x0 = torch.randn(5, c, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = grads(oracle(chain, 3, ws), x0, chain)
    monkeypatch.setattr(torch, "empty", poisoned)
    got = grads(lambda x: run_rule(rule, chain, x, ws)[0], x0, chain)
    close(got, want, 1e-11)


def test_out_of_order_merges_continue_on_the_torch_path_without_grad():
    """An ablation (a merge skipped) leaves the kernels' merge order: without grad mode the chain continues on the
    torch path over the same sources (equal to the torch path's forward); with grad mode it is refused, naming
    backend='torch'."""
    c, merges = 24, 6
    ws = branches(c, merges, torch.float64)
    x = torch.randn(3, c, generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    def ablated(rule, chain):
        state, h = rule.start(chain, x), x
        for k, w in enumerate(ws):
            u = torch.tanh(h @ w)
            state, h = rule.skip(chain, k, state, k + 1) if k == 2 else rule.step(chain, k, state, u, k + 1)
        return h

    outs = []
    for backend in ("triton", "torch"):
        rule, chain = build("attnres-block", backend, c, merges, 2)
        with torch.no_grad():
            outs.append(ablated(rule, chain))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    rule, chain = build("attnres-block", "triton", c, merges, 2)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        ablated(rule, chain)


def test_what_takes_the_torch_path():
    """Activation checkpointing's saved-tensor hooks, forward-mode AD and backend='torch' take the torch path; wider
    rows than the kernels hold too."""
    rule, chain = build("attnres", "triton", 16, 3)
    x = torch.randn(2, 16, dtype=torch.float64)
    assert uses_triton(chain, x) and isinstance(rule.start(chain, x), TritonState)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not uses_triton(chain, x)
    with torch.autograd.forward_ad.dual_level():
        assert not uses_triton(chain, x)
    _, torch_chain = build("attnres", "torch", 16, 3)
    assert not uses_triton(torch_chain, x)
    from lightning_resctl.runtime.triton import load_kernels

    wide = load_kernels("attnres").ATTNRES_MAX_COLS + 1
    _, wide_chain = build("attnres", "triton", wide, 2, dtype=torch.float32)
    assert not uses_triton(wide_chain, torch.randn(1, wide))


def test_diagnostics_read_the_kernels_state():
    """The rule's weights (what the callbacks' stats read) and streams from the kernels' state are the torch
    path's."""
    c, merges = 12, 4
    ws = branches(c, merges, torch.float64)
    x = torch.randn(3, c, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    seen = []
    for backend in ("triton", "torch"):
        rule, chain = build("attnres-block", backend, c, merges, 2)
        state, h, out = rule.start(chain, x), x, []
        with torch.no_grad():
            for k, w in enumerate(ws):
                u = torch.tanh(h @ w)
                out.append(rule.weights(chain, k, state, u))
                state, h = rule.step(chain, k, state, u, k + 1)
            out.append(rule.streams(chain, state))
        seen.append(out)
    for a, b in zip(*seen):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["attnres", "attnres-block"])
def test_a_pipeline_boundary_takes_the_triton_state_as_the_torch_paths_sources_without_grad_only(method):
    """A pipeline stage boundary (``stage_state``) after merges on the kernels: without grad mode the same tensors
    the torch path's state packs (the sources as they are); while gradients are recorded a clear refusal naming
    ``backend='torch'`` (the kernels keep the sources for the backward in one buffer of this stage)."""
    c, merges = 37, 3
    triton_rule, chain = build(method, "triton", c, merges, dtype=torch.float32)
    torch_rule = make_rule(method, {"backend": "torch", "key_norm_affine": True,
                                    **({"block_size": 2} if method == "attnres-block" else {})})
    ws = branches(c, merges, torch.float32)
    x = torch.randn(2, 3, c)

    def state_after(rule, k_stop):
        state, h = rule.start(chain, x), x
        for k in range(k_stop):
            state, h = rule.step(chain, k, state, torch.tanh(h @ ws[k]), k + 1)
        return state

    with torch.no_grad():
        state = state_after(triton_rule, 2)
        assert isinstance(state, TritonState)
        got = triton_rule.stage_state(chain, state)
        want = torch_rule.stage_state(chain, state_after(torch_rule, 2))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    state = state_after(triton_rule, 2)
    with pytest.raises(RuntimeError, match=r"pipeline stage while gradients are recorded.*backend='torch'"):
        triton_rule.stage_state(chain, state)
