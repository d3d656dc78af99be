"""Blocks compiled one by one (issue 45): ``block.compile()`` on each of identical pre-norm blocks, torchtitan's habit.

Plain blocks share their compiled code: dynamo compiles the same graphs at any depth. A patched model must too —
no more unique graphs than at a smaller depth (a chain rule's first and last blocks, and MGR's accumulating merges,
may have graphs of their own: a constant, not one per block) — without checkpointing (``fullgraph=True``, as plain
is), with ``torch.utils.checkpoint`` around each compiled block, and with ``checkpoint_wrapper`` inside the compiled
block (torchtitan's order). The compiled steps equal the eager patched model's. Depths 4 and 5 here (the first, two
middle and the last block at 4: a graph per block shows as one more at 5; ``attnres-block``'s stack of completed
blocks grows by one per block at S = 2, so dynamo compiles its first middle block for that size and the next for any
size, automatic dynamic shapes: from 4 blocks on the count stays). ``benchmarks/bench_block_graphs.py`` sweeps
4 / 8 / 16 for every rule. ``dwa`` still compiles a graph per block position (expected to fail here): its history
of block outputs is a tuple growing by one per block (stacked, it would save O(d²·C)). ``attnres`` (Full) does the
same for the same reason, its sources separate tensors so that it saves (K+1)·C per token, not O(K²·C)
(docs/rules/attnres.md; bench_block_graphs.py shows it; not repeated here). ``laurel-pa``'s
history grows over its first k - 1 merges only, then every merge runs one graph."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from benchmarks.bench_block_graphs import compile_blocks
from lightning_resctl import get_merge_rule, patch_residuals
from models import PreNormNet

C = 16
DEPTHS = (4, 5)
# one rule per runtime (the MGR chain, the frame family's, AttnRes'); every rule at 4 / 8 / 16 blocks in every
# checkpointing mode: benchmarks/bench_block_graphs.py (mHC-lite's coefficients cost this file 60 s more)
RULES = ("plain", "mgr-competitive", "hc", "attnres-block", "laurel-pa", "dwa")
# fewer streams than the default keep MGR's accumulating merges (graphs of their own) inside the first block
OPTIONS = {"mgr-competitive": {"streams": 2}, "hc": {"streams": 2}, "laurel-pa": {"variant": "pa"}}


def _x(seed=1):
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _patched(method: str, depth: int) -> nn.Module:
    torch.manual_seed(0)
    model = PreNormNet(depth, C).double()
    if method != "plain":
        names = get_merge_rule(method).option_names()
        exact = {**({"invert": False} if "invert" in names else {}),
                 **({"backend": "torch-eager"} if "backend" in names else {})}
        report = patch_residuals(model, method=method, example_input=(_x(0),), **exact, **OPTIONS.get(method, {}))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # off the init (zero-init queries would hide wrong gradients)
            for name in report.new_parameters:
                p = model.get_parameter(name)
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def _steps(model: nn.Module, run, steps: int = 2) -> list:
    out = []
    for seed in range(1, steps + 1):
        model.zero_grad(set_to_none=True)
        loss = run(_x(seed)).square().mean()
        loss.backward()
        grads = {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                 for k, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
    return out


def unique_graphs(method: str, depth: int, ckpt: str, compare: bool = False) -> int:
    """The graphs dynamo compiles for ``depth`` blocks compiled one by one (two training steps); ``compare``: the
    steps must equal the eager patched model's."""
    torch._dynamo.reset()
    model = _patched(method, depth)
    ref = copy.deepcopy(model) if compare else None
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compile_blocks(model, ckpt, counter)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=ckpt == "wrapper"):
        got = _steps(model, model)
    if compare:
        for (loss, grads), (ref_loss, ref_grads) in zip(got, _steps(ref, ref)):
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
            assert grads.keys() == ref_grads.keys()
            for k, g in ref_grads.items():
                torch.testing.assert_close(grads[k], g, rtol=1e-10, atol=1e-14, msg=k)
    torch._dynamo.reset()
    return counter.frame_count


POSITIONAL = ("dwa",)  # a graph per merge position (see the module docstring)


def _marked(method):
    reason = "its sources are separate tensors, as many as the blocks or merges before: a graph per merge position"
    return pytest.param(method, marks=pytest.mark.xfail(strict=True, reason=reason)) if method in POSITIONAL else method


@pytest.mark.parametrize("method", [_marked(m) for m in RULES])
def test_blocks_compiled_one_by_one_compile_the_same_graphs_at_any_depth(method):
    counts = [unique_graphs(method, d, "none", compare=d == DEPTHS[0]) for d in DEPTHS]
    assert counts[0] == counts[1], f"unique graphs at {DEPTHS} blocks: {counts}"


@pytest.mark.parametrize("method,ckpt", [("mgr-competitive", "outside"), ("hc", "wrapper")])
def test_checkpointed_blocks_compiled_one_by_one_compile_the_same_graphs_at_any_depth(method, ckpt):
    counts = [unique_graphs(method, d, ckpt, compare=d == DEPTHS[0]) for d in DEPTHS]
    assert counts[0] == counts[1], f"unique graphs at {DEPTHS} blocks: {counts}"


@pytest.mark.parametrize("method", ["mgr-competitive", "hc", "attnres-block"])
def test_the_strategys_checkpointed_blocks_compile_the_graphs_of_blocks_not_checkpointed(method):
    """ResidualParallelStrategy's checkpoint around each compiled block (``wrap_blocks``: ``checkpoint_wrapper`` with
    ``checkpoint_block``) keeps the chains' state at the block: the merges trace into the block's graph with no graph
    break before and after each (what ``torch.utils.checkpoint`` around the block costs, ``outside``), so the blocks
    compile the graphs of blocks compiled without checkpointing, at any depth, and train as the eager model does."""
    counts = [unique_graphs(method, d, "strategy", compare=d == DEPTHS[0]) for d in DEPTHS]
    assert counts == [unique_graphs(method, DEPTHS[0], "none")] * len(DEPTHS), counts
