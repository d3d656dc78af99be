"""dwa: DenseFormer's depth-weighted average (the spec's formula, fp64): the sources and weight counts, the runtime
against the oracle forward and backward, the identity init, the blocks the surgery groups, the history kept without
O(depth^2) copies (saved bytes), the in-place writes it refuses, the diagnostics. The comparison with the official
``DWAModules`` (epfml/DenseFormer) is in docs/rules/dwa.md."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_resctl import patch_residuals, saved_tensor_bytes
from lightning_resctl.rules import make_rule
from lightning_resctl.rules.dwa import averaging_blocks, dwa_chain_reference, dwa_num_weights, dwa_sources
from lightning_resctl.surgery import merge_sites
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT, PreNormBlock, PreNormNet

D = torch.float64
C = 8


def test_sources_and_weight_counts():
    """The average after block i reads X_j, j = i mod k, in weight order (the last is X_i); the 1 x 1 DenseFormer
    has d(d+3)/2 weights (paper §3.1); a 4 x 5 one of 48 blocks averages after blocks 5, 10, .., 45 with 62."""
    assert dwa_sources(7, 3) == [1, 4, 7] and dwa_sources(5, 1) == [0, 1, 2, 3, 4, 5] and dwa_sources(2, 4) == [2]
    assert sum(dwa_num_weights(i) for i in averaging_blocks(6)) == 6 * 9 // 2
    assert averaging_blocks(48, 5) == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    assert sum(dwa_num_weights(i, 4) for i in averaging_blocks(48, 5)) == 2 + 3 + 4 + 6 + 7 + 8 + 9 + 11 + 12


def _pair(depth=6, **options):
    """(patched PreNormNet, its unpatched twin, x, the chain module) in fp64, the weights off their init."""
    torch.manual_seed(0)
    net = PreNormNet(depth, C).double()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, C, dtype=D)
    report = patch_residuals(net, method="dwa", example_input=(x,), **options)
    chain = report.chains[0].module
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in chain.averages.values():
            w.weight.add_(torch.randn(w.weight.shape, generator=g, dtype=D))
    return net, ref, x, chain


def test_two_blocks_written_out():
    net, ref, x, chain = _pair(depth=2)
    a1, a2 = chain.averages["1"].weight, chain.averages["2"].weight
    x0 = ref.emb(x)
    x1 = ref.blocks[0](x0)
    y1 = a1[0] * x0 + a1[1] * x1
    x2 = ref.blocks[1](y1)
    y2 = a2[0] * x0 + a2[1] * x1 + a2[2] * x2
    torch.testing.assert_close(net(x), ref.head(y2), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("options", [{}, {"dilation": 2, "period": 3}, {"dilation": 2, "period": 2,
                                                                             "schedule": "grouped"}],
                         ids=["1x1", "2x3", "2x2-grouped"])
def test_runtime_matches_the_oracle_forward_and_backward(options):
    net, ref, x, chain = _pair(**options)
    alphas = {int(i): w.weight.detach().clone().requires_grad_() for i, w in chain.averages.items()}
    want = ref.head(dwa_chain_reference(ref.emb(x), list(ref.blocks), alphas, **options))
    got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(want)
    (want * w).sum().backward()
    (got * w).sum().backward()
    theirs = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        g_want = alphas[int(name.split(".")[2])].grad if "_resctl" in name else theirs[name].grad
        torch.testing.assert_close(p.grad, g_want, rtol=1e-11, atol=1e-12, msg=name)


@pytest.mark.parametrize("options", [{}, {"dilation": 4, "period": 5}], ids=["1x1", "4x5"])
def test_identity_at_init_is_bitwise(options):
    torch.manual_seed(0)
    model = NanoGPT(n_layer=5, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    idx = torch.randint(0, 32, (2, 8))
    want = model(idx)
    patch_residuals(model, method="dwa", **options)
    assert make_rule("dwa", options).identity_at_init is True
    assert torch.equal(model(idx), want)


class _OneMergeBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.f = nn.Linear(c, c)

    def forward(self, x):
        return x + self.f(torch.tanh(x))


class _TiedNet(nn.Module):
    """One PreNormBlock called three times (a weight-tied loop)."""

    def __init__(self, c):
        super().__init__()
        self.block = PreNormBlock(c)

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return x


@pytest.mark.parametrize("model,blocks", [
    (lambda: PreNormNet(3, C), (2, 2, 2)),
    (lambda: nn.Sequential(*[_OneMergeBlock(C) for _ in range(4)]), (1, 1, 1, 1)),
    (lambda: _TiedNet(C), (2, 2, 2)),
], ids=["two-merges-per-block", "one-merge-per-block", "weight-tied"])
def test_averages_sit_after_the_models_blocks(model, blocks):
    """The surgery groups the merges by the module of the model's stack that runs them (a repeated call: a new
    block); the report's chain note says DWA acts per block."""
    report = patch_residuals(model(), method="dwa", example_input=(torch.randn(2, 3, C),))
    chain = report.chains[0].module
    assert chain.model_blocks == blocks and sorted(map(int, chain.averages)) == list(range(1, len(blocks) + 1))
    ends = [sum(blocks[:i + 1]) - 1 for i in range(len(blocks))]
    assert chain.block_end == {e: i + 1 for i, e in enumerate(ends)}
    assert "DWA acts per block, not per merge" in str(report) and "the surgery's grouping" in str(report)
    assert [s.module is not None for s in report.sites] == [p in ends for p in range(sum(blocks))]


def test_merges_per_block_and_grouped_schedule_options():
    report = patch_residuals(PreNormNet(3, C), method="dwa", example_input=(torch.randn(2, 3, C),),
                             merges_per_block=1)
    chain = report.chains[0].module
    assert chain.model_blocks == (1,) * 6 and len(chain.averages) == 6
    assert "merges_per_block=1" in report.chains[0].note
    with pytest.raises(ValueError, match=r"schedule='grouped' averages after groups of period=2 blocks, but the "
                                         r"chain has 3 blocks"):
        patch_residuals(PreNormNet(3, C), method="dwa", example_input=(torch.randn(2, 3, C),), period=2,
                        schedule="grouped")


@pytest.mark.parametrize("options,match", [
    ({"dilation": 0}, "dilation must be an int >= 1, got 0"),
    ({"period": 1.5}, "period must be an int >= 1, got 1.5"),
    ({"schedule": "c2"}, r"schedule must be one of \('paper', 'grouped'\), got 'c2'"),
    ({"merges_per_block": 0}, "merges_per_block must be an int >= 1 or None, got 0"),
])
def test_bad_options_name_option_and_value(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        patch_residuals(PreNormNet(2, C), method="dwa", example_input=(torch.randn(2, 3, C),), **options)


@pytest.mark.parametrize("depth", [12, 48])
def test_history_costs_one_saved_output_per_block(depth):
    """Autograd saves each block output X_i once, beyond what the plain model saves (the next block reads the
    average, so X_i is kept for the later averages): d stream-sized tensors for d blocks, linear in depth -- where
    stacking the history at every block would save d(d+1)/2 of them."""
    B, T = 2, 4
    counts = {}
    for method in ("plain", "dwa"):
        torch.manual_seed(0)
        net = PreNormNet(depth, C)
        x = torch.randn(B, T, C)
        if method == "dwa":
            patch_residuals(net, method="dwa", example_input=(x,))
        counts[method], _ = saved_tensor_bytes(net, x, exclude=net.parameters())
    assert counts["dwa"] - counts["plain"] == depth * B * T * C * 4


class _InPlaceBlock(_OneMergeBlock):
    def forward(self, x):
        x += self.f(torch.tanh(x))
        return x


def test_an_in_place_write_into_a_kept_output_is_refused():
    """Period 2: block 1 (``x = x + f(x)``) has no average after it, so the model gets its output X_1 itself; block 2
    writes into it in place (``x += f(x)``, after its own average read it), and the average after block 4 would read
    the new values: refused, naming the fix. With period 1 every block hands the model an average, never X_i."""
    x = torch.randn(2, 3, C)
    for period in (2, 1):
        model = nn.Sequential(*[(_OneMergeBlock if i % 2 == 0 else _InPlaceBlock)(C) for i in range(4)]).eval()
        report = patch_residuals(model, method="dwa", example_input=(x,), period=period)
        assert report.chains[0].module.model_blocks == (1, 1, 1, 1)
        if period == 2:
            with torch.no_grad(), pytest.raises(RuntimeError, match=r"in place into the output of block 1 .*out of "
                                                                    r"place \(x = x \+ f\(x\)"):
                model(x)
        else:
            with torch.no_grad():
                assert torch.isfinite(model(x)).all()


def test_stats_are_the_weights_per_block():
    net, _, x, chain = _pair(depth=3)
    rule = merge_sites(net)[0].rule
    stats = rule.make_stats(6, net)
    for site in merge_sites(net):
        site.observer = lambda s, stream, update, streams: rule.observe(
            stats, s.current_position, s, s.current_position, stream, update, s.chain_state)
    net(x)
    out = stats.compute()
    w = out["dwa_weight"]
    assert w.shape == (6, 4)
    for i, weights in chain.averages.items():
        d = 2 * int(i) - 1  # the last merge of block i
        torch.testing.assert_close(w[d, :int(i) + 1], weights.weight.detach())
        assert torch.isnan(w[d, int(i) + 1:]).all()
        assert out["dwa_self_weight"][d] == weights.weight[-1]
    assert torch.isnan(w[0::2]).all()  # the first merge of each block ends no average
