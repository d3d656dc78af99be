"""laurel / laurel-pa: LAuReL's spec (fp64 unless stated): the RW weights, the low-rank init, one merge and a PA chain
written out, the identity init, the variants each name takes, the diagnostics, and the low-rank term against
transformers' Gemma 3n LAuReL block (its deployed form: the block with ``lr_norm``), forward and backward."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_resctl import patch_residuals
from lightning_resctl.rules import make_rule
from lightning_resctl.rules.laurel import LaurelMerge, orthogonal_down_init, rw_weights_reference
from lightning_resctl.surgery import merge_sites
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT, PreNormNet

D = torch.float64
C = 6


def _randomize(module, std=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def test_rw_weights():
    rw = torch.tensor([0.0, math.log(3.0)], dtype=D)
    alpha, beta = rw_weights_reference(rw, "sigmoid")  # 2 sigmoid each: (1, 1.5)
    assert (alpha.item(), beta.item()) == (1.0, pytest.approx(1.5, abs=1e-15))
    alpha, beta = rw_weights_reference(rw, "softmax")  # softmax(0, ln 3) = (1/4, 3/4)
    assert (alpha.item(), beta.item()) == (pytest.approx(0.25, abs=1e-15), pytest.approx(0.75, abs=1e-15))


def test_low_rank_inits():
    """Column-orthogonal A (the paper's LLM runs): 1/sqrt(rC) at [i mod r, i]; B = 0; Xavier (its ResNet runs) drawn
    from the module's own seeded generator: the same again in reset_parameters, other values at another seed."""
    a = orthogonal_down_init(3, 7, D)
    want = torch.zeros(3, 7, dtype=D)
    for i in range(7):
        want[i % 3, i] = 1 / math.sqrt(21)
    assert torch.equal(a, want)
    cfg = make_rule("laurel", {"rank": 3, "lr_init": "xavier"}).config
    m = LaurelMerge(7, cfg, seed=5)
    bound = math.sqrt(6 / 10)
    assert m.laurel_down.abs().max() <= bound and m.laurel_down.std() > bound / 4
    assert torch.equal(m.laurel_up, torch.zeros(1, 7, 3))
    first = m.laurel_down.detach().clone()
    _randomize(m)
    m.reset_parameters()
    assert torch.equal(m.laurel_down, first)
    assert not torch.equal(LaurelMerge(7, cfg, seed=6).laurel_down, first)


@pytest.mark.parametrize("options", [{"variant": "rw"}, {"variant": "lr"}, {"variant": "rw+lr"},
                                     {"variant": "rw+lr", "rw_per_dim": True, "rw_norm": "softmax"}],
                         ids=["rw", "lr", "rw+lr", "rw+lr-per-dim-softmax"])
def test_one_merge_written_out(options):
    cfg = make_rule("laurel", {"rank": 2, **options}).config
    m = _randomize(LaurelMerge(C, cfg).to(D))
    g = torch.Generator().manual_seed(1)
    x, u = torch.randn(4, C, generator=g, dtype=D), torch.randn(4, C, generator=g, dtype=D)
    alpha = beta = torch.ones((), dtype=D)
    if "rw" in cfg.variant:
        a, b = m.laurel_rw
        alpha, beta = ((torch.exp(a) / (torch.exp(a) + torch.exp(b)), torch.exp(b) / (torch.exp(a) + torch.exp(b)))
                       if cfg.rw_norm == "softmax" else (2 / (1 + torch.exp(-a)), 2 / (1 + torch.exp(-b))))
    g_x = x + (x @ m.laurel_down[0].T @ m.laurel_up[0].T if "lr" in cfg.variant else 0)
    torch.testing.assert_close(m(x, u), alpha * u + beta * g_x, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("variant", ["pa", "rw+lr+pa"])
def test_pa_chain_written_out_forward_and_backward(variant):
    """Merge i: ``x_{i+1} = alpha u_i + beta (x_i + sum_j gamma_j h_j(x_{i-j}))`` over the streams entering merges
    i, i-1, i-2 (the ones before the chain's first merge are absent); h_j = B_j A_j with LR, else the identity."""
    torch.manual_seed(0)
    net = PreNormNet(3, C).double()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, C, dtype=D)
    report = patch_residuals(net, method="laurel-pa", example_input=(x,), variant=variant, rank=2)
    chain = _randomize(report.chains[0].module)
    merges = list(chain.merges)
    stream = ref.emb(x)
    streams = []
    for b in ref.blocks:
        for f in (lambda v, b=b: b.f1(torch.tanh(b.ln1(v))), lambda v, b=b: b.f2(b.ln2(v))):
            m = merges[len(streams)]
            streams.insert(0, stream)
            u = f(stream)
            terms = stream
            for j, v in enumerate(streams[:3]):
                h = v @ m.laurel_down[j].T @ m.laurel_up[j].T if m.lr else v
                terms = terms + m.laurel_gamma[j] * h
            alpha, beta = m.weights() if m.rw else (1.0, 1.0)
            stream = alpha * u + beta * terms
    want = ref.head(stream)
    got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the written-out run used the patched model's rule parameters: their gradients, and the blocks', agree
    w = torch.randn_like(want)
    rule_grads = torch.autograd.grad((want * w).sum(), list(chain.parameters()), retain_graph=True)
    (want * w).sum().backward()
    (got * w).sum().backward()
    for (name, p), g_want in zip(chain.named_parameters(), rule_grads):
        torch.testing.assert_close(p.grad, 2 * g_want, rtol=1e-11, atol=1e-12, msg=name)  # (both runs added theirs)
    theirs = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        if "_resctl" not in name:
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-11, atol=1e-12, msg=name)


@pytest.mark.parametrize("method,options", [("laurel", {}), ("laurel", {"variant": "rw", "rw_per_dim": True}),
                                            ("laurel", {"lr_norm": True, "lr_init": "xavier"}), ("laurel-pa", {}),
                                            ("laurel-pa", {"variant": "pa"})])
def test_identity_at_init_is_bitwise(method, options):
    torch.manual_seed(0)
    model = NanoGPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    idx = torch.randint(0, 32, (2, 8))
    want = model(idx)
    patch_residuals(model, method=method, **options)
    assert torch.equal(model(idx), want)
    assert make_rule(method).identity_at_init == {"rw_norm": "sigmoid"}
    if "rw" in make_rule(method, options).config.variant:
        other = NanoGPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8)
        other.load_state_dict(model.state_dict(), strict=False)
        patch_residuals(other, method=method, rw_norm="softmax", **options)  # (x + u) / 2: not the plain network
        assert not torch.allclose(other(idx), want)


def test_each_name_takes_its_variants():
    with pytest.raises(ValueError, match=r"variant='rw\+pa' is a variant of method='laurel-pa' \(previous "
                                         r"activations"):
        patch_residuals(NanoGPT(n_layer=1), method="laurel", variant="rw+pa")
    with pytest.raises(ValueError, match=r"variant='rw' is a variant of method='laurel'; this method takes "
                                         r"\('pa', 'rw\+pa', 'lr\+pa', 'rw\+lr\+pa'\)"):
        patch_residuals(NanoGPT(n_layer=1), method="laurel-pa", variant="rw")
    with pytest.raises(ValueError, match="history must be an int >= 1, got 0"):
        patch_residuals(NanoGPT(n_layer=1), method="laurel-pa", history=0)
    assert make_rule("laurel").kind == "merge" and make_rule("laurel-pa").kind == "chain"
    assert make_rule("laurel").config.variant == "rw+lr" and make_rule("laurel-pa").config.variant == "rw+lr+pa"


def test_gemma3n_laurel_block_is_the_low_rank_term_with_lr_norm():
    """transformers' Gemma 3n ``Gemma3nTextLaurelBlock``: ``x + RMSNorm(W_right W_left x)`` (its post-norm weight,
    eps 1e-6). With ``variant="lr"``, ``lr_norm=True`` and its weights (W_left = A, W_right = B, the norm weight), a
    merge is ``u + block(x)``: forward and backward (x, u and the three weights) in fp32, random non-init weights."""
    pytest.importorskip("transformers")
    from transformers import Gemma3nTextConfig
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextLaurelBlock

    torch.manual_seed(0)
    cfg = Gemma3nTextConfig(hidden_size=16, laurel_rank=4, rms_norm_eps=1e-6)
    block = Gemma3nTextLaurelBlock(cfg)
    with torch.no_grad():
        block.post_laurel_norm.weight.add_(torch.randn(16) * 0.5)
    ours = LaurelMerge(16, make_rule("laurel", {"variant": "lr", "rank": 4, "lr_norm": True, "eps": 1e-6}).config)
    with torch.no_grad():
        ours.laurel_down[0].copy_(block.linear_left.weight)
        ours.laurel_up[0].copy_(block.linear_right.weight)
        ours.laurel_norm_weight[0].copy_(block.post_laurel_norm.weight)
    x = torch.randn(3, 5, 16, requires_grad=True)
    u = torch.randn(3, 5, 16, requires_grad=True)
    want, got = u + block(x), ours(x, u)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(want)
    g_want = torch.autograd.grad((want * w).sum(), [x, u, block.linear_left.weight, block.linear_right.weight,
                                                    block.post_laurel_norm.weight])
    g_got = torch.autograd.grad((got * w).sum(), [x, u, ours.laurel_down, ours.laurel_up, ours.laurel_norm_weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=1e-5)


def test_stats():
    """``laurel_alpha`` / ``laurel_beta`` (1 at init), ``laurel_lr_norm`` = ||B A||_F (0 at init), ``laurel_lr_ratio``
    = RMS of the LR / PA term over the stream's, ``laurel_gamma`` per previous activation."""
    torch.manual_seed(0)
    model = NanoGPT(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    idx = torch.randint(0, 32, (2, 8))
    report = patch_residuals(model, method="laurel-pa", rank=2)
    chain = report.chains[0].module
    rule = merge_sites(model)[0].rule
    stats = rule.make_stats(2, model)
    for site in merge_sites(model):
        site.observer = lambda s, stream, update, streams: rule.observe(
            stats, s.current_position, s, s.current_position, stream, update, s.chain_state)
    model(idx)
    out = stats.compute()
    assert torch.equal(out["laurel_alpha"], torch.ones(2, dtype=D)) and torch.equal(out["laurel_lr_norm"],
                                                                                     torch.zeros(2, dtype=D))
    assert torch.equal(out["laurel_lr_ratio"], torch.zeros(2, dtype=D))
    assert out["laurel_gamma"].shape == (2, 3) and torch.equal(out["laurel_gamma"], torch.ones(2, 3, dtype=D))
    with torch.no_grad():
        chain.merges[1].laurel_up.fill_(0.1)
    stats.reset()
    model(idx)
    m = chain.merges[1]
    want = torch.linalg.matrix_norm(m.laurel_up[0].double() @ m.laurel_down[0].double())
    out = stats.compute()
    assert out["laurel_lr_norm"][1] == pytest.approx(want.item(), rel=1e-12) and out["laurel_lr_ratio"][1] > 0
