"""A parallel block written as several additions (``x = attn_out + x; return mlp_out + x``): one merge of the
block's input with the sum of all its branches. :class:`ParallelPart` is each addition before the last, the
:class:`~.sites.MergeSite` of the last addition merges; :class:`ParallelRun` is the state they share in one forward."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["ParallelRun", "ParallelPart"]


class ParallelRun:
    """Per-forward state of one parallel block written as several additions, shared by its parts and its
    last addition's :class:`MergeSite` (a plain object, not a Module): the block's input, the branches'
    outputs so far, and the partial sum the model's code holds."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.stream: Optional[torch.Tensor] = None
        self.origin: Optional[torch.Tensor] = None   # the block's input as the model passed it (stream: a copy)
        self.updates: list = []
        self.partial: Optional[torch.Tensor] = None

    def __deepcopy__(self, memo):
        return ParallelRun()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.clear()


def _plain_add(stream: torch.Tensor, update: torch.Tensor, inplace: Optional[str], stream_first: bool) -> torch.Tensor:
    """The addition as the model wrote it (``+`` in its operand order, or in place on the stream or the update)."""
    if inplace == "stream":
        return stream.add_(update)
    if inplace == "update":
        return update.add_(stream)
    return stream + update if stream_first else update + stream


class ParallelPart(nn.Module):
    """An addition of a parallel block before its last one (``x = attn_out + x`` in ``x = attn_out + x;
    return mlp_out + x``): it computes the addition as written — the partial sum only the block's next
    addition reads — and hands the block's input and the branch's output to the :class:`MergeSite` of the
    block's last addition, which merges the input with the sum of all branches (one merge per block)."""

    def __init__(self, run: ParallelRun, *, first: bool, location: str = "", source_line: str = "",
                 inplace: Optional[str] = None, stream_first: bool = True, merged_at: str = ""):
        super().__init__()
        if inplace not in (None, "stream", "update"):
            raise ValueError(f"inplace must be None, 'stream' or 'update', got {inplace!r}")
        self.__dict__["_run"] = run
        self.first = first
        self.location = location
        self.source_line = source_line
        self.inplace = inplace
        self.stream_first = stream_first
        self.merged_at = merged_at

    def extra_repr(self) -> str:
        return f"parallel block part at={self.location}, merged at={self.merged_at}"

    def forward(self, stream: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        run = self._run
        if self.first:
            run.clear()
            run.stream = stream.clone() if self.inplace == "stream" else stream
            run.origin = stream
        elif run.partial is None or stream is not run.partial:
            raise RuntimeError(
                f"the addition at {self.location} ({self.source_line!r}) is part of a parallel block merged at "
                f"{self.merged_at}, but its stream is not the partial sum of the block's previous addition: the "
                "block ran differently from the forward the model was patched on")
        run.updates.append(update.clone() if self.inplace == "update" else update)
        run.partial = _plain_add(stream, update, self.inplace, self.stream_first)
        return run.partial
