"""Ahead-of-time compile of every Triton kernel variant the launch code picks, for sm_80 and sm_90, on any
machine (no GPU needed: Triton's CUDA backend and the ptxas inside the triton wheel run on CPU).

One line per variant: the tile and warps the launch code chose (taken from the kernels' own launch functions,
so the table cannot drift from what runs), registers per thread, spilled bytes, shared memory, theoretical
occupancy, the widest global load (bits), the narrowest load of any feature vector (``vec``: each load of the
PTX attributed to the pointer argument its address derives from; every one should be 128 bits, kernels/tiles.py)
and fp64 instructions from the PTX, the bytes the kernel moves per row (per token for MGR) against the rule's
minimum, and for MGR's persistent grids the programs per SM the launch code sizes the first launch for (the
tile's register limit; later launches use the compiled kernel's residency) against those resident at the
compiled registers and shared memory (``grid a/b``: a must not exceed b). A summary line ends the table.

Everything here is compiler output and a model of the hardware, not a GPU measurement:

* registers / spills: ``ptxas -v`` on the PTX Triton emits (the flags Triton uses);
* theoretical occupancy: resident warps per SM over 64, from registers (allocated per warp in units of 256),
  shared memory (+1 KiB reserved per block; 164 KiB per SM on sm_80, 228 KiB on sm_90), 32 blocks and 64
  warps per SM;
* bytes moved: every global load and store of the kernel counted while it runs in Triton's interpreter on a
  few rows (masked-off lanes not counted; lanes of one load at the same address counted once), split into the
  row tensors (the rule's inputs and outputs) and the rest (parameter vectors, per-program partial sums); the
  minimum reads every row input once and writes every row output once (ResController: 3C forward, 5C
  backward; MGR: see ``kernels/mgr.py``).

Usage::

    python benchmarks/kernels_aot.py                      # the full grid, both targets (~10 min on 2 cores
                                                          # without fp64; fp64 adds a third)
    python benchmarks/kernels_aot.py --C 768 4096 --dtypes bf16 --n 4 --arch 90   # a subset
    python benchmarks/kernels_aot.py --json out.json     # also write every row as JSON

Needs triton with its CUDA backend (the standard Linux wheel); no CUDA device or driver.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GRID_C = (64, 256, 768, 1024, 2048, 4096, 8192, 16384, 32768)
#: fp64 is compiled too: its launches use fp32's register limits and spill (kernels/tiles.py: fp64 runs are for
#: tests only); its spills are summed apart and do not fail the run.
DTYPES = ("fp32", "bf16", "fp16", "fp64")
STREAMS = (2, 4, 8)
#: MGR merge kinds; "<gating> inverted": a gated merge with the fallback inversion (fp32 streams' default)
INVERTED = " inverted"
KINDS = ("accumulating", "independent", "competitive", "independent" + INVERTED, "competitive" + INVERTED)
ARCHS = (80, 90)
#: Rows (tokens) the byte count runs on: no other dim of a variant has this size, so it marks row tensors.
COUNT_ROWS = 5
#: Rows (tokens) of the compiled launches: no feature size (a per-row scalar is not a feature vector)
AOT_ROWS = 4099

#: Per-SM limits of the occupancy model (CUDA occupancy calculator values; the goals are set for 80 and 90).
SM = {
    80: dict(regs=65536, warps=64, blocks=32, smem=164 * 1024),
    86: dict(regs=65536, warps=48, blocks=16, smem=100 * 1024),
    89: dict(regs=65536, warps=48, blocks=24, smem=100 * 1024),
    90: dict(regs=65536, warps=64, blocks=32, smem=228 * 1024),
    100: dict(regs=65536, warps=64, blocks=32, smem=228 * 1024),
}
REG_UNIT, SMEM_UNIT, SMEM_RESERVED = 256, 128, 1024


class Variant(NamedTuple):
    """One kernel launch the package can make: ``rule`` "rescontroller" / "mgr" / "attnres", ``direction`` "fwd" /
    "bwd"; MGR: ``n`` streams, ``kind`` of merge; AttnRes: ``kind`` "full" / "block" (S = 2), ``n`` the merge."""
    rule: str
    direction: str
    c: int
    dtype: str
    n: Optional[int] = None
    kind: Optional[str] = None

    def label(self) -> str:
        extra = (f" n={self.n} {self.kind}" if self.rule == "mgr" else
                 f" {self.kind} merge {self.n} of {ATTNRES_MERGES}" if self.rule == "attnres" else "")
        return f"{self.rule} {self.direction} C={self.c} {self.dtype}{extra}"


#: AttnRes variants: a chain of this many merges, merge 6 of Full AttnRes (7 completed sources and the new one) and
#: merge 5 of Block AttnRes with S = 2 (continuing a block: the partial read, 3 completed blocks); merge 11 (the last:
#: its backward writes the gradient buffers) and merge 0 (x into slot 0; its backward returns x's gradient)
ATTNRES_MERGES = 12
ATTNRES_KINDS = (("full", 6), ("block", 5), ("full", 11), ("full", 0))


def _attnres_max_cols() -> int:
    from lightning_resctl.runtime.triton import load_kernels

    return load_kernels("tiles").ATTNRES_MAX_COLS


def variants(cs, dtypes, ns, kinds, rules=("rescontroller", "mgr", "attnres")) -> list[Variant]:
    out = []
    for rule in rules:
        for direction in ("fwd", "bwd"):
            for c in cs:
                for dt in dtypes:
                    if rule == "rescontroller":
                        out.append(Variant(rule, direction, c, dt))
                    elif rule == "attnres":
                        if c <= _attnres_max_cols():  # wider rows take the rule's torch path
                            out.extend(Variant(rule, direction, c, dt, k, kind) for kind, k in ATTNRES_KINDS)
                    else:
                        out.extend(Variant(rule, direction, c, dt, n, k) for n in ns for k in kinds)
    return out


# ----------------------------------------------------------------------------------------------
# the launches, from the kernels' own launch code
# ----------------------------------------------------------------------------------------------
def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]


def build(v: Variant, rows: int, device: str, arch: Optional[int] = None):
    """``(launches, run)`` of variant ``v`` on ``rows`` rows (tokens): the kernel launches the launch code makes
    for these tensors on target ``arch`` (compute capability), and a function that runs the public op (for the
    byte count)."""
    import torch

    from lightning_resctl.runtime.triton import load_kernels

    dt = _torch_dtype(v.dtype)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=dt):
        if device == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randn(shape, generator=gen).to(dtype)

    if v.rule == "attnres":
        return _build_attnres(v, rows, device, arch, rand, dt)
    if v.rule == "rescontroller":
        k = load_kernels("rescontroller")
        r, u, g = rand(rows, v.c), rand(rows, v.c), rand(rows, v.c)
        opts = (0.18, 1.08, 8.0, 8.0, 1e-12)
        if v.direction == "fwd":
            launches = [k.forward_launch(r, u, torch.empty_like(r), opts, arch)]
            return launches, lambda: k.rescontroller_fwd(r, u, *opts)
        launches = [k.backward_launch(g, r, u, torch.empty_like(r), torch.empty_like(u), opts, arch)]
        return launches, lambda: k.rescontroller_bwd(g, r, u, *opts)
    k = load_kernels("mgr")
    gated = v.kind != "accumulating"
    m = v.n if gated else v.n - 1
    f32 = torch.float32
    streams, u = rand(rows, m, v.c), rand(rows, v.c)
    w = rand(v.c, dtype=f32)
    q = rand(v.c, dtype=f32) if gated else None
    cb = rand(v.n, dtype=f32) if gated else None
    fb = rand(dtype=f32) if v.kind.startswith("competitive") else None
    eps = 1e-6
    inverted = v.kind.endswith(INVERTED)
    inversion = k.Inversion(None, 0.05, 0.5, 8.0) if inverted else None
    if v.direction == "fwd":
        outs = (torch.empty(rows, v.n, v.c, dtype=dt, device=streams.device), torch.empty_like(u),
                torch.empty(rows, m if gated else 0, dtype=f32, device=streams.device),
                torch.empty(rows, v.n, dtype=f32, device=streams.device))
        launch, _ = k.forward_launch(streams, u, w, q, cb, fb, eps, *outs, arch=arch, inversion=inversion)
        return [launch], lambda: k.step_forward(streams, u, w, q, cb, fb, eps, inversion)
    beta = rand(rows, m if gated else 0, dtype=f32).softmax(-1) if gated else None
    a = rand(rows, v.n, dtype=f32).softmax(-1)
    grad_out, grad_h = rand(rows, v.n, v.c), rand(rows, v.c)
    exact = None
    if inverted:  # the forward's exact rows: a budget of rows, their slots
        _, _, _, _, exact = k.step_forward(streams, u, w, q, cb, fb, eps, inversion) if device != "meta" else (
            None, None, None, None, k.ExactRows(None, torch.full((rows, m), -1, dtype=torch.int32, device="meta"),
                                                torch.empty(8, v.c, dtype=dt, device="meta")))
    delivered = torch.empty_like(streams) if inverted else None
    launch, parts = k.backward_launch(streams, u, beta, a, w, q, fb, grad_out, grad_h, eps,
                                      torch.empty_like(streams), torch.empty_like(u), arch=arch, exact=exact,
                                      delivered=delivered)
    block_m = launch.meta["BLOCK_M"]
    partials = k.partials_launch(parts, v.c, m, gated, fb is not None, block_m, torch.empty_like(w),
                                 torch.empty_like(q) if gated else None, torch.empty_like(cb) if gated else None,
                                 torch.empty(1, device=w.device) if fb is not None else None,
                                 torch.float64 if dt == torch.float64 else f32)
    return [launch, partials], lambda: k.step_backward(streams, u, beta, a, w, q, cb, fb, grad_out, grad_h, eps,
                                                       exact=exact, deliver=inverted)


def _build_attnres(v: Variant, rows: int, device: str, arch, rand, dt):
    """AttnRes merge ``v.n`` of a chain of ATTNRES_MERGES: its launches and a function running the merge's forward
    or backward after the merges before (forward) or after (backward) it ran."""
    import torch

    from lightning_resctl.runtime.triton import load_kernels

    k = load_kernels("attnres")
    f32 = torch.float64 if dt == torch.float64 else torch.float32
    block = 1 if v.kind == "full" else 2
    x, q, g = rand(rows, v.c), rand(v.c, dtype=f32), rand(v.c, dtype=f32)
    us = [rand(rows, v.c) for _ in range(ATTNRES_MERGES)]
    bufs = k.new_buffers(x, ATTNRES_MERGES, block, f32)
    h, lse = torch.empty_like(x), torch.empty(rows, dtype=f32, device=x.device)
    if v.direction == "fwd":
        launches = [k.forward_launch(x, us[v.n], bufs, v.n, q, g, 1e-6, h, lse, arch)]

        def run():
            for j in range(v.n):  # the merges before write the sources (not counted: COUNT_ONLY)
                k.merge_forward(x, us[j], bufs, j, q, g, 1e-6)
            COUNT_ONLY.append(True)
            k.merge_forward(x, us[v.n], bufs, v.n, q, g, 1e-6)
        return launches, run
    first = v.n == ATTNRES_MERGES - 1
    bufs.grads[0] = (torch.empty_like(bufs.V), torch.empty(rows, ATTNRES_MERGES + 1, dtype=f32, device=x.device))
    launch, partials = k.backward_launch(bufs, v.n, rand(rows, v.c), lse, q, g, 1e-6, torch.empty_like(x),
                                         torch.empty_like(x) if v.n == 0 else None, first, arch)
    launches = [launch, k.partials_launch(partials, q, g, torch.empty_like(q), torch.empty_like(g))]

    def run():
        lses = [k.merge_forward(x, us[j], bufs, j, q, g, 1e-6)[1] for j in range(ATTNRES_MERGES)]
        bufs.grads[0] = None
        meta = ((rows, v.c), us[0].dtype)
        for j in range(ATTNRES_MERGES - 1, v.n, -1):
            k.merge_backward(bufs, j, rand(rows, v.c), lses[j], q, g, 1e-6, meta, None)
        COUNT_ONLY.append(True)
        k.merge_backward(bufs, v.n, rand(rows, v.c), lses[v.n], q, g, 1e-6, meta, meta if v.n == 0 else None)
    return launches, run


def attnres_minimum(v: Variant) -> float:
    """The least AttnRes merge ``v`` can move per token, in units of C elements of ``v.dtype``: each source read
    once (in the compute dtype), x, u, dh read and h, du, dx written once in their dtype; backward, each completed
    source's gradient read and written once (written only by the last merge's, the first backward), the partial's
    read once (not by the first), a partial inside a block handing its gradient on; the scalars per token (the
    log-sum-exp, each slot's D) likewise."""
    eu = _torch_dtype(v.dtype).itemsize
    ev = 8 if v.dtype == "fp64" else 4
    c = v.c
    block = 1 if v.kind == "full" else 2
    k = v.n
    closed = k // block + 1  # slot 0 and the completed blocks
    prev_open = k % block != 0
    if v.direction == "fwd":  # read: the completed sources (merge 0: x), u, P_k; write: P_{k+1}, h, lse
        nbytes = (eu + ev if k == 0 else closed * ev) * c + eu * c + prev_open * ev * c + ev * c + eu * c + ev
        return nbytes / (c * eu)
    first = k == ATTNRES_MERGES - 1
    nbytes = (closed + 1) * ev * c + eu * c + ev  # the sources, dh, lse
    if k == 0:  # x: its gradient read (not by the first) and dx written
        nbytes += (0 if first else ev * c + ev) + eu * c
    else:
        nbytes += closed * ((ev * c + ev) if first else 2 * (ev * c + ev))
    nbytes += (0 if first else ev * c + ev) + eu * c  # the partial's gradient read, du written
    nbytes += prev_open * (ev * c + ev)  # P_k's first gradient
    return nbytes / (c * eu)


#: set by an AttnRes run function when the counted launch starts (the merges before it are not counted)
COUNT_ONLY: list = []


def tile_of(launch) -> str:
    meta = launch.meta
    if "BLOCK_P" in meta:  # the backward's partials' sum
        return f"sum {meta['BLOCK_P']}x{meta['BLOCK_C']}"
    if "SINGLE" not in meta:  # AttnRes: one row per program
        return f"1x{meta['BLOCK_C']}"
    if "ROWS" in meta:
        kind = "one read" if meta["SINGLE"] else "2 passes"
        return f"{meta['ROWS']}x{meta['BLOCK']} {kind}"
    kind = "one read" if meta["SINGLE"] else "2 passes"
    return f"{meta['BLOCK_M']}x{meta['BLOCK_C']} {kind}"


# ----------------------------------------------------------------------------------------------
# ahead-of-time compile (worker processes without TRITON_INTERPRET)
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _ptxas_log(ptx: str, cap: int, fp_fusion: bool) -> str:
    """``ptxas -v`` on ``ptx`` with the flags Triton uses (the cubin Triton built is the same code; its log is
    not kept), memoized: variants that differ only in values the JIT does not specialize on compile alike."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cap).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               *([] if fp_fusion else ["--fmad=false"]), f"--gpu-name={sm_arch_from_capability(cap)}", src,
               "-o", src + ".o"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed: {res.stderr[-2000:]}")
        return res.stderr


def compile_launch(launch, cap: int) -> dict:
    """Compile one launch for ``sm_<cap>`` with the JIT's own specialization of its arguments; returns
    registers, spill bytes, shared memory, warps, widest global load (bits), fp64 instruction count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.meta)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    log = _ptxas_log(ptx, cap, options.enable_fp_fusion)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    stack = int(re.search(r"(\d+) bytes stack frame", log).group(1))
    widths = [(int(vec or 1)) * int(bits)
              for vec, bits in re.findall(r"ld\.global(?:\.[a-z_]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx)]
    args = [name for name, ty in signature.items() if ty != "constexpr"]
    return dict(regs=regs, spill=spills, stack=stack, smem=int(compiled.metadata.shared), warps=options.num_warps,
                ld_bits=max(widths, default=0), loads=load_widths(ptx, args), f64=len(re.findall(r"\.f64\b", ptx)))


_PTX_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*?);")
_PTX_REG = re.compile(r"%[a-z]+\d+")
_PTX_LD_GLOBAL = re.compile(r"^ld\.global(?:\.[a-z_]+)*?(?:\.v(\d))?\.[bfsu](\d+)$")


def load_widths(ptx: str, args: list) -> dict:
    """``{argument: sorted global load widths (bits)}``: every ``ld.global`` of the PTX attributed to the pointer
    argument(s) its address derives from (the registers' data flow back to ``ld.param`` of a ``.ptr``
    parameter; ``args``: the kernel's non-constexpr arguments in order, the PTX parameters' order)."""
    pointers = {int(i) for i in re.findall(r"\.param \.u64 \.ptr[^\n]*_param_(\d+)", ptx)}
    deps: dict = {}
    origin: dict = {}
    loads = []
    for line in ptx.splitlines():
        m = _PTX_INSTR.match(line)
        if not m:
            continue
        op, rest = m.groups()
        regs = _PTX_REG.findall(rest)
        if op.startswith("ld.param"):
            param = re.search(r"_param_(\d+)\s*\]", rest)
            if param and regs and int(param.group(1)) in pointers:
                origin[regs[0]] = int(param.group(1))
        elif _PTX_LD_GLOBAL.match(op):
            vec, bits = _PTX_LD_GLOBAL.match(op).groups()
            addr = re.search(r"\[\s*(%[a-z]+\d+)", rest)
            loads.append((int(vec or 1) * int(bits), addr.group(1) if addr else None))
        elif regs and not rest.startswith("{"):
            deps.setdefault(regs[0], set()).update(regs[1:])
    out: dict = {}
    for bits, reg in loads:
        seen, stack, params = set(), [reg], set()
        while stack:
            r = stack.pop()
            if r is None or r in seen:
                continue
            seen.add(r)
            if r in origin:
                params.add(origin[r])
            stack.extend(deps.get(r, ()))
        for p in params or {None}:
            out.setdefault(args[p] if p is not None and p < len(args) else "?", set()).add(bits)
    return {name: sorted(bits) for name, bits in out.items()}


#: The load width every thread should get of each feature vector (kernels/tiles.py), and the shortest vector
#: (bytes) held for it: one warp's 32 threads x 16 bytes; shorter rows (C < 256 in bf16) have fewer bytes than
#: a warp has threads x 16 and are not held to it.
VECTOR_BITS = 128
VECTOR_MIN_BYTES = 32 * 16


def feature_load_bits(launch, loads: dict, c: int) -> dict:
    """``{argument: narrowest global load (bits)}`` of the launch's feature-vector tensors (last dim ``c``:
    streams, u, w, q, dS', dh, the parameter-gradient partials) whose rows are at least VECTOR_MIN_BYTES long."""
    names = [n for n in launch.kernel.arg_names if n not in launch.meta]
    out = {}
    for name, arg in zip(names, launch.args):
        if (hasattr(arg, "shape") and arg.dim() > 0 and arg.shape[-1] == c and name in loads
                and c * arg.element_size() >= VECTOR_MIN_BYTES):
            out[name] = min(loads[name])
    return out


def occupancy(regs: int, smem: int, warps: int, cap: int) -> float:
    """Theoretical occupancy: resident warps per SM / 64."""
    sm = SM[cap]
    regs_per_warp = math.ceil(regs * 32 / REG_UNIT) * REG_UNIT
    by_regs = (sm["regs"] // regs_per_warp) // warps
    by_smem = sm["smem"] // (math.ceil(smem / SMEM_UNIT) * SMEM_UNIT + SMEM_RESERVED)
    blocks = min(by_regs, by_smem, sm["warps"] // warps, sm["blocks"])
    return blocks * warps / sm["warps"]


def aot_job(v: Variant, cap: int) -> dict:
    from lightning_resctl.runtime.triton import load_kernels

    t0 = time.perf_counter()
    try:
        launches, _ = build(v, AOT_ROWS, "meta", cap)
        stats = [compile_launch(launch, cap) for launch in launches]
        for launch, s in zip(launches, stats):
            s["vector_bits"] = feature_load_bits(launch, s["loads"], v.c)
        st = max(stats, key=lambda s: s["regs"])
        st["vector_bits"] = {k: b for s in stats for k, b in s["vector_bits"].items()}
        st["spill"] = sum(s["spill"] for s in stats)
        st["occupancy"] = min(occupancy(s["regs"], s["smem"], s["warps"], cap) for s in stats)
        persistent = [(launch, s) for launch, s in zip(launches, stats) if "maxnreg" in launch.meta]
        if v.rule == "mgr" and persistent:  # persistent grids: the programs per SM the launch code sizes them for
            tiles = load_kernels("tiles")  # vs resident (the backward's partials sum is not persistent)
            st["grid_per_sm"] = max(tiles.programs_per_sm(launch.meta["num_warps"], launch.meta["maxnreg"])
                                    for launch, _ in persistent)
            st["resident_per_sm"] = min(round(occupancy(s["regs"], s["smem"], s["warps"], cap) * SM[cap]["warps"])
                                        // s["warps"] for _, s in persistent)
        st["tile"] = ", ".join(tile_of(launch) for launch in launches)
        st["error"] = None
    except Exception as e:  # reported per variant, counted in the summary
        st = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    st["seconds"] = round(time.perf_counter() - t0, 2)
    return st


# ----------------------------------------------------------------------------------------------
# bytes moved (worker processes with TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------
def count_bytes(v: Variant, rows: int = COUNT_ROWS) -> dict:
    """Bytes the kernels of ``v`` load and store per row, counted in Triton's interpreter: ``moved`` on the
    row tensors, ``minimum`` (each row tensor read or written once), ``other`` (parameters, partials)."""
    import numpy as np
    from triton.runtime import interpreter as interp

    _, run = build(v, rows, "cpu")
    tensors: list = []  # (base, end, is_row, counter) of the current launch's tensor arguments
    builder = interp.InterpreterBuilder
    executor = interp.GridExecutor
    orig = (builder.create_masked_load, builder.create_masked_store, executor.__call__)

    def account(ptrs, mask, nbytes):
        # distinct addresses: lanes of one load that read the same element (a feature vector broadcast over a
        # tile's rows, kernels/mgr.py ``_vector``) are one read of memory
        addr = np.unique(np.asarray(ptrs.data).reshape(-1)[np.asarray(mask.data, dtype=bool).reshape(-1)])
        for entry in tensors:
            entry[3] += int(((addr >= entry[0]) & (addr < entry[1])).sum()) * nbytes

    def load(self, ptrs, mask, other, *args):
        account(ptrs, mask, ptrs.get_element_ty().primitive_bitwidth // 8)
        return orig[0](self, ptrs, mask, other, *args)

    def store(self, ptrs, value, mask, *args):
        account(ptrs, mask, ptrs.get_element_ty().primitive_bitwidth // 8)
        return orig[1](self, ptrs, value, mask, *args)

    seen: dict = {}

    def call(self, *args, **kwargs):
        tensors.clear()
        if v.rule == "attnres" and not COUNT_ONLY:  # the merges around the counted one
            return orig[2](self, *args, **kwargs)
        for a in args:
            if hasattr(a, "data_ptr") and a.numel() > 0:
                base = a.untyped_storage().data_ptr()
                key = (base, a.untyped_storage().nbytes())
                is_row = a.dim() > 0 and a.shape[0] == rows
                if key not in seen:
                    seen[key] = [base, base + key[1], is_row, 0]
                if seen[key] not in tensors:
                    tensors.append(seen[key])
        return orig[2](self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call
    try:
        run()
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = orig
    COUNT_ONLY.clear()
    elt = _torch_dtype(v.dtype).itemsize
    moved = sum(e[3] for e in seen.values() if e[2]) / rows
    minimum = sum(e[1] - e[0] for e in seen.values() if e[2]) / rows
    if v.rule == "attnres":  # the sources' buffer holds every merge's: the minimum is the merge's own
        return dict(moved=moved / (v.c * elt), minimum=attnres_minimum(v),
                    other=sum(e[3] for e in seen.values() if not e[2]) / rows / (v.c * elt))
    other = sum(e[3] for e in seen.values() if not e[2]) / rows
    unit = v.c * elt
    return dict(moved=moved / unit, minimum=minimum / unit, other=other / unit)


def bytes_job(v: Variant) -> dict:
    try:
        return count_bytes(v)
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {e}"[:300])


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def _set_interpret(interpret: bool) -> None:
    """Worker initializer: Triton's interpreter on or off (read when triton is first imported, which happens
    after this: the workers import nothing of triton before their first job)."""
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _pool(jobs: int, interpret: bool) -> cf.ProcessPoolExecutor:
    """Fresh worker processes with Triton's interpreter on (byte counts) or off (compiles)."""
    return cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_set_interpret,
                                  initargs=(interpret,))


def cuda_backend_missing() -> Optional[str]:
    """Why ahead-of-time CUDA compiles cannot run here, or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as e:
        return f"triton's CUDA backend is not available ({type(e).__name__}: {e})"
    if not path or not os.path.exists(path):
        return "ptxas is not available (triton's CUDA backend ships it in triton/backends/nvidia/bin)"
    return None


def device_arch() -> int:
    """This machine's CUDA device as a compute capability of the occupancy model (e.g. 90 for an H100)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--arch device: no CUDA device here")
    major, minor = torch.cuda.get_device_capability()
    cap = 10 * major + minor
    if cap not in SM:
        raise RuntimeError(f"--arch device: sm_{cap} is not in the occupancy model (known: {sorted(SM)})")
    return cap


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--C", type=int, nargs="+", default=list(GRID_C), help="feature sizes (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--n", type=int, nargs="+", default=list(STREAMS), help="MGR streams (default: %(default)s)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="MGR merge kinds")
    p.add_argument("--rules", nargs="+", default=["rescontroller", "mgr", "attnres"],
                   choices=["rescontroller", "mgr", "attnres"])
    p.add_argument("--arch", nargs="+", default=[str(a) for a in ARCHS], choices=[*map(str, SM), "device"],
                   help="compute capabilities (default: %(default)s); 'device': this machine's CUDA device")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--no-bytes", action="store_true", help="skip the byte count (compile only)")
    p.add_argument("--json", type=Path, help="write every row and the summary as JSON")
    args = p.parse_args(argv)
    missing = cuda_backend_missing()
    if missing:
        print(f"kernels_aot: {missing}; nothing compiled")
        return 2
    try:
        args.arch = sorted({device_arch() if a == "device" else int(a) for a in args.arch})
    except RuntimeError as e:
        print(f"kernels_aot: {e}")
        return 2
    vs = variants(args.C, args.dtypes, args.n, args.kinds, tuple(args.rules))
    start = time.perf_counter()
    with _pool(args.jobs, interpret=False) as aot_pool:
        aot = {(v, cap): aot_pool.submit(aot_job, v, cap) for v in vs for cap in args.arch}
        if args.no_bytes:
            counted = {}
        else:  # fp16 moves what bf16 moves (same launches, same element size): counted once
            with _pool(args.jobs, interpret=True) as byte_pool:
                futures = {v: byte_pool.submit(bytes_job, v) for v in vs
                           if not (v.dtype == "fp16" and v._replace(dtype="bf16") in vs)}
                counted = {v: f.result() for v, f in futures.items()}
            counted.update({v: counted[v._replace(dtype="bf16")] for v in vs if v not in counted})
        compiled = {key: f.result() for key, f in aot.items()}
    rows = []
    header = (f"{'variant':<46} {'arch':<5} {'tile':<20} {'warps':>5} {'regs':>4} {'spill':>5} {'smem':>6} "
              f"{'occ':>5} {'ld':>4} {'vec':>4} {'f64':>3}  bytes/row (x C elt): moved / min, other")
    print("AOT compile of the launch table (compiler output and an occupancy model, not a GPU measurement)")
    print(header)
    for v in vs:
        by = counted.get(v, {})
        for cap in args.arch:
            st = compiled[(v, cap)]
            row = dict(variant=v._asdict(), arch=f"sm_{cap}", **st, bytes=by)
            rows.append(row)
            if st.get("error"):
                print(f"{v.label():<46} sm_{cap:<2} COMPILE FAILED: {st['error']}")
                continue
            if "error" in by:
                btxt = f"count failed: {by['error']}"
            elif by:
                btxt = f"{by['moved']:.2f} / {by['minimum']:.2f}, {by['other']:.2f}"
            else:
                btxt = "-"
            print(f"{v.label():<46} sm_{cap:<2} {st['tile']:<20} {st['warps']:>5} {st['regs']:>4} {st['spill']:>5} "
                  f"{st['smem']:>6} {st['occupancy']:>5.0%} {st['ld_bits']:>4} {vector_text(st):>4} {st['f64']:>3}  "
                  f"{btxt}{grid_text(st)}{narrow_text(st)}")
    summary = summarize(rows, vs, counted, args)
    print(summary["line"])
    print(f"({time.perf_counter() - start:.0f} s, {args.jobs} jobs)")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, summary=summary), indent=1))
    return 0 if summary["ok"] else 1


def vector_text(st: dict) -> str:
    """The narrowest feature-vector load of a variant (bits), '-' when none is held to VECTOR_BITS."""
    return str(min(st["vector_bits"].values())) if st["vector_bits"] else "-"


def grid_text(st: dict) -> str:
    """Persistent grids: programs per SM launched / resident (from the compiled registers, shared memory)."""
    return f"  grid {st['grid_per_sm']}/{st['resident_per_sm']} per SM" if "grid_per_sm" in st else ""


def narrow_text(st: dict) -> str:
    narrow = {k: b for k, b in st["vector_bits"].items() if b < VECTOR_BITS}
    return "  narrow loads: " + ", ".join(f"{k} {b}" for k, b in narrow.items()) if narrow else ""


def summarize(rows, vs, counted, args) -> dict:
    ok_rows = [r for r in rows if not r.get("error")]
    failures = len(rows) - len(ok_rows)
    tests_only = [r for r in ok_rows if r["variant"]["dtype"] == "fp64"]  # kernels/tiles.py: fp64 spills
    spilled = sum(r["spill"] + r["stack"] for r in ok_rows if r not in tests_only)
    spilling = sum(1 for r in ok_rows if (r["spill"] or r["stack"]) and r not in tests_only)
    fp64_spilled = sum(r["spill"] + r["stack"] for r in tests_only)
    fp64_spilling = sum(1 for r in tests_only if r["spill"] or r["stack"])
    occ = [r["occupancy"] for r in ok_rows]
    low = sum(1 for o in occ if o < 0.25)
    fp64 = sum(1 for r in ok_rows if r["f64"] and r["variant"]["dtype"] != "fp64")
    narrow = sum(1 for r in ok_rows if any(b < VECTOR_BITS for b in r["vector_bits"].values()))
    persistent = [r for r in ok_rows if "grid_per_sm" in r]
    overfull = sum(1 for r in persistent if r["grid_per_sm"] > r["resident_per_sm"])
    underfull = sum(1 for r in persistent if r["grid_per_sm"] < r["resident_per_sm"])
    counts = [b for b in counted.values() if b and "error" not in b]
    count_failures = sum(1 for b in counted.values() if "error" in b)
    minimal = sum(1 for b in counts if b["moved"] <= b["minimum"] * (1 + 1e-9))
    worst = max((b["moved"] / b["minimum"] for b in counts), default=float("nan"))
    over = sorted({(v.rule, v.direction, v.c) for v, b in counted.items()
                   if b and "error" not in b and b["moved"] > b["minimum"] * (1 + 1e-9)})
    archs = ", ".join(f"sm_{a}" for a in args.arch)
    line = (f"AOT summary ({archs}; {len(rows)} compiled variants): {failures} compile failures, {spilled} spilled "
            f"bytes ({spilling} variants), occupancy >= 25% in {len(occ) - low}/{len(occ)} (min "
            f"{min(occ, default=float('nan')):.1%}), {fp64} with fp64 on a non-fp64 path, {narrow} with a "
            f"feature-vector load under {VECTOR_BITS} bits")
    if persistent:
        line += (f"; persistent grids (first launch): {overfull}/{len(persistent)} launch more programs per SM than "
                 f"are resident, {underfull} fewer")
    if tests_only:
        line += (f"; fp64 (tests only): {fp64_spilled} spilled bytes ({fp64_spilling} of {len(tests_only)} "
                 "variants), not counted above")
    if counted:
        line += (f"; bytes moved = the minimum in {minimal}/{len(counts)} variants (worst {worst:.2f}x the minimum"
                 f"{', byte count failed for ' + str(count_failures) if count_failures else ''})")
        if over:
            smallest = {(r, d): min(c for rr, dd, c in over if (rr, dd) == (r, d)) for r, d, _ in over}
            line += "; above the minimum: " + ", ".join(sorted(f"{r} {d} C>={c}" for (r, d), c in smallest.items()))
    ok = failures == 0 and spilled == 0 and low == 0 and count_failures == 0 and narrow == 0 and overfull == 0
    return dict(line=line, ok=ok, failures=failures, spilled_bytes=spilled, fp64_spilled_bytes=fp64_spilled,
                narrow_loads=narrow, overfull_grids=overfull,
                low_occupancy=low,
                min_occupancy=min(occ, default=None), minimal_bytes=minimal, counted=len(counts))


if __name__ == "__main__":
    sys.exit(main())
