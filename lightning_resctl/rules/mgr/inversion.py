"""MGR fallback inversion: the chain-level runtime state shared by the merges of one forward pass.

The backward recomputes each merge's input streams from its output, ``s_i = (s'_i - beta_i u) / (1 - beta_i)``,
instead of saving them; merge l+1's backward hands its reconstructed input to merge l as that merge's output.
Rows (token, stream) are saved exactly where beta is in the top ``top_p`` fraction of the merge, above
``threshold``, or where the error gain ``prod 1/(1 - beta)`` accumulated since the last exact row would exceed
``max_gain``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..common import compute_dtype

__all__ = ["InvertRun", "reconstruct_inputs", "output_streams"]


class InvertRun:
    """State of one forward pass of a chain with inversion.

    * ``outputs[k]``: (weakref to merge k's output, detached alias, version) until merge k+1 claims it — an
      unclaimed output stays alive here (exactly as if saved) and is used by merge k's backward.
    * ``slots[k]``: merge k's output streams as reconstructed by the backward of the merge that claimed it.
    * ``gain``: per (token, stream) log of the error gain accumulated since the last exact row.
    """

    def __init__(self, top_p: float, threshold: float, max_gain: float):
        self.top_p, self.threshold, self.log_max_gain = top_p, threshold, math.log(max_gain)
        self.outputs: dict[int, tuple] = {}
        self.slots: dict[int, Tensor] = {}
        self.gain: Optional[Tensor] = None

    def claim(self, streams: Tensor) -> Optional[int]:
        for k, (ref, _, version) in list(self.outputs.items()):
            if ref() is streams and streams._version == version:
                del self.outputs[k]
                return k
        return None

    def exact_mask(self, beta: Tensor) -> Tensor:
        """Rows (token, stream) to save exactly; updates the running error gain."""
        step = -torch.log1p(-beta.clamp(max=1.0 - 1e-7))
        gain = step if self.gain is None or self.gain.shape != beta.shape else self.gain + step
        mask = (beta > self.threshold) | (gain > self.log_max_gain)
        kp = int(math.ceil(self.top_p * beta.numel())) if self.top_p > 0 else 0
        if kp > 0:
            idx = torch.topk(beta.reshape(-1), min(kp, beta.numel()), sorted=False).indices
            mask.view(-1)[idx] = True
        self.gain = gain.masked_fill(mask, 0.0)
        return mask


def reconstruct_inputs(out2: Tensor, u2: Tensor, beta: Tensor, mask: Tensor, exact: Tensor) -> Tensor:
    """Inputs of a gated merge from its output (flat ``(T, m, C)``): ``s = lerp(u, s', 1 / (1 - beta))``,
    with the exactly saved rows put back."""
    cd = compute_dtype(out2)
    wgt = (1.0 - beta.to(cd)).clamp_min(1e-30).reciprocal_().unsqueeze(-1)
    s2 = torch.lerp(u2.to(cd).unsqueeze(1).expand_as(out2), out2.to(cd), wgt)
    s2[mask] = exact.to(cd)
    return s2.to(out2.dtype)


def output_streams(run: InvertRun, k: int, saved_out: Optional[Tensor]) -> Tensor:
    """Merge k's output streams in the backward: reconstructed by the merge that consumed them, or kept."""
    out = run.slots.pop(k, None)
    if out is not None:
        return out
    if saved_out is not None:
        return saved_out
    kept = run.outputs.get(k)  # never claimed by a later merge: kept like a saved tensor
    if kept is None:
        raise RuntimeError(
            f"MGR inversion: the output streams of merge {k} are not available in the backward (the merge "
            "that consumed them did not run its backward). Build the chain with invert=False for this use.")
    _, out, version = kept
    if out._version != version:
        raise RuntimeError(f"MGR inversion: the output streams of merge {k} were modified in place after the "
                           "step; build the chain with invert=False for this use.")
    return out
