"""Hand wiring of a merge rule into tests/models.NanoGPT, without the surgery (used by
tests/test_rescontroller.py and benchmarks/bench_rescontroller.py)."""
from __future__ import annotations

import types


def wire_merges(model, merge):
    """Replace both residual additions of every NanoGPT block by ``merge(x, update)``; returns ``model``."""

    def forward(block, x):
        x = merge(x, block.attn(block.ln_1(x)))
        return merge(x, block.mlp(block.ln_2(x)))

    for block in model.h:
        block.forward = types.MethodType(forward, block)
    return model
