"""kromhc: the KromHC spec's cases (fp64 unless stated): the Kronecker factors and their product, the init values,
the coefficients written out, the runtime against the frame oracle, the n = 2^K limit and the diagnostics. The
comparison with the official code (wz1119/KromHC ``Kromhc.py``) is in docs/rules/kromhc.md."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_resctl.rules import make_rule
from lightning_resctl.rules.frame import frame_chain_reference
from lightning_resctl.rules.kromhc import KromHCLayer, kromhc_coefficients_reference, kronecker_product
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


@pytest.mark.parametrize("K", [1, 2, 3])
def test_kronecker_product_is_torch_kron_of_the_factors(K):
    g = torch.Generator().manual_seed(K)
    p = torch.rand(5, K, generator=g, dtype=D)
    factors = torch.stack([torch.stack([p, 1 - p], -1), torch.stack([1 - p, p], -1)], -2)  # (5, K, 2, 2)
    got = kronecker_product(factors)
    for b in range(5):
        want = factors[b, 0]
        for k in range(1, K):
            want = torch.kron(want, factors[b, k])  # U_0 the most significant index
        torch.testing.assert_close(got[b], want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("init", ["paper", "residual"])
def test_init_values(init):
    """Spec: p_k = 1/(1+e^-8) = 0.99966 (res off-diagonal 3.4e-4 per factor), pre 0.731 at r = index mod n and 0.269
    elsewhere, post 1.462 / 0.538 (``init="residual"``: 1); the parameters' shapes and count nC(2n+2K)+nC+2n+2K+3."""
    n, C, index = 4, 8, 6
    layer = KromHCLayer(index, C, n, init=init).to(D)
    pre, res, post, factors = kromhc_coefficients_reference(
        torch.randn(3, n, C, dtype=D), layer.kromhc_proj, layer.kromhc_bias, layer.kromhc_alpha,
        layer.kromhc_norm_gain, with_factors=True)
    p = 1 / (1 + math.exp(-8))
    assert p == pytest.approx(0.99966, abs=1e-5)
    torch.testing.assert_close(factors[..., 0, 0], torch.full((3, 2), p, dtype=D), rtol=0, atol=1e-15)
    want_res = torch.kron(torch.tensor([[p, 1 - p], [1 - p, p]], dtype=D), torch.tensor([[p, 1 - p], [1 - p, p]],
                                                                                           dtype=D))
    torch.testing.assert_close(res, want_res.expand(3, n, n), rtol=0, atol=1e-15)
    hot = index % n
    want_pre = torch.full((n,), 0.2689414, dtype=D)
    want_pre[hot] = 0.7310586
    torch.testing.assert_close(pre, want_pre.expand(3, n), rtol=0, atol=1e-7)
    if init == "paper":
        assert post[0, hot].item() == pytest.approx(1.4621172, abs=1e-7)
        assert post[0, (hot + 1) % n].item() == pytest.approx(0.5378828, abs=1e-7)
    else:
        assert torch.equal(post, torch.ones(3, n, dtype=D))
    shapes = {k: tuple(v.shape) for k, v in layer.named_parameters()}
    assert shapes == {"kromhc_proj": (n * C, 2 * n + 4), "kromhc_bias": (2 * n + 4,), "kromhc_alpha": (3,),
                      "kromhc_norm_gain": (n * C,)}
    K = 2
    assert sum(v.numel() for v in layer.parameters()) == n * C * (2 * n + 2 * K) + n * C + 2 * n + 2 * K + 3


def test_coefficients_formula_written_out():
    g = torch.Generator().manual_seed(4)
    n, C = 8, 3
    layer = _randomize(KromHCLayer(2, C, n).to(D), std=0.7, seed=4)
    S = torch.randn(n, C, generator=g, dtype=D)
    pre, res, post = layer.coefficients(S)
    xf = S.flatten()
    N = xf / torch.sqrt((xf ** 2).mean() + 1e-6) * (1 + layer.kromhc_norm_gain)
    m = N @ layer.kromhc_proj
    a, b = layer.kromhc_alpha, layer.kromhc_bias
    torch.testing.assert_close(pre, torch.sigmoid(a[0] * m[:n] + b[:n]))
    torch.testing.assert_close(post, 2 * torch.sigmoid(a[1] * m[n:2 * n] + b[n:2 * n]))
    z = a[2] * m[2 * n:] + b[2 * n:]
    want = torch.ones(1, 1, dtype=D)
    for k in range(3):
        q = torch.exp(z[2 * k]) / (torch.exp(z[2 * k]) + torch.exp(z[2 * k + 1]))
        want = torch.kron(want, torch.stack([torch.stack([q, 1 - q]), torch.stack([1 - q, q])]))
    torch.testing.assert_close(res, want)
    # doubly stochastic and symmetric (the official code's transpose is the same matrix), exactly by construction
    torch.testing.assert_close(res.sum(-1), torch.ones(n, dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(res.sum(-2), torch.ones(n, dtype=D), rtol=0, atol=1e-15)
    assert torch.equal(res, res.T)


def test_random_coefficients_fp32_stay_doubly_stochastic():
    layer = _randomize(KromHCLayer(1, 8, 4), std=0.5, seed=3)
    pre, res, post = layer.coefficients(torch.randn(64, 4, 8))
    assert res.dtype == torch.float32 and (res >= 0).all()
    torch.testing.assert_close(res.sum(-1), torch.ones(64, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(res.sum(-2), torch.ones(64, 4), rtol=0, atol=1e-6)
    assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()


@pytest.mark.parametrize("init", ["paper", "residual"])
def test_runtime_matches_the_frame_oracle_with_gradients(init):
    g = torch.Generator().manual_seed(5)
    K, C, n = 4, 6, 4
    rule = make_rule("kromhc", {"streams": n, "init": init})
    chain = _randomize(rule.build_chain(C, K).to(D), std=0.3, seed=5)
    ws = [torch.randn(C, C, generator=g, dtype=D) / C ** 0.5 for _ in range(K)]
    branches = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
    x = torch.randn(2, 3, C, generator=g, dtype=D, requires_grad=True)
    assert_runtime_matches_oracle(rule, chain, x, branches,
                                  lambda: frame_chain_reference(list(chain.merges), x, branches, "sum"),
                                  list(chain.parameters()))


def test_residual_init_is_the_plain_network_for_a_pre_norm_model():
    """``init="residual"``: post = 1 keeps the n copies equal, so every sub-layer reads a positive multiple of the plain
    stream: with scale-invariant norms (LayerNorm eps 0) the logits are the unpatched model's."""
    torch.manual_seed(0)
    model = NanoGPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8).double()
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 0.0
    idx = torch.randint(0, 32, (2, 8))
    want = model(idx)
    patch_residuals(model, method="kromhc", init="residual")
    torch.testing.assert_close(model(idx), want, rtol=1e-10, atol=1e-10)


def test_streams_must_be_a_power_of_two():
    with pytest.raises(ValueError, match=r"streams must be a power of 2 >= 2 for method='kromhc', got 3"):
        patch_residuals(NanoGPT(n_layer=1), method="kromhc", streams=3)
    with pytest.raises(ValueError, match="streams must be a power of 2 >= 2 for KromHC, got 1"):
        KromHCLayer(0, 4, 1)
    assert make_rule("kromhc", {"streams": 16}).build_chain(2, 1).merges[0].kromhc_proj.shape == (32, 32 + 8)


def test_stats_factor_distance_and_doubly_stochastic_error():
    """``kromhc_factor_identity_dist (D, K)`` = ||U_k - I||_F = 2 (1 - p_k) per factor (6.7e-4 at init);
    ``kromhc_ds_error`` 0 up to rounding; the frame's families under the ``kromhc`` prefix."""
    rule = make_rule("kromhc", {"streams": 8})
    chain = rule.build_chain(4, 2).to(D)
    stats = rule.make_stats(2, None)
    S = torch.randn(5, 8, 4, dtype=D)
    layer = chain.merges[1]
    pre, res, post = layer.coefficients(S)
    stats.update(1, pre=pre, res=res, post=post, factors=layer.factor_matrices(S))
    out = stats.compute()
    p = 1 / (1 + math.exp(-8))
    torch.testing.assert_close(out["kromhc_factor_identity_dist"][1], torch.full((3,), 2 * (1 - p),
                                                                                    dtype=D), rtol=1e-12, atol=0)
    assert torch.isnan(out["kromhc_factor_identity_dist"][0]).all()
    assert out["kromhc_ds_error"][1] < 1e-15
    assert set(out) == {"kromhc_res_identity_dist", "kromhc_ds_error", "kromhc_pre_mean", "kromhc_post_mean",
                        "kromhc_factor_identity_dist"}
