"""Residual merges inside plain functions called from a module's forward (issue 13).

HF Falcon and Bloom merge through ``dropout_add(x, residual, prob, training)``; user code through helpers and
``functools.partial`` of them. Each such merge is patched for its call site only: the caller's call is
redirected to a rewritten copy of the function, other callers of the function are untouched, the report names
the function and its file:line, ``method="add"`` is bitwise and ``unpatch_residuals`` restores the original.
"""
from __future__ import annotations

import copy
import functools
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_resctl.surgery import merge_sites, patch_residuals, unpatch_residuals

C = 16
SEQ = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3))


def residual_add(x, update):
    return x + update                                     # LINE_RESIDUAL_ADD


def dropout_add(x, residual, prob, training):
    out = F.dropout(x, p=prob, training=training)
    return residual + out                                 # LINE_DROPOUT_ADD


def outer_helper(x, branch):
    return residual_add(x, branch(x))                     # a merge two calls below the method


def other_caller(a, b):
    """Another caller of ``residual_add``: never redirected."""
    return residual_add(a, b)


def _line(tag: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith("# " + tag))


class HelperBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))

    def forward(self, x):
        x = residual_add(x, self.attn(self.ln_1(x)))      # CALL_ATTN
        x = residual_add(x, self.mlp(self.ln_2(x)))       # CALL_MLP
        return x


class PartialBlock(nn.Module):
    """A partial of a free function held by the module, the update passed first (stream second)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(C, C)
        self.ffn = nn.Linear(C, C)
        self.merge = functools.partial(dropout_add, prob=0.0, training=False)

    def forward(self, x):
        x = self.merge(self.attn(x), x)
        x = self.merge(self.ffn(x), residual=x)
        return x


class NestedBlock(nn.Module):
    """The merge is in residual_add, called from outer_helper, called from the method."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(C, C)

    def forward(self, x):
        return outer_helper(x, self.mlp)


class InnerDefBlock(nn.Module):
    """A function defined inside forward is part of its source: patched like an addition of forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        def step(h, f):
            return h + f(h)

        x = step(x, self.a)
        x = step(x, self.b)
        return x


class Stack(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(C, C)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _check_add_and_unpatch(make, x, n_sites):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    before = model(x)
    report = patch_residuals(model, method="add", example_input=x)
    assert len(report.sites) == n_sites, report
    torch.manual_seed(0)
    out = model(x)
    assert torch.equal(out, before)
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    unpatch_residuals(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert torch.equal(model(x), before)
    return report


def _train_step_finite(make, x, method, **options):
    torch.manual_seed(0)
    model = make()
    report = patch_residuals(model, method=method, example_input=x, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(x) if not isinstance(x, dict) else model(**x)
    out = getattr(out, "logits", out)
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    opt.step()
    out = model(x) if not isinstance(x, dict) else model(**x)
    assert torch.isfinite(getattr(out, "logits", out)).all()
    return report


# ---------------------------------------------------------------------------------------------- user helpers
def test_helper_function_is_patched_per_call_site_and_reported_with_its_location():
    report = _check_add_and_unpatch(lambda: Stack(HelperBlock(), HelperBlock()), SEQ, 4)
    assert [c.length for c in report.chains] == [4]
    assert all(s.function == "residual_add" for s in report.sites)
    assert {s.location.rsplit(":", 1)[1] for s in report.sites} == {str(_line("LINE_RESIDUAL_ADD"))}
    assert [s.called_at.rsplit(":", 1)[1] for s in report.sites] == \
        [str(_line("CALL_ATTN")), str(_line("CALL_MLP"))] * 2
    assert [s.branch for s in report.sites] == ["attn", "mlp"] * 2
    assert "residual_add() called at" in str(report)
    # one site per call site: the two calls of one block have their own sites
    model = Stack(HelperBlock())
    patch_residuals(model, method="add", example_input=SEQ)
    assert len(merge_sites(model)) == 2 and len({id(s) for s in merge_sites(model)}) == 2


def test_other_callers_of_the_function_are_untouched():
    model = Stack(HelperBlock())
    code = residual_add.__code__
    patch_residuals(model, method="add", example_input=SEQ)
    calls = []
    for site in merge_sites(model):
        site.observer = lambda site, stream, update, streams: calls.append(site)
    a, b = torch.randn(3, C), torch.randn(3, C)
    assert torch.equal(residual_add(a, b), a + b) and torch.equal(other_caller(a, b), a + b)
    assert calls == [] and residual_add.__code__ is code
    model(SEQ)
    assert len(calls) == 2


def test_functools_partial_with_the_stream_as_second_argument():
    report = _check_add_and_unpatch(lambda: Stack(PartialBlock()), SEQ, 2)
    assert [s.function for s in report.sites] == ["dropout_add"] * 2
    assert [s.stream_operand for s in report.sites] == ["left", "left"]  # `residual + out`
    assert [s.branch for s in report.sites] == ["attn", "mlp"]
    assert [c.length for c in report.chains] == [2]


def test_merge_two_function_calls_below_the_method():
    report = _check_add_and_unpatch(lambda: Stack(NestedBlock(), NestedBlock()), SEQ, 2)
    assert [s.function for s in report.sites] == ["residual_add"] * 2
    assert [c.length for c in report.chains] == [2]


def test_function_defined_inside_forward_is_part_of_its_source():
    report = _check_add_and_unpatch(lambda: Stack(InnerDefBlock()), SEQ, 2)
    assert [s.function for s in report.sites] == ["", ""]  # lexically in forward: no call site to redirect
    assert [s.source_line for s in report.sites] == ["return h + f(h)"] * 2


@pytest.mark.parametrize("method", ["rescontroller", "mgr"])
def test_function_merges_train_with_the_other_rules(method):
    def make():
        return Stack(HelperBlock(), PartialBlock(), NestedBlock())

    report = _train_step_finite(make, SEQ, method, backend="torch") if method == "rescontroller" \
        else _train_step_finite(make, SEQ, method)
    assert len(report.sites) == 5 and [c.length for c in report.chains] == [5]


def test_pickle_and_deepcopy_of_a_model_with_function_merges():
    model = Stack(HelperBlock(), PartialBlock())
    patch_residuals(model, method="rescontroller", example_input=SEQ, backend="torch")
    want = model(SEQ)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert torch.equal(clone(SEQ), want)
        assert len(merge_sites(clone)) == 4


def test_replacing_the_function_after_patching_is_a_clear_error():
    model = Stack(PartialBlock())
    patch_residuals(model, method="add", example_input=SEQ)
    model.blocks[0].merge = lambda x, residual: residual + x
    with pytest.raises(RuntimeError, match="was patched as a call of dropout_add"):
        model(SEQ)


# ---------------------------------------------------------------------------------------------- HF Falcon, Bloom
transformers = pytest.importorskip("transformers")
T = transformers
_LM = dict(vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _falcon(parallel):
    return T.FalconForCausalLM(T.FalconConfig(**_LM, num_hidden_layers=3, hidden_size=32, num_attention_heads=2,
                                              parallel_attn=parallel, hidden_dropout=0.0, attention_dropout=0.0))


def _bloom():
    return T.BloomForCausalLM(T.BloomConfig(**_LM, n_layer=3, hidden_size=32, n_head=2))


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


# (factory, merges per layer, branch labels of one layer, where the update is computed)
HF = {
    # sequential Falcon (parallel_attn=False): residual = dropout_add(attn, residual), then the MLP's
    "falcon-sequential": (lambda: _falcon(False), 2, ["attn", "mlp"], ["transformer.h.0"] * 2),
    # Falcon's default parallel block: mlp_output += attention_output (two branches), then one merge
    "falcon-parallel": (lambda: _falcon(True), 1, ["attn+mlp"], ["transformer.h.0"]),
    # Bloom: the merges are inside BloomAttention.forward and BloomMLP.forward (residual passed in)
    "bloom": (_bloom, 2, ["attn", "mlp"], ["transformer.h.0.self_attention", "transformer.h.0.mlp"]),
}


@pytest.mark.parametrize("name", list(HF))
def test_hf_dropout_add_models(name):
    make, per_layer, branches, paths = HF[name]
    report = _check_add_and_unpatch(lambda: _Logits(make()), IDS, 3 * per_layer)
    assert [c.length for c in report.chains] == [3 * per_layer]
    assert {s.source_line for s in report.sites} == {"out = residual + out"}
    assert all(s.function == "dropout_add" for s in report.sites)
    assert [s.branch for s in report.sites[:per_layer]] == branches
    assert [s.path for s in report.sites[:per_layer]] == ["model." + p for p in paths]
    assert not any("dropout_add" in s.reason for s in report.skipped)
    for method in ("rescontroller", "mgr"):
        opts = {"backend": "torch"} if method == "rescontroller" else {}
        r = _train_step_finite(lambda: _Logits(make()), IDS, method, **opts)
        assert len(r.sites) == 3 * per_layer
