"""ddl: Deep Delta Learning's spec (d_v = 1, fp64): one merge written out with its numbers, the readout error's
contraction by (1 - beta), the patched model against the formula merge by merge, the gate's init, the seeded init,
gradcheck and the diagnostics. The comparison with the official model file (yifanzhang-pro/deep-delta-learning
``model/DDL-vdim1-gpt-mha-rope.py``) is in docs/rules/ddl.md."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_resctl import patch_residuals
from lightning_resctl.rules import make_rule
from lightning_resctl.rules.ddl import DDLMerge, beta_bias_init, ddl_reference
from lightning_resctl.surgery import merge_sites
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT, PreNormNet

D = torch.float64


def _merge(width, **options):
    return DDLMerge(width, make_rule("ddl", options).config).to(D)


def test_one_merge_written_out():
    """x = (3, 0, 4), h = (0, 2, 0): k = (0, 1, 0), k.x = 0; beta = 2 sigmoid(0) = 1 (w_beta = 0, b = 0); the paper's
    v = w_v . c with w_v = e_0 reads c_0 = 3 / sqrt(25/3); the code's v = 4 sigmoid(0) = 2: the write replaces the
    readout along k by v (eps 0 everywhere)."""
    x, h = torch.tensor([[3.0, 0.0, 4.0]], dtype=D), torch.tensor([[0.0, 2.0, 0.0]], dtype=D)
    for value, v in (("paper", 3 / math.sqrt(25 / 3)), ("code", 2.0)):
        m = _merge(3, value=value, k_eps=0.0, eps=0.0)
        with torch.no_grad():
            m.ddl_beta_weight.zero_()
            m.ddl_value_weight.copy_(torch.tensor([1.0, 0.0, 0.0]) if value == "paper" else torch.zeros(3))
            if value == "code":
                m.ddl_value_bias.zero_()
        torch.testing.assert_close(m(x, h), torch.tensor([[3.0, v, 4.0]], dtype=D), rtol=0, atol=1e-15)


@pytest.mark.parametrize("value", ["paper", "code"])
def test_the_readout_error_contracts_by_one_minus_beta(value):
    """``e = k.x - v``: after the merge ``e' = (1 - beta) e`` (|k| = 1 with eps_k = 0), per token, whatever beta."""
    m = _merge(8, value=value, k_eps=0.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.ddl_beta_weight.copy_(torch.randn(8, generator=g, dtype=D))
        m.ddl_beta_bias.fill_(0.3)
    x, h = torch.randn(16, 8, generator=g, dtype=D), torch.randn(16, 8, generator=g, dtype=D)
    out, beta, proj, v = m(x, h, parts=True)
    k = h / h.norm(dim=-1, keepdim=True)
    torch.testing.assert_close((k * x).sum(-1, keepdim=True), proj)
    torch.testing.assert_close((k * out).sum(-1, keepdim=True) - v, (1 - beta) * (proj - v), rtol=1e-12, atol=1e-12)
    assert ((beta > 0) & (beta < 2)).all() and not torch.allclose(beta, torch.ones_like(beta))
    # orthogonal to k nothing changes
    torch.testing.assert_close(out - (k * out).sum(-1, keepdim=True) * k, x - (k * x).sum(-1, keepdim=True) * k)


def test_patched_model_is_the_formula_merge_by_merge():
    """Each merge: the stream is x, the sub-layer's output is h (each merge its own gate and value)."""
    torch.manual_seed(0)
    net = PreNormNet(2, 8).double()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, dtype=D)
    report = patch_residuals(net, method="ddl", example_input=(x,))
    mods = [s.module for s in report.sites]
    assert len({id(m) for m in mods}) == 4 and len({m.ddl_beta_weight[0].item() for m in mods}) == 4
    s = ref.emb(x)
    i = 0
    for b in ref.blocks:
        for f in (lambda v, b=b: b.f1(torch.tanh(b.ln1(v))), lambda v, b=b: b.f2(b.ln2(v))):
            m = mods[i]
            s = ddl_reference(s, f(s), m.ddl_beta_weight, m.ddl_beta_bias, m.ddl_value_weight)
            i += 1
    torch.testing.assert_close(net(x), ref.head(s), rtol=1e-13, atol=1e-13)


def test_gradcheck():
    m = _merge(5, value="code")
    x = torch.randn(3, 5, dtype=D, requires_grad=True)
    h = torch.randn(3, 5, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, h, *p: m(x, h), (x, h, *m.parameters()))


def test_gate_init_and_not_the_plain_network():
    """b_beta = logit(beta_0 / 2), the probability clamped to [1e-6, 1 - 1e-6]; no init gives x + h."""
    assert beta_bias_init(1.0) == 0.0
    assert beta_bias_init(0.0) == pytest.approx(math.log(1e-6 / (1 - 1e-6)))
    assert beta_bias_init(2.0) == pytest.approx(-math.log(1e-6 / (1 - 1e-6)))
    assert _merge(4, beta_init=0.5).ddl_beta_bias.item() == pytest.approx(math.log(0.25 / 0.75))
    assert make_rule("ddl").identity_at_init is False
    torch.manual_seed(0)
    model = NanoGPT(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    idx = torch.randint(0, 32, (2, 8))
    want = model(idx)
    patch_residuals(model, method="ddl")
    assert not torch.allclose(model(idx), want)
    with pytest.raises(ValueError, match=r"beta_init must be in \[0, 2\], got 2.5"):
        make_rule("ddl", {"beta_init": 2.5})
    with pytest.raises(ValueError, match=r"value must be one of \('paper', 'code'\), got 'linear'"):
        make_rule("ddl", {"value": "linear"})


def test_init_is_seeded_per_merge_and_reset_gives_it_back():
    """The weights are N(0, (0.5/sqrt(C))^2) from a generator of each merge's own, seeded from torch's seed: the same
    model patched twice after the same torch.manual_seed gets the same init, each merge its own draw, and
    reset_parameters restores it."""
    inits = []
    for _ in range(2):
        torch.manual_seed(3)
        model = NanoGPT(n_layer=2, n_embd=64, n_head=2, vocab_size=32, block_size=8)
        report = patch_residuals(model, method="ddl", value="code")
        inits.append({n: model.get_parameter(n).detach().clone() for n in report.new_parameters})
    assert inits[0].keys() == inits[1].keys() and all(torch.equal(v, inits[1][k]) for k, v in inits[0].items())
    weights = [v for k, v in inits[0].items() if k.endswith("ddl_beta_weight")]
    assert len(weights) == 4 and not torch.equal(weights[0], weights[1])
    assert torch.cat(weights).std().item() == pytest.approx(0.5 / 8, rel=0.15)
    m = merge_sites(model)[0].module
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    m.reset_parameters()
    for n, p in m.named_parameters():
        assert torch.equal(p, inits[1][f"{report.new_parameters[0].rsplit('.', 1)[0]}.{n}"]), n
    with torch.device("meta"):  # meta-device init (FSDP): to_empty, then reset_parameters gives the same draw
        meta = DDLMerge(64, m.config, seed=m.seed)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(meta.parameters(), m.parameters()))


def test_stats_are_the_gate_and_the_readout():
    torch.manual_seed(0)
    model = NanoGPT(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    idx = torch.randint(0, 32, (2, 8))
    patch_residuals(model, method="ddl", beta_init=0.5)
    rule = merge_sites(model)[0].rule
    stats = rule.make_stats(2, model)
    seen = []
    for site in merge_sites(model):
        def obs(s, stream, update, streams):
            seen.append(s.module(stream, update, parts=True))
            rule.observe(stats, s.current_position, s, s.current_position, stream, update, None)
        site.observer = obs
    model(idx)
    out = stats.compute()
    for d, (_, beta, proj, v) in enumerate(seen):
        assert out["ddl_beta_mean"][d].item() == pytest.approx(beta.double().mean().item(), rel=1e-6)
        assert out["ddl_proj_rms"][d].item() == pytest.approx(proj.double().square().mean().sqrt().item(), rel=1e-6)
        assert out["ddl_value_mean"][d].item() == pytest.approx(v.double().mean().item(), rel=1e-6, abs=1e-9)
    assert 0 < out["ddl_beta_mean"][0] < 1  # beta_0 = 0.5 plus the gate's random part
