"""``add``: the plain residual addition, rewritten by the same machinery (the surgery's control).

``out = stream + update`` — bitwise what the unpatched model computes (in place where the original
was ``+=`` / ``add_``)."""
from __future__ import annotations

from ..base import MergeRule, register_merge_rule

__all__ = ["AddRule"]


class AddRule(MergeRule):
    description = "plain addition stream + update (the control: bitwise the unpatched model)"
    merges_in_place = True
    identity_at_init = True

    def merge(self, module, stream, update, inplace):
        if inplace == "stream":
            return stream.add_(update)
        if inplace == "update":
            return update.add_(stream)
        return stream + update

    def merge_written(self, module, stream, update, inplace, stream_first):
        # the operands in the order written: the result's memory layout follows the left one
        if inplace is None and not stream_first:
            return update + stream
        return self.merge(module, stream, update, inplace)

    def merge_parallel(self, module, stream, updates, partial, inplace, stream_first=True):
        # the model's own last addition, on its own partial sum: bitwise the block as written
        return self.merge_written(module, partial, updates[-1], inplace, stream_first)


register_merge_rule("add", AddRule)
