"""Small hand-written models used by the tests (and importable by other test files).

* :class:`NanoGPT` — a nanoGPT-style decoder (pre-norm blocks, ``x = x + attn(ln(x))``).
* :class:`TinyViT` — ViT-style blocks with layer scale and a class token.
* :class:`BranchyNet` — a forward that branches on Python values (``if``/``for``), with
  additions that are *not* merges (bias, counter, two-branch sum, positional embedding).
* :class:`PreNormBlock`, :class:`PreNormNet` (from :mod:`benchmarks.models`), :class:`PreNormInplaceBlock`, and
  :class:`TanhBranch` — blocks of two merges and the net of identical blocks the compile tests build.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

__all__ = ["NanoGPT", "CausalSelfAttention", "MLP", "Block", "TinyViT", "ViTBlock", "BranchyNet"]


# The nanoGPT is the compare job's built-in model: one definition; the pre-norm blocks live with the benchmarks' (the
# repository root on the path also for the scripts the tests start in processes of their own).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import PreNormBlock, PreNormNet  # noqa: E402,F401
from lightning_resctl.compare.nanogpt import MLP, Block, CausalSelfAttention, NanoGPT  # noqa: E402,F401


class TanhBranch(nn.Module):
    """A residual branch of width ``c``: ``fc(tanh(ln(x)))`` (the update of ``x = x + branch(x)``)."""

    def __init__(self, c: int):
        super().__init__()
        self.ln = nn.LayerNorm(c)
        self.fc = nn.Linear(c, c)

    def forward(self, x):
        return self.fc(torch.tanh(self.ln(x)))


class PreNormInplaceBlock(PreNormBlock):
    """The second merge written in place into the branch's output (``out += x``, torchvision style)."""

    def forward(self, x):
        x = x + self.f1(torch.tanh(self.ln1(x)))
        out = self.f2(self.ln2(x))
        out += x
        return out


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
