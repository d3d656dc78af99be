"""Lines that run in one mode only (issue 27, item 1).

A block whose training and evaluation take different lines (``if self.ckpt and self.training:
x = x + checkpoint(f, x)`` / ``else: x = x + f(x)``) must be patched in both: the patched network in either
mode equals the same model written with a single line, patched the same way, with the same weights. A chain
forward that runs none, or only part, of the merges it expected raises instead of giving another network.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_resctl import merge_rules
from lightning_resctl.rules import get_merge_rule
from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

C = 8
RULES = sorted(merge_rules())
CHAIN_RULES = [m for m in RULES if get_merge_rule(m).kind == "chain"]
PER_MERGE_RULES = [m for m in RULES if get_merge_rule(m).kind != "chain"]
CHECKPOINTABLE = [m for m in RULES if get_merge_rule(m).rule_class.supports_checkpointing]
assert {"add", "rescontroller"} <= set(CHECKPOINTABLE)


def _through(f, x):
    """Stands in for ``torch.utils.checkpoint`` on the training line (chain rules refuse checkpointing)."""
    return f(x)


class Block(nn.Module):
    """``lines``: "one" (the same line in both modes), "train" (training takes its own line), "eval" (evaluation
    takes its own line), "ckpt" (training runs the branch under non-reentrant activation checkpointing)."""

    def __init__(self, lines: str):
        super().__init__()
        self.lines = lines
        self.f = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))

    def forward(self, x):
        if self.lines == "train" and self.training:
            x = x + _through(self.f, x)
        elif self.lines == "ckpt" and self.training:
            x = x + checkpoint(self.f, x, use_reentrant=False)
        elif self.lines == "eval" and not self.training:
            x = x + _through(self.f, x)
        else:
            x = x + self.f(x)
        return x


class Net(nn.Module):
    def __init__(self, lines: str = "one", depth: int = 3):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(Block(lines) for _ in range(depth))
        self.head = nn.Linear(C, 3)

    def forward(self, x, skip=()):
        x = self.emb(x)
        for i, b in enumerate(self.blocks):
            if i not in skip:
                x = b(x)
        return self.head(x)


def _x(seed=0):
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed))


def _pair(lines: str, method: str, patch_training: bool):
    """(model with ``lines``, the single-line reference), both patched with ``method`` while in training or
    eval mode, the rule's parameters moved off their init, the same weights in both."""
    torch.manual_seed(0)
    model = Net(lines)
    ref = Net("one")
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        m.train(patch_training)
    return _patched_alike(model, ref, method)


def _patched_alike(model, ref, method: str):
    """``model`` and ``ref`` patched with ``method``, the rule's parameters of ``model`` moved off their init
    and every weight of ``model`` loaded into ``ref``."""
    report = patch_residuals(model, method=method, example_input=(_x(),))
    patch_residuals(ref, method=method, example_input=(_x(),))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {k: p.grad for k, p in model.named_parameters()}


def _assert_same_in_both_modes(model, ref, x):
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    model.train()
    ref.train()
    out, grads = _grads(model, x)
    out_ref, grads_ref = _grads(ref, x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        assert grads_ref[k] is not None, k
        assert grads[k] is not None, f"{k} got no gradient"
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("patch_training", [True, False], ids=["patched-in-train", "patched-in-eval"])
@pytest.mark.parametrize("lines", ["train", "eval"])
@pytest.mark.parametrize("method", RULES)
def test_lines_of_either_mode_are_patched(method, lines, patch_training):
    model, ref = _pair(lines, method, patch_training)
    x = _x(1)
    _assert_same_in_both_modes(model, ref, x)
    if method != "add":  # the patched network is not the unpatched one (the comparison above is not vacuous)
        plain = Net(lines)
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()})
        for mode in (True, False):
            plain.train(mode)
            model.train(mode)
            with torch.no_grad():
                assert not torch.allclose(model(x), plain(x), rtol=1e-3, atol=1e-4)
    # each line of a block calls that block's one site: the merges and their parameters are those of one line
    assert len(merge_sites(model)) == len(merge_sites(ref)) == 3


@pytest.mark.parametrize("patch_training", [True, False], ids=["patched-in-train", "patched-in-eval"])
@pytest.mark.parametrize("method", CHECKPOINTABLE)
def test_checkpointed_training_line_and_plain_eval_line(method, patch_training):
    model, ref = _pair("ckpt", method, patch_training)
    _assert_same_in_both_modes(model, ref, _x(1))


class EvalExtra(nn.Module):
    """A merge that runs only in eval mode, with a branch of its own (``always``: in both modes)."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always
        self.a = nn.Linear(C, C)
        self.g = nn.Linear(C, C)
        self.b = nn.Linear(C, C)

    def forward(self, x):
        x = x + self.a(x)
        if self.always or not self.training:
            x = x + self.g(x)
        return x + self.b(x)


@pytest.mark.parametrize("method", PER_MERGE_RULES)
def test_per_merge_rule_patches_an_eval_only_merge(method):
    torch.manual_seed(0)
    model, ref = _patched_alike(EvalExtra(), EvalExtra(always=True), method)
    assert [s.source_line for s in get_patch_report(model).sites] == [
        "x = x + self.a(x)", "return x + self.b(x)", "x = x + self.g(x)"]
    model.eval()
    ref.eval()
    x = _x(1)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", CHAIN_RULES)
def test_chain_rule_refuses_an_eval_only_merge_without_a_training_merge(method):
    with pytest.raises(ValueError, match=r"x = x \+ self\.g\(x\).*only in eval mode"):
        patch_residuals(EvalExtra(), method=method, example_input=(_x(),))


class Respelled(nn.Module):
    """Training and evaluation write the same merge differently (``x = x + f(x)`` / ``x += f(x)``)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(C, C)

    def forward(self, x):
        x = x * 1.0
        if self.training:
            x = x + self.f(x)
        else:
            x += self.f(x)
        return x


@pytest.mark.parametrize("method", ["rescontroller", "mgr"])
def test_a_merge_written_differently_in_each_mode_is_refused(method):
    with pytest.raises(ValueError, match=r"x \+= self\.f\(x\).*written differently"):
        patch_residuals(Respelled(), method=method, example_input=(_x(),))


@pytest.mark.parametrize("method", CHAIN_RULES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_chain_forward_running_none_or_part_of_its_merges_raises(method, training):
    torch.manual_seed(0)
    model = Net("train")
    patch_residuals(model, method=method, example_input=(_x(),))
    model.train(training)
    x = _x(1)
    with pytest.raises(RuntimeError, match=r"residual chain 0 ran none of its 3 merges.*blocks\.0"):
        model(x, skip=(0, 1, 2))
    with pytest.raises(RuntimeError, match=r"merge 2 of residual chain 0 .*ran where merge 1 \(blocks\.1"):
        model(x, skip=(1,))
    with pytest.raises(RuntimeError, match=r"merge 1 of residual chain 0 .*ran where merge 0 \(blocks\.0"):
        model(x, skip=(0,))
    # and the next forward is whole again
    ref = copy.deepcopy(model)
    torch.testing.assert_close(model(x), ref(x))


_NO_SOURCE: dict = {}
exec("def residual(x, f):\n    return x + f(x)\n", _NO_SOURCE)  # no source file: cannot be rewritten


class EvalLineWithoutSource(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(C, C)

    def forward(self, x):
        if self.training:
            return x + self.f(x)
        return _NO_SOURCE["residual"](x, self.f)


@pytest.mark.parametrize("method", ["rescontroller", "mgr"])
def test_an_eval_line_that_cannot_be_rewritten_is_refused_beside_its_patched_training_line(method):
    with pytest.raises(ValueError, match=r"runs only in eval mode where the merge at .*'return x \+ self\.f\(x\)'.*"
                                         r"cannot be patched: cannot rewrite the function residual"):
        patch_residuals(EvalLineWithoutSource(), method=method, example_input=(_x(),))


@pytest.mark.parametrize("method", RULES)
def test_the_transformer_encoder_fast_path_does_not_bypass_the_patched_lines(method):
    """``nn.TransformerEncoderLayer`` in eval under ``no_grad`` (how Lightning validates) would run a fused kernel
    instead of its Python forward, skipping every patched merge: the patch turns that fast path off for the layers
    it rewrites, so validation runs the patched network; unpatching turns it back on."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=False)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        before = enc(x, src_key_padding_mask=mask)
    patch_residuals(enc, method=method, example_input=x)
    enc.eval()
    want = enc(x)  # with autograd recording, the Python forward runs: the patched merges
    with torch.no_grad():
        got = enc(x)
        enc(x, src_key_padding_mask=mask)  # the encoder's nested-tensor path is not taken either
    # (the attention's own fused kernel under no_grad rounds differently: ~1e-6, not the 0.1-1 of a bypassed merge)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(enc(x), want, rtol=1e-5, atol=1e-5)
    from lightning_resctl import unpatch_residuals

    unpatch_residuals(enc)
    with torch.no_grad():
        torch.testing.assert_close(enc(x, src_key_padding_mask=mask), before, rtol=0, atol=0, equal_nan=True)
    assert before.is_nested is False
    assert all(l.activation_relu_or_gelu == 1 for l in enc.layers)


class LoopNet(nn.Module):
    """The two lines in the model's own loop over blocks (one expression per mode runs every merge), with
    dropout in the branches (a no-op in eval, so the branches' ops differ between the modes)."""

    def __init__(self, two: bool):
        super().__init__()
        self.two = two
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(C), nn.Linear(C, C), nn.Dropout(0.1))
                                    for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            if self.two and self.training:
                x = x + _through(b, x)
            else:
                x = x + b(x)
        return x


@pytest.mark.parametrize("method", RULES)
def test_lines_of_either_mode_in_a_loop_over_blocks(method):
    x = _x(1)
    torch.manual_seed(0)
    model, ref = _patched_alike(LoopNet(True), LoopNet(False), method)
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    (site,) = merge_sites(model)
    assert site.positions == (0, 1, 2)
