"""Checks shared by the surgery tests: ``add`` and ``unpatch_residuals`` are bitwise the model as written."""
from __future__ import annotations

import copy

import pytest
import torch

from lightning_resctl.surgery import patch_residuals, unpatch_residuals


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: intra-op threads only add contention on a busy CPU (restored after the module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def add_and_unpatch_are_bitwise(model, x):
    """Patch ``model`` with ``add``: outputs and gradients equal the unpatched model's bit for bit, and so do
    the outputs and module classes after ``unpatch_residuals``. Returns the ``add`` report."""
    ref = copy.deepcopy(model)
    before = ref(x)
    before.pow(2).mean().backward()
    report = patch_residuals(model, method="add", example_input=x)
    out = model(x)
    out.pow(2).mean().backward()
    assert torch.equal(out, before)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        assert p.grad is None or torch.equal(p.grad, grads[name].grad), name
    unpatch_residuals(model)
    assert torch.equal(model(x), before)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    return report
