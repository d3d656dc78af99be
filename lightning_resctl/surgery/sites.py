"""MergeSite: the runtime object a patched residual addition calls.

A patched expression ``stream + update`` (or ``update + stream``, ``torch.add``, ``+=``, ``add_``) becomes
``self.<site>(stream, update)``. The site asks its merge rule (:mod:`lightning_resctl.rules`):

* a per-merge rule computes ``rule.merge(module, stream, update)``;
* a chain rule keeps the chain's state (e.g. MGR's n streams) in a :class:`ChainRun` beside the model;
  what the site returns — what the model's own code sees between merges — always has the stream's shape.

The chain's per-forward state and its activation checkpointing replay: :mod:`.chain_run`; the parallel
blocks written as several additions: :mod:`.parallel`; the record a site writes into ``state_dict``: :mod:`.record`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..rules.base import branches_sum
from .chain_run import (
    ChainEntry,
    ChainRun,
    enter_chain,
    enter_chain_eagerly,
    enter_chain_traced,
    leave_chain,
    leave_chain_eagerly,
    move_entry,
    move_entry_eagerly,
    storage_ptr,
)
from .parallel import ParallelRun
from .phase import bookkeeping_in_eager_code, checkpoint_frame, counting_merge, inside_reentrant_checkpoint
from .record import decode_record, encode_record, plain

__all__ = ["MergeSite", "SitePlace", "mark_rule_module", "running_module"]


@dataclass(frozen=True)
class SitePlace:
    """Where a merge site's addition is: ``path`` (module path of the module whose forward holds it), ``location``
    ("file:line"), ``source_line``, ``branch`` (e.g. "attn", "mlp"), ``function`` (the free function holding the
    addition, "" in the module's own method) and ``called_at`` (the call in the method reaching it)."""

    path: str = ""
    location: str = ""
    source_line: str = ""
    branch: str = ""
    function: str = ""
    called_at: str = ""


class MergeSite(nn.Module):
    """One patched residual addition.

    Attributes: ``path`` (module path of the module whose forward holds the addition), ``location``
    ("file:line"), ``source_line``, ``stream_shape``, ``chain`` (chain id), ``position`` (depth of the merge
    in its chain; ``positions`` lists all of them when one expression runs several merges per forward),
    ``method`` (the rule's registered name), ``rule`` (the configured :class:`~lightning_resctl.rules.MergeRule`),
    ``dim`` (feature dim of the stream as the model sees it), ``module`` (the merge module of ``position``).

    Runtime switches:

    * ``observer``: ``None`` or ``observer(site, stream, update, streams)``, called each time the site runs
      with the real tensors; ``site.current_position`` is the position of that run and ``streams`` the
      chain's stream tensor entering it (chain rules that have one), else ``None``.
    * ``skip_update``: ablation — the update is dropped (per-merge: return the stream).

    In-place merges (``x += f(x)``, ``u += x``, ``add_``; ``inplace`` = the operand written) keep their
    semantics for every rule: the rule computes the merge from a copy of that operand (it may keep or save its
    inputs), and the result is written into the operand's storage, so other names bound to it see the merged
    value, as in the original model (rules with ``merges_in_place``, e.g. ``add``, do it themselves).
    """

    def __init__(self, rule: Any, place: SitePlace = SitePlace(), *, stream_shape: tuple = (), chain: int = 0,
                 positions: tuple = (0,), dim: int = -1, inplace: Optional[str] = None,
                 merge: Optional[nn.Module] = None, chain_slot: Optional[tuple] = None, run: Optional[ChainRun] = None,
                 mode_positions: Optional[dict] = None, parallel: Optional[ParallelRun] = None,
                 stream_first: bool = True, tally: Optional[tuple] = None):
        """``rule`` the configured merge rule; ``place`` where the addition is (:class:`SitePlace`);
        ``stream_shape``, ``chain``, ``positions`` (one per run of the expression in a forward), ``dim``, ``inplace``
        (the operand an in-place addition writes), ``stream_first`` (the model writes ``stream + update``; False:
        ``update + stream``) as in the class docstring. ``merge``: the per-merge rule's module; ``chain_slot`` and
        ``run`` (required by chain rules): ``(module, attribute)`` where the chain's module is registered (marked
        by :func:`mark_rule_module`), and the chain's :class:`ChainRun`; ``mode_positions``: chain rules,
        ``{"train": positions, "eval": the positions that run in eval}``; ``parallel``: the :class:`ParallelRun`
        when the site is the last addition of a parallel block. ``tally``: ``(SiteTally, bit)``, where the site marks
        that it ran in its module's current call (:mod:`.tally`)."""
        super().__init__()
        if inplace not in (None, "stream", "update"):
            raise ValueError(f"inplace must be None, 'stream' or 'update', got {inplace!r}")
        self.rule = rule
        self.method = rule.name
        self.path = place.path
        self.location = place.location
        self.source_line = place.source_line
        self.stream_shape = tuple(stream_shape)
        self.chain = chain
        self.positions = tuple(positions)
        self.position = self.positions[0]
        self.mode_positions: dict = dict(mode_positions or {})
        self.current_position = self.position
        self.dim = dim
        self.inplace = inplace
        self.stream_first = bool(stream_first)
        self.branch = place.branch
        self.function = place.function
        self.called_at = place.called_at
        self.observer: Optional[Callable] = None
        self.skip_update = False
        self.merge = merge
        # The chain module is registered once, higher up in the model; keep it out of this module's
        # children so its parameters have a single name, and read it from there at each call (what runs there).
        self.__dict__["_chain_slot"] = chain_slot
        self.__dict__["_run"] = run
        self.__dict__["_parallel"] = parallel   # a ParallelRun when this is the last addition of a parallel block
        self.__dict__["_tally"], self._tally_bit = tally if tally is not None else (None, 0)
        self.calls_in_forward = 0  # runs of this site in the chain's current forward (chain rules; ChainRun resets it)
        self.__dict__["_positions"] = None  # (chain module, {training: (ChainPosition per run)}): bind_positions()
        if rule.kind == "chain" and (chain_slot is None or run is None):
            raise ValueError(f"method={rule.name!r} is a chain rule: the site needs chain_slot and run")

    # ------------------------------------------------------------------ introspection
    @property
    def module(self) -> Optional[nn.Module]:
        """The merge module of ``position`` (e.g. ResController / MGRMerge), or None."""
        return self.merge_module(self.position)

    def merge_module(self, position: int) -> Optional[nn.Module]:
        return self.rule.merge_module(self, position)

    @property
    def chain_module(self) -> Optional[nn.Module]:
        """The chain module (chain rules) this site belongs to, else None: the module that runs where the patch
        registered it (:func:`running_module`), read at each call."""
        slot = self._chain_slot
        return None if slot is None else running_module(slot[0]._modules[slot[1]])

    @property
    def chain_state(self) -> Any:
        """Chain rules: the chain's state entering the merge that runs now (for observers), else None."""
        run = self._run
        return None if run is None else run.state

    def extra_repr(self) -> str:
        pos = self.position if len(self.positions) == 1 else list(self.positions)
        return f"method={self.method!r}, chain={self.chain}, position={pos}, dim={self.dim}, at={self.location}"

    def record(self) -> dict:
        """The site as plain data: the rule, its options and where the site is."""
        return {"method": self.method, "options": plain(self.rule.options()), "path": self.path,
                "location": self.location, "source_line": self.source_line, "positions": list(self.positions)}

    def get_extra_state(self) -> torch.Tensor:
        """What travels with ``state_dict``: :meth:`record` as UTF-8 JSON in a uint8 tensor (state dicts stay
        tensor-only, loadable with ``weights_only=True``). An unpatched model has no such key, so a patched
        checkpoint never loads silently into it (strict loading fails)."""
        return encode_record(self.record())

    def set_extra_state(self, state: Any) -> None:
        state = decode_record(state)
        if not isinstance(state, dict) or "method" not in state:
            raise RuntimeError(f"state_dict entry for the merge site at {self.location} is not a lightning_resctl "
                               f"site record: {state!r}")
        theirs_options = state.get("options")
        if isinstance(theirs_options, dict):  # the backend is recorded, but not compared (see execution_options)
            theirs_options = self.rule.math_options(theirs_options)
        mine = (self.method, plain(self.rule.math_options()))
        theirs = (state.get("method"), theirs_options)
        if mine != theirs:
            raise RuntimeError(
                f"checkpoint was saved with method={theirs[0]!r} options={theirs[1]} at the merge "
                f"{state.get('path')!r} "
                f"({state.get('location')}), but this model is patched with method={mine[0]!r} options={mine[1]}: "
                "patch the model the same way before loading")

    # ------------------------------------------------------------------ runtime
    @property
    def parallel(self) -> Optional[ParallelRun]:
        """The :class:`ParallelRun` when this site is the last addition of a parallel block, else None."""
        return self._parallel

    def forward(self, stream: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Merge ``update`` into ``stream``; the result has the stream's shape (and is the operand written in
        place for an in-place merge).

        The last addition of a parallel block (``return mlp_out + x`` after ``x = attn_out + x``) merges the
        block's input with the sum of the branches (``attn_out + mlp_out``): ``stream`` is then the partial
        sum its :class:`ParallelPart` computed."""
        if self.rule.kind != "chain":  # a chain merge marks it in its bookkeeping (eager code under the recipe)
            self._mark_ran()
        if self._parallel is not None:
            return self._merge_parallel(stream, update)
        if self.inplace is None or self.rule.merges_in_place:
            return self._merge(stream, update)
        origin = stream
        if self.inplace == "stream":
            target, stream = stream, stream.clone()
        else:
            target, update = update, update.clone()
        return self._write(target, self._merge(stream, update, origin))

    def _mark_ran(self) -> None:
        """Mark in this site's module tally (:mod:`.tally`) that the site ran in the module's current call."""
        tally = self._tally
        if tally is not None and counting_merge():
            tally.ran |= 1 << self._tally_bit

    def _merge_parallel(self, partial: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        par = self._parallel
        if par.partial is None or partial is not par.partial:
            raise RuntimeError(
                f"the merge at {self.location} ({self.source_line!r}) ends a parallel block, but its stream is "
                "not the partial sum of the block's previous addition: the block ran differently from the "
                "forward the model was patched on")
        block_input, origin, updates = par.stream, par.origin, par.updates + [update]
        par.clear()
        chain = self.rule.kind == "chain"
        if chain or self.observer is not None:
            total = branches_sum(updates)
        if chain:
            merged = self._forward_chain(block_input, total, origin)
        else:
            if self.observer is not None:
                self.current_position = self.position
                self.observer(self, block_input, total, None)
            merged = block_input if self.skip_update else self.rule.merge_parallel(
                self.merge, block_input, updates, partial, self.inplace, self.stream_first)
        if self.inplace is None or (self.rule.merges_in_place and not self.skip_update and not chain):
            return merged
        # an in-place last addition (``x += mlp_out``): the model's tensor holds the merged value afterwards
        return self._write(partial if self.inplace == "stream" else update, merged)

    def _write(self, target: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """An in-place merge: ``merged`` written into the model's tensor ``target`` (which a checkpointed region's
        recomputation then knows by ``merged``'s chain entry)."""
        out = target.copy_(merged)
        run = self._run
        eagerly = bookkeeping_in_eager_code()
        if run is not None and eagerly is not None:  # (nothing is remembered in a graph traced outside regions)
            (move_entry_eagerly if eagerly else move_entry)(run, merged, out)
        return out

    def _merge(self, stream: torch.Tensor, update: torch.Tensor, origin: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.rule.kind == "chain":
            return self._forward_chain(stream, update, origin)
        if self.observer is not None:
            self.current_position = self.position
            self.observer(self, stream, update, None)
        if self.skip_update:
            return stream
        return self.rule.merge_written(self.merge, stream, update, self.inplace, self.stream_first)

    # ------------------------------------------------------------------ chain positions
    def bind_positions(self) -> None:
        """Build (again, when the chain module that runs changed, e.g. behind PEFT's wrapper) the rule's
        :class:`~lightning_resctl.rules.ChainPosition` of each run of this site in a forward, per mode: what a merge
        runs, chosen by its run count alone (no position read in a compiled forward). Chain rules only."""
        chain = self.chain_module
        built = self._positions
        if built is not None and built[0] is chain:
            return
        run = self._run
        table = {}
        for training in (True, False):
            ks = self.mode_positions.get("train" if training else "eval", self.positions)
            table[training] = tuple(self._new_position(chain, run, k, training) for k in ks)
        self.__dict__["_positions"] = (chain, table)

    def _new_position(self, chain: nn.Module, run: ChainRun, k: int, training: bool) -> nn.Module:
        at = self.rule.position(chain, k, run.next_after(k, training))
        at.first = k == run.first_expected(training)
        return at

    def position_table(self, training: bool) -> tuple:
        """The :class:`~lightning_resctl.rules.ChainPosition` of each run of this site in a forward of this mode."""
        return self._positions[1][training]

    def position_module(self, k: int, training: bool) -> nn.Module:
        """The :class:`~lightning_resctl.rules.ChainPosition` of merge ``k`` in this mode (eager code)."""
        for at in self.position_table(training):
            if at.k == k:
                return at
        return self._new_position(self.chain_module, self._run, k, training)

    def _position_now(self, run: ChainRun) -> int:
        n = self.calls_in_forward
        positions = self.mode_positions.get("train" if self.training else "eval", self.positions)
        if n >= len(positions):
            raise RuntimeError(
                f"the merge at {self.location} ({self.path or 'root'}: {self.source_line!r}) ran {n + 1} times in one "
                f"forward of residual chain {self.chain}, but {len(positions)} were observed in "
                f"{'training' if self.training else 'eval'} mode when the model was patched: a stream-carrying rule "
                "needs the same merges in every forward of one mode")
        self.calls_in_forward = n + 1
        return positions[n]

    def _forward_chain(self, stream: torch.Tensor, update: torch.Tensor,
                       origin: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One merge of the chain; ``origin``: the stream tensor as the model passed it (``stream`` may be a copy
        of it for an in-place merge), by which a checkpointed region's recomputation finds its chain state."""
        rule = self.rule
        chain = self.chain_module
        run = self._run
        origin = stream if origin is None else origin
        eagerly = bookkeeping_in_eager_code()
        if eagerly is None:  # traced into a graph compiled outside any checkpointed region: the live run
            phase, state, at, lead, training = enter_chain_traced(self, run, stream)
        else:
            phase, state, at, lead, training = (enter_chain_eagerly if eagerly else enter_chain)(
                self, run, stream, origin, "now")
        d = self.dim
        moved = d != -1 and d != stream.dim() - 1
        s = stream.movedim(d, -1) if moved else stream
        u = update.movedim(d, -1) if moved else update
        if state is None:  # a chain whose merges are compiled in graphs apart from its owner's forward: start_apart
            apart = torch.compiler.is_compiling() and not run.owner_traced
            state = (rule.start_apart if apart else rule.start)(chain, s)
            lead = s.shape[:-1]
        if self.observer is not None and phase != "recompute":  # (no branch on the phase in the math's graph)
            self.current_position = at.k
            run.state, run.lead = state, lead  # observers read the state entering this merge (chain_state)
            self.observer(self, stream, update, rule.streams(chain, state))
        if u.shape[:-1] != lead:  # the model re-viewed the stream between merges (e.g. reshape(-1, C))
            u = u.reshape(lead + u.shape[-1:])
        if u.dtype != s.dtype and not torch.is_autocast_enabled(s.device.type):
            out_dtype = torch.result_type(s, u)
        else:
            out_dtype = s.dtype
        if u.dtype != s.dtype:  # the chain's state keeps the dtype of its input; the result is promoted below
            u = u.to(s.dtype)
        state, h = at.skip(state) if self.skip_update else at.step(state, u)
        if h.shape[:-1] != s.shape[:-1]:
            h = h.reshape(s.shape)
        if h.dtype != out_dtype:
            h = h.to(out_dtype)
        h = h.movedim(-1, d) if moved else h
        if eagerly:  # the phase read again at the graph break: one graph of the math serves both phases
            leave_chain_eagerly(self, run, "now", at, state, lead, training, h)
        else:
            leave_chain(self, run, phase, at, state, lead, training, h)
        return h

    def _replay_entry(self, run: ChainRun, stream: torch.Tensor) -> ChainEntry:
        """The chain state the forward had entering this merge, for a checkpointed region's recomputation: the
        entry of ``stream`` (or of a live tensor of the same storage and version, when the model re-viewed it)."""
        entry = run.entries.get(stream)
        if entry is None:
            ptr = storage_ptr(stream)
            for key, candidate in list(run.entries.items()):
                if ptr is not None and storage_ptr(key) == ptr and key._version == candidate.version == stream._version:
                    entry = candidate
                    break
        if entry is None:  # the region's input came back as another tensor (offloaded): its region's first merge
            frame = checkpoint_frame()
            entry = None if frame is None else frame.__dict__.get("_resctl_chain_entries", {}).get(id(run))
        if entry is None:
            raise RuntimeError(
                f"the merge at {self.location} ({self.source_line!r}) of residual chain {self.chain} ran in a "
                "backward pass (activation checkpointing recomputing its block), but its stream is not a tensor "
                "the chain handed to the model inside a checkpointed region, so its chain state is unknown: "
                "checkpoint with torch.utils.checkpoint(..., use_reentrant=False) around whole blocks, whose "
                "input is the previous merge's output. A block compiled with torch.compile outside any checkpointed "
                "region keeps that graph when checkpointing is switched on later: call torch._dynamo.reset() then")
        positions = set(self.mode_positions.get("train" if entry.training else "eval") or self.positions)
        if entry.k not in positions:
            raise RuntimeError(
                f"the merge at {self.location} ({self.source_line!r}) recomputed in backward received the stream "
                f"of merge {entry.k} of residual chain {self.chain}, but it runs merges {sorted(positions)}: the "
                "checkpointed block ran differently from its forward")
        return entry

    def _refuse_reentrant(self, stream: torch.Tensor, run: ChainRun) -> None:
        """Raise when this merge runs in the ``no_grad`` forward of reentrant checkpointing while training."""
        state_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(run.state))
        if (stream.requires_grad or state_grad) and inside_reentrant_checkpoint():
            raise RuntimeError(
                f"the merge at {self.location} ({self.source_line!r}) runs inside "
                f"torch.utils.checkpoint(..., use_reentrant=True), which runs its block under no_grad: "
                f"method={self.method!r} carries its state beside the model, and that state's gradient would not "
                "reach the blocks before it. Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (HF: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}); "
                "checkpoint_sequential(..., use_reentrant=False)), or a per-merge rule (e.g. "
                "method='rescontroller')")

#: attribute by which a module the rule built names itself (:func:`mark_rule_module`)
_RULE_MODULE_ATTR = "_resctl_rule_module"


def mark_rule_module(module: nn.Module) -> nn.Module:
    """Mark a module the rule built (a chain module) with a reference to itself, so that :func:`running_module`
    finds it, or the copy that runs instead of it, behind a wrapper. Returns ``module``."""
    module.__dict__[_RULE_MODULE_ATTR] = module
    return module


def running_module(registered: nn.Module) -> nn.Module:
    """The module that runs for a rule's module as it is registered now: the module itself, or, where a wrapper
    replaced it, the one the wrapper routes to — PEFT's ``modules_to_save`` puts a ``ModulesToSaveWrapper`` (the
    frozen original and a trainable copy per adapter) in its place and passes attribute reads to the active
    copy (the original while adapters are disabled): the copy's mark (:func:`mark_rule_module`, copied with it)
    names the copy."""
    own = registered.__dict__.get(_RULE_MODULE_ATTR)
    return own if own is not None else getattr(registered, _RULE_MODULE_ATTR, registered)
