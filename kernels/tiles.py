"""The launch table of every kernel: tile shapes and warps keyed on (C, n, dtype), in one place.

Chosen from the ahead-of-time compile of every variant for sm_80 and sm_90 (``python
benchmarks/kernels_aot.py``: registers, spills, shared memory, theoretical occupancy): no fp32, bf16 or fp16
variant spills and every one keeps >= 25 % theoretical occupancy.

**fp64 runs are for tests only** (the comparisons with the fp64 oracles). fp64 launches take fp32's limits
(ResController's table is one for every dtype; MGR's 8-byte elements use its 4-byte entries), which assume
4-byte values; with two registers per value they spill: in the AOT compile of C in the
benchmark grid, n in {2, 8}, every MGR kind, sm_80 and sm_90, 132 of 252 fp64 variants spill (81216 bytes; measured
before issue 30's vector loads and fp32 forward tiles, whose fp64 rows ``kernels_aot.py --dtypes fp64`` gives):
ResController backward at every C and forward at C = 8192-16384, MGR backward at n = 8 (and gated n = 2 at
C = 256-2048), MGR forward from C = 768 (n = 8) or 4096 (n = 2). They compile, keep >= 25 % occupancy and
compute correctly, only slower than fp64 limits of their own would; ``benchmarks/kernels_aot.py`` compiles fp64
and sums its spills apart.

Warps follow from elements per thread: a program gets ``tile elements / (32 * thread elements)`` warps (a power
of two, at most 32), so each thread holds a fixed share of every tile, at least 16 bytes (one 128-bit load)
until the warps run out; past that each thread holds more of the row, which costs registers — hence the
``single_*`` limits past which a row (token) is read in column blocks instead. MGR's feature vectors (u, w, q,
dh, the parameter-gradient partials) are loaded in the stream tile's own layout (``_vector`` in
``kernels/mgr.py``), so they get the tile's 128-bit loads too (``benchmarks/kernels_aot.py`` checks every
feature-vector load of the PTX). Registers past the table's are in :data:`TILE_REGS` (per target where sm_90's
ptxas allocates more than sm_80's), and MGR's persistent grids launch what the SMs hold (:func:`programs_per_sm`:
at the compiled kernel's registers and shared memory once it has run, at the tile's limit before).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton

__all__ = ["Launch", "LaunchPlans", "clear_launch_plans", "RowTile", "StreamTile", "rescontroller_tile", "mgr_tile",
           "attnres_tile", "persistent_programs", "programs_per_sm", "residency_key", "residency_known",
           "device_arch", "RESCONTROLLER", "MGR", "ATTNRES", "ATTNRES_MAX_COLS", "TILE_REGS"]


class Launch(NamedTuple):
    """One kernel launch, as data (``benchmarks/kernels_aot.py`` compiles exactly these ahead of time):
    ``kernel[grid](*args, **meta)``; ``residency``: the key under which a persistent kernel records the programs
    per SM its compiled binary allows (:func:`persistent_programs` sizes later grids from it)."""
    kernel: object
    grid: tuple
    args: tuple
    meta: dict
    residency: Optional[tuple] = None

    def run(self) -> None:
        compiled = self.kernel[self.grid](*self.args, **self.meta)
        if self.residency is not None and self.residency not in _COMPILED_RESIDENCY:
            _record_residency(self.residency, compiled)


#: Every :class:`LaunchPlans` (:func:`clear_launch_plans` forgets them all)
_ALL_PLANS: list = []


def clear_launch_plans() -> None:
    """Forget every kept launch plan (after the launch table changed: tests shrink it)."""
    for plans in _ALL_PLANS:
        plans.plans.clear()


class LaunchPlans:
    """Launches already worked out, by a key of their call's signature (shapes, strides, dtypes, device, options): a
    repeated call's host code is a dict lookup and one launch, not the launch table's arithmetic again. A plan holds
    no tensor; ``maxsize`` plans at most (then it starts over)."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self.plans: dict = {}
        _ALL_PLANS.append(self)

    def get(self, key):
        return self.plans.get(key)

    def put(self, key, plan) -> None:
        if len(self.plans) >= self.maxsize:
            self.plans.clear()
        self.plans[key] = plan


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
#: registers per thread (lowered to 64 for 32-warp programs; a dict: per block_m); ``inverted_*_regs``: the inverted
#: backward's (it rebuilds the inputs beside its output and writes them: more live values), per block_m.
#: Each thread holds at least 16 bytes of the tile (8 elements of 2-byte streams, 4 of fp32: one 128-bit load of
#: each stream row and feature vector it holds); fp32's single forward tiles hold 16 elements per thread (at 8
#: the 32-warp programs' 64 registers spill).
MGR = {
    ("forward", 4): dict(single_elems=8192, single_thread_elems=16, single_regs=128,
                         loop_elems=2048, loop_thread_elems=4, loop_regs=64),
    ("forward", 2): dict(single_elems=8192, single_thread_elems=16, single_regs=128,
                         loop_elems=2048, loop_thread_elems=4, loop_regs=64),
    ("backward", 4): dict(single_elems=4096, single_thread_elems=8, single_regs=128,
                          loop_elems=1024, loop_thread_elems=4, loop_regs={2: 128, 4: 128, 8: 72},
                          inverted_loop_regs={8: 80}),
    ("backward", 2): dict(single_elems=4096, single_thread_elems=8, single_regs=128,
                          loop_elems=1024, loop_thread_elems=4, loop_regs={2: 128, 4: 128, 8: 96},
                          inverted_loop_regs={8: 104}),
}

#: AttnRes, per direction: elements of a row per thread (at least one 128-bit load), the most warps, registers per
#: thread; a token's row is one block (``kernels/attnres.py``: rows up to ``ATTNRES_MAX_COLS`` features).
ATTNRES = {
    "forward": dict(thread_bytes=16, max_warps=16, max_regs=128),
    "backward": dict(thread_bytes=16, max_warps=16, max_regs=128),
}
#: The widest row the AttnRes kernels take (wider: the rule's torch path; at 8192 the backward's 16-warp programs
#: spill, benchmarks/kernels_aot.py).
ATTNRES_MAX_COLS = 4096

#: Register limits of single tiles, past the table's: ``None``, for every target; a compute capability (90), for
#: that target alone, where its ptxas allocates more than sm_80's and crosses an occupancy step (from
#: ``benchmarks/kernels_aot.py``; none of these spills at its limit). Keys: ResController ``("rescontroller",
#: direction, elem_bytes, rows, block)``; MGR ``("mgr", direction, elem_bytes, block_m, block_c, gated)``.
TILE_REGS = {
    None: {  # bf16/fp16 accumulating forward, n = 2: 71-72 registers (one 16-warp program per SM) -> 63
        ("mgr", "forward", 2, 2, 1024, False): 64,  # 44 % -> 50 %
        ("mgr", "forward", 2, 2, 2048, False): 64,  # 38 % -> 50 %
        ("mgr", "forward", 2, 2, 4096, False): 64,  # 25 % -> 50 %
    },
    90: {
        ("mgr", "forward", 4, 2, 1024, False): 64,  # 72 registers on sm_90 (64 on sm_80): 44 % -> 50 %
        ("mgr", "forward", 4, 2, 2048, False): 64,  # 72 (64): 38 % -> 50 %
        ("mgr", "forward", 4, 4, 1024, False): 80,  # 84 (80): 25 % -> 38 %
        ("mgr", "backward", 2, 4, 256, False): 96,  # 100 (95): 25 % -> 31 %
        ("mgr", "backward", 4, 2, 256, False): 72,  # 80 (72): 38 % -> 44 %
        ("rescontroller", "backward", 4, 4, 256): 48,  # 50 (46): 50 % -> 62 %
    },
}

MIN_WARPS, MAX_WARPS = 1, 32
REGISTERS_PER_SM = 65536
#: Per SM: resident warps and programs, and the unit registers are allocated in (per warp).
WARPS_PER_SM, PROGRAMS_PER_SM, REGISTER_UNIT = 64, 32, 256
#: Bytes of every feature vector each thread loads at once: one 128-bit load.
VECTOR_BYTES = 16


def _warps(elems: int, thread_elems: int, min_warps: int = MIN_WARPS) -> int:
    """Warps that give each thread ``thread_elems`` of ``elems`` (a power of two in [min_warps, MAX_WARPS])."""
    want = triton.next_power_of_2(max(1, elems // (32 * thread_elems)))
    return max(min_warps, min(MAX_WARPS, want))


def _max_regs(max_regs: int, num_warps: int) -> int:
    """``max_regs``, lowered so that one program fits an SM's 64K registers (a 32-warp program: 64)."""
    return min(max_regs, REGISTERS_PER_SM // (32 * num_warps))


def _tile_regs(arch: Optional[int], key: tuple, regs: int) -> int:
    """``regs``, or the tile's own limit (:data:`TILE_REGS`): the target's, else every target's."""
    return TILE_REGS.get(arch, {}).get(key, TILE_REGS[None].get(key, regs))


def rescontroller_tile(n_cols: int, elem_bytes: int, direction: str, arch: Optional[int] = None) -> RowTile:
    """Tile of the ResController kernel for rows of ``n_cols`` features of ``elem_bytes`` bytes
    (``direction``: "forward" / "backward") on target ``arch`` (compute capability, e.g. 90; None: the
    shared limits); at least 4 warps per program."""
    cfg = RESCONTROLLER[direction]
    thread_elems = max(1, cfg["thread_bytes"] // elem_bytes)
    block = triton.next_power_of_2(max(1, n_cols))
    if block <= cfg["single_elems"]:
        rows = max(1, cfg["tile_bytes"] // (block * elem_bytes))
        warps = _warps(rows * block, thread_elems, 4)
        regs = _tile_regs(arch, ("rescontroller", direction, elem_bytes, rows, block), cfg["max_regs"])
        return RowTile(rows, block, True, warps, _max_regs(regs, warps))
    block = cfg["loop_block"]
    warps = _warps(block, thread_elems, 4)
    regs = _tile_regs(arch, ("rescontroller", direction, elem_bytes, 1, block), cfg["max_regs"])
    return RowTile(1, block, False, warps, _max_regs(regs, warps))


def mgr_tile(n_cols: int, m_out: int, elem_bytes: int, direction: str, gated: bool = True,
             arch: Optional[int] = None, inverted: bool = False) -> StreamTile:
    """Tile of the MGR step kernel for ``m_out`` output streams of ``n_cols`` features of ``elem_bytes``
    bytes (``direction``: "forward" / "backward"; ``gated``: a gated merge, else an accumulating one; ``inverted``:
    with the fallback inversion) on target ``arch`` (compute capability, e.g. 90; None: the shared limits)."""
    cfg = MGR[(direction, min(4, max(2, elem_bytes)))]
    block_m = max(2, triton.next_power_of_2(m_out))
    block_c = triton.next_power_of_2(max(1, n_cols))
    single = block_m * block_c <= cfg["single_elems"]
    path = "single" if single else "loop"
    if not single:
        block_c = max(16, cfg["loop_elems"] // block_m)
    # at least one 128-bit load of the tile per thread (the feature vectors are loaded in the tile's layout)
    warps = _warps(block_m * block_c, max(VECTOR_BYTES // elem_bytes, cfg[f"{path}_thread_elems"]))
    regs = cfg[f"{path}_regs"]
    regs = regs[block_m] if isinstance(regs, dict) else regs
    if inverted and gated:
        regs = cfg.get(f"inverted_{path}_regs", {}).get(block_m, regs)
    regs = _tile_regs(arch, ("mgr", direction, elem_bytes, block_m, block_c, gated), regs)
    return StreamTile(block_m, block_c, single, warps, _max_regs(regs, warps))


def attnres_tile(n_cols: int, elem_bytes: int, direction: str, arch: Optional[int] = None) -> StreamTile:
    """Tile of the AttnRes kernels for rows of ``n_cols`` features of ``elem_bytes`` bytes (the narrowest of the
    sources' compute dtype and the update's; ``direction``: "forward" / "backward") on target ``arch``: one row per
    program, at least 16 bytes of the narrowest per thread."""
    cfg = ATTNRES[direction]
    block_c = triton.next_power_of_2(max(1, n_cols))
    warps = min(cfg["max_warps"], _warps(block_c, max(1, cfg["thread_bytes"] // elem_bytes)))
    regs = _tile_regs(arch, ("attnres", direction, elem_bytes, block_c), cfg["max_regs"])
    return StreamTile(1, block_c, True, warps, _max_regs(regs, warps))


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: Optional[int]) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def device_arch(device: torch.device) -> Optional[int]:
    """The compute capability of a CUDA ``device`` (e.g. 90), None off CUDA: the key of :data:`TILE_REGS`."""
    return _cuda_arch(device.index) if device.type == "cuda" else None


def programs_per_sm(num_warps: int, max_regs: int, shared: int = 0, shared_per_sm: Optional[int] = None) -> int:
    """Programs of ``num_warps`` warps with ``max_regs`` registers per thread (and ``shared`` bytes of shared
    memory, 1 KiB more reserved per program, of ``shared_per_sm``) that one SM holds at once: 64K registers
    allocated per warp in units of 256, at most 64 warps and 32 programs (sm_80 / sm_90). ptxas keeps a program
    within its ``maxnreg``, so at the limit this is what is resident at most registers."""
    regs_per_warp = triton.cdiv(max_regs * 32, REGISTER_UNIT) * REGISTER_UNIT
    by_regs = REGISTERS_PER_SM // regs_per_warp // num_warps
    by_shared = shared_per_sm // (shared + 1024) if shared_per_sm else PROGRAMS_PER_SM
    return max(1, min(by_regs, by_shared, WARPS_PER_SM // num_warps, PROGRAMS_PER_SM))


#: Programs per SM of compiled persistent kernels (their registers and shared memory), by residency key.
_COMPILED_RESIDENCY: dict = {}


def residency_key(kernel, device: torch.device, meta: dict) -> Optional[tuple]:
    """The key of a persistent kernel's compiled residency on a CUDA ``device`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return (kernel, device.index, tuple(sorted((k, repr(v)) for k, v in meta.items())))


def _record_residency(key: tuple, compiled) -> None:
    """Record the programs per SM the compiled kernel allows (its ``n_regs`` and shared memory)."""
    n_regs = getattr(compiled, "n_regs", None)
    if not n_regs:
        return
    props = torch.cuda.get_device_properties(key[1])
    _COMPILED_RESIDENCY[key] = programs_per_sm(compiled.metadata.num_warps, n_regs, compiled.metadata.shared,
                                               getattr(props, "shared_memory_per_multiprocessor", None))


def residency_known(key: Optional[tuple]) -> bool:
    """Whether the programs per SM of a persistent kernel are final: off CUDA (no key), or its compiled residency
    recorded (after its first launch)."""
    return key is None or key in _COMPILED_RESIDENCY


def persistent_programs(items: int, tile: StreamTile, device: torch.device, min_items: int = 1,
                        residency: Optional[tuple] = None) -> int:
    """Programs of a grid that loops over ``items`` (tokens) with ``tile``'s programs: as many as every SM holds
    at once, each with at least ``min_items`` items (so per-program partial sums stay few); 4 off CUDA (the
    interpreter). Resident programs: those the compiled kernel's registers and shared memory allow once it has
    run (recorded under ``residency``, :func:`residency_key`), before that those of the tile's warps and register
    limit (:func:`programs_per_sm`, never more than the compiled kernel allows)."""
    if device.type != "cuda":
        return max(1, min(items, 4))
    per_sm = _COMPILED_RESIDENCY.get(residency) or programs_per_sm(tile.num_warps, tile.max_regs)
    return max(1, min(_sm_count(device.index) * per_sm, triton.cdiv(items, min_items)))
