"""The ``torch.library`` registration every kernel file shares, written once: a fused forward op and a fused
backward op (each with its fake, for ``torch.compile`` / ``torch.export`` tracing) joined by the forward's autograd.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["register_fused_ops"]


def register_fused_ops(names: tuple[str, str], forward: Callable, forward_fake: Callable, backward: Callable,
                       backward_fake: Callable, setup_context: Callable, grads: Callable):
    """Register ``lightning_resctl::<names[0]>`` (``forward``) and ``lightning_resctl::<names[1]>`` (``backward``;
    schemas from the functions' annotations, no input mutated) with their fakes, and the forward's autograd:
    ``setup_context(ctx, inputs, output)`` saves what the backward needs, ``grads(backward_op, ctx, *grad_outputs)``
    returns one gradient per input of the forward (calling the backward op). Returns ``(forward_op, backward_op)``.
    """
    forward_op = torch.library.custom_op(f"lightning_resctl::{names[0]}", forward, mutates_args=())
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(f"lightning_resctl::{names[1]}", backward, mutates_args=())
    backward_op.register_fake(backward_fake)

    def autograd_backward(ctx, *grad_outputs):
        return grads(backward_op, ctx, *grad_outputs)

    forward_op.register_autograd(autograd_backward, setup_context=setup_context)
    return forward_op, backward_op
