"""MergeSite: the runtime object a patched residual addition calls.

A patched expression ``stream + update`` (or ``update + stream``, ``torch.add``, ``+=``, ``add_``) becomes
``self.<site>(stream, update)``. The site computes

* ``method="add"``:           ``stream + update`` (in place when the original was in place);
* ``method="rescontroller"``: ``ResController(stream, update)`` (``out = r + s_u * s_s * u``);
* ``method="mgr"``:           one merge of a Multi-Gate Residuals chain. The chain's n streams
  ``S (..., n_k, C)`` travel beside the model in a per-chain state; what the site returns (and what the
  model's own code sees between merges) is the pooled view ``h`` that the next merge's branch reads —
  or, after the chain's last merge, the chain's output pool — always with the stream's original shape.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["MergeSite", "ChainState"]

METHODS = ("add", "rescontroller", "mgr")


class ChainState:
    """Per-forward state of one MGR chain, shared by the chain's sites (a plain object, not a Module).

    ``k``: index of the next merge to run; ``streams``: the streams entering merge ``k`` (``None``
    between forwards, so nothing is kept alive after the chain's last merge).
    """

    def __init__(self) -> None:
        self.k = 0
        self.streams: Optional[torch.Tensor] = None

    def __deepcopy__(self, memo):
        return ChainState()


class MergeSite(nn.Module):
    """One patched residual addition.

    Attributes: ``path`` (module path of the module whose forward holds the addition), ``location``
    ("file:line"), ``source_line``, ``stream_shape``, ``chain`` (chain id), ``position`` (depth of
    the merge in its chain; ``positions`` lists all of them when one expression runs several merges
    per forward, e.g. ``for f in self.layers: x = x + f(x)``), ``method``, ``dim`` (feature dim of
    the stream as the model sees it: -1, or 1 for channels-first), ``module`` (the merge module:
    ``ResController``, the ``MGRMerge`` of ``position``, or ``None`` for "add").

    Runtime switches:

    * ``observer``: ``None`` or ``observer(site, stream, update, streams)``, called each time the site
      runs with the real tensors; ``streams`` is the MGR stream tensor entering the merge
      (``(..., n_k, C)``, features last) or ``None``.
    * ``skip_update``: ablation — return the stream unchanged (MGR: keep the streams, pool them).
    """

    def __init__(self, method: str, *, path: str = "", location: str = "", source_line: str = "",
                 stream_shape: tuple = (), chain: int = 0, positions: tuple = (0,), dim: int = -1,
                 inplace: Optional[str] = None, merge: Optional[nn.Module] = None,
                 mgr_chain: Optional[nn.Module] = None, mgr_state: Optional[ChainState] = None):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if inplace not in (None, "stream", "update"):
            raise ValueError(f"inplace must be None, 'stream' or 'update', got {inplace!r}")
        self.method = method
        self.path = path
        self.location = location
        self.source_line = source_line
        self.stream_shape = tuple(stream_shape)
        self.chain = chain
        self.positions = tuple(positions)
        self.position = self.positions[0]
        self.dim = dim
        self.inplace = inplace
        self.observer: Optional[Callable] = None
        self.skip_update = False
        if method == "rescontroller":
            if merge is None:
                raise ValueError("method='rescontroller' needs merge=<ResController>")
            self.merge = merge
        else:
            self.merge = None
        # The MGR chain is registered once, higher up in the model; keep it out of this module's
        # children so its parameters have a single name.
        self.__dict__["_mgr_chain"] = mgr_chain
        self.__dict__["_mgr_state"] = mgr_state
        self._starts_chain = self.positions == (0,)
        self._chain_length = len(mgr_chain.merges) if mgr_chain is not None else 0
        if method == "mgr" and (mgr_chain is None or mgr_state is None):
            raise ValueError("method='mgr' needs mgr_chain and mgr_state")

    # ------------------------------------------------------------------ introspection
    @property
    def module(self) -> Optional[nn.Module]:
        """The merge module of ``position`` (ResController / MGRMerge), or None for "add"."""
        return self.merge_module(self.position)

    def merge_module(self, position: int) -> Optional[nn.Module]:
        if self.method == "rescontroller":
            return self.merge
        if self.method == "mgr":
            return self._mgr_chain.merges[position]
        return None

    @property
    def mgr_chain(self) -> Optional[nn.Module]:
        """The ``MGRChain`` this site belongs to (MGR only)."""
        return self._mgr_chain

    def extra_repr(self) -> str:
        pos = self.position if len(self.positions) == 1 else list(self.positions)
        return f"method={self.method!r}, chain={self.chain}, position={pos}, dim={self.dim}, at={self.location}"

    # ------------------------------------------------------------------ runtime
    def forward(self, stream: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Merge ``update`` into ``stream``; the result has the stream's shape."""
        if self.method == "mgr":
            return self._forward_mgr(stream, update)
        if self.observer is not None:
            self.observer(self, stream, update, None)
        if self.skip_update:
            return stream
        if self.method == "add":
            if self.inplace == "stream":
                return stream.add_(update)
            if self.inplace == "update":
                return update.add_(stream)
            return stream + update
        return self.merge(stream, update)

    def _forward_mgr(self, stream: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        chain = self._mgr_chain
        state = self._mgr_state
        d = self.dim
        moved = d != -1 and d != stream.dim() - 1
        s = stream.movedim(d, -1) if moved else stream
        u = update.movedim(d, -1) if moved else update
        if u.dtype != s.dtype:  # e.g. under autocast: the plain addition would promote, the streams keep x's dtype
            u = u.to(s.dtype)
        k = 0 if self._starts_chain else state.k
        if k == 0:
            streams, _ = chain.start(s)
        else:
            streams = state.streams
        if self.observer is not None:
            self.observer(self, stream, update, streams)
        lead = streams.shape[:-2]
        if u.shape[:-1] != lead:  # the model re-viewed the stream between merges (e.g. reshape(-1, C))
            u = u.reshape(lead + u.shape[-1:])
        if self.skip_update:
            new_streams, h = chain.skip(k, streams)
            h = h.to(stream.dtype)
        else:
            new_streams, h = chain.step(k, streams, u)
        if h.shape != s.shape:
            h = h.reshape(s.shape)
        if k + 1 >= self._chain_length:
            state.streams = None
            state.k = 0
        else:
            state.streams = new_streams
            state.k = k + 1
        return h.movedim(-1, d) if moved else h

