"""What one merge launches on the path ``backend="auto"`` picks for a CUDA tensor (the Triton kernels), counted on
CPU under Triton's interpreter: the Triton launches and every torch op around them that runs a device kernel (a
cast, a reduction, a copy, a fill). At most one forward and two backward per merge, for every rule with kernels,
n = 4 for MGR with its default inversion (fp32 streams), bf16 streams, and an fp32 stream with a bf16 branch output
(autocast). ``python benchmarks/launch_count.py`` prints the same table."""
from __future__ import annotations

import pytest
import torch

from benchmarks.launch_count import count_merge
from benchmarks.merge_cases import CASES

#: (forward, backward) launches per merge at most (issue 55)
LIMITS = (1, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_merge_launches_one_kernel_forward_and_at_most_two_backward(name):
    fwd, bwd = CASES[name]()
    assert sum(fwd.triton.values()) == 1 and not fwd.kernels, fwd.describe()
    assert fwd.launches <= LIMITS[0], fwd.describe()
    assert 1 <= sum(bwd.triton.values()) and bwd.launches <= LIMITS[1], bwd.describe()
    assert not bwd.kernels, bwd.describe()


def test_the_counter_sees_torch_kernels_and_triton_launches():
    """The counter is not blind: the torch path of a merge counts its ops (reductions, casts, ...), and a plain
    residual add is one kernel forward and none backward (the gradient passes through)."""
    from lightning_resctl.rules.rescontroller import ResController

    r = torch.randn(3, 8, requires_grad=True)
    u = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    fwd, bwd = count_merge(lambda: ResController(backend="torch-eager")(r, u), (r, u))
    assert fwd.launches > 10 and not fwd.triton and "_to_copy.default" in fwd.kernels, fwd.describe()
    assert bwd.launches > 5, bwd.describe()
    fwd, bwd = count_merge(lambda: r + r.detach(), (r,))
    assert fwd.launches == 1 and bwd.launches == 0, (fwd.describe(), bwd.describe())
