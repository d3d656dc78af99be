"""hc / mhc: the reference cases of the HC spec (fp64 unless stated), the runtime against the oracle, exact
identity of HC at init, mHC properties, and numerical comparisons with lucidrains' ``hyper_connections``
(HC) and HF transformers' DeepSeek-V4 hyper-connection (mhc sinkhorn="dsv4") on the same weights."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_resctl.rules import make_rule
from lightning_resctl.rules.frame import frame_chain_reference, frame_read, frame_step_reference, frame_write
from lightning_resctl.rules.hc import (
    HCLayer,
    MHCLayer,
    hc_coefficients_reference,
    mhc_coefficients_reference,
    sinkhorn,
    sinkhorn_dsv4,
)
from lightning_resctl.surgery import merge_sites, patch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT
from test_rule_common import assert_runtime_matches_oracle

D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _randomize(chain, std=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return chain


def _case1_layer():
    layer = HCLayer(1, 2, 2, eps=0.0).to(D)
    with torch.no_grad():
        layer.hc_scale.fill_(0.5)
        layer.hc_dyn.copy_(_t([1, 0, 0, 0.5], [0, 1, -1, 0]))
    return layer


# ---------------------------------------------------------------------------------------------- HC
def test_case1_hc_values():
    layer = _case1_layer()
    torch.testing.assert_close(layer.hc_static.detach(), _t([0, 1, 0, 1], [1, 0, 1, 1]))
    S, u = _t([1, 0], [0, 2]), _t(1, 1).squeeze(0)
    pre, res, post = layer.coefficients(S)
    c0 = _t(0.444193, 1, 0, 1.304430).squeeze(0)
    c1 = _t(1, 0.444193, 0.555807, 1).squeeze(0)
    c = torch.stack([pre, res[0], res[1], post], -1)  # c[s] = [pre_s | res[0, s], res[1, s] | post_s]
    torch.testing.assert_close(c, torch.stack([c0, c1]), rtol=0, atol=1e-6)
    h, S1 = frame_step_reference(S, u, pre, res, post)
    torch.testing.assert_close(h, _t(0.444193, 2.0).squeeze(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(S1, _t([2.304430, 2.192815], [1.0, 2.111614]), rtol=0, atol=1e-6)
    # the training path (frame_read / frame_write) computes the same
    torch.testing.assert_close(frame_read(pre, S), h, rtol=0, atol=1e-15)
    torch.testing.assert_close(frame_write(S, res, post, u), S1, rtol=0, atol=1e-15)


def test_case2_hc_at_init_every_h_is_the_unpatched_stream_bitwise():
    torch.manual_seed(0)
    ref = NanoGPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    ref.ln_f.eps = 0.0  # the output is n * r_K: equal after the final norm only up to its eps
    model = copy.deepcopy(ref)
    x = ref.example_input_array

    def reads(m):
        seen = []
        hooks = [ln.register_forward_hook(lambda mod, a, o: seen.append(a[0])) for b in m.h for ln in (b.ln_1, b.ln_2)]
        hooks.append(m.ln_f.register_forward_hook(lambda mod, a, o: seen.append(a[0])))
        out = m(x)
        for h in hooks:
            h.remove()
        return seen, out

    want, out_ref = reads(ref)
    patch_residuals(model, method="hc", streams=4)
    got, out = reads(model)
    assert len(got) == len(want) == 7
    for k in range(6):
        assert torch.equal(got[k], want[k]), k
    torch.testing.assert_close(got[6], 4 * want[6], rtol=1e-6, atol=0)  # output n * r_K
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_case2_hc_runtime_at_init_any_inputs(n):
    g = torch.Generator().manual_seed(n)
    K, C = 5, 8
    rule = make_rule("hc", {"streams": n})
    chain = rule.build_chain(C, K)
    x = torch.randn(3, C, generator=g)
    state, r = rule.start(chain, x), x
    for k in range(K):
        u = torch.randn(3, C, generator=g)
        r = r + u
        state, h = rule.step(chain, k, state, u, k + 1)
        assert torch.equal(state.streams, r.unsqueeze(-2).expand(3, n, C))  # all streams equal r
        if k < K - 1:
            assert torch.equal(h, r)
    torch.testing.assert_close(h, n * r, rtol=1e-6, atol=0)


def test_static_hc_has_only_the_static_parameters():
    chain = make_rule("hc", {"dynamic": False, "streams": 3}).build_chain(8, 2)
    assert [n for n, _ in chain.named_parameters()] == ["merges.0.hc_static", "merges.1.hc_static"]
    S = torch.randn(2, 3, 8)
    pre, res, post = chain.coefficients(1, S)
    assert torch.equal(pre[0], torch.tensor([0.0, 1, 0])) and torch.equal(res[0], torch.eye(3))
    assert torch.equal(post[0], torch.ones(3))


def test_hc_parameter_names_shapes_init():
    chain = make_rule("hc").build_chain(6, 5)
    m = chain.merges[3]
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"hc_static": (4, 6), "hc_dyn": (6, 6), "hc_scale": (2,), "hc_norm_gain": (6,)}
    want = torch.zeros(4, 6)
    want[3, 0] = 1
    want[:, 1:5] = torch.eye(4)
    want[:, 5] = 1
    assert torch.equal(m.hc_static.detach(), want)
    assert torch.equal(chain.merges[5 - 1].hc_static[0, 0].detach(), torch.tensor(1.0))  # j mod n: layer 4 -> 0
    assert (m.hc_dyn == 0).all() and torch.equal(m.hc_scale.detach(), torch.full((2,), 0.01))
    assert (m.hc_norm_gain == 0).all()


# ---------------------------------------------------------------------------------------------- lucidrains
def _lucidrains_layer(ours: HCLayer):
    from hyper_connections import HyperConnections

    n = ours.streams
    hc = HyperConnections(n, dim=ours.dim, layer_index=ours.index).to(D)
    with torch.no_grad():
        hc.static_alpha.copy_(ours.hc_static[:, :n + 1])
        hc.static_beta.copy_(ours.hc_static[:, n + 1])
        hc.dynamic_alpha_fn.copy_(ours.hc_dyn[:, :n + 1])
        hc.dynamic_beta_fn.copy_(ours.hc_dyn[:, n + 1])
        hc.dynamic_alpha_scale.copy_(ours.hc_scale[0])
        hc.dynamic_beta_scale.copy_(ours.hc_scale[1])
        hc.norm.gamma.copy_(ours.hc_norm_gain)
    return hc


def test_lucidrains_init_equals_ours():
    from hyper_connections import HyperConnections

    for j in range(5):
        ours = HCLayer(j, 6, 4)
        theirs = HyperConnections(4, dim=6, layer_index=j)
        assert torch.equal(theirs.static_alpha.detach(), ours.hc_static[:, :5].detach())
        assert torch.equal(theirs.static_beta.detach(), ours.hc_static[:, 5].detach())
        assert (theirs.dynamic_alpha_fn == 0).all() and (theirs.dynamic_beta_fn == 0).all()
        assert theirs.dynamic_alpha_scale.item() == theirs.dynamic_beta_scale.item() == pytest.approx(0.01)
        assert (theirs.norm.gamma == 0).all()


@pytest.mark.parametrize("n", [2, 4])
def test_chain_matches_lucidrains_hyper_connections_on_the_same_weights(n):
    """K layers of lucidrains' HyperConnections (expand = repeat, reduce = sum) against this rule's runtime, fp64,
    random (trained-looking) weights. Their RMSNorm is L2-normalise x sqrt(C): equal to ours with eps = 0. The
    branch of layer 0 is scale-invariant (the surgery feeds x where HC feeds pre_0 . S_0 = c x)."""
    from einops import rearrange

    g = torch.Generator().manual_seed(10 + n)
    K, C, B, T = 4, 8, 2, 3
    rule = make_rule("hc", {"streams": n, "eps": 0.0})
    chain = _randomize(rule.build_chain(C, K).to(D), seed=n)
    with torch.no_grad():  # keep c = sum_s pre_0[s] > 0: the surgery's reading of x is HC's only up to c > 0
        chain.merges[0].hc_static[:, 0] += 1.0
    theirs = [_lucidrains_layer(m) for m in chain.merges]
    ws = [torch.randn(C, C, generator=g, dtype=D) for _ in range(K)]

    def branch(k, h):
        return torch.tanh((h / h.norm(dim=-1, keepdim=True)) @ ws[k])

    x = torch.randn(B, T, C, generator=g, dtype=D)
    # lucidrains
    res = rearrange(x.unsqueeze(-2).expand(B, T, n, C), "b t s d -> (b s) t d")
    their_h = []
    for k, hc in enumerate(theirs):
        h, add = hc(res)
        their_h.append(h)
        res = add(branch(k, h))
    their_out = rearrange(res, "(b s) t d -> b t s d", s=n).sum(-2)
    # ours
    state, h, our_h = rule.start(chain, x), x, []
    for k in range(K):
        our_h.append(h)
        state, h = rule.step(chain, k, state, branch(k, h), k + 1)
    torch.testing.assert_close(h, their_out, rtol=1e-10, atol=1e-10)
    for k in range(1, K):  # h_0 differs by the per-token scalar c (the surgery reads x)
        torch.testing.assert_close(our_h[k], their_h[k], rtol=1e-10, atol=1e-10)
    c = their_h[0] / x
    torch.testing.assert_close(c, c[..., :1].expand_as(c), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- runtime vs oracle
@pytest.mark.parametrize("method,options", [("hc", {}), ("hc", {"dynamic": False, "reduce": "mean"}),
                                            ("hc", {"recompute_every": 3}), ("mhc", {}),
                                            ("mhc", {"sinkhorn": "dsv4", "init": "residual", "recompute_every": 1})])
def test_runtime_matches_the_oracle_with_gradients(method, options):
    """The chain (each merge one Function that recomputes its streams from its group's first in the backward:
    groups of 4 — the default —, 3 — a group and a partial one — or 1) against plain autograd over the papers'
    formulas, fp64, outputs and gradients."""
    g = torch.Generator().manual_seed(20)
    K, C, n = 4, 6, 3
    rule = make_rule(method, {"streams": n, **options})
    chain = _randomize(rule.build_chain(C, K).to(D), std=0.3)
    ws = [torch.randn(C, C, generator=g, dtype=D) / C ** 0.5 for _ in range(K)]
    branches = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
    x = torch.randn(2, 3, C, generator=g, dtype=D, requires_grad=True)
    params = list(chain.parameters())
    reduce = rule.config.reduce
    assert_runtime_matches_oracle(rule, chain, x, branches,
                                  lambda: frame_chain_reference(list(chain.merges), x, branches, reduce), params)


def test_bf16_streams_fp32_coefficients():
    g = torch.Generator().manual_seed(21)
    rule = make_rule("mhc", {"streams": 4})
    chain = _randomize(rule.build_chain(16, 3), std=0.1)
    x = torch.randn(2, 16, generator=g).bfloat16()
    state = rule.start(chain, x)
    pre, res, post = chain.coefficients(0, state.streams)
    assert pre.dtype == res.dtype == post.dtype == torch.float32
    state, h = rule.step(chain, 0, state, torch.randn(2, 16, generator=g).bfloat16(), 1)
    assert h.dtype == torch.bfloat16 and state.streams.dtype == torch.bfloat16 and state.res.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- mHC
def test_case3_sinkhorn_values_fp32():
    L = torch.tensor([[0, 1, 2, 3], [1, 0, -1, 2], [0.5, 0.5, 0, -2], [3, -1, 1, 0]], dtype=torch.float32)
    M = sinkhorn(L, 20)
    torch.testing.assert_close(M.sum(-1), torch.ones(4), rtol=0, atol=1e-6)
    torch.testing.assert_close(M.sum(-2), torch.ones(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(M[0], torch.tensor([0.017966, 0.175615, 0.392363, 0.414056]), rtol=0, atol=1e-6)
    torch.testing.assert_close(sinkhorn(L, 1).sum(-2), torch.tensor([1.0552, 1.2644, 0.8092, 0.8712]), rtol=0,
                               atol=1e-4)
    # DeepSeek-V4's variant: the same fixed point (eps aside), also ends on the outputs
    V = sinkhorn_dsv4(L.double(), 20, 0.0)
    torch.testing.assert_close(V, M.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(V.sum(-1), torch.ones(4, dtype=D), rtol=0, atol=1e-12)


@pytest.mark.parametrize("init", ["paper", "residual"])
def test_case4_mhc_init_values(init):
    layer = MHCLayer(5, 8, 4, init=init).to(D)
    S = torch.randn(3, 4, 8, dtype=D)
    pre, res, post = layer.coefficients(S)
    hot = 5 % 4
    want_pre = torch.full((4,), 0.2689414, dtype=D)
    want_pre[hot] = 0.7310586
    torch.testing.assert_close(pre, want_pre.expand(3, 4), rtol=0, atol=1e-7)
    if init == "paper":
        want_post = torch.full((4,), 0.5378828, dtype=D)
        want_post[hot] = 1.4621172
        torch.testing.assert_close(post.sum(-1), torch.full((3,), 3.0757657, dtype=D), rtol=0, atol=1e-7)
    else:
        want_post = torch.ones(4, dtype=D)
    torch.testing.assert_close(post, want_post.expand(3, 4), rtol=0, atol=1e-7)
    off = torch.full((4, 4), 3.3513e-4, dtype=D)
    want_res = off + torch.eye(4, dtype=D) * (0.9989946 - 3.3513e-4)
    torch.testing.assert_close(res, want_res.expand(3, 4, 4), rtol=0, atol=1e-7)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"mhc_phi": (32, 24), "mhc_bias": (24,), "mhc_alpha": (3,)}


@pytest.mark.parametrize("variant", ["paper", "dsv4"])
def test_case4_mhc_ranges_for_random_phi(variant):
    layer = _randomize(MHCLayer(0, 8, 4, sinkhorn=variant).to(D), std=2.0, seed=3)
    pre, res, post = layer.coefficients(torch.randn(50, 4, 8, dtype=D) * 3)
    assert ((pre > 0) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all() and (res > 0).all()


def test_case5_stream_sum():
    g = torch.Generator().manual_seed(4)
    layer = MHCLayer(0, 8, 4).to(D)
    with torch.no_grad():  # the test logits of case 3 as b_res (alpha = 0 removes the dynamic part)
        layer.mhc_alpha.zero_()
        layer.mhc_bias[8:].copy_(torch.tensor([[0, 1, 2, 3], [1, 0, -1, 2], [0.5, 0.5, 0, -2], [3, -1, 1, 0]],
                                              dtype=D).flatten())
    S = torch.randn(3, 4, 8, generator=g, dtype=D)
    u = torch.randn(3, 8, generator=g, dtype=D)
    pre, res, post = layer.coefficients(S)
    S1 = frame_write(S, res, post, u)
    colsum = res.sum(-2)
    torch.testing.assert_close(S1.sum(-2), (colsum.unsqueeze(-1) * S).sum(-2) + post.sum(-1, keepdim=True) * u,
                               rtol=1e-12, atol=1e-12)
    assert (colsum - 1).abs().max() <= 1e-5
    torch.testing.assert_close(S1.sum(-2), S.sum(-2) + post.sum(-1, keepdim=True) * u, rtol=0, atol=1e-4)


def test_mhc_residual_init_is_the_plain_residual_for_prenorm_gpt():
    torch.manual_seed(0)
    ref = NanoGPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    for m in ref.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 0.0
    x = ref.example_input_array
    for method in ("mhc", "mhc-lite"):
        model = copy.deepcopy(ref)
        patch_residuals(model, method=method, init="residual")
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
        paper = copy.deepcopy(ref)
        patch_residuals(paper, method=method)  # paper init: close to, not equal to, the residual
        assert not torch.allclose(paper(x), ref(x), rtol=1e-5, atol=1e-5)


def test_mhc_dsv4_matches_transformers_deepseek_v4_hyper_connection():
    """sinkhorn="dsv4" against HF transformers' DeepseekV4HyperConnection on the same weights (fp64). Their
    ``fn`` (2n+n^2, nC) is our ``mhc_phi`` transposed; their comb logits are laid out [input, output] where ours
    are [output, input] (row = output stream), so the comb columns are permuted; their comb is consumed
    transposed (``comb.T @ S``), i.e. comb == res.T."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    n, C, iters = 3, 8, 7
    cfg = DeepseekV4Config(hidden_size=C, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6)
    theirs = DeepseekV4HyperConnection(cfg).to(D)
    ours = _randomize(MHCLayer(1, C, n, sinkhorn="dsv4", sinkhorn_iters=iters).to(D), std=1.0, seed=5)
    perm = list(range(2 * n)) + [2 * n + s * n + t for t in range(n) for s in range(n)]  # ours[t, s] <- theirs[s, t]
    inv = torch.argsort(torch.tensor(perm))
    with torch.no_grad():
        theirs.fn.copy_(ours.mhc_phi.t()[inv])
        theirs.base.copy_(ours.mhc_bias[inv])
        theirs.scale.copy_(ours.mhc_alpha)
    S = torch.randn(2, 5, n, C, dtype=D)
    post_t, comb_t, collapsed = theirs(S)  # computed in fp32 whatever the input dtype (their .float())
    pre, res, post = ours.coefficients(S)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post, post_t.double(), **tol)
    torch.testing.assert_close(res, comb_t.double().transpose(-1, -2), **tol)
    torch.testing.assert_close(frame_read(pre, S), collapsed, **tol)
    u = torch.randn(2, 5, C, dtype=D)
    their_next = post_t.double().unsqueeze(-1) * u.unsqueeze(-2) + torch.matmul(comb_t.double().transpose(-1, -2), S)
    torch.testing.assert_close(frame_write(S, res, post, u), their_next, **tol)


def test_mhc_coefficients_formula_written_out():
    """The fused reference against the spec's formula written step by step (one token, n = 2)."""
    g = torch.Generator().manual_seed(6)
    n, C = 2, 3
    phi = torch.randn(n * C, 2 * n + n * n, generator=g, dtype=D)
    b = torch.randn(2 * n + n * n, generator=g, dtype=D)
    a = _t(0.3, 0.7, 1.1).squeeze(0)
    S = torch.randn(n, C, generator=g, dtype=D)
    pre, res, post = mhc_coefficients_reference(S, phi, b, a, eps=1e-6, iters=30)
    xf = S.flatten()
    m = (xf @ phi) / torch.sqrt((xf ** 2).mean() + 1e-6)
    torch.testing.assert_close(pre, torch.sigmoid(a[0] * m[:2] + b[:2]))
    torch.testing.assert_close(post, 2 * torch.sigmoid(a[1] * m[2:4] + b[2:4]))
    L = (a[2] * m[4:] + b[4:]).reshape(2, 2)
    M = torch.exp(L - L.max())
    for _ in range(30):
        M = M / M.sum(0, keepdim=True)
        M = M / M.sum(1, keepdim=True)
    torch.testing.assert_close(res, M)
    pre_h, res_h, post_h = hc_coefficients_reference(S, torch.zeros(n, n + 2, dtype=D))
    assert (pre_h == 0).all() and (res_h == 0).all()


def test_sites_of_a_patched_model_share_one_chain():
    model = NanoGPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    report = patch_residuals(model, method="mhc", streams=2)
    (chain,) = report.chains
    assert chain.module.streams == 2 and chain.module.num_merges == 4
    assert [s.module.index for s in report.sites] == [0, 1, 2, 3]
    assert all(s.chain_module is chain.module for s in merge_sites(model))
