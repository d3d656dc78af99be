"""The launch table of every kernel: tile shapes and warps keyed on (C, n, dtype), in one place.

Chosen from the ahead-of-time compile of every variant for sm_80 and sm_90 (``python
benchmarks/kernels_aot.py``: registers, spills, shared memory, theoretical occupancy): no fp32, bf16 or fp16
variant spills and every one keeps >= 25 % theoretical occupancy.

**fp64 runs are for tests only** (the comparisons with the fp64 oracles). fp64 launches take fp32's limits
(ResController's table is one for every dtype; MGR's 8-byte elements use its 4-byte entries), which assume
4-byte values; with two registers per value they spill: in the AOT compile of C in the
benchmark grid, n in {2, 8}, every MGR kind, sm_80 and sm_90, 132 of 252 fp64 variants spill (81216 bytes):
ResController backward at every C and forward at C = 8192-16384, MGR backward at n = 8 (and gated n = 2 at
C = 256-2048), MGR forward from C = 768 (n = 8) or 4096 (n = 2). They compile, keep >= 25 % occupancy and
compute correctly, only slower than fp64 limits of their own would; ``benchmarks/kernels_aot.py`` compiles fp64
and sums its spills apart.

Warps follow from elements per thread: a program gets ``tile elements / (32 * thread elements)`` warps (a power
of two, at most 32), so each thread holds a fixed share of every tile (for ResController 16 bytes of each
tensor: one 128-bit load) until the warps run out; past that each thread holds more of the row, which costs
registers — hence the ``single_*`` limits past which a row (token) is read in column blocks instead.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton

__all__ = ["Launch", "RowTile", "StreamTile", "rescontroller_tile", "mgr_tile", "persistent_programs",
           "RESCONTROLLER", "MGR"]


class Launch(NamedTuple):
    """One kernel launch, as data (``benchmarks/kernels_aot.py`` compiles exactly these ahead of time):
    ``kernel[grid](*args, **meta)``."""
    kernel: object
    grid: tuple
    args: tuple
    meta: dict

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


class RowTile(NamedTuple):
    """A ResController program: ``rows`` rows of ``block`` columns; ``single``: the whole row is one block
    (read once), else the row is read in column blocks twice (sums, then output); ``max_regs`` registers per
    thread ptxas may use (``maxnreg``)."""
    rows: int
    block: int
    single: bool
    num_warps: int
    max_regs: int


class StreamTile(NamedTuple):
    """An MGR program's tile: ``block_m`` streams x ``block_c`` features; ``single``: a token's streams are
    one tile (read once), else they are read in column tiles twice (sums, then output); ``max_regs``
    registers per thread ptxas may use (``maxnreg``)."""
    block_m: int
    block_c: int
    single: bool
    num_warps: int
    max_regs: int


#: ResController, per direction: ``single_elems`` longest row (elements, a power of two) read once into
#: registers; ``loop_block`` the column block of longer rows; ``tile_bytes`` bytes of one tensor per program
#: for short rows (several rows to a program); ``thread_bytes`` bytes of one tensor per thread; ``max_regs``.
RESCONTROLLER = {
    "forward": dict(single_elems=16384, loop_block=2048, tile_bytes=4096, thread_bytes=16, max_regs=64),
    "backward": dict(single_elems=8192, loop_block=2048, tile_bytes=4096, thread_bytes=16, max_regs=64),
}

#: MGR, per direction and element size (bytes of the streams' dtype), per path (``single``: a token's tile
#: read once; ``loop``: column tiles): ``single_elems`` largest tile (block_m * block_c) read once,
#: ``loop_elems`` the column tile's elements; ``*_thread_elems`` elements of the tile per thread; ``*_regs``
#: registers per thread (lowered to 64 for 32-warp programs; a dict: per block_m).
#: 2-byte streams hold 8 elements of every feature vector (u, q, w: one 128-bit load) per thread, so their
#: single tiles get fewer warps and a smaller limit than fp32's to stay unspilled.
MGR = {
    ("forward", 4): dict(single_elems=16384, single_thread_elems=8, single_regs=128,
                         loop_elems=2048, loop_thread_elems=4, loop_regs=64),
    ("forward", 2): dict(single_elems=8192, single_thread_elems=16, single_regs=128,
                         loop_elems=2048, loop_thread_elems=4, loop_regs=64),
    ("backward", 4): dict(single_elems=4096, single_thread_elems=8, single_regs=128,
                          loop_elems=1024, loop_thread_elems=4, loop_regs={2: 128, 4: 128, 8: 72}),
    ("backward", 2): dict(single_elems=4096, single_thread_elems=8, single_regs=128,
                          loop_elems=1024, loop_thread_elems=4, loop_regs={2: 128, 4: 128, 8: 72}),
}

MIN_WARPS, MAX_WARPS = 1, 32
REGISTERS_PER_SM = 65536


def _warps(elems: int, thread_elems: int, min_warps: int = MIN_WARPS) -> int:
    """Warps that give each thread ``thread_elems`` of ``elems`` (a power of two in [min_warps, MAX_WARPS])."""
    want = triton.next_power_of_2(max(1, elems // (32 * thread_elems)))
    return max(min_warps, min(MAX_WARPS, want))


def _max_regs(max_regs: int, num_warps: int) -> int:
    """``max_regs``, lowered so that one program fits an SM's 64K registers (a 32-warp program: 64)."""
    return min(max_regs, REGISTERS_PER_SM // (32 * num_warps))


def rescontroller_tile(n_cols: int, elem_bytes: int, direction: str) -> RowTile:
    """Tile of the ResController kernel for rows of ``n_cols`` features of ``elem_bytes`` bytes
    (``direction``: "forward" / "backward"); at least 4 warps per program."""
    cfg = RESCONTROLLER[direction]
    thread_elems = max(1, cfg["thread_bytes"] // elem_bytes)
    block = triton.next_power_of_2(max(1, n_cols))
    if block <= cfg["single_elems"]:
        rows = max(1, cfg["tile_bytes"] // (block * elem_bytes))
        warps = _warps(rows * block, thread_elems, 4)
        return RowTile(rows, block, True, warps, _max_regs(cfg["max_regs"], warps))
    block = cfg["loop_block"]
    warps = _warps(block, thread_elems, 4)
    return RowTile(1, block, False, warps, _max_regs(cfg["max_regs"], warps))


def mgr_tile(n_cols: int, m_out: int, elem_bytes: int, direction: str) -> StreamTile:
    """Tile of the MGR step kernel for ``m_out`` output streams of ``n_cols`` features of ``elem_bytes``
    bytes (``direction``: "forward" / "backward")."""
    cfg = MGR[(direction, min(4, max(2, elem_bytes)))]
    block_m = max(2, triton.next_power_of_2(m_out))
    block_c = triton.next_power_of_2(max(1, n_cols))
    single = block_m * block_c <= cfg["single_elems"]
    path = "single" if single else "loop"
    if not single:
        block_c = max(16, cfg["loop_elems"] // block_m)
    warps = _warps(block_m * block_c, cfg[f"{path}_thread_elems"])
    regs = cfg[f"{path}_regs"]
    regs = regs[block_m] if isinstance(regs, dict) else regs
    return StreamTile(block_m, block_c, single, warps, _max_regs(regs, warps))


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(items: int, num_warps: int, device: torch.device, min_items: int = 1) -> int:
    """Programs of a grid that loops over ``items`` (tokens): enough to fill every SM at full occupancy, each
    with at least ``min_items`` items (so per-program partial sums stay few); 4 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return max(1, min(items, 4))
    resident = _sm_count(device.index) * max(1, 64 // num_warps)
    return max(1, min(resident, triton.cdiv(items, min_items)))
