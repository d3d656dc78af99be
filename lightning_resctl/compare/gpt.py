"""The compare job's built-in model: :class:`CharGPT`, a LightningModule training the project's one nanoGPT
(:class:`~lightning_resctl.compare.nanogpt.NanoGPT`, pre-norm blocks ``x = x + attn(ln_1(x))``,
``x = x + mlp(ln_2(x))``) on next-byte prediction, with plain residuals that ``patch_residuals`` rewrites.

Its LayerNorms use ``eps=1e-12`` (BERT's value) instead of torch's default 1e-5: with GPT-2's init (embedding
std 0.02) the stream's mean square at the deep norms of a rule that divides the stream by the number of its
sources (zero-query Attention Residuals: ``(x + u_0 + ... + u_k) / m``) falls to about 1e-6, near 1e-5, so the
eps — not the rule — would move the model away from plain at init. Measured on the default model (16 layers,
C=128, 8 sequences of 64 bytes), relative difference to plain of the logits / of the gradient norm at init:

=================  ===================  ===================
rule               eps = 1e-5           eps = 1e-12
=================  ===================  ===================
attnres            0.69 / 0.73          5e-7 / 3e-7
attnres-block      0.16 / 0.19          4e-7 / 2e-8
hc                 2.0e-3 / 2.0e-3      0 / 1e-8
mhc-lite (init =   2.7e-3 / 2.9e-3      8e-7 / 4e-7
residual)
=================  ===================  ===================

so every rule whose docs call it identity at init starts as plain (the job checks this every run).
"""
from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F

from .data import VOCAB_SIZE
from .nanogpt import NanoGPT

__all__ = ["CharGPT", "DEFAULT_NORM_EPS"]

#: LayerNorm eps of the built-in model (see the module docstring for the measurement behind it).
DEFAULT_NORM_EPS = 1e-12


class CharGPT(L.LightningModule):
    """The built-in model of the compare job: :class:`~benchmarks.models.NanoGPT` on next-byte
    prediction.

    Loss: ``cross_entropy(logits, y)`` averaged over all tokens, logged as ``train/loss`` (every step) and
    ``val/loss`` (the mean over the validation batches). Optimiser: AdamW with weight decay on parameters of
    dimension >= 2 only (gains, biases and rules' vector parameters are not decayed); schedule: ``warmup_steps``
    of linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the Trainer's ``max_steps``.

    Args:
        vocab_size: 256 byte values for the built-in data.
        block_size, n_layer, n_head, n_embd, dropout, bias, norm_eps: the network (see ``NanoGPT``).
        lr, weight_decay, betas, warmup_steps, min_lr_ratio: the optimiser and its schedule.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = 64, n_layer: int = 16, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = True, norm_eps: float = DEFAULT_NORM_EPS,
                 lr: float = 3e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 warmup_steps: int = 16, min_lr_ratio: float = 0.1):
        super().__init__()
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        self.save_hyperparameters()
        self.model = NanoGPT(vocab_size, block_size, n_layer, n_head, n_embd, bias=bias, dropout=dropout,
                             norm_eps=norm_eps)
        self.example_input_array = torch.zeros(2, block_size, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def _total_steps(self) -> int:
        trainer = self._trainer  # None outside a Trainer (e.g. the job's cost measurement)
        if trainer is None:
            return 1000
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        return max(1, int(trainer.estimated_stepping_batches))

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas))
        warmup, total, floor = hp.warmup_steps, self._total_steps(), hp.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
