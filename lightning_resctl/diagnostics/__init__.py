"""Residual diagnostics for any training loop (see ``docs/diagnostics.md``).

* :class:`ResidualMonitor` — per-depth statistics of the merges, summary scalars, alerts, figures; written to
  TensorBoard, W&B, MLflow, any Lightning logger or PNG files. The Lightning callbacks are adapters of it.
* :func:`ablate` — the loss increase when each merge's update is skipped in turn (:class:`AblationResult`).
"""
from .ablation import AblationResult, ablate
from .monitor import Record, ResidualMonitor

__all__ = ["ResidualMonitor", "Record", "ablate", "AblationResult"]
