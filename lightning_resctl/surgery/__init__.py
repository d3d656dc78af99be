"""Model surgery: find the residual merges of any model and rewrite them, reversibly.

>>> report = patch_residuals(model, method="rescontroller")   # or "mgr" (streams=4, gating=...), "add"
>>> print(report)                                             # one row per merge: module, file:line, source
>>> unpatch_residuals(model)                                  # bitwise back to the original

How it works: one forward on an example input (``model.example_input_array`` by default) runs under a
``TorchFunctionMode`` that records every addition of two tensors with its operands and the calling frame;
a light dataflow graph decides which additions are residual merges (same shape, the update computed from
the stream through a learned branch); Python 3.11's ``co_positions`` maps each one to its exact source
expression, which is rewritten into ``self.<site>(stream, update)`` in a per-instance subclass of the
block's class. Parameter names and ``isinstance`` are kept; sites are :class:`MergeSite` submodules.

Modules, in the order a patch runs (:mod:`.api` holds the public functions): :mod:`.observe` (the forwards that
record every addition, :mod:`.events`), :mod:`.classify` (which additions are merges), :mod:`.plan` (one site per
expression, the chains, what is skipped; :mod:`.rewrite` builds the patched classes over :mod:`.source_edits`),
:mod:`.bind` (the sites and chain modules built complete and put into the model; :mod:`.sites`, :mod:`.chain_run`
and :mod:`.parallel` are what runs them), :mod:`.report` (describe). What a patch saves: :mod:`.record`. Around it:
:mod:`.checkpoint`, :mod:`.pretrained` and :mod:`.patcher` (a Trainer stage's patch, for the callbacks).

Where to patch in Lightning: before ``configure_optimizers``, DDP/FSDP wrapping and ``torch.compile`` —
``Callback.setup`` is that point::

    class Patch(L.Callback):
        def setup(self, trainer, pl_module, stage):
            patch_residuals(pl_module, method="mgr")

Checkpoints (:mod:`.checkpoint`): a patched model's ``state_dict`` loads into a freshly patched twin as usual;
:func:`patch_from_state_dict` patches a fresh model as the checkpoint's site records say, then loads it, and
:class:`PatchOnLoadMixin` makes ``MyModule.load_from_checkpoint(path)`` do that; a transformers
``save_pretrained`` folder of a patched model loads with :func:`from_pretrained` (:mod:`.pretrained`). An unpatched
checkpoint loads into a patched model with :func:`load_unpatched_state_dict` (the sites' records and MGR's new
parameters are the only keys allowed to be missing; it returns their names).

Limits: only additions that ran in the observed forward are patched (Python branches not taken are not
seen); chain rules support non-reentrant activation checkpointing (a recomputed block replays its merges
from the chain state recorded at its entry) and refuse the reentrant variant at the first training forward;
patch before wrapping (DDP/FSDP/``torch.compile``) and unpatch before ``fully_shard``.
"""
from .api import get_patch_report, merge_sites, patch_residuals, unpatch_residuals
from .checkpoint import (
                         PatchOnLoadMixin,
                         adapt_optimizer_state,
                         load_unpatched_state_dict,
                         patch_from_checkpoint,
                         patch_from_state_dict,
)
from .pretrained import from_pretrained
from .report import ChainInfo, PatchReport, SiteInfo, SkippedInfo
from .sites import MergeSite

__all__ = [
    "patch_residuals",
    "unpatch_residuals",
    "get_patch_report",
    "merge_sites",
    "load_unpatched_state_dict",
    "patch_from_state_dict",
    "patch_from_checkpoint",
    "PatchOnLoadMixin",
    "from_pretrained",
    "adapt_optimizer_state",
    "MergeSite",
    "PatchReport",
    "SiteInfo",
    "SkippedInfo",
    "ChainInfo",
]
