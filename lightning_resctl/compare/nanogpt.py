"""The project's nanoGPT (pure torch: importing it imports no Lightning): pre-norm blocks
``x = x + attn(ln_1(x))``, ``x = x + mlp(ln_2(x))`` with plain residuals that ``patch_residuals`` rewrites. The
compare job's built-in model (:class:`~lightning_resctl.compare.gpt.CharGPT`) trains it; the tests and the
benchmarks use it as their GPT."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "Block", "CausalSelfAttention", "MLP"]


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
