"""Lightning callbacks recording what the residual merges do (see ``docs/diagnostics.md``).

* :class:`ResidualControlCallback` — patch (optional) + per-depth diagnostics in the Trainer's loggers (the Lightning
  adapter of :class:`lightning_resctl.ResidualMonitor`).
* :class:`ResidualAblationCallback` — validation-loss increase per skipped merge (:func:`lightning_resctl.ablate`).
* :class:`ResidualTrainerCallback` — the same for Hugging Face's ``transformers.Trainer`` (imports transformers
  when first used).
"""
from .ablation import ResidualAblationCallback
from .control import ResidualControlCallback

__all__ = ["ResidualControlCallback", "ResidualAblationCallback", "ResidualTrainerCallback"]


def __getattr__(name: str):
    if name == "ResidualTrainerCallback":  # transformers is an optional dependency: imported on first use
        from .hf_trainer import ResidualTrainerCallback

        return ResidualTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
