"""The streams' byte floor (benchmarks/floor.py) is what the kernels move: its per-merge bytes plus a plain add's equal
the least the fused kernels read and write per token (counted in Triton's interpreter, kernels_aot.count_bytes),
up to the per-token scalars (gates, pool weights, log-sum-exp) the floor leaves out."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks.floor import merge_bytes, step_floor

_SPEC = importlib.util.spec_from_file_location("kernels_aot",
                                               Path(__file__).parents[1] / "benchmarks" / "kernels_aot.py")
aot = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(aot)

C = 40


def plain_bytes(es, eu):
    return (2 * es + eu) * C, (es + eu) * C


@pytest.mark.parametrize("kind, inverted", [("competitive", False), ("competitive inverted", True)])
def test_mgr_floor_is_what_its_kernels_move(kind, inverted):
    n = 4
    floor = merge_bytes("mgr", C, n, stream_bytes=4, update_bytes=4, inverted=inverted)
    pf, pb = plain_bytes(4, 4)
    for direction, extra, plain in (("fwd", floor.forward, pf), ("bwd", floor.backward, pb)):
        counted = aot.count_bytes(aot.Variant("mgr", direction, C, "fp32", n, kind))["minimum"] * C * 4
        scalars = 4 * (2 * n + 2) + (8 * n if inverted else 0)  # beta, a (and slots, gain) per token, fp32
        assert extra + plain <= counted <= extra + plain + scalars, (direction, counted, extra + plain)


def test_attnres_floor_is_what_its_kernels_move():
    """A middle merge of Full AttnRes (merge 6 of the 12 the kernels' byte count runs)."""
    floor6 = merge_bytes("attnres", C, merges=7, stream_bytes=4, update_bytes=4)  # mean over merges 0..6
    floor5 = merge_bytes("attnres", C, merges=6, stream_bytes=4, update_bytes=4)
    pf, pb = plain_bytes(4, 4)
    for direction, f6, f5, plain in (("fwd", floor6.forward, floor5.forward, pf),
                                     ("bwd", floor6.backward, floor5.backward, pb)):
        merge6 = 7 * (f6 + plain) - 6 * (f5 + plain)  # merge 6 alone (the floor averages over the chain)
        counted = aot.attnres_minimum(aot.Variant("attnres", direction, C, "fp32", 6, "full")) * C * 4
        assert merge6 == pytest.approx(counted, abs=3 * 4 * 8), direction  # (the per-token scalars)


def test_gpt2_small_step_floors():
    """GPT-2 small, 24 merges, 8 x 1024 tokens, fp32 streams and bf16 updates, the H200's 4178 GB/s and 34 ms plain
    step: MGR n = 4 with its inversion moves (9 + 17) x 4 + 2 + 2 bytes per feature in a merge where a plain add
    moves 10 + 6: 94 x 768 x 8192 x 24 bytes more, 14.2 GB, 3.4 ms, 1.10x plain at best (docs gpu.md's arithmetic:
    ~13 GB, ~3 ms); ResController 1.01x; AttnRes above Block AttnRes."""
    mgr = step_floor("mgr-competitive", 8192, 768, 24, 34.0, 4178.0)
    assert mgr.gb == pytest.approx(94 * 768 * 8192 * 24 / 1e9)
    assert 1.09 < mgr.ratio < 1.11
    assert step_floor("rescontroller", 8192, 768, 24, 34.0, 4178.0).ratio < 1.02
    full = step_floor("attnres", 8192, 768, 24, 34.0, 4178.0)
    block = step_floor("attnres-block", 8192, 768, 24, 34.0, 4178.0)
    assert full.gb > block.gb > 0
    assert merge_bytes("plain", 768) == (0.0, 0.0)
