"""ResController demo: the residual stream of a deep stack, plain ``x + f(x)`` vs ResController.

A 24-block pre-norm MLP stack (random init, no training) runs twice on the same input: once
with the plain residual addition and once with ``ResController`` in every merge. It prints,
per depth, the stream RMS of each, and the controller's mean scales (alpha = s_u caps the
update RMS at ``update_ratio`` x the stream RMS; beta = s_s caps the candidate stream RMS at
``stream_ratio`` x the stream RMS). Runs in a few seconds on CPU::

    python examples/rescontroller_demo.py
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_resctl import ResController
from lightning_resctl.rules.rescontroller import rescontroller_scales


class Branch(nn.Module):
    """Pre-norm MLP branch; ``gain`` > 1 makes each update larger than the stream."""

    def __init__(self, dim: int, gain: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        nn.init.normal_(self.fc2.weight, std=gain / (4 * dim) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--gain", type=float, default=2.0, help="init scale of each branch's output layer")
    args = parser.parse_args(argv)
    for name in ("depth", "dim"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: expected a positive integer, got {getattr(args, name)}")

    torch.manual_seed(0)
    branches = nn.ModuleList([Branch(args.dim, args.gain) for _ in range(args.depth)])
    controller = ResController()  # defaults: update_ratio=0.18, stream_ratio=1.08
    x0 = torch.randn(4, 32, args.dim)  # (batch, tokens, features): features last, dim=-1

    print(f"{args.depth}-block MLP stack, width {args.dim}, branch gain {args.gain}; "
          f"backend {controller.resolved_backend(x0)!r}")
    print(f"{'depth':>5} {'plain RMS':>12} {'controller RMS':>15} {'mean alpha':>11} {'mean beta':>10}")
    plain, ctl = x0, x0
    print(f"{0:>5} {rms(plain):12.3f} {rms(ctl):15.3f}")
    for depth, branch in enumerate(branches, start=1):
        plain = plain + branch(plain)
        update = branch(ctl)
        scales = rescontroller_scales(ctl, update, **controller.options())
        ctl = controller(ctl, update)
        print(f"{depth:>5} {rms(plain):12.3f} {rms(ctl):15.3f} {scales.alpha.mean().item():11.3f} "
              f"{scales.beta.mean().item():10.3f}")
    growth_plain = rms(plain) / rms(x0)
    growth_ctl = rms(ctl) / rms(x0)
    print(f"stream RMS growth over {args.depth} blocks: plain {growth_plain:.2f}x, controller {growth_ctl:.2f}x")


if __name__ == "__main__":
    main()
