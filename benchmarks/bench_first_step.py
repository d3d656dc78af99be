"""Time to the first training step of a patched model, and whole-model ``torch.compile`` time, per rule.

    python benchmarks/bench_first_step.py                       # both tables, default rules and models
    python benchmarks/bench_first_step.py --rules rescontroller,mgr-competitive --models gpt --skip-compile

**First step** (issue 20's goals: ≤ 5 s more than eager with a cold inductor cache, ≤ 1 s more with a warm one):
for each model — the nanoGPT of ``lightning_resctl/compare/nanogpt.py`` (12 layers, C=256, T=64, batch 8) and a
ResNet-18-shaped conv net (32x32 images, batch 8; one feature-map shape per stage) — and each rule (default
backend; "plain" is the unpatched model), one fresh Python process builds the model, patches it and times its first
training step (forward, loss, backward, AdamW step) with a fresh ``TORCHINDUCTOR_CACHE_DIR`` ("cold"); it then keeps
stepping until the rule's compiled regions are ready (:func:`lightning_resctl.wait_for_compiles`, printed
as "compiled after"), which fills that cache directory, and a second fresh process times the first step again with
it ("warm"). Printed per row: wall seconds of the first step, its CPU seconds (the process's threads and its
finished subprocesses, e.g. the C++ compiler), and the extra wall seconds over "plain" of the same model.
(Inductor keeps precompiled headers outside the cache directory, so "cold" still finds those of an earlier run on
the machine.)

**Whole-model torch.compile** (goal: a patched model compiles in ≤ 1.5x the unpatched model's time): a 4-layer
nanoGPT (C=256, T=64, batch 8) wrapped in ``torch.compile``, one fresh process and a fresh cache per rule; the first
training step (the compile) in wall and CPU seconds, and its ratio to "plain".

Every measurement runs in its own subprocess; the machine's load average is printed with the figures (other jobs
running on the machine inflate wall times: compare the CPU column, and re-measure on a quiet machine).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_RULES = ("rescontroller", "mgr-competitive", "mgr-independent", "attnres-block")
FIRST_STEP_GOALS = {"cold": 5.0, "warm": 1.0}  # seconds over plain
COMPILE_GOAL = 1.5  # x plain


# ----------------------------------------------------------------------------------------------
# the measured process
# ----------------------------------------------------------------------------------------------
def _cpu_s() -> float:
    """CPU seconds of this process (all threads) and of its finished children (the C++ compiler; not the
    background compiler, which runs on)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _build(model: str, layers: int):
    import torch
    import torch.nn.functional as F

    from benchmarks.models import NanoGPT, ResNet

    torch.manual_seed(0)
    if model == "gpt":
        net = NanoGPT(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=256)
        batch = torch.randint(0, 256, (8, 64))

        def loss_fn(m):
            logits = m(batch)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    elif model == "resnet":
        net = ResNet(num_classes=10, image_size=32)
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

        def loss_fn(m):
            return F.cross_entropy(m(images), labels)
    else:
        raise ValueError(f"--model must be 'gpt' or 'resnet', got {model!r}")
    return net, loss_fn


def measure(args) -> dict:
    """One measurement in this (fresh) process; returns what the parent prints."""
    import torch

    from lightning_resctl.runtime.regions import wait_for_compiles
    from lightning_resctl.surgery import patch_residuals

    torch.set_num_threads(args.threads)
    net, loss_fn = _build(args.model, args.layers)
    if args.rule != "plain":
        patch_residuals(net, method=args.rule)
    run = torch.compile(net) if args.kind == "compile" else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(run).backward()
        opt.step()

    c0, t0 = _cpu_s(), time.perf_counter()
    step()
    first, first_cpu = time.perf_counter() - t0, _cpu_s() - c0
    out = {"first_s": first, "first_cpu_s": first_cpu}
    if args.kind == "first-step" and args.until_compiled:
        steps, deadline = 1, t0 + args.max_wait
        while not wait_for_compiles(timeout=0) and time.perf_counter() < deadline:
            step()
            steps += 1
        out["compiled"] = wait_for_compiles(timeout=0)
        out["compiled_after_s"] = time.perf_counter() - t0
        out["steps_until_compiled"] = steps
        t1 = time.perf_counter()
        step()  # loads the compiled graphs
        out["switch_step_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        step()
        out["compiled_step_s"] = time.perf_counter() - t1
    return out


# ----------------------------------------------------------------------------------------------
# the parent: one subprocess per measurement
# ----------------------------------------------------------------------------------------------
def _child(kind: str, model: str, rule: str, cache_dir: str, args, until_compiled: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", model, "--rule", rule,
           "--threads", str(args.threads), "--layers", str(args.compile_layers if kind == "compile" else args.layers),
           "--max-wait", str(args.max_wait)] + (["--until-compiled"] if until_compiled else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.max_wait + 1200)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def first_step_table(args) -> list[str]:
    lines = [f"First training step, default backend, {args.threads} threads "
             f"(wall s / CPU s of the process; extra = wall over plain of the same model)"]
    head = (f"{'model':<8}{'rule':<18}{'cold s':>8}{'cpu':>7}{'extra':>8}{'warm s':>8}{'cpu':>7}{'extra':>8}"
            f"{'compiled after':>16}{'switch step s':>15}{'step s':>8}")
    lines.append(head)
    print("\n".join(lines), flush=True)
    for model in args.models:
        plain = {}
        for rule in ["plain", *args.rules]:
            with tempfile.TemporaryDirectory(prefix="bench_first_step_") as cache:
                cold = _child("first-step", model, rule, cache, args, until_compiled=True)
                warm = _child("first-step", model, rule, cache, args) if "error" not in cold else cold
            if rule == "plain":
                plain = {"cold": cold.get("first_s"), "warm": warm.get("first_s")}
            if "error" in cold or "error" in warm:
                row = f"{model:<8}{rule:<18}  ERROR: {cold.get('error') or warm.get('error')}"
            else:
                extra = {k: (v["first_s"] - plain[k]) if plain.get(k) is not None else float("nan")
                         for k, v in (("cold", cold), ("warm", warm))}
                flags = {k: " " if extra[k] <= FIRST_STEP_GOALS[k] else "!" for k in extra}
                after = (f"{cold['compiled_after_s']:.1f} s / {cold['steps_until_compiled']} st"
                         if cold.get("compiled") else "not in time")
                row = (f"{model:<8}{rule:<18}{cold['first_s']:>8.2f}{cold['first_cpu_s']:>7.2f}"
                       f"{extra['cold']:>7.2f}{flags['cold']}{warm['first_s']:>8.2f}{warm['first_cpu_s']:>7.2f}"
                       f"{extra['warm']:>7.2f}{flags['warm']}{after:>16}{cold['switch_step_s']:>15.2f}"
                       f"{cold['compiled_step_s']:>8.2f}")
            print(row, flush=True)
            lines.append(row)
    lines.append(f"goals: extra <= {FIRST_STEP_GOALS['cold']} s cold, <= {FIRST_STEP_GOALS['warm']} s warm "
                 "('!' marks a miss); 'compiled after': seconds / steps until the background compiles were ready; "
                 "'switch step': the step that loaded them; 'step': the next one")
    print(lines[-1])
    return lines


def compile_table(args) -> list[str]:
    lines = [f"Whole-model torch.compile of a {args.compile_layers}-layer nanoGPT, cold cache, first training step "
             f"(wall s / CPU s), {args.threads} threads",
             f"{'rule':<18}{'wall s':>9}{'cpu s':>9}{'x plain (wall)':>16}{'x plain (cpu)':>15}"]
    print("\n".join(lines), flush=True)
    plain = None
    for rule in ["plain", *args.rules]:
        with tempfile.TemporaryDirectory(prefix="bench_first_step_") as cache:
            res = _child("compile", "gpt", rule, cache, args)
        if "error" in res:
            row = f"{rule:<18}  ERROR: {res['error']}"
        else:
            plain = plain or res
            flag = " " if res["first_s"] / plain["first_s"] <= COMPILE_GOAL else "!"
            row = (f"{rule:<18}{res['first_s']:>9.1f}{res['first_cpu_s']:>9.1f}"
                   f"{res['first_s'] / plain['first_s']:>15.2f}{flag}"
                   f"{res['first_cpu_s'] / plain['first_cpu_s']:>15.2f}")
        print(row, flush=True)
        lines.append(row)
    lines.append(f"goal: <= {COMPILE_GOAL}x plain ('!' marks a miss)")
    print(lines[-1])
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", default=",".join(DEFAULT_RULES), help="comma-separated registered rules")
    p.add_argument("--models", default="gpt,resnet", help="comma-separated: gpt, resnet")
    p.add_argument("--layers", type=int, default=12, help="GPT layers for the first-step table")
    p.add_argument("--compile-layers", type=int, default=4, help="GPT layers for the torch.compile table")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads in each measured process")
    p.add_argument("--max-wait", type=float, default=900.0, help="seconds to wait for the background compiles")
    p.add_argument("--skip-first-step", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--child", choices=["first-step", "compile"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    p.add_argument("--rule", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--until-compiled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.kind = args.child
        print(json.dumps(measure(args)), flush=True)
        return
    args.rules = [r for r in args.rules.split(",") if r and r != "plain"]
    args.models = [m for m in args.models.split(",") if m]
    import torch

    print(f"torch {torch.__version__}; {_load()} at the start", flush=True)
    if not args.skip_first_step:
        first_step_table(args)
    if not args.skip_compile:
        print()
        compile_table(args)
    print(f"{_load()} at the end")


if __name__ == "__main__":
    main()
