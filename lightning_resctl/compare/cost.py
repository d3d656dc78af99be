"""Cost vs plain: each method's training-step time next to plain's, measured side by side, with its spread.

Tokens/s measured run after run drifts with whatever else the machine does in between. Here every method gets
its own copy of the seed's initial model (patched with the method) and its own optimizer (the model's
``configure_optimizers``) in one process, and training steps alternate between the methods: round ``i`` runs
one step of every method (the order rotated each round) on the same batch.

* **Warm-up**: first compiles and recompiles stay out of the timed rounds. The timed rounds use the first
  batches of the training data; the untimed rounds run every method at least ``warmup`` times and once on every
  batch *shape* the timed rounds hold, so each compiled region (CPU inductor regions, Triton kernels, anything
  specialising on shapes) has compiled for every shape it will see before timing starts; the timed rounds wait
  for the compiles the warm-up started in the background (:func:`lightning_resctl.runtime.regions.wait_for_compiles`).
* **Ratio**: a method's cost is the median over rounds of ``its step time / plain's step time in the same
  round``; load that changes slower than one round cancels out.
* **Spread**: the per-round ratios' interquartile range (and min-max). When the IQR exceeds
  :data:`MAX_RELATIVE_IQR` of the median, or fewer than 3 rounds were timed, the ratio is *unreliable* — the
  summary says so instead of printing a bare number (a busy machine, or steps too short for the clock).

A step is the model's ``training_step`` (the loss it returns), ``backward``, the Trainer's gradient clipping and
the optimizer step, without Lightning's loop and without the diagnostics callbacks. On CPU a step is timed by
this process's CPU time (``time.process_time``: time spent waiting for other jobs is not counted); on a GPU by
wall time between device synchronisations.
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..runtime.regions import wait_for_compiles
from .methods import PLAIN, apply_method

__all__ = ["measure_cost", "MAX_RELATIVE_IQR", "resolve_device", "autocast_for", "first_optimizer"]

#: A ratio whose per-round interquartile range exceeds this fraction of the median is reported as unreliable.
MAX_RELATIVE_IQR = 0.10


def resolve_device(accelerator: Any) -> torch.device:
    """The device a Trainer with ``accelerator`` trains this process's model on (a rank's own GPU: ``LOCAL_RANK``)."""
    acc = accelerator.lower() if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    if acc in ("gpu", "cuda", "cudaaccelerator") or (acc == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if acc in ("mps", "mpsaccelerator") or (acc == "auto" and torch.backends.mps.is_available()):
        return torch.device("mps")
    return torch.device("cpu")


def autocast_for(device: torch.device, precision: Any) -> Callable[[], Any]:
    """A context-manager factory: the autocast of a Trainer ``precision`` (``"bf16-mixed"``, ``"16-mixed"``), or
    none."""
    p = str(precision)
    if "mixed" in p and p.startswith("bf16"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    if "mixed" in p and p.startswith("16"):
        return lambda: torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext


def first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of whatever ``configure_optimizers`` returned (an optimizer, a list or tuple of them, a
    dict with ``"optimizer"``, or ``([optimizers], [schedulers])``)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return first_optimizer(configured[0])
    raise TypeError(f"configure_optimizers returned {type(configured).__name__}: no optimizer to time")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _signature(batch: Any) -> tuple:
    if isinstance(batch, torch.Tensor):
        return ("T", tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, Mapping):
        return tuple((k, _signature(v)) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0])))
    if isinstance(batch, (list, tuple)):
        return tuple(_signature(b) for b in batch)
    return (type(batch).__name__,)


def _quantiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def measure_cost(methods: Sequence[str], reference: torch.nn.Module, batches: Sequence[Any], *,
                 options: Mapping[str, Mapping[str, Any]] | None = None, warmup: int = 2,
                 device: torch.device = torch.device("cpu"), precision: Any = "32-true",
                 gradient_clip_val: float | None = None,
                 on_round: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Time interleaved training steps of every method; ``plain`` is always measured (the baseline).

    Args:
        methods: method names (``plain`` is added when missing); a method the surgery refuses is left out.
        reference: the unpatched LightningModule at init (copied for every method).
        batches: the batches of the timed rounds (one round per batch).
        options: merge-rule options per method.
        warmup: untimed rounds at least (more when the batches hold several shapes, see the module docstring).
        on_round: called with (round index, number of rounds) after each round (progress).

    Returns ``{"ratio": {m: median ratio to plain}, "iqr": {m: [q1, q3]}, "range": {m: [min, max]},
    "reliable": {m: bool}, "step_s": {m: median step seconds}, "ratios": {m: [per-round ratio]}, "rounds",
    "warmup_rounds", "device", "clock", "max_relative_iqr"}``.
    """
    from lightning.fabric.utilities.apply_func import move_data_to_device

    names = list(dict.fromkeys([PLAIN, *methods]))
    if not batches:
        raise ValueError("need at least one batch to time")
    autocast = autocast_for(device, precision)
    models, optimizers = {}, {}
    for name in names:
        model = copy.deepcopy(reference)
        try:
            apply_method(model, name, (options or {}).get(name))
        except Exception:  # noqa: BLE001 - the job reports the refusal; it is not timed
            continue
        model.to(device).train()
        optimizers[name] = first_optimizer(model.configure_optimizers())
        models[name] = model
    names = [n for n in names if n in models]
    batches = [move_data_to_device(b, device) for b in batches]
    by_shape: dict[tuple, Any] = {}
    for b in batches:
        by_shape.setdefault(_signature(b), b)
    warm = list(by_shape.values())
    warm += [batches[i % len(batches)] for i in range(max(0, warmup - len(warm)))]

    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {m: [] for m in names}
    rounds = [(b, False) for b in warm] + [(b, True) for b in batches]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        for i, (batch, timed) in enumerate(rounds):
            if timed and i == len(warm):
                wait_for_compiles()  # the rules' CPU regions compile in the background: time the compiled code
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                model, opt = models[name], optimizers[name]
                _sync(device)
                start = clock()
                with autocast():
                    out = model.training_step(batch, i)
                loss = out["loss"] if isinstance(out, Mapping) else out
                loss.backward()
                if gradient_clip_val:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(device)
                if timed:
                    times[name].append(clock() - start)
            if on_round is not None:
                on_round(i + 1, len(rounds))
    ratios = {m: [t / p for t, p in zip(times[m], times[PLAIN])] for m in names}
    result: dict[str, Any] = {"ratio": {}, "iqr": {}, "range": {}, "reliable": {}, "step_s": {}, "ratios": ratios,
                              "rounds": len(batches), "warmup_rounds": len(warm), "device": str(device),
                              "clock": "process CPU time" if device.type == "cpu" else "wall time",
                              "max_relative_iqr": MAX_RELATIVE_IQR}
    for m, r in ratios.items():
        median = statistics.median(r)
        q1, q3 = _quantiles(r)
        result["ratio"][m] = median
        result["iqr"][m] = [q1, q3]
        result["range"][m] = [min(r), max(r)]
        result["reliable"][m] = m == PLAIN or (len(r) >= 3 and (q3 - q1) <= MAX_RELATIVE_IQR * median)
        result["step_s"][m] = statistics.median(times[m])
    return result
