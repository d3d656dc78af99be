"""saved_tensor_bytes: each storage once, parameters excludable, MGR's inversion stays on while counting."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_resctl.rules.mgr import MGRChain
from lightning_resctl.runtime.memory import saved_tensor_bytes


def test_counts_each_storage_once_and_returns_the_result():
    x = torch.randn(4, 6, requires_grad=True)

    def fn():
        # x * x saves x twice and x[1:] * x[1:] two views of it (one storage); exp saves its output (a second)
        return (x * x).sum() + x.exp().sum() + (x[1:] * x[1:]).sum()

    nbytes, out = saved_tensor_bytes(fn)
    assert nbytes == 2 * x.numel() * 4
    out.backward()  # the graph is intact


def test_exclude_leaves_out_parameter_storages():
    lin = nn.Linear(8, 8, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    with_params, _ = saved_tensor_bytes(lin, x)
    without, _ = saved_tensor_bytes(lin, x, exclude=lin.parameters())
    assert with_params == x.numel() * 4 + lin.weight.numel() * 4
    assert without == x.numel() * 4
    with pytest.raises(TypeError, match="exclude"):
        saved_tensor_bytes(lin, x, exclude=[1.0])


def test_mgr_keeps_its_inversion_while_counted():
    x = torch.randn(16, 32, requires_grad=True)

    def run(chain):
        r = chain.begin(x)
        for _ in range(6):
            r.write(r.read() * 0.5)
        return r.end()

    ordinary, y0 = saved_tensor_bytes(run, MGRChain(32, 6, streams=3, invert=False))
    inverted, y1 = saved_tensor_bytes(run, MGRChain(32, 6, streams=3, invert=True))
    torch.testing.assert_close(y0, y1)
    assert inverted < ordinary
