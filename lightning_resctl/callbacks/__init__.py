"""Lightning callbacks recording what the residual merges do (see ``docs/diagnostics.md``).

* :class:`ResidualControlCallback` — patch (optional) + per-depth diagnostics in the Trainer's loggers (the Lightning
  adapter of :class:`lightning_resctl.ResidualMonitor`).
* :class:`ResidualAblationCallback` — validation-loss increase per skipped merge (:func:`lightning_resctl.ablate`).
* :func:`patch_in_configure_model` — the one-liner for models built and sharded in ``configure_model``.
"""
from .ablation import ResidualAblationCallback
from .control import ResidualControlCallback
from .sharded import patch_in_configure_model

__all__ = ["ResidualControlCallback", "ResidualAblationCallback", "patch_in_configure_model"]
