"""Whole-model ``torch.compile`` of a patched model: the per-merge math of the torch paths (ResController, MGR) is
one opaque op per direction, so dynamo, AOTAutograd and inductor do not trace it at every merge site (the patched
model's graph stays about the size of the unpatched one); the numbers equal the eager model's."""
from __future__ import annotations

import copy

import pytest
import torch

from lightning_resctl.surgery import patch_residuals
from benchmarks.models import NanoGPT, gpt_loss

OPS = {"rescontroller": "lightning_resctl.rescontroller_torch", "mgr-competitive": "lightning_resctl.mgr_step_torch"}


def _capture(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)
    return backend


@pytest.mark.parametrize("method", sorted(OPS))
def test_the_merge_math_is_one_op_per_site_and_the_numbers_are_eager(method):
    torch.manual_seed(0)
    model = NanoGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    patch_residuals(model, method=method)  # default backend: the torch path on CPU
    twin = copy.deepcopy(model)
    idx = torch.randint(0, 32, (3, 8))
    graphs = []
    loss = gpt_loss(torch.compile(model, backend=_capture(graphs), fullgraph=True), idx)
    loss.backward()
    want = gpt_loss(twin, idx)
    want.backward()
    torch.testing.assert_close(loss, want)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    (graph,) = graphs
    calls = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum(OPS[method] in c for c in calls) == 4  # one op per merge (2 blocks x 2 merges)
    assert not any("vector_norm" in c or "rsqrt" in c or "sigmoid" in c for c in calls)  # no per-merge math


def test_the_ops_pass_torch_library_opcheck():
    import importlib

    from lightning_resctl.rules.mgr.ops import mgr_step_torch_op

    rc = importlib.import_module("lightning_resctl.rules.rescontroller.ops")
    r, u = torch.randn(3, 5, 8, requires_grad=True), torch.randn(3, 5, 8, requires_grad=True)
    torch.library.opcheck(rc._rescontroller_op, (r, u, 0.18, 1.08, 8.0, 8.0, 1e-12, -1, "torch-eager"))
    torch.library.opcheck(rc._rescontroller_op, (r.transpose(1, 2), u.transpose(1, 2), 0.18, 1.08, 8.0, 8.0, 1e-12,
                                                 1, "torch-eager"))
    for gated, competitive in [(False, False), (True, False), (True, True)]:
        s = torch.randn(3, 5, 4 if gated else 2, 8, requires_grad=True)
        x = torch.randn(3, 5, 8, requires_grad=True)
        params = (torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True) if gated else None,
                  torch.randn(4, requires_grad=True) if gated else None,
                  torch.randn((), requires_grad=True) if competitive else None)
        torch.library.opcheck(mgr_step_torch_op, (s, x, *params, 1e-6, "torch-eager"))

