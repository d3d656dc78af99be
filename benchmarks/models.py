"""Test and benchmark helpers around the project's one nanoGPT (:class:`NanoGPT`, which lives with the compare job
that trains it: :mod:`lightning_resctl.compare.nanogpt`), and hand wiring of merge rules into it.

* :class:`NanoGPT` (and its ``Block``, ``CausalSelfAttention``, ``MLP``) — imported from
  :mod:`lightning_resctl.compare.nanogpt` (one definition, no Lightning import).
* :func:`wire_merges` — replace both residual additions of every block by ``merge(x, update)`` (no surgery).
* :func:`wire_hyper_connections` — HC / mHC of the ``hyper-connections`` package wired by hand into the
  same GPT (the package's own ``expand_stream`` / ``reduce_stream`` and one connection per sub-layer).
* :class:`ResNet` — a ResNet-18-shaped conv net (BasicBlocks, one feature-map shape per stage) for small images.
* :class:`PreNormNet` — an embedding, identical :class:`PreNormBlock` s (two merges each), a head: blocks to compile
  one by one, each optionally checkpointed.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_resctl.compare.nanogpt import MLP, Block, CausalSelfAttention, NanoGPT

__all__ = ["NanoGPT", "Block", "CausalSelfAttention", "MLP", "wire_merges", "wire_hyper_connections", "gpt_loss",
           "add_step_arguments", "ResNet", "BasicBlock", "PreNormBlock", "PreNormNet"]


class PreNormBlock(nn.Module):
    """Pre-norm transformer-like block of width ``c``: two merges (``x = x + f(ln(x))``)."""

    def __init__(self, c: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.f1, self.f2 = nn.Linear(c, c), nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))

    def forward(self, x):
        x = x + self.f1(torch.tanh(self.ln1(x)))
        x = x + self.f2(self.ln2(x))
        return x


class PreNormNet(nn.Module):
    """Embedding, ``depth`` blocks of width ``c`` (``block``: a class taking ``c``), a 3-way head; ``ckpt``: each block
    in non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, depth: int, c: int, block: type = PreNormBlock):
        super().__init__()
        self.emb = nn.Linear(c, c)
        self.blocks = nn.ModuleList(block(c) for _ in range(depth))
        self.head = nn.Linear(c, 3)
        self.ckpt = False

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


class BasicBlock(nn.Module):
    """ResNet basic block: ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; the shortcut is a strided 1x1
    conv + BN when the shape changes (a projection, not a merge of the stream)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18-shaped conv net for ``image_size``-pixel images: a 3x3 stem, four stages of ``depth`` basic
    blocks with ``widths`` channels (stride 2 from the second stage on), global pooling, a linear head.

    ``forward(images) -> logits`` of shape (B, num_classes)."""

    def __init__(self, num_classes: int = 10, widths: tuple = (64, 128, 256, 512), depth: int = 2,
                 image_size: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, c_in = [], widths[0]
        for i, c in enumerate(widths):
            for j in range(depth):
                blocks.append(BasicBlock(c_in, c, stride=2 if i > 0 and j == 0 else 1))
                c_in = c
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)
        self.example_input_array = torch.randn(2, 3, image_size, image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


def gpt_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model(idx)``."""
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def wire_merges(model: NanoGPT, merge) -> NanoGPT:
    """Replace both residual additions of every block by ``merge(x, update)``; returns ``model``."""

    def forward(block, x):
        x = merge(x, block.attn(block.ln_1(x)))
        return merge(x, block.mlp(block.ln_2(x)))

    for block in model.h:
        block.forward = types.MethodType(forward, block)
    return model


def wire_hyper_connections(model: NanoGPT, kind: str = "hc", streams: int = 4) -> NanoGPT:
    """Wire ``hyper-connections`` (lucidrains) HC (``kind="hc"``) or mHC (``kind="mhc"``) with ``streams``
    streams into every sub-layer of ``model`` (in place; adds the connections' parameters). Raises
    ImportError when the package is absent."""
    if kind == "hc":
        from hyper_connections import get_init_and_expand_reduce_stream_functions as get_fns
    elif kind == "mhc":
        from hyper_connections import mc_get_init_and_expand_reduce_stream_functions as get_fns
    else:
        raise ValueError(f"kind must be 'hc' or 'mhc', got {kind!r}")
    init_hc, expand, reduce = get_fns(streams, dim=model.ln_f.normalized_shape[0])
    model.hc_layers = nn.ModuleList()
    for i, block in enumerate(model.h):
        block.hc_attn = init_hc(layer_index=2 * i)
        block.hc_mlp = init_hc(layer_index=2 * i + 1)

        def forward(blk, x):
            h, add = blk.hc_attn(x)
            x = add(blk.attn(blk.ln_1(h)))
            h, add = blk.hc_mlp(x)
            return add(blk.mlp(blk.ln_2(h)))

        block.forward = types.MethodType(forward, block)

    def gpt_forward(m, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = expand(m.wte(idx) + m.wpe(pos))
        for blk in m.h:
            x = blk(x)
        return m.lm_head(m.ln_f(reduce(x)))

    model.forward = types.MethodType(gpt_forward, model)
    del model.hc_layers
    return model


def add_step_arguments(parser, *, layers: int = 12, C: int = 256, reps: int = 15, depths: bool = False) -> None:
    """The benchmarks' shared flags for one nanoGPT training step: shape (layers, C, heads, T, batch, vocab)
    and repetitions (reps, warmup); ``depths``: ``--layers`` takes a list of depths (e.g. ``--layers 12 24 48``)."""
    if depths:
        parser.add_argument("--layers", type=int, nargs="+", default=[layers])
    else:
        parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--C", type=int, default=C)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--warmup", type=int, default=2)
