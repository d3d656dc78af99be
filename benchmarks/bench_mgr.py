"""Benchmark of one Multi-Gate-Residual merge (gates + lerp + the next merge's pool).

Prints, for n in {4, 8} and C in {768, 2048}:
  * per-merge forward and forward+backward time of the eager torch reference (autograd of plain ops),
    the package's torch path (closed-form backward), torch.compile (inductor) of the reference, and the
    fused Triton kernel (GPU only), each as a ratio to a plain residual add ``x + u`` at the same shapes;
  * per-merge time inside a 24-merge chain, with and without the fallback inversion;
  * bytes saved for backward per merge with and without inversion (units of one stream (tokens x C)), and the
    whole chain with a Linear branch relative to a plain residual chain with the same branch;
  * on GPU, the fused forward against the bytes-moved lower bound ((n+1)·C reads + (n+1)·C writes per token),
    timed as a device copy of the same bytes.

Usage: python benchmarks/bench_mgr.py [--tokens T] [--reps R] [--threads K] [--clock wall|cpu] [--no-compile]
(CPU default: 256 tokens, ~2 minutes; GPU default: 16384 tokens.)
       python benchmarks/bench_mgr.py --kernels [--dtypes fp32 bf16] [--streams 4 8] [--dims 768 2048 4096]
(GPU: the fused kernels alone, forward and forward + backward, fp32 also inverted, as % of the device's copy bandwidth
at the bytes each must move, beside torch.compile of the reference: issue 55's device goals.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_resctl.rules.mgr import MGRChain, mgr_step_reference
from lightning_resctl.runtime.memory import saved_tensor_bytes
from lightning_resctl.runtime.regions import wait_for_compiles
from lightning_resctl.runtime.triton import triton_available

CLOCK = time.perf_counter


def timer(fn, reps: int, device: torch.device) -> float:
    """Seconds of ``fn()`` over ``reps`` runs after 3 warm-up runs (and the background compiles of the torch path
    on CPU): best on CPU, median on GPU."""
    fn()
    wait_for_compiles()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = CLOCK()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(CLOCK() - t0)
    # CPU: the best run (a shared CPU and allocator page faults only ever add time); GPU: the median
    return min(times) if device.type == "cpu" else statistics.median(times)


def make_inputs(tokens, n, c, device, dtype):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(tokens, n, c, generator=g).to(device, dtype)
    u = torch.randn(tokens, c, generator=g).to(device, dtype)
    return s, u


def per_merge_times(args, n, c, device, dtype):
    s0, u0 = make_inputs(args.tokens, n, c, device, dtype)
    chain = MGRChain(c, n, streams=n, invert=False).to(device)  # merge n-1: the first gated merge, then the output pool
    k = n - 1
    m = chain.merges[k]
    params = (chain.output_pool.pool_query, m.gate_query, m.gate_bias, m.forget_bias)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)
    gy = torch.randn(args.tokens, n, c, device=device, dtype=dtype)
    gh = torch.randn(args.tokens, c, device=device, dtype=dtype)
    s = s0.clone().requires_grad_(True)
    u = u0.clone().requires_grad_(True)

    def plain_f():
        return s[:, 0] + u

    def plain_fb():
        torch.autograd.backward([plain_f()], [gh])

    def ref_f():
        return mgr_step_reference(s, u, *params)

    def fused_f(backend):
        chain.set_backend(backend)
        return chain.step(k, s, u)

    def fb(f):
        def run():
            out, h = f()
            torch.autograd.backward([out, h], [gy, gh])
        return run

    rows = {}
    t_plain = (timer(plain_f, args.reps, device), timer(plain_fb, args.reps, device))
    rows["eager reference"] = (timer(ref_f, args.reps, device), timer(fb(ref_f), args.reps, device))
    rows["torch path"] = (timer(lambda: fused_f("torch"), args.reps, device),
                          timer(fb(lambda: fused_f("torch")), args.reps, device))
    if device.type == "cpu":  # "torch" is the compiled region on CPU when a C++ compiler is present
        rows["torch path, eager"] = (timer(lambda: fused_f("torch-eager"), args.reps, device),
                                     timer(fb(lambda: fused_f("torch-eager")), args.reps, device))
    if args.compile:
        compiled = torch.compile(mgr_step_reference, dynamic=False)

        def comp_f():
            return compiled(s, u, *params)

        rows["torch.compile"] = (timer(comp_f, args.reps, device), timer(fb(comp_f), args.reps, device))
    if device.type == "cuda" and triton_available():
        rows["fused triton"] = (timer(lambda: fused_f("triton"), args.reps, device),
                                timer(fb(lambda: fused_f("triton")), args.reps, device))
    return t_plain, rows


def chain_times(args, n, c, device, dtype, merges=24):
    """Per-merge time of a chain of `merges` gated merges fed precomputed updates, with/without inversion."""
    total = merges + n - 1
    x0, _ = make_inputs(args.tokens, 1, c, device, dtype)
    us = [torch.randn(args.tokens, c, device=device, dtype=dtype) * 0.5 for _ in range(total)]
    out = {}

    def plain():
        x = x0[:, 0].clone().requires_grad_(True)
        h = x
        for u in us:
            h = h + u * 0.5
        h.sum().backward()

    out["plain add"] = timer(plain, args.reps, device) / total
    for invert in (False, True):
        chain = MGRChain(c, total, streams=n, invert=invert).to(device)

        def run():
            x = x0[:, 0].clone().requires_grad_(True)
            r = chain.begin(x)
            for u in us:
                r.write(u * 0.5)
            r.end().sum().backward()

        out["invert" if invert else "ordinary"] = timer(run, args.reps, device) / total
    return out


def saved_bytes(args, n, c, device, dtype, gated=24):
    total = gated + n - 1
    tokens = args.tokens
    x = torch.randn(tokens, c, device=device, dtype=dtype, requires_grad=True)
    lins = [nn.Linear(c, c).to(device, dtype) for _ in range(total)]

    def plain():
        h = x
        for lin in lins:
            h = h + lin(h)
        return h

    def with_branch(chain):
        r = chain.begin(x)
        for lin in lins:
            r.write(lin(r.read()))
        return r.end()

    def merges_only(chain):
        r = chain.begin(x)
        for _ in range(total):
            r.write(r.read() * 0.5)
        return r.end()

    row = tokens * c * x.element_size()
    res = {"plain": saved_tensor_bytes(plain)[0]}
    for invert in (False, True):
        chain = MGRChain(c, total, streams=n, invert=invert).to(device)
        name = "invert" if invert else "ordinary"
        res[name + " merge"] = saved_tensor_bytes(merges_only, chain)[0] / gated / row
        res[name + " chain"] = saved_tensor_bytes(with_branch, chain)[0]
    return res


def lower_bound(args, n, c, device, dtype):
    """GPU: fused forward vs a device copy of the lower-bound bytes ((n+1)C read + (n+1)C written per token)."""
    s, u = make_inputs(args.tokens, n, c, device, dtype)
    chain = MGRChain(c, n, streams=n, invert=False, backend="triton").to(device)
    src = torch.randn(args.tokens, n + 1, c, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    with torch.no_grad():
        t_fused = timer(lambda: chain.step(n - 1, s, u), args.reps, device)
        t_copy = timer(lambda: dst.copy_(src), args.reps, device)
    lb = 2 * (n + 1) * c * args.tokens * s.element_size()
    return t_fused, t_copy, lb


def copy_bandwidth(device, nbytes=1 << 30) -> float:
    """The device's copy bandwidth (bytes read + written per second) on a ``nbytes`` buffer."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src), 20, device)


def kernel_rows(args, n, c, dtype, device, bandwidth):
    """The fused kernels alone (a gated competitive step and its backward; fp32 also with the fallback inversion),
    against the bytes each must move (its minimum: kernels/mgr.py) at the device's copy bandwidth, and torch.compile
    of the reference at the same shape: ``[(label, ms forward, % bw, ms fwd + bwd, % bw, compile ms fwd, fwd + bwd)]``.
    """
    from lightning_resctl.runtime.triton import load_kernels

    k = load_kernels("mgr")
    g = torch.Generator().manual_seed(0)
    t = args.tokens
    s = torch.randn(t, n, c, generator=g).to(device, dtype)
    u = torch.randn(t, c, generator=g).to(device, dtype)
    w, q = (torch.randn(c, generator=g).to(device) * 0.1 for _ in range(2))
    cb, fb = torch.randn(n, generator=g).to(device), torch.tensor(-1.0).to(device)
    gy, gh = torch.randn_like(s), torch.randn_like(u)
    e = s.element_size()
    fwd_bytes = (2 * n + 2) * c * e * t  # read S, u; write S', h
    rows = []
    for inverted in ((False, True) if dtype == torch.float32 else (False,)):
        inv = k.Inversion(None, 0.05, 0.5, 8.0) if inverted else None
        out, h, beta, a, exact = k.step_forward(s, u, w, q, cb, fb, 1e-6, inv)
        x = out if inverted else s
        bwd_bytes = ((2 * n + 2) + (n + 1) + (n if inverted else 0)) * c * e * t  # + the rebuilt inputs
        t_f = timer(lambda: k.step_forward(s, u, w, q, cb, fb, 1e-6, inv), args.reps, device)
        t_b = timer(lambda: k.step_backward(x, u, beta, a, w, q, cb, fb, gy, gh, 1e-6, exact=exact,
                                            deliver=inverted), args.reps, device)
        rows.append((f"triton{' inverted' if inverted else ''}", t_f, fwd_bytes / t_f / bandwidth, t_f + t_b,
                     (fwd_bytes + bwd_bytes) / (t_f + t_b) / bandwidth))
    if args.compile:
        compiled = torch.compile(mgr_step_reference, dynamic=False)
        sr, ur = s.clone().requires_grad_(True), u.clone().requires_grad_(True)
        wr, qr, cbr, fbr = (p.clone().requires_grad_(True) for p in (w, q, cb, fb))

        def comp_fb():
            o, hh = compiled(sr, ur, wr, qr, cbr, fbr)
            torch.autograd.backward([o, hh], [gy, gh])

        with torch.no_grad():
            t_cf = timer(lambda: compiled(s, u, w, q, cb, fb), args.reps, device)
        t_cfb = timer(comp_fb, args.reps, device)
        rows = [r + (t_cf, t_cfb) for r in rows]
    return rows


def kernels_table(args, device):
    """issue 55's device goals for MGR: the fused kernels >= 80 % of the copy bandwidth forward and forward +
    backward, fp32 and bf16, C in {768, 2048, 4096}, n in {4, 8}, never slower than torch.compile of the reference."""
    bandwidth = copy_bandwidth(device)
    print(f"\nfused kernels alone, {args.tokens} tokens, % of the copy bandwidth ({bandwidth / 1e9:.0f} GB/s) at the "
          "bytes each must move; torch.compile of the reference beside (goal: >= 80 %, never slower than compile)")
    head = f"  {'dtype':<9}{'n':>3}{'C':>6}  {'kernel':<18}{'fwd ms':>8}{'%bw':>6}{'f+b ms':>9}{'%bw':>6}"
    print(head + (f"{'compile fwd':>13}{'f+b':>8}{'triton/compile f+b':>21}" if args.compile else ""))
    for dtype in args.dtypes:
        for n in args.streams:
            for c in args.dims:
                for row in kernel_rows(args, n, c, dtype, device, bandwidth):
                    label, tf, bf, tfb, bfb, *comp = row
                    line = (f"  {str(dtype).removeprefix('torch.'):<9}{n:>3}{c:>6}  {label:<18}{tf * 1e3:>8.3f}"
                            f"{bf:>6.0%}{tfb * 1e3:>9.3f}{bfb:>6.0%}")
                    if comp:
                        line += f"{comp[0] * 1e3:>13.3f}{comp[1] * 1e3:>8.3f}{tfb / comp[1]:>20.2f}x"
                    print(line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: CPU time of the main thread (steadier on a shared CPU; use with --threads 1)")
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dims", type=int, nargs="+", default=[768, 2048])
    ap.add_argument("--kernels", action="store_true",
                    help="GPU: only the fused kernels' table (%% of copy bandwidth, vs compile), --dtypes")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = ap.parse_args(argv)
    args.dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    if args.clock == "cpu" and device.type == "cpu":
        CLOCK = time.thread_time  # CPU backward runs on the calling thread
    args.tokens = args.tokens or (16384 if device.type == "cuda" else 256)
    args.reps = args.reps or (20 if device.type == "cuda" else 9)
    dtype = torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    clock = "thread CPU time" if CLOCK is time.thread_time else "wall time"
    stat = "best" if device.type == "cpu" else "median"
    print(f"MGR merge benchmark on {name}, torch {torch.__version__}, {args.tokens} tokens, fp32, "
          f"{stat} {clock} of {args.reps}")
    if args.kernels:
        if device.type == "cuda" and triton_available():
            kernels_table(args, device)
        else:
            print("the fused kernels' bandwidth table waits for a GPU")
        return
    print("\nper-merge time as a ratio to a plain residual add at the same shapes (forward | forward+backward)")
    for n in args.streams:
        for c in args.dims:
            t_plain, rows = per_merge_times(args, n, c, device, dtype)
            print(f"  n={n} C={c}: plain add {t_plain[0] * 1e3:.3f} ms | {t_plain[1] * 1e3:.3f} ms")
            for label, (tf, tfb) in rows.items():
                print(f"    {label:16s} {tf / t_plain[0]:7.2f}x | {tfb / t_plain[1]:7.2f}x   "
                      f"({tf * 1e3:.3f} | {tfb * 1e3:.3f} ms)")
            if device.type != "cuda":
                print("    fused triton     waits for a GPU (CPU runs Triton only in the interpreter)")
    print("\nper-merge forward+backward inside a chain of 24 gated merges (torch path)")
    for n in args.streams:
        for c in args.dims:
            t = chain_times(args, n, c, device, dtype)
            print(f"  n={n} C={c}: plain add {t['plain add'] * 1e3:.3f} ms, ordinary {t['ordinary'] * 1e3:.3f} ms "
                  f"({t['ordinary'] / t['plain add']:.2f}x), inverted {t['invert'] * 1e3:.3f} ms "
                  f"({t['invert'] / t['plain add']:.2f}x)")
    print("\nbytes saved for backward (24 gated merges; saved_tensors_hooks, each storage once)")
    for n in args.streams:
        for c in args.dims:
            b = saved_bytes(args, n, c, device, dtype)
            print(f"  n={n} C={c}: per merge ordinary {b['ordinary merge']:.2f} streams, inverted "
                  f"{b['invert merge']:.2f} streams ({b['ordinary merge'] / b['invert merge']:.2f}x less); "
                  f"chain with a Linear branch vs plain residual add: ordinary {b['ordinary chain'] / b['plain']:.2f}x,"
                  f" inverted {b['invert chain'] / b['plain']:.2f}x")
    if device.type == "cuda" and triton_available():
        print("\nfused forward vs the bytes-moved lower bound ((n+1)C reads + (n+1)C writes per token)")
        for n in args.streams:
            for c in args.dims:
                t_fused, t_copy, lb = lower_bound(args, n, c, device, dtype)
                print(f"  n={n} C={c}: fused {t_fused * 1e6:.1f} us ({lb / t_fused / 1e9:.0f} GB/s), copy of the "
                      f"same bytes {t_copy * 1e6:.1f} us -> {t_fused / t_copy:.2f}x the lower bound (goal <= 1.5x)")
    else:
        print("\nbytes-moved lower bound check: waits for a GPU")


if __name__ == "__main__":
    main()
