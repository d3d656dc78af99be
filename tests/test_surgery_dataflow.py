"""What the dataflow of one forward must tell apart (found on timm's zoo): a residual nested in another merge's
branch, the chunks of one ``split``, and a stream that is a part of the tensor its branch reads."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_resctl.surgery import patch_residuals
from surgery_checks import add_and_unpatch_are_bitwise, one_thread  # noqa: F401 (module fixture)

C = 8
IMG = torch.randn(2, C, 5, 5, generator=torch.Generator().manual_seed(3))
SEQ = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(4))


class ResidualNorm(nn.Module):
    """ConvNeXt-V2's global response norm: ``x + (gamma * (x * Nx) + beta)``, a residual of its own."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((1, C, 1, 1), 0.5))
        self.beta = nn.Parameter(torch.full((1, C, 1, 1), 0.1))

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(2, 3), keepdim=True)
        nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
        return x + torch.addcmul(self.beta, self.gamma, x * nx)


class NestedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(C, C, 3, padding=1), ResidualNorm(), nn.Conv2d(C, C, 1)

    def forward(self, x):
        return x + self.conv2(self.norm(self.conv1(x)))


def test_residual_nested_in_a_branch_does_not_hide_the_outer_merge():
    """The block's ``x + branch(x)`` is a merge although its branch holds a merge of its own (it once was
    skipped as "depends on this one only through another residual merge")."""
    report = add_and_unpatch_are_bitwise(nn.Sequential(NestedBlock(), NestedBlock()), IMG)
    block = "return x + self.conv2(self.norm(self.conv1(x)))"
    norm = "return x + torch.addcmul(self.beta, self.gamma, x * nx)"
    assert sorted((s.path, s.source_line) for s in report.sites) == [("0", block), ("0.norm", norm), ("1", block),
                                                                     ("1.norm", norm)]
    # the blocks' merges are one chain; each norm's merge starts its own (its stream is a tensor of the branch)
    assert [c.length for c in report.chains] == [1, 2, 1]
    model = nn.Sequential(NestedBlock(), NestedBlock())
    patch_residuals(model, method="mgr", example_input=IMG, backend="torch-eager")
    out = model(IMG)
    out.pow(2).mean().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())


class ScaleSplitBlock(nn.Module):
    """Res2Net's hierarchical split: ``sp = conv_i(sp + spx[i])`` adds the previous scale's output to the next
    chunk of one ``split``; the block's own merge is ``out + x``."""

    def __init__(self, scales=3):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C * scales, 1)
        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1) for _ in range(scales - 1))
        self.conv3 = nn.Conv2d(C * scales, C, 1)

    def forward(self, x):
        spx = torch.split(self.conv1(x), C, 1)
        outs = []
        sp = spx[0]
        for i, conv in enumerate(self.convs):
            sp = sp if i == 0 else sp + spx[i]
            sp = conv(sp)
            outs.append(sp)
        outs.append(spx[-1])
        out = self.conv3(torch.cat(outs, 1))
        out += x
        return out


def test_chunks_of_one_split_are_not_each_others_stream():
    report = add_and_unpatch_are_bitwise(nn.Sequential(ScaleSplitBlock(), ScaleSplitBlock()), IMG)
    assert [(s.path, s.source_line) for s in report.sites] == [("0", "out += x"), ("1", "out += x")]
    reasons = {s.source_line: s.reason for s in report.skipped}
    assert "sp = sp if i == 0 else sp + spx[i]" in reasons


class ClassTokenBlock(nn.Module):
    """CrossViT's / VOLO's class attention: the class token (a part of x) is the stream, the attention reads
    the whole of x."""

    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        cls = x[:, 0:1] + self.attn(self.norm(x)).mean(1, keepdim=True)
        return torch.cat([cls, x[:, 1:]], dim=1)


def test_a_part_of_the_tensor_its_branch_reads_is_a_stream():
    report = add_and_unpatch_are_bitwise(nn.Sequential(nn.Linear(C, C), ClassTokenBlock(), ClassTokenBlock()), SEQ)
    assert [(s.path, s.stream_operand) for s in report.sites] == [("1", "left"), ("2", "left")]


class UpdateFirst(nn.Module):
    """``update + stream`` with a transposed (non-contiguous) update: the sum's memory layout follows the left
    operand, and what the next op computes can depend on it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C, C, 3, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2) + x


class UpdateFirstParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.mlp = nn.Conv1d(C, C, 3, padding=1), nn.Linear(C, C)

    def forward(self, x):
        h = self.conv(x.transpose(1, 2)).transpose(1, 2) + x
        return self.mlp(x).transpose(1, 2).contiguous().transpose(1, 2) + h


@pytest.mark.parametrize("block", [UpdateFirst, UpdateFirstParallel])
def test_add_keeps_the_operand_order_as_written(block):
    """``add`` is the model as written, memory layout included (found on HF Inkling: a short-convolution
    residual ``(hidden_states + residual)`` whose left operand is transposed)."""
    model = nn.Sequential(nn.Linear(C, C), block())
    ref = model(SEQ)
    report = patch_residuals(model, method="add", example_input=SEQ)
    out = model(SEQ)
    assert len(report.sites) == 1
    assert torch.equal(out, ref) and out.stride() == ref.stride()
