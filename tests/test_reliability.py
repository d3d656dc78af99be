"""Reliability: no silent wrong result from the surgery and the chain rules in real training loops.

Every registered merge rule is run through these checks automatically (``merge_rules()``), so a new rule
gets them for free. Chain rules must either give the right answer or raise a clear error at that forward.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_resctl import merge_rules, patch_residuals, unpatch_residuals
from lightning_resctl.rules import get_merge_rule
from lightning_resctl.surgery import get_patch_report, merge_sites
from models import TanhBranch

ALL = list(merge_rules())
CHAIN = [m for m in ALL if get_merge_rule(m).kind == "chain"]
C = 16


class LoopNet(nn.Module):
    """``for _ in range(steps): x = x + f(x)`` with a data-dependent number of steps."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.f = nn.ModuleList(TanhBranch(C) for _ in range(4))
        self.head = nn.Linear(C, 3)
        self.fail_at = None

    def forward(self, x, steps: int = 4):
        x = self.emb(x)
        for i in range(steps):
            if self.fail_at == i:
                raise ValueError("boom")
            x = x + self.f[i % 4](x)
        return self.head(x)


class TrainOnlyNet(nn.Module):
    """A merge that runs only in training (``where`` = index of the training-only merge)."""

    def __init__(self, where: int = 3):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(TanhBranch(C) for _ in range(4))
        self.where = where
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        x = self.emb(x)
        for i, b in enumerate(self.blocks):
            if i == self.where and not self.training:
                continue
            x = x + b(x)
        return self.head(x)


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, C, generator=g)


def _run(model, x):
    out = model(x)
    return out


# ------------------------------------------------------------------------------------------ 10.1: state leaks
@pytest.mark.parametrize("method", ALL)
def test_fewer_merges_than_observed_never_continues_a_previous_forward(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    x = _x(1)
    fresh = copy.deepcopy(model)
    ref = fresh(x)
    if get_merge_rule(method).kind == "chain":
        with pytest.raises(RuntimeError, match="stopped after merge 1"):
            model(x, 2)
    else:
        model(x, 2)
    # the next forward starts from scratch: same output as a never-used copy, and it trains
    out = model(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    out2 = model(x)
    out2.sum().backward()
    assert torch.equal(out2, ref)


@pytest.mark.parametrize("method", ALL)
def test_exception_mid_forward_leaves_no_state(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    x = _x(2)
    ref = copy.deepcopy(model)(x)
    model.fail_at = 2
    with pytest.raises(ValueError, match="boom"):
        model(x)
    model.fail_at = None
    out = model(x)
    assert torch.equal(out, ref)
    out.sum().backward()  # no "backward through the graph a second time"


@pytest.mark.parametrize("method", ALL)
def test_more_merges_than_observed(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    x = _x(1)
    ref = copy.deepcopy(model)(x)
    if get_merge_rule(method).kind == "chain":
        with pytest.raises(RuntimeError, match="ran 5 times in one forward"):
            model(x, 5)
    else:
        assert torch.isfinite(model(x, 5)).all()
    assert torch.equal(model(x), ref)


# ------------------------------------------------------------------------------------------ 10.2: mode-dependent merges
@pytest.mark.parametrize("where", [1, 3])
@pytest.mark.parametrize("method", CHAIN)
def test_training_only_merge_eval_is_deterministic_and_completes(method, where):
    torch.manual_seed(0)
    model = TrainOnlyNet(where)
    patch_residuals(model, method=method, example_input=(_x(),))
    model.eval()
    x = _x(3)
    a = model(x)
    b = model(x)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    model.train()
    model(x).sum().backward()
    model.eval()
    assert torch.equal(model(x), a)


@pytest.mark.parametrize("where", [1, 3])
@pytest.mark.parametrize("method", [m for m in CHAIN if m.startswith("mgr")])
def test_mgr_skipped_merge_leaves_streams_and_output_pool_applies(method, where):
    torch.manual_seed(0)
    model = TrainOnlyNet(where)
    patch_residuals(model, method=method, example_input=(_x(),), streams=2)
    chain = merge_sites(model)[0].chain_module
    with torch.no_grad():  # move every parameter away from its (symmetric) init
        for p in chain.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.eval()
    x = _x(4)
    ref = model(x)
    with torch.no_grad():  # the merge that does not run in eval: none of its parameters may matter
        for p in chain.merges[where].parameters():
            p.add_(1.0)
    assert torch.equal(model(x), ref)
    with torch.no_grad():  # the output pool is applied however the forward ends
        chain.output_pool.pool_query.add_(1.0)
    assert not torch.allclose(model(x), ref)


# ------------------------------------------------------------------------------------------ 10.4: observation is pure
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(3, 8, 1)
        self.b1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.b2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.calls = 0
        self.cache = {}
        self.example_input_array = torch.randn(2, 3, 5, 5)

    def forward(self, x):
        self.calls += 1
        self.cache["last"] = x.shape
        x = self.inp(x)
        x = x + self.b1(x)
        x = x + self.b2(x)
        return x.mean((2, 3))


@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("training", [True, False])
def test_patching_leaves_buffers_attributes_rng_and_mode(method, training):
    torch.manual_seed(0)
    model = BNNet().train(training)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.random.get_rng_state()
    patch_residuals(model, method=method)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training is training and all(m.training is training for m in model.modules()
                                               if not hasattr(m, "positions"))
    assert model.calls == 0 and model.cache == {}
    for k, v in buffers.items():
        assert torch.equal(model.get_buffer(k), v), k


def test_add_patch_keeps_eval_outputs_bitwise():
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(2, 3, 5, 5)
    ref = copy.deepcopy(model).eval()(x)
    patch_residuals(model, method="add")
    assert torch.equal(model.eval()(x), ref)


# ------------------------------------------------------------------------------------------ 10.3: checkpoints
@pytest.mark.parametrize("method", ALL)
def test_patched_checkpoint_never_loads_silently_into_unpatched_model(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    sd = model.state_dict()
    plain = LoopNet()
    with pytest.raises(RuntimeError, match="_resctl_site"):
        plain.load_state_dict(sd)
    twin = LoopNet()
    patch_residuals(twin, method=method, example_input=(_x(),))
    twin.load_state_dict(sd)
    assert torch.equal(twin(_x(5)), model(_x(5)))
    # a checkpoint loads with weights_only=True (tensor-only state dict)
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert set(torch.load(buf, weights_only=True)) == set(sd)


@pytest.mark.parametrize("method", ALL)
def test_patch_from_state_dict_gives_back_the_trained_network(method):
    from lightning_resctl import patch_from_state_dict

    torch.manual_seed(0)
    model = LoopNet()
    options = {"streams": 2} if get_merge_rule(method).kind == "chain" and method.startswith("mgr") else {}
    patch_residuals(model, method=method, example_input=(_x(),), **options)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fresh = LoopNet()
    report = patch_from_state_dict(fresh, model.state_dict(), example_input=(_x(),))
    assert report.method == method
    assert torch.equal(fresh(_x(5)), model(_x(5)))
    with pytest.raises(ValueError, match="no lightning_resctl site record"):
        patch_from_state_dict(LoopNet(), LoopNet().state_dict(), example_input=(_x(),))


def test_checkpoint_of_other_options_is_refused_with_the_reason():
    torch.manual_seed(0)
    a = LoopNet()
    patch_residuals(a, method="rescontroller", example_input=(_x(),), update_ratio=0.3)
    b = LoopNet()
    patch_residuals(b, method="rescontroller", example_input=(_x(),))
    with pytest.raises(RuntimeError, match="update_ratio"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("method", [m for m in ALL if "backend" in get_merge_rule(m).option_names()])
def test_backend_is_recorded_but_does_not_block_a_load(method):
    """The backend changes how the math runs, not what it computes: a checkpoint saved with one backend loads
    into a twin patched with another; each record says which backend its model ran."""
    from lightning_resctl.surgery.sites import decode_record

    torch.manual_seed(0)
    a = LoopNet()
    patch_residuals(a, method=method, example_input=(_x(),), backend="torch-eager")
    b = LoopNet()
    patch_residuals(b, method=method, example_input=(_x(),), backend="reference")
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(_x(5)), a(_x(5)), rtol=1e-5, atol=1e-6)
    records = [decode_record(v) for k, v in b.state_dict().items() if k.endswith("._extra_state")]
    assert records and {r["options"]["backend"] for r in records} == {"reference"}


# ------------------------------------------------------------------------------------------ 10.5: reset_parameters
@pytest.mark.parametrize("method", CHAIN)
def test_reset_parameters_gives_exactly_the_init(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    new = get_patch_report(model).new_parameters
    assert new
    init = {k: model.get_parameter(k).detach().clone() for k in new}
    with torch.no_grad():
        for k in new:
            model.get_parameter(k).uniform_(-1e6, 1e6)
    for site in merge_sites(model):
        for m in site.chain_module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    for k in new:
        assert torch.equal(model.get_parameter(k), init[k]), k


# ------------------------------------------------------------------------------------------ 10.7: checkpointing
class CkptNet(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(TanhBranch(C) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.emb(x)
        for b in self.blocks:
            x = checkpoint(self.merge, b, x, use_reentrant=self.reentrant)
        return x

    def merge(self, b, t):
        return t + b(t)


@pytest.mark.parametrize("method", CHAIN)
def test_chain_rules_refuse_reentrant_checkpoint_at_the_first_forward(method):
    """Non-reentrant checkpointing is supported (tests/test_checkpointing.py); the reentrant variant runs its
    block under no_grad, which would cut the chain state's gradient: refused at the first training forward."""
    model = CkptNet(True)
    patch_residuals(model, method=method, example_input=(_x(),))
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False"):
        model(_x().requires_grad_())


@pytest.mark.parametrize("reentrant", [False, True])
def test_per_merge_rules_train_under_checkpointing_with_equal_gradients(reentrant):
    torch.manual_seed(0)
    model = CkptNet(reentrant)
    plain = PlainNet(reentrant)
    plain.load_state_dict(model.state_dict())
    patch_residuals(model, method="rescontroller", example_input=(_x(),))
    twin = copy.deepcopy(plain)
    patch_residuals(twin, method="rescontroller", example_input=(_x(),))
    x = _x(6).requires_grad_(reentrant)
    model(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


class PlainNet(CkptNet):
    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = x + b(x)
        return x


# ------------------------------------------------------------------------------------------ habits
@pytest.mark.parametrize("method", ALL)
def test_no_grad_inference_mode_and_deepcopy_agree(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    x = _x(7)
    ref = model(x).detach()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)
    clone = copy.deepcopy(model)
    assert torch.equal(clone(x), model(x))
    clone2 = pickle.loads(pickle.dumps(model))
    assert torch.equal(clone2(x), model(x))
    unpatch_residuals(clone)
    assert type(clone.f[0]) is TanhBranch


@pytest.mark.parametrize("method", ALL)
def test_gradient_accumulation_equals_one_big_batch(method):
    torch.manual_seed(0)
    model = LoopNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    twin = copy.deepcopy(model)
    x = torch.cat([_x(8), _x(9)])
    model(x).square().mean().backward()
    for part in x.chunk(2):
        (twin(part).square().mean() / 2).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_unpatch_of_a_non_module_is_a_type_error():
    with pytest.raises(TypeError, match="model"):
        unpatch_residuals("x")


class BiasNet(nn.Module):
    """One learned position bias added to every layer's attention scores (mpnet/T5 style): a tensor reused
    across layers is not a residual stream, even though it reaches later layers through earlier merges."""

    def __init__(self, T=5, layers=3):
        super().__init__()
        self.rel = nn.Embedding(2 * T, 1)
        self.q = nn.ModuleList(nn.Linear(C, C) for _ in range(layers))
        self.v = nn.ModuleList(nn.Linear(C, C) for _ in range(layers))
        self.T = T

    def forward(self, x):
        pos = torch.arange(self.T)
        bias = self.rel(pos[None, :] - pos[:, None] + self.T).squeeze(-1).expand(x.shape[0], -1, -1).contiguous()
        for q, v in zip(self.q, self.v):
            scores = q(x) @ x.transpose(1, 2)
            scores = scores + bias
            x = x + v(scores.softmax(-1) @ x)
        return x


def test_a_bias_reused_by_every_layer_is_not_a_merge():
    model = BiasNet()
    report = patch_residuals(model, method="add", example_input=(_x(),))
    assert [s.source_line for s in report.sites] == ["x = x + v(scores.softmax(-1) @ x)"] * 3
    skipped = [s for s in report.skipped if "scores + bias" in s.source_line]
    assert skipped and all("reused across layers" in s.reason or "independent" in s.reason for s in skipped)
    assert any("reused across layers" in s.reason for s in skipped)


# ------------------------------------------------------------------------------------------ in-place merges
class InPlaceUpdateNet(nn.Module):
    """``u = blk(x); seen.append(u); u += x``: the merge writes into the update, which another name holds.
    ``in_place=False``: the same network spelled out of place (``x = x + u; seen.append(x)``)."""

    def __init__(self, in_place: bool = True):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(TanhBranch(C) for _ in range(3))
        self.in_place = in_place

    def forward(self, x):
        x = self.emb(x)
        seen = []
        for blk in self.blocks:
            u = blk(x)
            if self.in_place:
                seen.append(u)
                u += x
                x = u
            else:
                x = x + u
                seen.append(x)
        return x, torch.stack(seen)


class InPlaceStreamNet(nn.Module):
    """``first = x; x += blk(x)``: every merge writes into the stream, so ``first`` is the final stream."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(TanhBranch(C) for _ in range(3))

    def forward(self, x):
        x = self.emb(x)
        first = x
        for blk in self.blocks:
            x += blk(x)
        return x, first


@pytest.mark.parametrize("method", ALL)
def test_in_place_merge_into_the_update_keeps_its_aliases(method, monkeypatch):
    """Other names bound to the tensor an in-place merge writes into see the merged value, as in the original
    model; outputs and gradients equal the out-of-place spelling of the same network patched the same way."""
    monkeypatch.setenv("LIGHTNING_RESCTL_COMPILE", "0")  # the eager torch path: no compile time in the suite
    x = _x()
    models = []
    for in_place in (True, False):
        torch.manual_seed(0)
        model = InPlaceUpdateNet(in_place)
        patch_residuals(model, method=method, example_input=(x,))
        models.append(model)
    assert [s.inplace for s in merge_sites(models[0])] == ["update"] * len(merge_sites(models[0]))
    results = []
    for model in models:
        out, seen = model(x)
        assert torch.equal(seen[-1], out)  # the last merge's result is where `seen` holds it
        loss = out.square().sum() + (seen * torch.linspace(-1, 1, C)).sum()
        results.append((out, seen, torch.autograd.grad(loss, list(model.parameters()))))
    (out, seen, grads), (want_out, want_seen, want_grads) = results
    torch.testing.assert_close(seen, want_seen, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ALL)
def test_in_place_merge_into_the_stream_writes_into_its_storage(method, monkeypatch):
    monkeypatch.setenv("LIGHTNING_RESCTL_COMPILE", "0")
    torch.manual_seed(0)
    model = InPlaceStreamNet()
    patch_residuals(model, method=method, example_input=(_x(),))
    assert {s.inplace for s in merge_sites(model)} == {"stream"}
    with torch.no_grad():  # (the branch's LayerNorm saves x: in place, the original only runs without grad)
        out, first = model(_x(3))
    assert torch.equal(first, out)
