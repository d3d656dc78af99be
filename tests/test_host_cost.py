"""The host side of one merge on the Triton path, forward + backward, with the launches stubbed (what remains is
the rule's Python, its allocations and the autograd bookkeeping), counted deterministically:
``benchmarks/host_cost.py`` (``--time`` gives the wall clock against a plain add's forward + backward, to run on a
quiet machine). A repeated call works out no launch again (the launch plans, ``kernels/tiles.py``); the torch kernels
around the launches: tests/test_launch_counts.py."""
from __future__ import annotations

import pytest
import torch

from benchmarks.host_cost import merge_steps, plain_step, python_calls, stub_launches

#: The package's own Python calls per merge, forward + backward, at most (measured: 29, 54, 72, 42, 43 — a chain's
#: start included for MGR and AttnRes); the launch table's arithmetic on every call was 112 / 114 / 133 / 58 / 59.
BUDGET = {"rescontroller": 32, "mgr n=4 competitive": 60, "mgr n=4 competitive inverted": 80, "attnres": 48,
          "attnres-block": 48}


@pytest.fixture(scope="module")
def steps():
    with stub_launches():
        out = merge_steps()
        for step in out.values():
            step()  # the first call works the launches out
    return out


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_a_repeated_merge_costs_few_python_calls(steps, name):
    with stub_launches():
        calls = python_calls(steps[name])
    assert calls["package"] <= BUDGET[name], calls
    plain = python_calls(plain_step())
    assert plain["package"] == 0 and plain["torch"] < calls["torch"] + 1  # the yardstick is torch's own autograd


def test_launch_plans_follow_the_signature():
    """A plan is kept per call signature: another dtype, shape or stride works its launch out again (no stale
    plan), and the results are those of a fresh launch."""
    from lightning_resctl.rules.rescontroller import rescontroller, rescontroller_reference
    from lightning_resctl.runtime.triton import load_kernels

    load_kernels("tiles").clear_launch_plans()
    r, u = torch.randn(3, 24), torch.randn(3, 24)
    for a, b in ((r, u), (r.double(), u.double()), (r[:, :12], u[:, :12]), (r.t().contiguous().t(), u)):
        torch.testing.assert_close(rescontroller(a, b, backend="triton"), rescontroller_reference(a, b),
                                   rtol=1e-5, atol=1e-5)
    plans = load_kernels("rescontroller")._PLANS.plans
    assert len(plans) == 4
