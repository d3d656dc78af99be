"""mhc-lite: the reference cases of the mHC-lite spec (fp64 unless stated), permutations, the runtime against
the oracle, the n <= 6 limit."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_resctl.rules import make_rule
from lightning_resctl.rules.frame import frame_chain_reference, frame_write
from lightning_resctl.rules.mhc_lite import MHCLiteLayer, mhc_lite_coefficients_reference, permutation_matrices
from lightning_resctl.surgery import patch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT
from test_rule_common import assert_runtime_matches_oracle

D = torch.float64


def _randomize(module, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_permutation_matrices(n):
    P = permutation_matrices(n, D)
    perms = list(itertools.permutations(range(n)))
    assert P.shape == (math.factorial(n), n, n)
    assert torch.equal(P[0], torch.eye(n, dtype=D))  # k = 0 is the identity
    for k, pi in enumerate(perms):
        for t in range(n):
            assert P[k, t, pi[t]] == 1 and P[k, t].sum() == 1  # P_k[t, pi_k(t)] = 1
        assert torch.equal(P[k].sum(0), torch.ones(n, dtype=D))


@pytest.mark.parametrize("init", ["paper", "residual"])
def test_case1_init_values(init):
    layer = MHCLiteLayer(6, 8, 4, init=init).to(D)
    pre, res, post = layer.coefficients(torch.randn(3, 4, 8, dtype=D))
    hot = 6 % 4
    a0 = 1 / (1 + 23 * math.exp(-8))
    assert a0 == pytest.approx(0.9923434, abs=1e-7)
    diag = a0 + 5 * math.exp(-8) * a0  # identity + the 5 other permutations fixing t (each weight e^-8 a0)
    torch.testing.assert_close(res.diagonal(dim1=-2, dim2=-1), torch.full((3, 4), 0.9940079, dtype=D), rtol=0,
                               atol=1e-7)
    assert diag == pytest.approx(0.9940079, abs=1e-7)
    off = res - torch.diag_embed(res.diagonal(dim1=-2, dim2=-1))
    torch.testing.assert_close(off.sum(-1), torch.full((3, 4), 3 * 0.0019974, dtype=D), rtol=0, atol=1e-6)
    torch.testing.assert_close(res.sum(-1), torch.ones(3, 4, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(res.sum(-2), torch.ones(3, 4, dtype=D), rtol=0, atol=1e-12)
    want_pre = torch.full((4,), 0.2689414, dtype=D)
    want_pre[hot] = 0.7310586
    torch.testing.assert_close(pre, want_pre.expand(3, 4), rtol=0, atol=1e-7)
    if init == "paper":
        torch.testing.assert_close(post.sum(-1), torch.full((3,), 3.0757657, dtype=D), rtol=0, atol=1e-7)
        assert post[0, hot].item() == pytest.approx(1.4621172, abs=1e-7)
    else:
        assert torch.equal(post, torch.ones(3, 4, dtype=D))
    shapes = {k: tuple(p.shape) for k, p in layer.named_parameters()}
    assert shapes == {"mhcl_phi": (32, 32), "mhcl_bias": (32,), "mhcl_alpha": (3,), "mhcl_norm_gain": (32,)}
    assert "perms" not in layer.state_dict()  # a constant, not a checkpoint entry


def test_case2_two_streams():
    layer = MHCLiteLayer(0, 4, 2).to(D)
    _, res, _ = layer.coefficients(torch.randn(5, 2, 4, dtype=D))
    a = torch.sigmoid(torch.tensor(8.0, dtype=D))  # logits (0, -8)
    assert a.item() == pytest.approx(0.9996646, abs=1e-7)
    torch.testing.assert_close(res, torch.tensor([[a, 1 - a], [1 - a, a]], dtype=D).expand(5, 2, 2), rtol=0,
                               atol=1e-15)
    # any logits: res = [[a, 1-a], [1-a, a]] with a = sigmoid(l0 - l1)
    with torch.no_grad():
        layer.mhcl_bias[4:].copy_(torch.tensor([0.3, 1.7], dtype=D))
    _, res, _ = layer.coefficients(torch.zeros(1, 2, 4, dtype=D) + 1)
    a = torch.sigmoid(torch.tensor(0.3 - 1.7, dtype=D))
    torch.testing.assert_close(res[0], torch.tensor([[a, 1 - a], [1 - a, a]], dtype=D), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_case3_random_doubly_stochastic_fp32(n):
    layer = _randomize(MHCLiteLayer(1, 8, n), std=0.5, seed=n)  # unsaturated: fp32 sigmoid rounds to 1 beyond ~17
    pre, res, post = layer.coefficients(torch.randn(64, n, 8))
    assert res.dtype == torch.float32 and (res >= 0).all()
    torch.testing.assert_close(res.sum(-1), torch.ones(64, n), rtol=0, atol=1e-6)
    torch.testing.assert_close(res.sum(-2), torch.ones(64, n), rtol=0, atol=1e-6)
    assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()


def test_case4_stream_sum_identity():
    g = torch.Generator().manual_seed(1)
    layer = _randomize(MHCLiteLayer(0, 8, 4), std=1.0, seed=1)
    S = torch.randn(16, 4, 8, generator=g)
    u = torch.randn(16, 8, generator=g)
    pre, res, post = layer.coefficients(S)
    S1 = frame_write(S, res, post, u)
    lhs = S1.sum(-2) - S.sum(-2)
    rhs = post.sum(-1, keepdim=True) * u
    torch.testing.assert_close(lhs, rhs, rtol=1e-6, atol=1e-6 * S.abs().max().item())


def test_case5_one_merge_chain_at_init():
    g = torch.Generator().manual_seed(2)
    rule = make_rule("mhc-lite", {"streams": 4})
    chain = rule.build_chain(8, 1).to(D)
    x = torch.randn(3, 8, generator=g, dtype=D)
    u = torch.randn(3, 8, generator=g, dtype=D)
    _, out = rule.step(chain, 0, rule.start(chain, x), u, 1)
    torch.testing.assert_close(out, 4 * x + 3.0757657 * u, rtol=0, atol=1e-6)
    post_sum = 2 * (torch.sigmoid(torch.tensor(1.0, dtype=D)) + 3 * torch.sigmoid(torch.tensor(-1.0, dtype=D)))
    torch.testing.assert_close(out, 4 * x + post_sum * u, rtol=1e-13, atol=1e-13)


def test_case6_gradient_reaches_phi_not_alpha_at_init():
    g = torch.Generator().manual_seed(3)
    rule = make_rule("mhc-lite")
    chain = rule.build_chain(8, 2).to(D)
    x = torch.randn(3, 8, generator=g, dtype=D)
    state, h = rule.step(chain, 0, rule.start(chain, x), torch.randn(3, 8, generator=g, dtype=D), 1)
    state, out = rule.step(chain, 1, state, torch.tanh(h), 2)
    (out.square().sum() + h.square().sum()).backward()
    m = chain.merges[1]
    assert m.mhcl_phi.grad.abs().sum() > 0
    assert torch.equal(m.mhcl_alpha.grad, torch.zeros(3, dtype=D))
    assert torch.equal(chain.merges[0].mhcl_alpha.grad, torch.zeros(3, dtype=D))


def test_coefficients_formula_written_out():
    g = torch.Generator().manual_seed(4)
    n, C = 3, 2
    layer = _randomize(MHCLiteLayer(2, C, n).to(D), std=0.7, seed=4)
    S = torch.randn(n, C, generator=g, dtype=D)
    pre, res, post = layer.coefficients(S)
    xf = S.flatten()
    N = xf / torch.sqrt((xf ** 2).mean() + 1e-6) * (1 + layer.mhcl_norm_gain)
    m = N @ layer.mhcl_phi
    a, b = layer.mhcl_alpha, layer.mhcl_bias
    torch.testing.assert_close(pre, torch.sigmoid(a[0] * m[:n] + b[:n]))
    torch.testing.assert_close(post, 2 * torch.sigmoid(a[1] * m[n:2 * n] + b[n:2 * n]))
    w = torch.softmax(a[2] * m[2 * n:] + b[2 * n:], 0)
    want = torch.zeros(n, n, dtype=D)
    for k, pi in enumerate(itertools.permutations(range(n))):
        for t in range(n):
            want[t, pi[t]] += w[k]
    torch.testing.assert_close(res, want)
    torch.testing.assert_close(
        mhc_lite_coefficients_reference(S, layer.mhcl_phi, b, a, layer.mhcl_norm_gain, permutation_matrices(n, D))[1],
        want)


@pytest.mark.parametrize("init,every", [("paper", 4), ("residual", 3)])
def test_runtime_matches_the_oracle_with_gradients(init, every):
    """The chain (streams recomputed in the backward from each group's first: ``recompute_every``) against plain
    autograd over the formulas, fp64, outputs and gradients."""
    g = torch.Generator().manual_seed(5)
    K, C, n = 4, 6, 3
    rule = make_rule("mhc-lite", {"streams": n, "init": init, "recompute_every": every})
    chain = _randomize(rule.build_chain(C, K).to(D), std=0.3, seed=5)
    ws = [torch.randn(C, C, generator=g, dtype=D) / C ** 0.5 for _ in range(K)]
    branches = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
    x = torch.randn(2, 3, C, generator=g, dtype=D, requires_grad=True)
    params = list(chain.parameters())
    assert_runtime_matches_oracle(rule, chain, x, branches,
                                  lambda: frame_chain_reference(list(chain.merges), x, branches, "sum"), params)


def test_stream_limit():
    assert make_rule("mhc-lite", {"streams": 6}).build_chain(2, 1).merges[0].mhcl_phi.shape == (12, 12 + 720)
    with pytest.raises(ValueError, match=r"streams must be <= 6 for method='mhc-lite', got 8: .*40320"):
        patch_residuals(NanoGPT(n_layer=1), method="mhc-lite", streams=8)
    with pytest.raises(ValueError, match=r"streams must be in \[1, 6\]"):
        MHCLiteLayer(0, 4, 7)
