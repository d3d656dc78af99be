"""Cost of patch_residuals: training-step time and saved-for-backward bytes, patched vs unpatched.

    python benchmarks/bench_surgery.py [--reps 15] [--batch 8] [--models nanogpt,gpt2] [--threads 1] [--clock cpu]

For each model (the nanoGPT-style GPT of lightning_resctl/compare/nanogpt.py: 12 layers, C=256, T=64; and HF
GPT-2 with the same small config), four copies of the same initial weights are built: unpatched, and patched with
``add``, ``rescontroller`` and ``mgr`` (n=4). Their training steps (forward, loss, backward, AdamW step) are timed
side by side in one process, interleaved (every repetition runs each variant once, in a rotating order), and
the median step time of each variant is divided by the unpatched median. The default clock is the process
CPU time with one intra-op thread (robust when other jobs share the machine); ``--clock wall`` uses wall time.
Saved-for-backward bytes are measured with ``torch.autograd.graph.saved_tensors_hooks`` (deduplicated by storage)
over one forward.
Patch time is the wall time of ``patch_residuals`` (one observed forward + rewrite).

Goals (issue 4): add within 2% of unpatched; rescontroller <= 1.10x and mgr <= 1.30x step time;
saved bytes <= 1.2x (rescontroller) and <= 1.3x (mgr).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import NanoGPT, add_step_arguments  # noqa: E402
from lightning_resctl.runtime.memory import saved_tensor_bytes  # noqa: E402
from lightning_resctl.runtime.regions import wait_for_compiles  # noqa: E402
from lightning_resctl.surgery import patch_residuals  # noqa: E402

VARIANTS = ("unpatched", "add", "rescontroller", "mgr")
GOALS = {"add": (1.02, None), "rescontroller": (1.10, 1.2), "mgr": (1.30, 1.3)}


def build(name: str, vocab: int, T: int, C: int, layers: int, heads: int):
    if name == "nanogpt":
        model = NanoGPT(vocab_size=vocab, block_size=T, n_layer=layers, n_head=heads, n_embd=C)

        def loss_fn(m, idx):
            logits = m(idx)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        return model, loss_fn
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=C, n_head=heads, vocab_size=vocab, n_positions=T, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
        model.config.use_cache = False

        def loss_fn(m, idx):
            return m(idx, labels=idx, use_cache=False).loss
        return model, loss_fn
    raise ValueError(f"unknown model {name!r}")


def saved_bytes(model, loss_fn, idx) -> int:
    """Activation bytes saved for backward by one loss: parameters are saved by every variant (the weights of
    the linears), so they are left out; the counting hook leaves MGR's fallback inversion on."""
    return saved_tensor_bytes(loss_fn, model, idx, exclude=model.parameters())[0]


def bench(name: str, args) -> None:
    torch.manual_seed(0)
    base, loss_fn = build(name, args.vocab, args.T, args.C, args.layers, args.heads)
    idx = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(0))
    example = idx[:2]
    models, opts, patch_s, sites = {}, {}, {}, {}
    for v in VARIANTS:
        m = copy.deepcopy(base)
        if v != "unpatched":
            t0 = time.perf_counter()
            report = patch_residuals(m, method=v, example_input=example, **({"streams": 4} if v == "mgr" else {}))
            patch_s[v] = time.perf_counter() - t0
            sites[v] = len(report.sites)
        models[v] = m
        opts[v] = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(v):
        m, opt = models[v], opts[v]
        loss = loss_fn(m, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for v in VARIANTS:  # warm-up; the torch paths compile in the background on CPU: time the compiled steady state
        step(v)
    wait_for_compiles()
    for v in VARIANTS:
        for _ in range(args.warmup):
            step(v)
    times = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for r in range(args.reps):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            c0, t0 = time.process_time(), time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
    wall = {v: statistics.median(times[v]) for v in VARIANTS}
    cpu_med = {v: statistics.median(cpu[v]) for v in VARIANTS}
    med = cpu_med if args.clock == "cpu" else wall
    mem = {v: saved_bytes(models[v], loss_fn, idx) for v in VARIANTS}

    print(f"\n== {name}: {args.layers} layers, C={args.C}, T={args.T}, batch={args.batch}, vocab={args.vocab}, "
          f"threads={torch.get_num_threads()}, reps={args.reps} (interleaved, median)")
    print(f"ratios use the {args.clock} clock (cpu: process CPU time, robust to other processes on the machine)")
    print(f"{'variant':<14}{'sites':>6}{'step ms':>10}{'ratio':>8}{'goal':>7}{'saved MB':>10}{'ratio':>8}"
          f"{'goal':>7}{'patch s':>9}{'wall ms':>9}{'wall ratio':>11}")
    for v in VARIANTS:
        ratio = med[v] / med["unpatched"]
        mratio = mem[v] / mem["unpatched"]
        goal_t, goal_m = GOALS.get(v, (None, None))
        gt = "" if goal_t is None else ("ok" if ratio <= goal_t else "MISS")
        gm = "" if goal_m is None else ("ok" if mratio <= goal_m else "MISS")
        print(f"{v:<14}{sites.get(v, 0):>6}{med[v] * 1e3:>10.2f}{ratio:>8.3f}{gt:>7}{mem[v] / 2**20:>10.2f}"
              f"{mratio:>8.3f}{gm:>7}{patch_s.get(v, 0.0):>9.3f}{wall[v] * 1e3:>9.1f}"
              f"{wall[v] / wall['unpatched']:>11.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="nanogpt,gpt2")
    add_step_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    for name in args.models.split(","):
        bench(name.strip(), args)


if __name__ == "__main__":
    main()
