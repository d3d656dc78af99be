"""One nanoGPT training step of several variants, timed interleaved: the machinery that ``bench_peers.py`` and
``bench_scaling.py`` share.

* :func:`rule_installer` — an installer ``model -> model`` that patches a model with one of the project's rules;
* :func:`build_rows` — one row per variant (``{"label", "model", "note"}``; a variant that fails to build keeps
  its reason as the note and no model);
* :func:`compiled_rows` — the same models under a whole-model ``torch.compile`` (a compiled column);
* :func:`time_interleaved` — the step of every built variant, interleaved, then the saved-for-backward bytes.

A step is forward, next-token loss, backward and an AdamW step. Every repetition runs one step of each variant in a
rotating order (slow phases of a shared machine hit every variant alike); the first step of each variant is timed
apart (``first``: one-time costs such as the compile of a CPU region) and ``warmup`` more steps are not timed.
Saved bytes: activations saved for backward by one loss (each storage once, parameters left out); for a compiled
row, what AOTAutograd's partitioner chose to save. A compiled row's first step holds its compile (``first``).

``share_weights=True`` (``bench_scaling.py``) builds every variant on the *same* parameter tensors of the base model
(their own rule parameters apart) with one AdamW over all of them: a parameter without a gradient is skipped by
AdamW, so a variant's step updates the base weights and its own rule parameters, as with an optimizer of its own,
while the memory holds one copy of the weights and of the optimizer state instead of one per variant (a 48-layer
C=512 GPT is 0.6 GB of weights, 2.4 GB with gradients and AdamW state). The variants' weights then drift apart
from a common start only by the steps the others take, which does not change a step's cost.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks.models

from benchmarks.models import gpt_loss  # noqa: E402
from lightning_resctl.runtime.memory import saved_tensor_bytes  # noqa: E402
from lightning_resctl.runtime.regions import wait_for_compiles  # noqa: E402

__all__ = ["rule_installer", "build_rows", "compiled_rows", "compile_modes", "time_interleaved", "ratio",
           "first_line"]


def first_line(err: BaseException, width: int = 80) -> str:
    """``"Type: first line of the message"`` cut to ``width`` characters (a row's note)."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:width]}"


def rule_installer(method: str, options: dict, example: torch.Tensor) -> Callable:
    """An installer that runs ``patch_residuals(model, method=method, example_input=example, **options)``; a
    ``streams`` option that the rule does not take is dropped (one option set for every rule)."""

    def install(model):
        from lightning_resctl import patch_residuals
        try:
            patch_residuals(model, method=method, example_input=example, **options)
        except (TypeError, ValueError) as err:
            if "streams" not in options or "streams" not in str(err):
                raise
            rest = {k: v for k, v in options.items() if k != "streams"}
            patch_residuals(model, method=method, example_input=example, **rest)  # a rule without a stream count
        return model
    return install


def build_rows(base: torch.nn.Module, variants: list, *, share_weights: bool = False, lr: float = 1e-4) -> list[dict]:
    """``[plain] + variants`` as rows ``{"label", "model", "note", "opt"}``.

    ``variants``: ``(label, installer or None, note)``; an installer that raises leaves the row without a model
    and its error as the note. ``share_weights``: see the module docstring (otherwise each variant is a deep copy
    with its own AdamW)."""
    memo = {id(p): p for p in base.parameters()} if share_weights else None

    def copy_of_base():
        return copy.deepcopy(base, memo=dict(memo)) if share_weights else copy.deepcopy(base)

    rows = [{"label": "plain", "model": copy_of_base(), "note": None}]
    for label, install, note in variants:
        row = {"label": label, "model": None, "note": note}
        if install is not None:
            try:
                row["model"] = install(copy_of_base())
            except Exception as err:  # noqa: BLE001 - listed, not skipped
                row["note"] = f"failed to build: {first_line(err)}"
        rows.append(row)
    live = [r for r in rows if r["model"] is not None]
    if share_weights:
        params = list({id(p): p for r in live for p in r["model"].parameters()}.values())
        opt = torch.optim.AdamW(params, lr=lr)
        for r in live:
            r["opt"] = opt
    else:
        for r in live:
            r["opt"] = torch.optim.AdamW(r["model"].parameters(), lr=lr)
    return rows


def compile_modes(text: str) -> list[str]:
    """``--compile`` of the step benchmarks: comma-separated ``torch.compile`` modes ("default",
    "reduce-overhead", "max-autotune", ...) for the compiled columns; "none" (or "") for none."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    return [] if modes == ["none"] else modes


def compiled_rows(rows: list[dict], mode: str) -> list[dict]:
    """One row per eager row with a model: that model (the same weights and optimizer) under a whole-model
    ``torch.compile(model, mode=mode)``, with its label and ``"mode": mode`` (eager rows have no mode). Timed
    interleaved with the eager rows; its first step holds the compile. Dynamo's recompile limits are raised to
    the number of models: every variant recompiles the same forward code (a limit reached would run the model
    eagerly, silently)."""
    eager = [r for r in rows if r["model"] is not None and r.get("mode") is None]
    models = len(rows) + len(eager)  # every model compiled so far and now
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * models)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 64 * models)
    return [{"label": r["label"], "model": torch.compile(r["model"], mode=mode), "opt": r["opt"], "note": None,
             "mode": mode} for r in eager]


def autocast_for(device: torch.device, dtype: str):
    """The context a step of ``dtype`` runs in: bf16 autocast for "bf16", else none."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def train_step(row: dict, idx: torch.Tensor, dtype: str = "fp32") -> None:
    """One training step of ``row["model"]`` with ``row["opt"]`` (next-token loss on ``idx``, backward, optimizer
    step) in :func:`autocast_for` ``dtype``, finished on the device before it returns."""
    row["opt"].zero_grad(set_to_none=True)
    with autocast_for(idx.device, dtype):
        loss = gpt_loss(row["model"], idx)
    loss.backward()
    row["opt"].step()
    if idx.device.type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(rows: list[dict], idx: torch.Tensor, *, reps: int, warmup: int,
                     dtype: str = "fp32", before_timing: Optional[Callable] = None) -> list[dict]:
    """Time the training step of every row with a model (see the module docstring); adds ``first`` (s),
    ``times`` (s), ``median`` (s), ``saved`` (bytes) and on CUDA ``peak`` (bytes: the allocator's peak over one
    more step) to each; a variant whose step raises loses its model and
    keeps the error as its note; ``before_timing()`` is called after the warm-up steps. Returns ``rows``."""
    live = [r for r in rows if r["model"] is not None]
    for r in live:  # first step: one-time costs (compiles, lazy kernel loads)
        r["times"] = []
        t0 = time.perf_counter()
        try:
            train_step(r, idx, dtype)
        except Exception as err:  # noqa: BLE001
            r["note"] = f"failed in a step: {first_line(err)}"
            r["model"] = None
            continue
        r["first"] = time.perf_counter() - t0
    wait_for_compiles()  # the torch paths compile in the background on CPU: time the compiled steady state
    live = [r for r in live if r["model"] is not None]
    for _ in range(warmup):
        for r in live:
            train_step(r, idx, dtype)
    if before_timing is not None:
        before_timing()
    for rep in range(reps):
        k = rep % len(live)
        for r in live[k:] + live[:k]:
            t0 = time.perf_counter()
            train_step(r, idx, dtype)
            r["times"].append(time.perf_counter() - t0)
    for r in live:
        r["median"] = statistics.median(r["times"])
        with autocast_for(idx.device, dtype):
            r["saved"] = saved_tensor_bytes(gpt_loss, r["model"], idx, exclude=r["model"].parameters())[0]
        if idx.device.type == "cuda":  # the peak of one more step, from a reset (weights and optimizer state too)
            torch.cuda.reset_peak_memory_stats(idx.device)
            train_step(r, idx, dtype)
            r["peak"] = torch.cuda.max_memory_allocated(idx.device)
    return rows


def ratio(row: dict, plain: dict, key: str) -> Optional[float]:
    """``row[key] / plain[key]``, or None when either was not measured."""
    if row.get(key) is None or not plain.get(key):
        return None
    return row[key] / plain[key]
