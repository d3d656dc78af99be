"""benchmarks/kernels_aot.py: the ahead-of-time CUDA compile of a representative subset of the launch table
(every kernel, its one-read and its two-pass path, sm_80 and sm_90, n=8) must compile, spill nothing and keep
>= 25 % theoretical occupancy; the bytes the kernels move (counted in the interpreter) must be the rule's
minimum on the one-read paths and the documented two reads on the others."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_resctl.runtime.triton import load_kernels

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "kernels_aot.py"


def load_aot():
    spec = importlib.util.spec_from_file_location("kernels_aot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


aot = load_aot()


def test_occupancy_model_matches_the_hardware_limits():
    """Hand-computed from the per-SM limits (64K registers allocated per warp in units of 256, 64 warps,
    32 blocks, 164 / 228 KiB shared memory with 1 KiB reserved per block)."""
    assert aot.occupancy(32, 0, 4, 90) == 1.0  # 16 blocks of 4 warps
    assert aot.occupancy(128, 0, 16, 80) == 0.25  # 128 x 32 x 16 = 64K registers: one block
    assert aot.occupancy(129, 0, 4, 90) == 12 / 64  # 136 registers allocated: 15 warps, 3 blocks of 4
    assert aot.occupancy(255, 0, 8, 90) == 0.125
    assert aot.occupancy(16, 0, 1, 90) == 0.5  # 32 blocks of one warp
    assert aot.occupancy(32, 100 * 1024, 4, 80) == 4 / 64  # one 101 KiB block per 164 KiB
    assert aot.occupancy(32, 100 * 1024, 4, 90) == 8 / 64  # two per 228 KiB


def test_launch_table_shapes():
    """Over the benchmark's grid: short ResController rows go several to a program with >= 4 warps; every
    program fits one SM's 64K registers at its register cap (else it could not launch); tiles are powers of
    two; MGR tiles hold every stream."""
    tiles = load_kernels("tiles")
    for c in aot.GRID_C + (33, 777):
        for elem in (2, 4):
            for direction in ("forward", "backward"):
                t = tiles.rescontroller_tile(c, elem, direction)
                assert t.num_warps >= 4 and t.max_regs * 32 * t.num_warps <= 65536, (c, elem, t)
                if c * elem <= 1024:
                    assert t.rows > 1 and t.single, (c, elem, t)
                assert t.block >= c if t.single else t.block < c
                for n in aot.STREAMS:
                    m = tiles.mgr_tile(c, n, elem, direction)
                    assert m.block_m >= n and m.max_regs * 32 * m.num_warps <= 65536, (c, n, elem, m)
                    assert m.block_c & (m.block_c - 1) == 0 and (m.block_c >= c) == m.single
                    # every thread holds at least one 128-bit load of the stream tile (one warp: tiles smaller
                    # than 32 x 16 bytes have less)
                    assert m.block_m * m.block_c * elem >= 16 * 32 * m.num_warps or m.num_warps == 1, (c, n, m)


def test_persistent_grid_is_what_the_sms_hold(monkeypatch):
    """A persistent grid launches as many programs as the SMs hold at the tile's warps and register limit
    (hand-computed: 64K registers per SM allocated per warp in units of 256, at most 64 warps and 32 programs),
    not 64 warps' worth regardless of registers."""
    tiles = load_kernels("tiles")
    monkeypatch.setattr(tiles, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)

    def grid(warps, regs, items=10 ** 6, min_items=1):
        return tiles.persistent_programs(items, tiles.StreamTile(2, 1024, True, warps, regs), cuda, min_items)

    assert grid(16, 128) == 132  # 128 x 32 x 16 = 64K registers: one program per SM, not 4
    assert grid(16, 64) == 2 * 132
    assert grid(4, 128) == 4 * 132
    assert grid(8, 72) == 3 * 132  # 72 x 32 x 8 = 18K registers: 3 programs (24 warps)
    assert grid(1, 32) == 32 * 132  # 32 programs per SM at most
    assert grid(4, 128, items=100) == 100 and grid(4, 128, items=100, min_items=8) == 13
    assert tiles.persistent_programs(100, tiles.StreamTile(2, 1024, True, 4, 128), torch.device("cpu")) == 4


def test_persistent_grid_follows_the_compiled_kernel(monkeypatch):
    """Once a persistent kernel has run, later grids launch what its compiled binary's registers and shared memory
    let an SM hold (hand-computed as above, 228 KiB of shared memory with 1 KiB reserved per program), not what the
    tile's register limit does."""
    tiles = load_kernels("tiles")
    monkeypatch.setattr(tiles, "_sm_count", lambda index: 132)
    monkeypatch.setattr(tiles, "_COMPILED_RESIDENCY", {})
    monkeypatch.setattr(tiles.torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(shared_memory_per_multiprocessor=228 * 1024))
    cuda = torch.device("cuda", 0)
    tile = tiles.StreamTile(2, 256, True, 1, 128)

    class Kernel:  # stands in for a JIT function: kernel[grid](...) launches and returns the compiled kernel
        def __init__(self, regs, shared):
            self.compiled = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=1, shared=shared))

        def __getitem__(self, grid):
            return lambda *args, **meta: self.compiled

    for regs, shared, per_sm in [(64, 0, 32), (96, 0, 21), (64, 100 * 1024, 2)]:
        kernel = Kernel(regs, shared)
        key = tiles.residency_key(kernel, cuda, {"BLOCK_C": 256, "maxnreg": 128})
        assert tiles.persistent_programs(10 ** 6, tile, cuda, residency=key) == 16 * 132  # at the limit: 16
        tiles.Launch(kernel, (16 * 132,), (), {}, key).run()
        assert tiles.persistent_programs(10 ** 6, tile, cuda, residency=key) == per_sm * 132, (regs, shared)
    assert tiles.residency_key(Kernel(64, 0), torch.device("cpu"), {}) is None


def test_load_widths_follow_the_pointer_arguments():
    """Each ld.global of the PTX is attributed to the pointer parameter its address register derives from
    (through address arithmetic), with its width; scalar parameters are not pointers."""
    ptx = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u32 k_param_2
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	ld.param.b32 	%r1, [k_param_2];
	mul.wide.s32 	%rd3, %r1, 2;
	add.s64 	%rd4, %rd1, %rd3;
	add.s64 	%rd5, %rd4, 16;
	@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd5 + 0 ];
	add.s64 	%rd6, %rd2, %rd3;
	@%p2 ld.global.b32 { %r6 }, [ %rd6 + 0 ];
	ld.global.v2.b16 { %rs1, %rs2 }, [ %rd2 + 0 ];
}
"""
    assert aot.load_widths(ptx, ["S", "U", "T"]) == {"S": [128], "U": [32]}


def run_aot(tmp_path, *args):
    """Run the script (compile only, 2 jobs) with ``args``; it must succeed. ``(process, its JSON)``; skipped
    without triton's CUDA backend."""
    missing = aot.cuda_backend_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(SCRIPT), *args, "--no-bytes", "--jobs", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads(out.read_text())


def test_subset_compiles_without_spills_at_quarter_occupancy(tmp_path):
    """Every kernel on its one-read path (C=64) and its two-pass path (C=32768), both targets, bf16, n=8,
    a gated and an accumulating MGR merge: no compile failure, no spill, occupancy >= 25 %."""
    res, data = run_aot(tmp_path, "--C", "64", "32768", "--dtypes", "bf16", "--n", "8", "--kinds", "competitive",
                        "accumulating", "--rules", "rescontroller", "mgr")
    rows = data["rows"]
    seen = set()
    for row in rows:
        v = row["variant"]
        assert row["error"] is None, row
        assert row["spill"] == 0 and row["stack"] == 0, row
        assert row["occupancy"] >= 0.25, row
        assert row["ld_bits"] == 128 and row["f64"] == 0, row  # 128-bit loads, no fp64 on a bf16 path
        # every feature vector (streams, u, w, q, dS', dh, partials) of a long row loaded 128 bits at a time
        assert all(bits == 128 for bits in row["vector_bits"].values()), row
        if v["c"] == 32768:
            assert {"S", "U"} <= set(row["vector_bits"]) or {"r_ptr", "u_ptr"} <= set(row["vector_bits"]), row
        if v["rule"] == "mgr":  # the persistent grid: no more programs per SM than are resident
            assert 1 <= row["grid_per_sm"] <= row["resident_per_sm"], row
        seen.add((v["rule"], v["direction"], row["arch"], "one read" in row["tile"]))
    assert seen == {(rule, d, arch, single) for rule in ("rescontroller", "mgr") for d in ("fwd", "bwd")
                    for arch in ("sm_80", "sm_90") for single in (True, False)}
    assert "0 compile failures, 0 spilled bytes" in res.stdout
    assert data["summary"]["narrow_loads"] == 0 and data["summary"]["overfull_grids"] == 0


def test_attnres_and_inverted_mgr_compile_without_spills(tmp_path):
    """The AttnRes kernels (Full and Block AttnRes; a middle merge, the last, the first) at the widest row they take
    and at C=768, and MGR's inverted step (n=4, C=768: one read), sm_90, bf16: no spill, occupancy >= 25 %,
    every feature vector loaded 128 bits at a time."""
    res, data = run_aot(tmp_path, "--rules", "attnres", "mgr", "--C", "768", "4096", "--dtypes", "bf16", "--n", "4",
                        "--kinds", "competitive inverted", "--arch", "90")
    rows = data["rows"]
    assert {r["variant"]["rule"] for r in rows} == {"attnres", "mgr"}
    for row in rows:
        assert row["error"] is None and row["spill"] == 0 and row["stack"] == 0, row
        assert row["occupancy"] >= 0.25, row
        assert row["vector_bits"] and all(bits == 128 for bits in row["vector_bits"].values()), row
    assert "0 compile failures, 0 spilled bytes" in res.stdout


def test_bf16_multi_row_tiles_load_feature_vectors_128_bits(tmp_path):
    """The shapes issue 30 found narrow: MGR forward bf16 C=1024 n=8 (u 32-bit, w 64-bit) and the column-tiled
    backward n=2 C=4096 (no 128-bit load) load every feature vector 128 bits at a time; the accumulating forward
    bf16 C=4096 n=2 keeps 50 % occupancy on sm_90 (it had 25 %), and its grid fills what is resident."""
    _, data = run_aot(tmp_path, "--rules", "mgr", "--C", "1024", "4096", "--dtypes", "bf16", "--n", "2", "8",
                      "--kinds", "accumulating", "--arch", "90")
    rows = {(r["variant"]["direction"], r["variant"]["c"], r["variant"]["n"]): r for r in data["rows"]}
    assert len(rows) == 8
    for key, row in rows.items():
        assert row["error"] is None and row["spill"] == 0, row
        names = {"S", "U", "W"} | ({"DOUT", "DH"} if key[0] == "bwd" else set())
        assert names <= set(row["vector_bits"]), row
        assert all(bits == 128 for bits in row["vector_bits"].values()), row
        assert row["grid_per_sm"] <= row["resident_per_sm"], row
    assert "2 passes" in rows[("bwd", 4096, 2)]["tile"]
    assert rows[("fwd", 4096, 2)]["occupancy"] == 0.5
    assert rows[("fwd", 4096, 2)]["grid_per_sm"] == rows[("fwd", 4096, 2)]["resident_per_sm"]


def test_fp64_compiles_and_its_spills_are_counted_apart(tmp_path):
    """fp64 is in the grid (kernels/tiles.py: its launches use fp32's register limits, so they spill; fp64 runs are
    for tests only): it compiles, keeps >= 25 % occupancy and computes in fp64; its spills are summed apart and do
    not fail the run, while any spill of fp32/bf16/fp16 would."""
    res, data = run_aot(tmp_path, "--C", "64", "--dtypes", "fp64", "--n", "8", "--kinds", "competitive", "--arch",
                        "90", "--rules", "rescontroller", "mgr")
    rows, summary = data["rows"], data["summary"]
    assert len(rows) == 4 and all(r["variant"]["dtype"] == "fp64" for r in rows)
    for row in rows:
        assert row["error"] is None and row["occupancy"] >= 0.25 and row["f64"] > 0, row
    spilled = sum(r["spill"] + r["stack"] for r in rows)
    assert summary["spilled_bytes"] == 0 and summary["fp64_spilled_bytes"] == spilled
    # what kernels/tiles.py and docs/benchmarks.md state: fp64 spills (update both if the table gets fp64 limits)
    assert spilled > 0
    assert f"fp64 (tests only): {spilled} spilled bytes" in res.stdout


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Launch plans made with a shrunk launch table (``monkeypatch``) are forgotten before and after each test."""
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    yield
    tiles.clear_launch_plans()


def shrink_tables(monkeypatch):
    """Small single-read limits, so that small rows reach the two-pass paths in the interpreter."""
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    for entry in tiles.RESCONTROLLER.values():
        monkeypatch.setitem(entry, "single_elems", 128)
        monkeypatch.setitem(entry, "loop_block", 64)
    for entry in tiles.MGR.values():
        monkeypatch.setitem(entry, "single_elems", 512)
        monkeypatch.setitem(entry, "loop_elems", 128)


@pytest.mark.parametrize("c", [96, 200])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_rescontroller_bytes_moved(monkeypatch, direction, c):
    """Per row, in units of C elements: one read of each input and one write of each output (3 forward,
    5 backward) when the row is read once (C=96); the inputs read twice on the two-pass path (C=200: 5, 8)."""
    shrink_tables(monkeypatch)
    got = aot.count_bytes(aot.Variant("rescontroller", direction, c, "fp32"))
    inputs, outputs = (2, 1) if direction == "fwd" else (3, 2)
    assert got["minimum"] == inputs + outputs
    assert got["moved"] == (inputs + outputs if c <= 128 else 2 * inputs + outputs)
    assert got["other"] == 0


@pytest.mark.parametrize("kind", ["competitive", "accumulating"])
@pytest.mark.parametrize("c", [40, 200])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_mgr_bytes_moved(monkeypatch, direction, c, kind):
    """Per token, in units of C elements (n=4): the rule's minimum when a token is one tile (C=40: 4 x 64
    <= 512), the stream inputs read twice when it is tiled (C=200)."""
    shrink_tables(monkeypatch)
    n = 4
    m = n if kind != "accumulating" else n - 1
    got = aot.count_bytes(aot.Variant("mgr", direction, c, "fp32", n, kind))
    gated = kind != "accumulating"
    if direction == "fwd":  # read S, u; write S', h, beta (m fp32 when gated), a (n fp32)
        row_inputs, minimum = m + 1, (m + 1) + (n + 1) + ((m if gated else 0) + n) / c
    else:  # read S, u, dS', dh, beta, a; write dS, du
        row_inputs, minimum = m + 1 + n + 1, (m + 1 + n + 1) + ((m if gated else 0) + n) / c + (m + 1)
    assert got["minimum"] == pytest.approx(minimum, rel=1e-12)
    extra = 0 if c == 40 else row_inputs  # C=40: one 4 x 64 tile; C=200: 4 x 256 > 512, tiled
    assert got["moved"] == pytest.approx(minimum + extra, rel=1e-12)


@pytest.mark.parametrize("kind, k", [("full", 6), ("block", 5), ("full", 11), ("full", 0)])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_attnres_bytes_moved(direction, kind, k):
    """Per token, an AttnRes merge moves its minimum (kernels_aot.attnres_minimum: each source read once, its
    gradient read and written once, the outputs written once): a middle merge of Full AttnRes, one continuing a
    block, the last (its backward writes the gradient buffers), the first (x into slot 0, x's gradient out)."""
    got = aot.count_bytes(aot.Variant("attnres", direction, 40, "fp32", k, kind))
    assert got["moved"] == pytest.approx(got["minimum"], rel=1e-12)
    assert got["minimum"] == pytest.approx(aot.attnres_minimum(aot.Variant("attnres", direction, 40, "fp32", k, kind)))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_inverted_mgr_bytes_moved(monkeypatch, direction):
    """The inverted MGR step (n=4, one tile) moves the rule's minimum: forward as without inversion (the exact rows,
    slots and gain are the few extra), backward reading the output streams and writing the rebuilt inputs too."""
    shrink_tables(monkeypatch)
    got = aot.count_bytes(aot.Variant("mgr", direction, 40, "fp32", 4, "competitive inverted"))
    assert got["moved"] == pytest.approx(got["minimum"], rel=1e-12)
