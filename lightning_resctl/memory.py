"""Memory accounting: the bytes autograd saves for backward while a function runs.

One counter for the tests and benchmarks that compare the merges' activation memory::

    nbytes, loss = saved_tensor_bytes(loss_fn, model, idx, exclude=model.parameters())
    loss.backward()
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

__all__ = ["saved_tensor_bytes"]


def _storage_key(t: Tensor):
    """``(device, data_ptr)`` of the tensor's untyped storage, or None when it has none (some subclasses)."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return st.device, st.data_ptr()


def saved_tensor_bytes(fn: Callable, *args, exclude: Optional[Iterable[Tensor]] = None,
                       **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` and count the bytes autograd saves for backward meanwhile.

    ``bytes = sum(storage.nbytes() for each distinct storage packed by
    torch.autograd.graph.saved_tensors_hooks)``: a storage is identified by its device and
    ``untyped_storage().data_ptr()`` and counted once however many views of it are saved; a tensor
    without a storage counts ``numel * element_size`` once per tensor. Storages of the tensors in
    ``exclude`` are left out (pass ``model.parameters()`` to count activations only: every variant
    of a model saves its weights alike). ``exclude`` is consumed by this function, so it is not
    passed on to ``fn``.

    The hook keeps every tensor as it is and is marked ``_mgr_transparent``: an
    :class:`~lightning_resctl.mgr.MGRChain` measured with it keeps its fallback inversion on (MGR
    turns the inversion off under other saved-tensor hooks, e.g. checkpointing or offloading).

    Returns ``(bytes, fn's result)``; the result keeps the graph (and so the saved storages) alive
    for a following ``backward``.
    """
    skip = set()
    for t in exclude if exclude is not None else ():
        if not isinstance(t, Tensor):
            raise TypeError(f"exclude must hold tensors, got {type(t).__name__}")
        key = _storage_key(t)
        if key is not None:
            skip.add(key)
    seen: dict = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key is None:
            seen[id(t)] = t.numel() * t.element_size()
        elif key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    pack._mgr_transparent = True  # only observes: MGRChain.inverts() keeps the inversion while measured

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return sum(seen.values()), result
