"""The compare job's built-in model: :class:`CharGPT`, a LightningModule training the project's one nanoGPT
(:class:`tests.support.models.NanoGPT`, pre-norm blocks ``x = x + attn(ln_1(x))``,
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
from torch import nn

from .data import VOCAB_SIZE

__all__ = ["CharGPT", "DEFAULT_NORM_EPS", "NanoGPT", "Block", "CausalSelfAttention", "MLP"]

#: LayerNorm eps of the built-in model (see the module docstring for the measurement behind it).
DEFAULT_NORM_EPS = 1e-12


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (``scaled_dot_product_attention`` with ``is_causal=True``)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` with a 4x hidden width."""

    def __init__(self, n_embd: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block with two plain residual merges."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0, norm_eps: float = 1e-5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=norm_eps)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=norm_eps)
        self.mlp = MLP(n_embd, bias, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """nanoGPT-style GPT: token + position embeddings, ``n_layer`` pre-norm blocks, final LayerNorm, a head
    tied to the token embedding. ``forward(idx) -> logits`` of shape (B, T, vocab_size).

    Initialisation as in nanoGPT (GPT-2): N(0, 0.02) weights, zero biases, the residual projections
    (``c_proj``) N(0, 0.02 / sqrt(2 * n_layer)).

    Args:
        vocab_size, block_size: vocabulary and longest sequence (the position table).
        n_layer, n_head, n_embd: blocks (2 residual merges each), attention heads, width C.
        bias: biases in the linear layers.
        dropout: dropout probability (embeddings, attention weights, both sub-layer outputs).
        norm_eps: eps of every LayerNorm (``torch.nn.LayerNorm``'s default 1e-5).
    """

    def __init__(self, vocab_size: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32, bias: bool = True, dropout: float = 0.0, norm_eps: float = 1e-5):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if not norm_eps >= 0.0:
            raise ValueError(f"norm_eps must be >= 0, got {norm_eps!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias, dropout, norm_eps) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=norm_eps)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.example_input_array = torch.randint(0, vocab_size, (2, block_size))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # a positional embedding: not a merge
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


class CharGPT(L.LightningModule):
    """The built-in model of the compare job: :class:`~tests.support.models.NanoGPT` on next-byte
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
