"""Benchmark of the ResController merge.

Part 1 — the merge alone at transformer shapes (rows x C, C in 768, 2048, 4096, 8192; fp32
and bf16), forward and forward+backward, side by side in one process:

* ``eager``    — the torch reference (plain ops, plain autograd);
* ``compiled`` — ``torch.compile`` of the reference (inductor);
* ``lean``     — the lean torch path (autograd.Function with the closed-form backward), eager ops;
* ``region``   — the same Function with its math as compiled regions (``backend="torch"`` on CPU with a C++
  compiler: :class:`lightning_resctl.runtime.regions.CompiledRegion`);
* ``triton``   — the fused Triton kernels (GPU only).

Each time is printed with its ratio to eager (< 1 = faster). On GPU the achieved memory
bandwidth of each path is printed as a fraction of the device's measured copy bandwidth
(``dst.copy_(src)``); the bytes counted are the minimum the merge must move: forward reads
r, u and writes out (3 tensors); forward+backward adds reading grad_out, r, u and writing
grad_r, grad_u (8 tensors in all).

Part 2 — a 12-layer, C=256 nanoGPT (T=64), the controller (torch path) in every merge vs the
plain ``x + f(x)``: training-step time ratio and saved-for-backward bytes ratio.

Usage::

    python benchmarks/bench_rescontroller.py              # GPU if there is one, else CPU
    python benchmarks/bench_rescontroller.py --device cpu --rows 256
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks.models

from lightning_resctl.rules.rescontroller import rescontroller, rescontroller_reference  # noqa: E402
from lightning_resctl.rules.rescontroller.ops import _ResControllerFunction  # noqa: E402
from lightning_resctl.runtime.backends import cpu_compile_available  # noqa: E402
from lightning_resctl.runtime.memory import saved_tensor_bytes  # noqa: E402
from lightning_resctl.runtime.regions import wait_for_compiles  # noqa: E402

OPTS = (0.18, 1.08, 8.0, 8.0, 1e-12)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _cpu_clock():
    """On CPU the benchmark runs torch single-threaded and times with the thread's CPU clock:
    other processes sharing the cores then barely disturb the figures (wall time would)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def time_ms(fn, device, reps: int, warmup: int = 3) -> float:
    """Time of ``fn()`` in ms: the median of CUDA-event times on GPU; on CPU the minimum over
    ``reps`` runs of :func:`_cpu_clock` (the least disturbed run)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    times = []
    for _ in range(reps):
        t0 = _cpu_clock()
        fn()
        times.append(_cpu_clock() - t0)
    return 1e3 * min(times)


def copy_bandwidth(device) -> float:
    """Measured device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20)
    return 2 * src.numel() / (ms * 1e-3)


# ----------------------------------------------------------------------------------------------
# part 1: the merge alone
# ----------------------------------------------------------------------------------------------
def _paths(device):
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no dynamic shapes
    paths = {
        "eager": rescontroller_reference,
        "compiled": torch.compile(rescontroller_reference, dynamic=False),
        "lean": lambda r, u: _ResControllerFunction.apply(r, u, *OPTS, -1),
    }
    if device.type == "cpu" and cpu_compile_available():
        paths["region"] = lambda r, u: _ResControllerFunction.apply(r, u, *OPTS, -1, "compiled")
    if device.type == "cuda":
        paths["triton"] = lambda r, u: rescontroller(r, u, backend="triton")
    return paths


def bench_merge(device, rows_for, dtypes, widths, reps):
    names = list(_paths(device))
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    if bw is not None:
        print(f"measured copy bandwidth: {bw / 1e9:.0f} GB/s")
    head = f"{'dtype':>8} {'rows x C':>13} {'pass':>8} " + " ".join(f"{n + ' ms':>12}" for n in names)
    head += " " + " ".join(f"{n + '/eager':>15}" for n in names[1:])
    if bw is not None:
        head += " " + " ".join(f"{n + ' %bw':>12}" for n in names)
    print(head)
    print("-" * len(head))
    for dtype in dtypes:
        for C in widths:
            rows = rows_for(C)
            r = torch.randn(rows, C, device=device, dtype=dtype)
            u = (0.3 * torch.randn(rows, C, device=device)).to(dtype)
            g = torch.randn(rows, C, device=device, dtype=dtype)
            rg, ug = r.clone().requires_grad_(), u.clone().requires_grad_()
            paths = _paths(device)
            elt = r.element_size() * r.numel()
            for mode, n_tensors in (("fwd", 3), ("fwd+bwd", 8)):
                ms = {}
                for name, fn in paths.items():
                    if mode == "fwd":
                        def step(fn=fn):
                            with torch.no_grad():
                                fn(r, u)
                    else:
                        def step(fn=fn):
                            torch.autograd.backward(fn(rg, ug), g)
                    try:
                        ms[name] = time_ms(step, device, reps)
                    except Exception as err:  # e.g. no C++ compiler for inductor
                        print(f"  {name} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                        ms[name] = float("nan")
                line = f"{str(dtype).replace('torch.', ''):>8} {f'{rows}x{C}':>13} {mode:>8} "
                line += " ".join(f"{ms[n]:12.3f}" for n in names)
                line += " " + " ".join(f"{ms[n] / ms['eager']:15.2f}" for n in names[1:])
                if bw is not None:
                    line += " " + " ".join(f"{100 * n_tensors * elt / (ms[n] * 1e-3) / bw:11.0f}%" for n in names)
                print(line, flush=True)


# ----------------------------------------------------------------------------------------------
# part 2: a 12-layer GPT, controller in every merge vs plain addition
# ----------------------------------------------------------------------------------------------
def _load_test_model():
    """The benchmarks' nanoGPT and hand wiring (benchmarks.models)."""
    from benchmarks.models import NanoGPT, wire_merges

    return NanoGPT, wire_merges


def _lm_loss(model, idx):
    return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def _saved_bytes(model, idx, exclude_params: bool) -> int:
    nbytes, loss = saved_tensor_bytes(_lm_loss, model, idx, exclude=model.parameters() if exclude_params else None)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return nbytes


def bench_gpt(device, batch, reps):
    NanoGPT, wire_merges = _load_test_model()
    cfg = dict(n_layer=12, n_head=4, n_embd=256, vocab_size=256, block_size=64)
    torch.manual_seed(0)
    plain = NanoGPT(**cfg).to(device)
    models = {
        "plain": plain,
        "controller": wire_merges(copy.deepcopy(plain), lambda r, u: rescontroller(r, u, backend="torch")),
        "reference": wire_merges(copy.deepcopy(plain), rescontroller_reference),
    }
    idx = torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"]), device=device)

    def step(model):
        model.zero_grad(set_to_none=True)
        _lm_loss(model, idx).backward()

    for m in models.values():
        step(m)
    wait_for_compiles()  # backend="torch" compiles in the background on CPU: time the compiled steady state
    for m in models.values():
        step(m)
        step(m)
    times = {k: [] for k in models}
    clock = time.perf_counter if device.type == "cuda" else _cpu_clock
    for _ in range(reps):  # interleaved, so load changes hit every model alike
        for name, m in models.items():
            _sync(device)
            t0 = clock()
            step(m)
            _sync(device)
            times[name].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    clock_name = "CUDA-synchronised wall time" if device.type == "cuda" else (
        "thread CPU time" if torch.get_num_threads() == 1 else "wall time")
    print(f"\nGPT 12 layers, C=256, T=64, batch {batch}, {device.type}, torch path, "
          f"{reps} interleaved steps, {clock_name}:")
    for name in ("controller", "reference"):
        print(
            f"  step time {name:>10} / plain: median {med[name] / med['plain']:.3f}  min {low[name] / low['plain']:.3f}"
            f"   ({1e3 * med[name]:.1f} ms vs {1e3 * med['plain']:.1f} ms median)"
        )
    for exclude in (True, False):
        saved = {k: _saved_bytes(m, idx, exclude) for k, m in models.items()}
        what = "activations only" if exclude else "incl. parameters"
        print(
            f"  saved-for-backward bytes ({what}): plain {saved['plain'] / 2**20:.1f} MiB, "
            f"controller {saved['controller'] / saved['plain']:.3f}x, "
            f"reference autograd {saved['reference'] / saved['plain']:.3f}x"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="rows per shape (default: 2^25 / C on GPU, 256 on CPU)")
    parser.add_argument("--widths", type=int, nargs="+", default=[768, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--gpt-batch", type=int, default=8)
    parser.add_argument("--gpt-reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: time with the thread CPU clock)")
    parser.add_argument("--skip-merge", action="store_true")
    parser.add_argument("--skip-gpt", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads)
    # GPU: 2^25 elements per tensor (128 MiB in fp32), so launch overheads do not hide the kernels
    rows_for = (lambda C: args.rows) if args.rows else (lambda C: 2**25 // C if gpu else 256)
    reps = args.reps or (50 if gpu else 10)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if gpu else f", {torch.get_num_threads()} threads"))
    if not args.skip_merge:
        bench_merge(device, rows_for, [torch.float32, torch.bfloat16], args.widths, reps)
    if not args.skip_gpt:
        bench_gpt(device, args.gpt_batch, args.gpt_reps or (30 if gpu else 12))


if __name__ == "__main__":
    main()
