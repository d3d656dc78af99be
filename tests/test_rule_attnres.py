"""attnres / attnres-block: the reference cases of the AttnRes spec (fp64), the runtime against the oracle, the
memory behaviour of Full AttnRes, identity at init on a pre-norm GPT."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_resctl.rules import make_rule
from lightning_resctl.rules.attnres import (
    attnres_chain_reference,
    attnres_pool_reference,
    attnres_sources_reference,
    default_block_size,
    num_sources,
)
from lightning_resctl.runtime.memory import saved_tensor_bytes
from lightning_resctl.surgery import patch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT
from test_rule_common import assert_runtime_matches_oracle

D = torch.float64


def _t(*v):
    return torch.tensor(v, dtype=D)


def _rule(block_size=None, **kw):
    if block_size is None:
        return make_rule("attnres", kw)
    return make_rule("attnres-block", {"block_size": block_size, **kw})


#: Block AttnRes's two states: the sources as they are, and stacked (``start_apart``: blocks compiled one by one)
APART = pytest.mark.parametrize("apart", [False, True], ids=["sources", "stacked"])


def _drive(rule, chain, x, updates, positions=None, apart=False):
    """Run the chain runtime with fixed updates; returns the h after each merge (and the final state)."""
    k_all = list(range(len(updates))) if positions is None else positions
    state = (rule.start_apart if apart else rule.start)(chain, x)
    hs = []
    for i, k in enumerate(k_all):
        nxt = k_all[i + 1] if i + 1 < len(k_all) else chain.num_merges
        state, h = rule.step(chain, k, state, updates[k], nxt)
        hs.append(h)
    return hs, state


def _set_queries(chain, queries, gains=None):
    with torch.no_grad():
        for k, m in enumerate(chain.merges):
            m.pool_query.copy_(queries[k])
            if gains is not None:
                m.key_norm_weight.copy_(gains[k])


# ---------------------------------------------------------------------------------------------- reference cases
def test_case1_zero_queries_average():
    rule = _rule()
    chain = rule.build_chain(2, 2).to(D)
    x, u0, u1 = _t(1, 3), _t(5, 7), _t(9, 11)
    hs, state = _drive(rule, chain, x, [u0, u1])
    torch.testing.assert_close(hs[1], _t(5, 7), rtol=0, atol=1e-15)
    torch.testing.assert_close(hs[0], _t(3, 5), rtol=0, atol=1e-15)
    alpha = rule.weights(chain, 1, _drive(rule, chain, x, [u0, u1], positions=[0])[1], u1)
    torch.testing.assert_close(alpha, torch.full((3,), 1 / 3, dtype=D), rtol=0, atol=1e-15)


@pytest.mark.parametrize("sources,w,alpha,h", [
    ([[1, 1], [3, -1]], [1, 0], [0.4154109, 0.5845891], [2.1691782, -0.1691782]),
    ([[1, 3], [5, 7], [9, 11]], [0.5, -0.5], [0.2671882, 0.3545211, 0.3782907], [5.4444102, 7.4444102]),
], ids=["case2", "case3"])
def test_cases_2_3_pool_values(sources, w, alpha, h):
    src = torch.tensor(sources, dtype=D)
    h_ref, a_ref = attnres_pool_reference(src, torch.tensor(w, dtype=D))
    torch.testing.assert_close(a_ref, torch.tensor(alpha, dtype=D), rtol=0, atol=1e-7)
    torch.testing.assert_close(h_ref, torch.tensor(h, dtype=D), rtol=0, atol=1e-7)
    if len(sources) == 2:  # case 2: the logits
        from lightning_resctl.rules.common import rms_norm
        z = rms_norm(src) @ torch.tensor(w, dtype=D)
        torch.testing.assert_close(z, _t(0.9999995, 1.3416407), rtol=0, atol=1e-7)
    # the runtime (sources as the chain input and updates of a Full chain) gives the same numbers
    rule = _rule()
    chain = rule.build_chain(2, len(sources) - 1).to(D)
    _set_queries(chain, [torch.tensor(w, dtype=D)] * chain.num_merges)
    hs, _ = _drive(rule, chain, src[0], list(src[1:]))
    torch.testing.assert_close(hs[-1], torch.tensor(h, dtype=D), rtol=0, atol=1e-7)


def test_case4_key_scale_invariance():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 8, generator=g, dtype=D)
    s = s / s.square().mean(-1, keepdim=True).sqrt()  # unit-rms sources: the eps 1e-6 shifts z by ~z*5e-7
    for _ in range(3):
        w = torch.randn(8, generator=g, dtype=D)
        src = torch.stack([s, 10 * s], -2)
        _, a = attnres_pool_reference(src, w)
        torch.testing.assert_close(a, torch.full_like(a, 0.5), rtol=0, atol=1e-6)
        _, a0 = attnres_pool_reference(src, w * 5, eps=0.0)  # without eps: exact for any w
        torch.testing.assert_close(a0, torch.full_like(a0, 0.5), rtol=0, atol=1e-12)


@APART
def test_case5_block_bookkeeping(apart):
    x = _t(1.0)
    us = [_t(10.0 ** (i + 1)) for i in range(5)]  # distinct powers: each source's value names its members
    table = {0: [1], 1: [1, 10], 2: [1, 110], 3: [1, 110, 1000], 4: [1, 110, 11000]}
    for t, want in table.items():
        got = attnres_sources_reference(x, us[:t], 2)
        assert [v.item() for v in got] == want
    assert [v.item() for v in attnres_sources_reference(x, us[:3], 2)] == [1, 110, 1000]  # K = 3 output sources
    assert [len(attnres_sources_reference(x, us[:t], 2)) for t in range(6)] == [1, 2, 2, 3, 3, 4]
    assert [num_sources(t, 2) for t in range(6)] == [1, 2, 2, 3, 3, 4]
    # the runtime's state holds exactly these sources after every merge, for several block sizes
    for s in (1, 2, 3, 4):
        rule = _rule(block_size=s)
        chain = rule.build_chain(1, 5).to(D)
        state = (rule.start_apart if apart else rule.start)(chain, x)
        for k in range(5):
            state, _ = rule.step(chain, k, state, us[k], k + 1)
            want = attnres_sources_reference(x, us[:k + 1], s)
            assert [v.item() for v in state.sources()] == [v.item() for v in want], (s, k)


@APART
@pytest.mark.parametrize("affine", [True, False])
def test_case6_block_size_one_is_full(affine, apart):
    g = torch.Generator().manual_seed(1)
    K, C = 6, 8
    x = torch.randn(3, C, generator=g, dtype=D)
    us = [torch.randn(3, C, generator=g, dtype=D) for _ in range(K)]
    qs = [torch.randn(C, generator=g, dtype=D) for _ in range(K)]
    full, block = _rule(key_norm_affine=affine), _rule(block_size=1, key_norm_affine=affine)
    cf, cb = full.build_chain(C, K).to(D), block.build_chain(C, K).to(D)
    _set_queries(cf, qs)
    _set_queries(cb, qs)
    for a, b in zip(_drive(full, cf, x, us)[0], _drive(block, cb, x, us, apart=apart)[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@APART
@pytest.mark.parametrize("s", [1, 2, 3])
def test_case6_zero_queries_return_residual_over_sources(s, apart):
    g = torch.Generator().manual_seed(2)
    K, C = 7, 8
    x = torch.randn(3, C, generator=g, dtype=D)
    us = [torch.randn(3, C, generator=g, dtype=D) for _ in range(K)]
    rule = _rule(block_size=s)
    chain = rule.build_chain(C, K).to(D)
    hs, _ = _drive(rule, chain, x, us, apart=apart)
    for k, h in enumerate(hs):
        r = x + sum(us[:k + 1])
        torch.testing.assert_close(h, r / num_sources(k + 1, s), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["attnres", "attnres-block"])
def test_case7_prenorm_gpt_identity_at_init_with_eps_zero(method):
    torch.manual_seed(0)
    ref = NanoGPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    for m in ref.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 0.0
    model = copy.deepcopy(ref)
    x = ref.example_input_array
    patch_residuals(model, method=method, eps=0.0)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5 * ref(x).abs().max().item())


# ---------------------------------------------------------------------------------------------- runtime vs oracle
@APART
@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_runtime_matches_the_oracle_with_gradients(s, apart):
    g = torch.Generator().manual_seed(3)
    K, C = 6, 8
    ws = [torch.randn(C, C, generator=g, dtype=D) / C ** 0.5 for _ in range(K)]
    branches = [lambda h, w=w: torch.tanh(h @ w) * 2 for w in ws]
    rule = _rule(block_size=s)
    chain = rule.build_chain(C, K).to(D)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D))
    x = torch.randn(2, 3, C, generator=g, dtype=D, requires_grad=True)
    qs = [m.pool_query for m in chain.merges]
    gs = [m.key_norm_weight for m in chain.merges]
    grads = assert_runtime_matches_oracle(rule, chain, x, branches,
                                          lambda: attnres_chain_reference(x, branches, qs, gs, s), qs + gs, apart)
    assert all(gq.abs().sum() > 0 for gq in grads[1:K + 1])  # every query is used (DDP)


@APART
def test_absent_merge_leaves_the_block_structure_by_position(apart):
    """Merge 1 does not run (e.g. eval-only): the runtime equals the oracle with u_1 = 0 (block boundaries are by
    position; the partial u_0 is closed when merge 2 starts the next block)."""
    g = torch.Generator().manual_seed(4)
    C = 4
    x = torch.randn(2, C, generator=g, dtype=D)
    us = [torch.randn(2, C, generator=g, dtype=D) for _ in range(4)]
    rule = _rule(block_size=2)
    chain = rule.build_chain(C, 4).to(D)
    with torch.no_grad():
        for m in chain.merges:
            m.pool_query.normal_(generator=g)
    hs, state = _drive(rule, chain, x, us, positions=[0, 2, 3], apart=apart)
    zero = [us[0], torch.zeros_like(us[1]), us[2], us[3]]
    assert [v.tolist() for v in state.sources()] == [v.tolist() for v in attnres_sources_reference(x, zero, 2)]
    ref, _ = attnres_pool_reference(torch.stack(attnres_sources_reference(x, zero[:1], 2), -2),
                                    chain.merges[1].pool_query)  # merge 0 reads for merge 2: site 1's query
    torch.testing.assert_close(hs[0], ref, rtol=1e-12, atol=1e-12)


@APART
def test_skip_drops_the_update_from_every_source(apart):
    g = torch.Generator().manual_seed(5)
    C = 4
    x = torch.randn(2, C, generator=g, dtype=D)
    us = [torch.randn(2, C, generator=g, dtype=D) for _ in range(3)]
    for s in (1, 2):
        rule = _rule(block_size=s)
        chain = rule.build_chain(C, 3).to(D)
        state = (rule.start_apart if apart else rule.start)(chain, x)
        state, _ = rule.step(chain, 0, state, us[0], 1)
        state, _ = rule.skip(chain, 1, state, 2)
        state, h = rule.step(chain, 2, state, us[2], 3)
        zero = [us[0], torch.zeros_like(us[1]), us[2]]
        want = [v for v in attnres_sources_reference(x, zero, s) if s > 1 or v.abs().sum() > 0]
        assert [v.tolist() for v in state.sources()] == [v.tolist() for v in want]


def test_default_block_size_and_num_blocks():
    assert [default_block_size(k) for k in (1, 4, 8, 23, 24, 32, 54, 64)] == [2, 2, 2, 2, 4, 4, 6, 8]
    assert make_rule("attnres-block", {"num_blocks": 3}).block_size(10) == 4
    assert make_rule("attnres-block", {"block_size": 5}).block_size(10) == 5
    assert make_rule("attnres").block_size(10) == 1
    chain = make_rule("attnres-block").build_chain(4, 54)
    assert chain.block_size == 6 and chain.max_sources == 10  # x + 9 blocks, as in the paper's 48B model
    assert make_rule("attnres").build_chain(4, 7).max_sources == 8


# ---------------------------------------------------------------------------------------------- dtype, memory
@APART
def test_bf16_streams_fp32_pool(apart):
    g = torch.Generator().manual_seed(6)
    C, K = 16, 4
    x = torch.randn(2, C, generator=g).bfloat16()
    us = [torch.randn(2, C, generator=g).bfloat16() for _ in range(K)]
    rule = _rule(block_size=2)
    chain = rule.build_chain(C, K)
    with torch.no_grad():
        for m in chain.merges:
            m.pool_query.normal_(generator=g)
    hs, state = _drive(rule, chain, x, us, apart=apart)
    assert all(h.dtype == torch.bfloat16 for h in hs) and state.sources()[0].dtype == torch.float32
    ref, _ = attnres_pool_reference(torch.stack(attnres_sources_reference(x.double(), [u.double() for u in us], 2), -2),
                                    chain.merges[-1].pool_query.double())
    torch.testing.assert_close(hs[-1].double(), ref, rtol=1e-2, atol=1e-2)


def _saved(K, C, fn):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8, C, generator=g, requires_grad=True)
    us = [torch.randn(4, 8, C, generator=g, requires_grad=True) for _ in range(K)]
    nbytes, out = saved_tensor_bytes(fn, x, us)
    out.sum().backward()
    return nbytes


def test_full_attnres_saves_linear_not_quadratic_memory():
    C = 256
    rule = _rule()

    def runtime(K):
        chain = rule.build_chain(C, K)
        with torch.no_grad():
            for m in chain.merges:
                m.pool_query.normal_()

        def fn(x, us):
            state, h, total = rule.start(chain, x), x, 0
            for k in range(K):
                state, h = rule.step(chain, k, state, us[k], k + 1)
                total = total + h.sum()
            return total
        return _saved(K, C, fn), chain

    def stacked(K, chain):
        def fn(x, us):
            total = 0
            for k in range(K):
                src = torch.stack([x] + us[:k + 1], -2)
                total = total + attnres_pool_reference(src, chain.merges[k].pool_query)[0].sum()
            return total
        return _saved(K, C, fn)

    vec = 4 * 8 * C * 4  # bytes of one C-vector per token
    b8, _ = runtime(8)
    b16, chain16 = runtime(16)
    # sources are referenced (x and the updates: K+1 vectors) plus 2m scalars per token per merge (dots, alpha)
    assert b16 <= 1.25 * (16 + 1) * vec, (b16, vec)
    assert b16 - b8 <= 1.25 * 8 * vec, (b16 - b8, vec)
    assert stacked(16, chain16) > 3 * b16  # what stacking the sources every merge would cost


def test_full_attnres_computes_each_source_key_logits_once():
    """A source's key logits depend only on the source and the (input-independent) queries: they are computed once
    per source for every later site, so a forward of K merges reduces sources over C O(K) times (a matmul and an
    rms per source), not once per (source, merge) pair (K(K+3)/2 logits + K+1 rms = 53 for K = 8)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    K, C = 8, 16
    reductions = []

    class CountReductionsOverC(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-1] == C]
            if ins and not func.is_view and isinstance(out, torch.Tensor) and out.shape[-1:] != (C,):
                reductions.append(func.__name__)
            return out

    g = torch.Generator().manual_seed(8)
    rule = _rule()
    chain = rule.build_chain(C, K).to(D)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D))
    x = torch.randn(3, C, generator=g, dtype=D, requires_grad=True)
    us = [torch.randn(3, C, generator=g, dtype=D) for _ in range(K)]
    with CountReductionsOverC():
        _drive(rule, chain, x, us)
    assert len(reductions) <= 2 * (K + 1), reductions


def test_depth_mix_gradients_second_order_forward_ad_and_vmap():
    """The weighted sum over the sources (one autograd node per merge) against autograd's own derivatives: first and
    second order, forward-mode AD and batched gradients (vmap)."""
    from lightning_resctl.rules.attnres.ops import _DepthMixWithJvp as _DepthMix

    g = torch.Generator().manual_seed(9)
    alpha = torch.softmax(torch.randn(2, 3, generator=g, dtype=D), -1).requires_grad_()
    sources = [torch.randn(2, 5, generator=g, dtype=D, requires_grad=True) for _ in range(3)]
    torch.autograd.gradcheck(_DepthMix.apply, (alpha, *sources), check_forward_ad=True, check_batched_grad=True)
    torch.autograd.gradgradcheck(_DepthMix.apply, (alpha, *sources))
    torch.testing.assert_close(_DepthMix.apply(alpha, *sources), sum(alpha[:, i:i + 1] * v for i, v in
                                                                      enumerate(sources)), rtol=1e-12, atol=1e-12)
