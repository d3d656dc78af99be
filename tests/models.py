"""Small hand-written models used by the tests (and importable by other test files).

* :class:`NanoGPT` — a nanoGPT-style decoder (pre-norm blocks, ``x = x + attn(ln(x))``).
* :class:`TinyViT` — ViT-style blocks with layer scale and a class token.
* :class:`BranchyNet` — a forward that branches on Python values (``if``/``for``), with
  additions that are *not* merges (bias, counter, two-branch sum, positional embedding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "CausalSelfAttention", "MLP", "Block", "TinyViT", "ViTBlock", "BranchyNet"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool = True):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """nanoGPT-style GPT: token + position embeddings, ``n_layer`` pre-norm blocks, tied head.

    ``forward(idx) -> logits`` of shape (B, T, vocab_size).
    """

    def __init__(self, vocab_size: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32, bias: bool = True):
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
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
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # a positional embedding: not a merge
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


class ViTBlock(nn.Module):
    """timm-style ViT block: pre-norm, layer scale, ``x = x + ls(attn(norm(x)))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0, init_values: float = 0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        attn_out, _ = self.attn(y, y, y, need_weights=False)
        x = x + self.gamma_1 * attn_out
        x = x + self.gamma_2 * self.mlp(self.norm2(x))
        return x


class TinyViT(nn.Module):
    """ViT-style classifier: conv patch embedding, class token, learned positions, ViT blocks."""

    def __init__(self, image_size: int = 8, patch_size: int = 4, in_chans: int = 3, dim: int = 16,
                 depth: int = 2, num_heads: int = 2, num_classes: int = 5):
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, num_patches + 1, dim))
        self.blocks = nn.ModuleList([ViTBlock(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.example_input_array = torch.randn(2, in_chans, image_size, image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        x = x + self.pos_embed  # a positional embedding: not a merge
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


class BranchyNet(nn.Module):
    """A model whose forward branches on Python values, with several additions that are not merges.

    True merges (per forward, ``depth`` layers): one per layer, written in turn as
    ``x = x + f(x)``, ``x = f(x) + x``, ``torch.add(x, f(x))`` and ``h = f(x); h += x``.
    Non-merges: a bias add, a counter, a sum of two branches of the same input, a scalar shift.
    """

    def __init__(self, dim: int = 16, depth: int = 6, use_gate: bool = True):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.extra_bias = nn.Parameter(torch.zeros(dim))
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                                   nn.Linear(dim, dim)) for _ in range(depth)])
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 3)
        self.use_gate = use_gate
        self.depth = depth
        self.example_input_array = torch.randn(4, 5, dim)

    def forward(self, x: torch.Tensor, mode: str = "train") -> torch.Tensor:
        x = self.inp(x) + self.extra_bias  # a bias: not a merge
        count = torch.zeros((), device=x.device)
        for i, layer in enumerate(self.layers):
            if i % 4 == 0:
                x = x + layer(x)
            elif i % 4 == 1:
                x = layer(x) + x
            elif i % 4 == 2:
                x = torch.add(x, layer(x))
            else:
                h = layer(x)
                h += x  # in place, on the update
                x = h
            count = count + 1  # a counter: not a merge
        if self.use_gate and mode == "train":
            both = self.left(x) + self.right(x)  # two branches combined: not a merge
            x = both * 0.5
        x = x - 0.0 + 1.0  # scalar shifts: not merges
        return self.out(x).mean(1) + 0 * count
