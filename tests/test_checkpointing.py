"""Activation checkpointing of patched models (issue 28): every chain rule trains under non-reentrant
checkpointing with the gradients of the non-checkpointed patched model, whichever order checkpointing and the
patch are applied in; reentrant checkpointing is refused at the first training forward, naming the alternative."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_resctl import get_merge_rule, merge_rules, patch_residuals

CHAIN = [m for m in merge_rules() if get_merge_rule(m).kind == "chain"]
C = 16


class Block(nn.Module):
    """Pre-norm transformer-like block: two merges (``x = x + f(ln(x))``)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.f1, self.f2 = nn.Linear(C, C), nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))

    def forward(self, x):
        x = x + self.f1(torch.tanh(self.ln1(x)))
        x = x + self.f2(self.ln2(x))
        return x


class Net(nn.Module):
    """A small GPT-like net; ``ckpt``: None (plain), "block" (each block in torch.utils.checkpoint, ``reentrant``
    chooses the variant) or "sequential" (checkpoint_sequential in 2 segments)."""

    def __init__(self, layers=3, ckpt=None, reentrant=False):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
        self.head = nn.Linear(C, 3)
        self.ckpt, self.reentrant = ckpt, reentrant

    def forward(self, x):
        x = self.emb(x)
        if self.ckpt == "block":
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=self.reentrant)
        elif self.ckpt == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=self.reentrant)
        else:
            for b in self.blocks:
                x = b(x)
        return self.head(x)


def _x(seed=0):
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed))


def randomize_rule(model, report, std=0.3, seed=3):
    """Move the rule's parameters away from their init (zero-init queries would hide wrong gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def grads_of(model, loss_fn) -> dict:
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, rel=1e-6):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k, g in want.items():
        err = float((got[k] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= rel, f"{k}: relative gradient error {err:.3g}"


def _loss(x):
    return lambda m: m(x).square().mean()


def _patched_pair(method, ckpt, order, reentrant=False, **options):
    """(checkpointed patched model, non-checkpointed patched twin with the same parameters)."""
    torch.manual_seed(0)
    model = Net(ckpt=ckpt if order == "ckpt-first" else None, reentrant=reentrant)
    report = patch_residuals(model, method=method, example_input=(_x(),), **options)
    randomize_rule(model, report)
    ref = copy.deepcopy(model)
    model.ckpt = ckpt
    ref.ckpt = None
    return model, ref


@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
@pytest.mark.parametrize("method", CHAIN)
def test_non_reentrant_checkpoint_gives_the_gradients_of_the_plain_patched_model(method, order):
    model, ref = _patched_pair(method, "block", order)
    x = _x(1)
    want = grads_of(ref, _loss(x))
    got = grads_of(model, _loss(x))
    assert_same_grads(got, want)
    assert any(".".join(k.split(".")[:1]).startswith("_resctl") or "_resctl" in k for k in got)  # the rule's own
    # a second step (fresh forward, the entries of the first are gone) is as exact
    assert_same_grads(grads_of(model, _loss(_x(2))), grads_of(ref, _loss(_x(2))))
    assert len(next(iter(s._run for s in model.modules() if getattr(s, "_run", None) is not None)).entries) == 0


@pytest.mark.parametrize("method", ["mgr", "attnres-block", "mhc"])
def test_checkpoint_sequential_gives_the_gradients_of_the_plain_patched_model(method):
    model, ref = _patched_pair(method, "sequential", "patch-first")
    x = _x(1)
    assert_same_grads(grads_of(model, _loss(x)), grads_of(ref, _loss(x)))


@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
@pytest.mark.parametrize("ckpt", ["block", "sequential"])
def test_reentrant_checkpoint_is_refused_at_the_first_training_forward(ckpt, order):
    model, _ = _patched_pair("mgr", ckpt, order, reentrant=True)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False"):
        model(_x(1))
    # inference through the same checkpointed model is fine (nothing to differentiate)
    with torch.no_grad():
        model.eval()
        out = model(_x(1))
        model.ckpt = None
        torch.testing.assert_close(model(_x(1)), out)
