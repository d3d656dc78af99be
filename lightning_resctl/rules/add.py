"""``add``: the plain residual addition, rewritten by the same machinery (the surgery's control).

``out = stream + update`` — bitwise what the unpatched model computes (in place where the original
was ``+=`` / ``add_``)."""
from __future__ import annotations

from .base import MergeRule


class AddRule(MergeRule):
    description = "plain addition stream + update (the control: bitwise the unpatched model)"

    def merge(self, module, stream, update, inplace):
        if inplace == "stream":
            return stream.add_(update)
        if inplace == "update":
            return update.add_(stream)
        return stream + update

    def merge_parallel(self, module, stream, updates, partial, inplace):
        # the model's own last addition, on its own partial sum: bitwise the block as written
        return self.merge(module, partial, updates[-1], inplace)
