"""Cost vs plain: each method's training-step time next to plain's, measured side by side.

Tokens/s measured run after run drifts with whatever else the machine does in between. Here every
method gets its own model (same config, same initial weights, patched with the method) and its own
optimizer in one process, and the timed training steps alternate between the methods: round ``i``
runs one step of every method (the order rotated each round) on the same batch. A method's cost is
the median over rounds of ``step time / plain's step time in the same round``: load that changes
slower than one round cancels out.

A step is forward, loss, backward, gradient clipping and the optimizer step, without Lightning and
without the diagnostics callbacks, so the ratio is the cost of the merges themselves. On CPU a step
is timed by this process's CPU time (``time.process_time``: time spent waiting for other jobs' use of
the cores is not counted); on a GPU by wall time between device synchronisations.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .methods import PLAIN, apply_method

__all__ = ["measure_cost"]


def _device(accelerator: str) -> torch.device:
    acc = str(accelerator).lower()
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    if acc == "mps" or (acc == "auto" and getattr(torch.backends, "mps", None) is not None
                        and torch.backends.mps.is_available()):
        return torch.device("mps")
    return torch.device("cpu")


def _autocast(device: torch.device, precision: str):
    p = str(precision)
    if p.startswith("bf16") and "mixed" in p:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if p.startswith("16") and "mixed" in p:
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_cost(methods: Sequence[str], build_model: Callable[[], torch.nn.Module], batches: Sequence[Any], *,
                 warmup: int = 2, streams: int | None = None, grad_clip: float | None = 1.0,
                 accelerator: str = "cpu", precision: str = "32-true",
                 on_round: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Time interleaved training steps of every method; ``plain`` is always measured (the baseline).

    Args:
        methods: method names (``plain`` is added when missing).
        build_model: returns a fresh, unpatched CharGPT-like LightningModule (same weights every call:
            seed inside it); it must have ``_loss(batch)`` and ``configure_optimizers()``.
        batches: the batches of the rounds; ``len(batches) - warmup`` rounds are timed.
        on_round: called with (round index, number of rounds) after each round (progress).

    Returns ``{"ratio": {m: median ratio to plain}, "step_s": {m: median step seconds},
    "rounds": timed rounds, "ratios": {m: [per-round ratio]}}``.
    """
    names = list(dict.fromkeys([PLAIN, *methods]))
    if len(batches) <= warmup:
        raise ValueError(f"need more batches ({len(batches)}) than warm-up rounds ({warmup})")
    device = _device(accelerator)
    models, optimizers = {}, {}
    for name in names:
        model = build_model()
        apply_method(model, name, streams)
        model.to(device).train()
        opt = model.configure_optimizers()
        optimizers[name] = opt["optimizer"] if isinstance(opt, dict) else opt
        models[name] = model
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {m: [] for m in names}
    rounds = len(batches)
    for i, batch in enumerate(batches):
        batch = tuple(t.to(device) for t in batch)
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            model, opt = models[name], optimizers[name]
            _sync(device)
            start = clock()
            with _autocast(device, precision):
                loss = model._loss(batch)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times[name].append(clock() - start)
        if on_round is not None:
            on_round(i + 1, rounds)
    ratios = {m: [t / p for t, p in zip(times[m], times[PLAIN])] for m in names}
    return {
        "ratio": {m: statistics.median(r) for m, r in ratios.items()},
        "step_s": {m: statistics.median(t) for m, t in times.items()},
        "rounds": rounds - warmup,
        "ratios": ratios,
        "device": str(device),
        "clock": "process CPU time" if device.type == "cpu" else "wall time",
    }
