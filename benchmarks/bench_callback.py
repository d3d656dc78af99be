"""Step-time cost of the diagnostics (ResidualControlCallback / ResidualMonitor), side by side in one process.

    python benchmarks/bench_callback.py [--loop trainer|plain] [--method rescontroller] [--steps 100] [--every 50]

The same patched nanoGPT (patched by hand, so both variants run identical merges) trains on CPU/GPU, once
without and once with the diagnostics, alternating ``--reps`` times:

* ``--loop trainer`` (default): a Lightning Trainer with / without ``ResidualControlCallback(log_every_n_steps=
  --every)``; a timing callback listed first measures each step from one ``on_train_batch_start`` to the next
  (so the callback's own hooks, metric reduction and logging are inside the step);
* ``--loop plain``: a hand-written loop (forward, backward, AdamW step) with / without
  ``with monitor.step(step): ...`` and ``monitor.log_to(writer)`` of a ``ResidualMonitor(log_every_n_steps=
  --every)``, each step timed from its start to the next one's (a TensorBoard ``SummaryWriter`` in both).

Printed:

* non-logging steps: median step time with / without (goal: no cost — probes are off on these steps);
* a logging step: median of the logging steps with the callback / median plain step without;
* amortized at log_every_n_steps=--every: ((every - 1) x median plain step + median logging step) / every,
  with / without (goal <= 1.03), and the raw mean over all steps (sensitive to noise on a shared CPU);
* the diagnostics' own time, instrumented (the callback's hooks or the monitor's calls, the observer and the
  gradient hooks wrapped with timers): per non-logging step, per logging step, and the ratio it implies
  (steadier than whole-step timings when the CPU is shared).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.models import NanoGPT  # noqa: E402
from lightning_resctl.callbacks import ResidualControlCallback  # noqa: E402
from lightning_resctl.diagnostics import ResidualMonitor  # noqa: E402
from lightning_resctl.runtime.regions import wait_for_compiles  # noqa: E402
from lightning_resctl.surgery import patch_residuals  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, cfg, method):
        super().__init__()
        self.model = NanoGPT(**cfg)
        self.example_input_array = torch.randint(0, cfg["vocab_size"], (2, cfg["block_size"]))
        patch_residuals(self, method=method)

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(L.Callback):
    def __init__(self):
        self.times: list[float] = []
        self._t = None

    def _sync(self, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now

    def on_train_end(self, trainer, pl_module):
        self._sync(pl_module)
        if self._t is not None:
            self.times.append(time.perf_counter() - self._t)


def _instrument(obj, names, timer) -> None:
    """Time every listed method of ``obj`` (the diagnostics' own code) per step, into ``timer.own``."""
    timer.own = getattr(timer, "own", {})

    def wrap(name):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                i = len(timer.times)  # index of the current step
                timer.own[i] = timer.own.get(i, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    for name in names:
        wrap(name)


#: the monitor's code that runs inside a step (``start``/``stop`` are what ``with monitor.step()`` calls)
MONITOR_CALLS = ("start", "stop", "log_to", "_observe", "_grad_hook")
CALLBACK_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step")


def _data(args) -> DataLoader:
    tok = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq + 1),
                        generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tok[:, :-1], tok[:, 1:]), batch_size=args.batch, shuffle=False)


def run_plain(args, with_monitor: bool, model_state) -> list[float]:
    """A hand-written loop; with the monitor: ``with monitor.step(i)`` around forward + backward, ``log_to``."""
    from torch.utils.tensorboard import SummaryWriter

    cfg = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    torch.manual_seed(0)
    module = Lit(cfg, args.method)
    module.load_state_dict(model_state)
    device = torch.device("cuda" if args.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
                          else "cpu")
    model = module.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = SummaryWriter(f"{args.logdir}/plain_{'with' if with_monitor else 'without'}")
    timer = StepTimer()
    monitor = ResidualMonitor(model, log_every_n_steps=args.every) if with_monitor else None
    if monitor is not None:
        _instrument(monitor, MONITOR_CALLS, timer)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i, (x, y) in enumerate(_data(args)):
        sync()
        now = time.perf_counter()
        if timer._t is not None:
            timer.times.append(now - timer._t)
        timer._t = now
        x, y = x.to(device), y.to(device)
        with monitor.step(i) if monitor is not None else contextlib.nullcontext():
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if monitor is not None:
            monitor.log_to(writer)
    sync()
    timer.times.append(time.perf_counter() - timer._t)
    writer.close()
    run.own = getattr(timer, "own", None)
    return timer.times


def run(args, with_callback: bool, model_state) -> list[float]:
    if args.loop == "plain":
        return run_plain(args, with_callback, model_state)
    cfg = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    torch.manual_seed(0)
    module = Lit(cfg, args.method)
    module.load_state_dict(model_state)
    loader = _data(args)
    timer = StepTimer()
    callbacks = [timer]
    if with_callback:
        cb = ResidualControlCallback(log_every_n_steps=args.every)
        _instrument(cb, CALLBACK_HOOKS, timer)
        _instrument(cb.monitor, ("_observe", "_grad_hook"), timer)
        callbacks.append(cb)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, log_every_n_steps=args.every,
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="with" if with_callback else "without"),
    )
    trainer.fit(module, loader)
    run.own = getattr(timer, "own", None)
    return timer.times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", default="trainer", choices=["trainer", "plain"],
                   help="a Lightning Trainer with ResidualControlCallback, or a plain loop with ResidualMonitor")
    p.add_argument("--method", default="rescontroller", choices=["add", "rescontroller", "mgr"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (steadier timings on a shared CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--logdir", default="/tmp/bench_callback_logs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    cfg = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    torch.manual_seed(0)
    state = Lit(cfg, args.method).state_dict()
    # step i (0-based) is a logging step when (i + 1) % every == 0, as in Lightning
    log_idx = {i for i in range(args.steps) if (i + 1) % args.every == 0}
    without, with_, own = [], [], []
    run(args, False, state)  # warm-up (allocator, kernels, imports)
    wait_for_compiles()  # the torch paths compile in the background on CPU: time the compiled steady state
    run(args, False, state)
    for rep in range(args.reps):  # alternate the order (ABBA...) so that drift on a shared machine cancels
        for with_cb in ((False, True) if rep % 2 == 0 else (True, False)):
            (with_ if with_cb else without).append(run(args, with_cb, state))
            if with_cb:
                own.append(run.own)

    def split(runs):
        plain = [t for r in runs for i, t in enumerate(r) if i not in log_idx and i > 0]
        logging = [t for r in runs for i, t in enumerate(r) if i in log_idx]
        total = [sum(r[1:]) / (len(r) - 1) for r in runs]
        return plain, logging, total

    wo_plain, wo_log, wo_mean = split(without)
    w_plain, w_log, w_mean = split(with_)
    med = statistics.median
    dev = "cuda" if (args.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()) else "cpu"
    what = "Trainer + ResidualControlCallback" if args.loop == "trainer" else "plain loop + ResidualMonitor"
    print(f"bench_callback ({what}): nanoGPT {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch}, "
          f"method={args.method}, {dev} ({args.threads} thread(s)), {args.steps} steps x {args.reps} reps, "
          f"log_every_n_steps={args.every}")
    print(f"  non-logging step  median: without {med(wo_plain) * 1e3:8.2f} ms   with {med(w_plain) * 1e3:8.2f} ms"
          f"   ratio {med(w_plain) / med(wo_plain):.3f}")
    e = args.every
    amort_wo = ((e - 1) * med(wo_plain) + med(wo_log)) / e
    amort_w = ((e - 1) * med(w_plain) + med(w_log)) / e
    print(f"  logging step      median: without {med(wo_log) * 1e3:8.2f} ms   with {med(w_log) * 1e3:8.2f} ms"
          f"   ratio {med(w_log) / med(wo_plain):.3f}   (vs a plain step without the callback)")
    print(f"  amortized over {e} steps (medians): without {amort_wo * 1e3:8.2f} ms   with {amort_w * 1e3:8.2f} ms"
          f"   ratio {amort_w / amort_wo:.3f}   (goal <= 1.03)")
    own_plain = [o.get(i, 0.0) for o in own for i in range(1, args.steps) if i not in log_idx]
    own_log = [o.get(i, 0.0) for o in own for i in log_idx]
    est = 1 + ((e - 1) * med(own_plain) + med(own_log)) / e / med(wo_plain)
    print(f"  diagnostics' own code (instrumented): {med(own_plain) * 1e6:7.1f} us per non-logging step, "
          f"{med(own_log) * 1e3:6.2f} ms per logging step -> estimated ratio at log_every_n_steps={e}: {est:.3f}")
    print(f"  all steps, measured mean: without {med(wo_mean) * 1e3:8.2f} ms   with {med(w_mean) * 1e3:8.2f} ms"
          f"   ratio {med(w_mean) / med(wo_mean):.3f}   (noisy on a shared CPU)")


if __name__ == "__main__":
    main()
