"""MGR fallback inversion: the chain-level runtime state shared by the merges of one forward pass, and the rows a
gated merge saves exactly.

The backward recomputes each merge's input streams from its output, ``s_i = (s'_i - beta_i u) / (1 - beta_i)``,
instead of saving them; merge l+1's backward hands its reconstructed input to merge l as that merge's output.
Where that is ill-conditioned a row (token, stream) is saved exactly instead: where beta is above ``threshold``,
or where the error gain ``prod 1/(1 - beta)`` accumulated since the row's last exact save would exceed
``max_gain``. The rows saved are a fixed budget per merge, ``ceil(top_p * rows)``, allocated up front (static
shapes: the memory is known before the step, and the same under ``torch.compile``, and no device-to-host sync): the
rows that need it first (on the torch path the largest gain first, and the rest of the budget to the largest beta;
the Triton kernels give each program its share of the budget, first come in its token order, ``kernels/mgr.py``). A
row that needs saving past the budget is rebuilt by the inversion, its error not bounded by ``max_gain`` (its gain
keeps growing, so it needs saving again at the next merge): a merge whose gates put more than ``top_p`` of its rows
near 1 (a layer that overwrites its streams) wants a larger ``invert_top_p`` or ``invert=False``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..common import compute_dtype

__all__ = ["InvertRun", "ExactSelection", "select_exact", "reconstruct_inputs", "output_streams"]


class InvertRun:
    """State of one forward pass of a chain with inversion.

    * ``outputs[k]``: (weakref to merge k's output, detached alias, version) until merge k+1 claims it — an
      unclaimed output stays alive here (exactly as if saved) and is used by merge k's backward.
    * ``slots[k]``: merge k's output streams as reconstructed by the backward of the merge that claimed it.
    * ``gain``: per (token, stream) the log of the error gain accumulated since the row's last exact save (the last
      gated merge's, a tensor).
    """

    def __init__(self, top_p: float, threshold: float, max_gain: float):
        self.top_p, self.threshold, self.max_gain = top_p, threshold, max_gain
        self.outputs: dict[int, tuple] = {}
        self.slots: dict[int, Tensor] = {}
        self.gain: Optional[Tensor] = None

    def claim(self, streams: Tensor) -> Optional[int]:
        for k, (ref, _, version) in list(self.outputs.items()):
            if ref() is streams and streams._version == version:
                del self.outputs[k]
                return k
        return None

    def gain_for(self, beta_shape) -> Optional[Tensor]:
        """The running gain entering a gated merge whose beta has ``beta_shape`` (None: none of that shape yet)."""
        gain = self.gain
        return gain if gain is not None and tuple(gain.shape) == tuple(beta_shape) else None


class ExactSelection(NamedTuple):
    """The torch path's exact rows of one gated merge: the running ``gain`` after it, the flat row indices
    ``index`` (token * m + stream) and the rows ``exact`` (budget x C)."""
    gain: Tensor
    index: Optional[Tensor]
    exact: Optional[Tensor]


def select_exact(s2: Tensor, beta: Tensor, gain: Optional[Tensor], top_p: float, threshold: float,
                 max_gain: float) -> ExactSelection:
    """The rows of flat streams ``s2`` (T, m, C) a gated merge with gates ``beta`` (T, m) saves exactly, in static
    shapes: the ``ceil(top_p * T * m)`` rows of the highest priority, the rows that need it (beta > ``threshold``,
    or the running gain past ``log(max_gain)``) first, the largest gain first, then the largest beta. The gain of a
    saved row restarts."""
    step = -torch.log1p(-beta.clamp(max=1.0 - 1e-7))
    gain = step if gain is None else gain + step
    budget = min(math.ceil(top_p * beta.numel()), beta.numel()) if top_p > 0 else 0
    if budget == 0:
        return ExactSelection(gain, None, None)
    must = (beta > threshold) | (gain > math.log(max_gain))
    priority = torch.where(must, 2.0 + gain, beta)  # the rows that need it, the largest gain first; then beta
    index = torch.topk(priority.reshape(-1), budget, sorted=False).indices
    exact = s2.reshape(-1, s2.shape[-1]).index_select(0, index)
    # a float fill (torch.jit.trace's alias analysis has no index_fill_ with a bool value)
    return ExactSelection(gain.reshape(-1).index_fill(0, index, 0.0).view_as(gain), index, exact)


def reconstruct_inputs(out2: Tensor, u2: Tensor, beta: Tensor, index: Optional[Tensor],
                       exact: Optional[Tensor]) -> Tensor:
    """Inputs of a gated merge from its output (flat ``(T, m, C)``): ``s = lerp(u, s', 1 / (1 - beta))``,
    with the exactly saved rows (``index`` into the flat rows) put back."""
    cd = compute_dtype(out2)
    wgt = (1.0 - beta.to(cd)).clamp_min(1e-30).reciprocal_().unsqueeze(-1)
    s2 = torch.lerp(u2.to(cd).unsqueeze(1).expand_as(out2), out2.to(cd), wgt)
    if index is not None:
        s2.view(-1, s2.shape[-1]).index_copy_(0, index, exact.to(cd))
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
