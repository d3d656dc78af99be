"""What one comparison depends on: :class:`CompareConfig` (CLI flags and YAML keys use its names)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .methods import DEFAULT_METHODS, PRESETS, UnknownMethodError, check_methods

__all__ = ["CompareConfig"]


@dataclass
class CompareConfig:
    """Everything one comparison depends on. CLI flags and YAML keys use these names
    (dashes or underscores)."""

    # model
    n_layer: int = 16
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64
    dropout: float = 0.0
    # methods and seeds
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    preset: str | None = None
    seeds: int = 2
    first_seed: int = 0
    streams: int = 4
    # optimisation
    steps: int = 160
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 16
    grad_clip: float = 1.0
    # evaluation and logging
    eval_every: int = 10
    val_batches: int = 3
    ablation: bool = True
    ablation_batches: int = 1
    log_every_n_steps: int = 20
    depth_images: bool = True
    # cost vs plain: interleaved timed training steps of every method in one process
    cost_steps: int = 10
    cost_warmup: int = 2
    # hardware
    accelerator: str = "auto"
    precision: str = "32-true"
    threads: int | None = None
    # data
    text: str | None = None
    hf_dataset: str | None = None
    hf_config: str | None = None
    hf_text_field: str = "text"
    max_train_chars: int = 2_000_000
    max_val_chars: int = 250_000
    # output
    out: str = "resctl_runs/compare"
    overwrite: bool = False
    progress_bar: bool = True

    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    def validate(self) -> "CompareConfig":
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        check_methods(self.methods)
        for name in ("n_layer", "n_embd", "n_head", "block_size", "seeds", "steps", "batch_size",
                     "eval_every", "val_batches", "ablation_batches", "log_every_n_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("cost_steps", "cost_warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.streams < 2:
            raise ValueError(f"streams must be >= 2, got {self.streams!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.text is not None and self.hf_dataset is not None:
            raise ValueError("give at most one of text and hf_dataset")
        return self


__all__ += ["UnknownMethodError"]
