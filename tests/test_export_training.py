"""``torch.export`` of a patched model in training mode (grad on): the exported program holds the merge math as
aten ops that autograd differentiates (the closed-form torch paths record their plain-autograd oracle there,
:func:`lightning_resctl.runtime.backends.exporting_for_training`), so training through ``program.module()`` gives
the eager patched model's loss and gradients."""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.models import NanoGPT, gpt_loss
from lightning_resctl.runtime.backends import COMPILE_ENV
from lightning_resctl.surgery import patch_residuals

RULES = ["add", "rescontroller", "mgr-competitive", "mgr-independent", "attnres", "attnres-block", "hc", "mhc",
         "mhc-lite", "dwa", "laurel", "laurel-pa", "ddl", "kromhc"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("method", RULES)
def test_a_training_mode_export_trains_like_the_eager_model(method, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "0")  # the eager twin runs its math op by op (no background compile)
    model = NanoGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    patch_residuals(model, method=method)
    twin = copy.deepcopy(model)
    idx = torch.randint(0, 32, (3, 8))
    program = torch.export.export(model.train(), (idx,))
    assert not any("lightning_resctl" in str(n.target) for n in program.graph.nodes)  # runs without this package
    exported = program.module()
    loss = gpt_loss(exported, idx)
    loss.backward()  # raised "element 0 of tensors does not require grad" (rescontroller), "bmm(): out=" (MGR)
    want = gpt_loss(twin, idx)
    want.backward()
    tol = 1e-5 if method.startswith("mgr") else 1e-6  # the eager MGR chain inverts its merges in the backward
    assert _rel(loss.detach(), want.detach()) <= 1e-6
    grads = dict(exported.named_parameters())
    for name, q in twin.named_parameters():
        p = grads[name]
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert _rel(p.grad, q.grad) <= tol, (name, _rel(p.grad, q.grad))
