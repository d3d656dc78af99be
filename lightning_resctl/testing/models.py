"""The one nanoGPT of the project (the compare job's built-in model, the tests and the benchmarks), and hand
wiring of merge rules into it.

* :class:`NanoGPT` — nanoGPT-style decoder: token + position embeddings, pre-norm blocks
  ``x = x + attn(ln_1(x))``, ``x = x + mlp(ln_2(x))``, tied head; options for bias, dropout and the norms'
  eps. The compare job's :class:`lightning_resctl.compare.gpt.CharGPT` trains it.
* :func:`wire_merges` — replace both residual additions of every block by ``merge(x, update)`` (no surgery).
* :func:`wire_hyper_connections` — HC / mHC of the ``hyper-connections`` package wired by hand into the
  same GPT (the package's own ``expand_stream`` / ``reduce_stream`` and one connection per sub-layer).
* :class:`ResNet` — a ResNet-18-shaped conv net (BasicBlocks, one feature-map shape per stage) for small images.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "Block", "CausalSelfAttention", "MLP", "wire_merges", "wire_hyper_connections", "gpt_loss",
           "add_step_arguments", "ResNet", "BasicBlock"]


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


def add_step_arguments(parser, *, layers: int = 12, C: int = 256, reps: int = 15) -> None:
    """The benchmarks' shared flags for one nanoGPT training step: shape (layers, C, heads, T, batch, vocab)
    and repetitions (reps, warmup)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--C", type=int, default=C)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--warmup", type=int, default=2)
