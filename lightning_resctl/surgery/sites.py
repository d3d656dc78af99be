"""MergeSite: the runtime object a patched residual addition calls; ChainRun: one chain's per-forward state.

A patched expression ``stream + update`` (or ``update + stream``, ``torch.add``, ``+=``, ``add_``) becomes
``self.<site>(stream, update)``. The site asks its merge rule (:mod:`lightning_resctl.rules`):

* a per-merge rule computes ``rule.merge(module, stream, update)``;
* a chain rule keeps the chain's state (e.g. MGR's n streams) in a :class:`ChainRun` beside the model;
  what the site returns — what the model's own code sees between merges — always has the stream's shape.

Chain bookkeeping (why a forward can never continue another forward's chain):

* a site's chain position is a property of the site (``positions``; an expression run several times per
  forward, e.g. in a ``for`` loop, has one position per run, taken in order);
* the chain's state is reset when the forward of the chain's *owner* (the innermost module whose single
  call encloses the whole chain) starts, and cleared when it ends, also after an exception;
* merges that do not run in the current mode (``if self.training: x = x + f(x)``) were seen when the patch
  observed the model in that mode: the previous merge then reads for the next merge that does run, and the
  skipped one leaves the state as it is; the output is produced by the last merge that runs;
* anything else (a merge that runs twice, out of order, after an expected one was skipped, a chain that stops
  early, or a forward of the owner that runs none of the merges observed in its mode) raises a RuntimeError
  naming the chain and the site at that forward — never a silently different network.

Activation checkpointing (non-reentrant ``torch.utils.checkpoint`` and what builds on it: HF
``gradient_checkpointing_enable()``, ``checkpoint_sequential``, ``checkpoint_wrapper``): a merge that runs
inside a checkpointed region remembers, for the stream tensor it received, the chain state and position it
stood for (:class:`ChainEntry`, in a weak mapping that lives as long as that tensor: the checkpoint keeps
exactly its region's inputs alive). When backward recomputes the region, its merges *replay* from those
entries (and from the ones the replay's own merges leave on the tensors they return) instead of touching the
live :class:`ChainRun`: the recomputation saves the same tensors as the forward, and the gradients flow
through the forward's own graph. Reentrant checkpointing (``use_reentrant=True``) runs the region under
``no_grad`` and would cut the chain state's gradient: it is refused at the first forward that trains through
it, naming ``use_reentrant=False``.

Under ``torch.compile``: a graph traced outside any checkpointed region (the whole model, ``fullgraph=True``, a
checkpoint dynamo traces inside the graph) carries the live run's bookkeeping in the graph and remembers nothing
per tensor. A block compiled on its own and checkpointed from outside runs its merges' bookkeeping eagerly, at a
graph break before and after each merge's math (which ``fullgraph=True`` refuses, naming what to do instead).
"""
from __future__ import annotations

import json
import sys
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..rules.base import branches_sum

__all__ = ["MergeSite", "ChainRun", "ChainEntry", "ParallelRun", "ParallelPart", "mark_rule_module", "running_module",
           "SWITCHED_LINES"]

#: The likely cause and the fix, in every message about observed merges that did not run.
SWITCHED_LINES = (
    "Likely cause: a flag switched which lines the model runs after it was patched (e.g. activation checkpointing "
    "or another config flag turned on after patch_residuals or after the callback patched it); set such flags "
    "before patching, or patch again: unpatch_residuals(model), then patch_residuals(...). A data-dependent skip of "
    "merges inside a module is not supported (layer drop that skips whole blocks is, with a per-merge rule such "
    "as method='rescontroller')")


class ChainEntry(NamedTuple):
    """What a stream tensor handed to the model's code inside a checkpointed region stands for: the chain state
    entering merge ``k`` (None: the chain starts there), the chain's leading shape, the mode and the tensor's
    version counter when it was recorded (a view of it is recognised by its storage and that version)."""

    state: Any
    k: int
    lead: Any
    training: bool
    version: int


def _checkpoint_phase() -> Optional[str]:
    """``"recompute"`` while backward recomputes a non-reentrant checkpointed region (its recomputation hooks are
    on top, or a backward pass runs), ``"region"`` while other saved-tensor hooks decide what is kept (a
    checkpointed region's forward, offloading; not the observing ones marked ``_mgr_transparent``), else None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", ""):
        return "recompute"
    if torch._C._current_graph_task_id() != -1:
        return "recompute"
    if hooks is not None and not getattr(hooks[0], "_mgr_transparent", False):
        return "region"
    return None


def _checkpoint_frame() -> Any:
    """The checkpointed region (``torch.utils.checkpoint``'s frame object) whose saved-tensor hooks are on top,
    found through the hook's closure, or None: the region's first chain state is also kept on it, so a
    recomputation finds it when the region's input comes back as a new tensor (offloading hooks around the
    checkpoint, e.g. HF's ``offload=True``)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = getattr(hooks[0], "__wrapped__", hooks[0]) if hooks is not None else None
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, weakref.ref):
            value = value()
        if type(value).__name__ == "_CheckpointFrame":
            return value
    return None


def _inside_reentrant_checkpoint() -> bool:
    """True when ``torch.utils.checkpoint``'s reentrant ``CheckpointFunction`` is on the call stack."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "forward" and f.f_code.co_filename.replace("\\", "/").endswith(
                "torch/utils/checkpoint.py"):
            return True
        f = f.f_back
    return False


class ChainRun:
    """Per-forward state of one chain, shared by the chain's sites (a plain object, not a Module).

    ``expected``: ``{"train": positions, "eval": positions}`` — the merges observed to run in each mode (a
    mode without an entry expects the training ones); ``sites``: per position, where its merge is
    ("module path: file:line", for error messages)."""

    def __init__(self, index: int, num_merges: int, expected: dict, sites: tuple = ()) -> None:
        self.index = index
        self.num_merges = num_merges
        self.expected = {mode: tuple(sorted(p)) for mode, p in expected.items()}
        self.sites = tuple(sites)
        #: stream tensor -> ChainEntry, for merges that run inside checkpointed regions (weak: an entry lives as
        #: long as its tensor; kept across forwards, since backward recomputes a region after its forward ended)
        self.entries = WeakTensorKeyDictionary()
        self._next = {}
        for mode in ("train", "eval"):
            seq = self.expected.get(mode, self.expected.get("train", ()))
            self._next[mode] = {k: (seq[i + 1] if i + 1 < len(seq) else num_merges) for i, k in enumerate(seq)}
            self._next[mode][-1] = seq[0] if seq else num_merges   # before any merge: the first one expected
        self.reset()

    def reset(self) -> None:
        self.state: Any = None
        self.last = -1            # position of the last merge run in this forward
        self.done = False         # the chain produced its output in this forward
        self.last_site: Optional[str] = None
        self.calls: dict = {}     # id(site) -> runs in this forward

    def next_after(self, k: int, training: bool) -> int:
        """The next position expected to run after ``k`` in this mode (``num_merges``: none, output)."""
        nxt = self._next["train" if training else "eval"].get(k)
        if nxt is None:
            raise RuntimeError(
                f"merge {k} of residual chain {self.index} ran in {'training' if training else 'eval'} mode, where it "
                "was not observed when the model was patched: a stream-carrying rule needs the same merges in every "
                "forward of one mode")
        return nxt

    def check_order(self, k: int, training: bool, where: str) -> None:
        """Raise unless merge ``k`` (at ``where``) is the merge expected next in this forward of this mode:
        never twice, never out of order, none of the expected ones skipped."""
        mode = "training" if training else "eval"
        if self.done or k <= self.last:
            raise RuntimeError(
                f"merge {k} of residual chain {self.index} (site {where}) ran after merge {self.last}"
                f"{' and the chain output' if self.done else ''} in the same forward: a stream-carrying rule needs "
                "each merge once per forward, in order")
        nxt = self._next["train" if training else "eval"]
        if k not in nxt:
            self.next_after(k, training)  # raises: not observed in this mode
        want = nxt.get(self.last, k)
        if k != want:
            raise RuntimeError(
                f"merge {k} of residual chain {self.index} (site {where}) ran where merge {want} "
                f"({self.site(want)}) was expected next in {mode} mode: the merges between did not run in this "
                f"forward. A stream-carrying rule needs the same merges in every forward of one mode. {SWITCHED_LINES}")

    def site(self, k: int) -> str:
        """Where merge ``k`` is (``"module path: file:line"``), for messages."""
        return self.sites[k] if 0 <= k < len(self.sites) else f"position {k}"

    def __deepcopy__(self, memo):
        return ChainRun(self.index, self.num_merges, self.expected, self.sites)

    def __getstate__(self):
        return {"index": self.index, "num_merges": self.num_merges, "expected": self.expected, "sites": self.sites}

    def __setstate__(self, state):
        self.__init__(state["index"], state["num_merges"], state["expected"], state.get("sites", ()))


class ChainStart:
    """Forward pre-hook of a chain's owner: a new forward starts a new chain run."""

    def __init__(self, run: ChainRun) -> None:
        self.run = run

    def __call__(self, module, args):
        self.run.reset()


class ChainEnd:
    """Forward hook (``always_call``) of a chain's owner: the run must have produced the chain's output, or
    run no merge in a mode where none was observed."""

    def __init__(self, run: ChainRun) -> None:
        self.run = run

    def __call__(self, module, args, output):
        run = self.run
        unfinished = run.last >= 0 and not run.done
        mode = "train" if module.training else "eval"
        expected = run.expected.get(mode, run.expected.get("train", ()))
        none = run.last < 0 and len(expected) > 0
        where = run.last_site
        last = run.last
        run.reset()
        if none and output is not None:
            raise RuntimeError(
                f"residual chain {run.index} ran none of its {len(expected)} merges observed in "
                f"{'training' if module.training else 'eval'} mode (the first: {run.site(expected[0])}) in this "
                f"forward of {type(module).__name__}: the chain's output was never produced, and the model's "
                "additions did not go through the rule. A stream-carrying rule needs the same merges in every "
                f"forward of one mode. {SWITCHED_LINES}")
        if unfinished and output is not None:
            raise RuntimeError(
                f"residual chain {run.index} stopped after merge {last} (site {where}) of {run.num_merges}: the "
                f"merges that were observed to follow it in {'training' if module.training else 'eval'} mode did "
                "not run in this forward, so the chain's output was never produced. A stream-carrying rule needs "
                f"the same merges in every forward of one mode. {SWITCHED_LINES}")


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

    def __init__(self, rule: Any, *, path: str = "", location: str = "", source_line: str = "",
                 stream_shape: tuple = (), chain: int = 0, positions: tuple = (0,), dim: int = -1,
                 inplace: Optional[str] = None, merge: Optional[nn.Module] = None,
                 chain_slot: Optional[tuple] = None, run: Optional[ChainRun] = None,
                 mode_positions: Optional[dict] = None, parallel: Optional[ParallelRun] = None,
                 stream_first: bool = True, branch: str = "", function: str = "", called_at: str = "",
                 tally: Optional[tuple] = None):
        """``rule`` the configured merge rule; ``path``, ``location``, ``source_line`` where the addition is;
        ``stream_shape``, ``chain``, ``positions`` (one per run of the expression in a forward), ``dim``, ``inplace``
        (the operand an in-place addition writes), ``stream_first`` (the model writes ``stream + update``; False:
        ``update + stream``) as in the class docstring. ``merge``: the per-merge rule's module; ``chain_slot`` and
        ``run`` (required by chain rules): ``(module, attribute)`` where the chain's module is registered (marked
        by :func:`mark_rule_module`), and the chain's :class:`ChainRun`; ``mode_positions``: chain rules,
        ``{"train": positions, "eval": the positions that run in eval}``; ``parallel``: the :class:`ParallelRun`
        when the site is the last addition of a parallel block. ``branch`` (e.g. "attn", "mlp"), ``function`` (the
        free function holding the addition, "" in the module's own method) and ``called_at`` (the call in the
        method reaching it) describe the site. ``tally``: ``(SiteTally, bit)``, where the site marks that it ran in
        its module's current call (:mod:`.tally`)."""
        super().__init__()
        if inplace not in (None, "stream", "update"):
            raise ValueError(f"inplace must be None, 'stream' or 'update', got {inplace!r}")
        self.rule = rule
        self.method = rule.name
        self.path = path
        self.location = location
        self.source_line = source_line
        self.stream_shape = tuple(stream_shape)
        self.chain = chain
        self.positions = tuple(positions)
        self.position = self.positions[0]
        self.mode_positions: dict = dict(mode_positions or {})
        self.current_position = self.position
        self.dim = dim
        self.inplace = inplace
        self.stream_first = bool(stream_first)
        self.branch = branch
        self.function = function
        self.called_at = called_at
        self.observer: Optional[Callable] = None
        self.skip_update = False
        self.merge = merge
        # The chain module is registered once, higher up in the model; keep it out of this module's
        # children so its parameters have a single name, and read it from there at each call (what runs there).
        self.__dict__["_chain_slot"] = chain_slot
        self.__dict__["_run"] = run
        self.__dict__["_parallel"] = parallel   # a ParallelRun when this is the last addition of a parallel block
        self.__dict__["_tally"], self._tally_bit = tally if tally is not None else (None, 0)
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
        return {"method": self.method, "options": _plain(self.rule.options()), "path": self.path,
                "location": self.location, "source_line": self.source_line, "positions": list(self.positions)}

    def get_extra_state(self) -> torch.Tensor:
        """What travels with ``state_dict``: :meth:`record` as UTF-8 JSON in a uint8 tensor (state dicts stay
        tensor-only, loadable with ``weights_only=True``). An unpatched model has no such key, so a patched
        checkpoint never loads silently into it (strict loading fails)."""
        data = json.dumps(self.record(), sort_keys=True).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()

    def set_extra_state(self, state: Any) -> None:
        state = decode_record(state)
        if not isinstance(state, dict) or "method" not in state:
            raise RuntimeError(f"state_dict entry for the merge site at {self.location} is not a lightning_resctl "
                               f"site record: {state!r}")
        theirs_options = state.get("options")
        if isinstance(theirs_options, dict):  # the backend is recorded, but not compared (see execution_options)
            theirs_options = self.rule.math_options(theirs_options)
        mine = (self.method, _plain(self.rule.math_options()))
        theirs = (state.get("method"), theirs_options)
        if mine != theirs:
            raise RuntimeError(
                f"checkpoint was saved with method={theirs[0]!r} options={theirs[1]} at the merge {state.get('path')!r} "
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
        if tally is not None and counting():
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
        eagerly = _bookkeeping_in_eager_code()
        if run is not None and eagerly is not None:  # (nothing is remembered in a graph traced outside regions)
            (_move_entry_eagerly if eagerly else _move_entry)(run, merged, out)
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

    def _position_now(self, run: ChainRun) -> int:
        n = run.calls.get(id(self), 0)
        positions = self.mode_positions.get("train" if self.training else "eval", self.positions)
        if n >= len(positions):
            raise RuntimeError(
                f"the merge at {self.location} ({self.path or 'root'}: {self.source_line!r}) ran {n + 1} times in one "
                f"forward of residual chain {self.chain}, but {len(positions)} were observed in "
                f"{'training' if self.training else 'eval'} mode when the model was patched: a stream-carrying rule "
                "needs the same merges in every forward of one mode")
        run.calls[id(self)] = n + 1
        return positions[n]

    def _forward_chain(self, stream: torch.Tensor, update: torch.Tensor,
                       origin: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One merge of the chain; ``origin``: the stream tensor as the model passed it (``stream`` may be a copy
        of it for an in-place merge), by which a checkpointed region's recomputation finds its chain state."""
        rule = self.rule
        chain = self.chain_module
        run = self._run
        origin = stream if origin is None else origin
        eagerly = _bookkeeping_in_eager_code()
        if eagerly is None:  # traced into a graph compiled outside any checkpointed region: the live run
            phase, state, k, lead, training = _enter_chain(self, run, stream, origin, None)
        else:
            phase, state, k, lead, training = (_enter_chain_eagerly if eagerly else _enter_chain)(
                self, run, stream, origin, "now")
        d = self.dim
        moved = d != -1 and d != stream.dim() - 1
        s = stream.movedim(d, -1) if moved else stream
        u = update.movedim(d, -1) if moved else update
        if state is None:
            state = rule.start(chain, s)
            lead = s.shape[:-1]
        self.current_position = k
        if self.observer is not None and phase != "recompute":  # (no branch on the phase in the math's graph)
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
        next_k = run.next_after(k, training)
        if self.skip_update:
            state, h = rule.skip(chain, k, state, next_k)
        else:
            state, h = rule.step(chain, k, state, u, next_k)
        if h.shape[:-1] != s.shape[:-1]:
            h = h.reshape(s.shape)
        if h.dtype != out_dtype:
            h = h.to(out_dtype)
        h = h.movedim(-1, d) if moved else h
        after = ChainEntry(state, next_k, lead, training, None)  # the version: taken by a recomputation
        if eagerly:  # the phase read again at the graph break: one graph of the math serves both phases
            _leave_chain_eagerly(self, run, "now", k, after, h)
        else:
            _leave_chain(self, run, phase, k, after, h)
        return h

    def _replay_entry(self, run: ChainRun, stream: torch.Tensor) -> ChainEntry:
        """The chain state the forward had entering this merge, for a checkpointed region's recomputation: the
        entry of ``stream`` (or of a live tensor of the same storage and version, when the model re-viewed it)."""
        entry = run.entries.get(stream)
        if entry is None:
            ptr = _storage_ptr(stream)
            for key, candidate in list(run.entries.items()):
                if ptr is not None and _storage_ptr(key) == ptr and key._version == candidate.version == stream._version:
                    entry = candidate
                    break
        if entry is None:  # the region's input came back as another tensor (offloaded): its region's first merge
            frame = _checkpoint_frame()
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
        if (stream.requires_grad or state_grad) and _inside_reentrant_checkpoint():
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


def _enter_chain(site: MergeSite, run: ChainRun, stream: torch.Tensor, origin: torch.Tensor,
                 phase: Optional[str]) -> tuple:
    """The bookkeeping entering one merge of a chain: ``(phase, state, k, lead, training)``; ``phase``: the
    checkpoint phase (``"now"``: read it here, see :func:`_checkpoint_phase`). Recomputing a checkpointed
    region, the state comes from the entry the forward left on ``origin`` and the live run is not touched;
    otherwise the merge's position is checked against the live run, and inside a checkpointed region the
    state entering it is remembered for the recomputation."""
    site._mark_ran()  # here, not in the compiled forward: read there, the tally's int would be guarded per merge
    if phase == "now":
        phase = _checkpoint_phase()
    if phase == "recompute":
        entry = site._replay_entry(run, origin)
        return phase, entry.state, entry.k, entry.lead, entry.training
    if not torch.is_grad_enabled() and site.training:
        site._refuse_reentrant(stream, run)
    training = site.training
    k = site._position_now(run)
    run.check_order(k, training, f"{site.location}: {site.source_line!r}")
    state, lead = run.state, getattr(run, "lead", None)
    if phase == "region":
        entry = ChainEntry(state, k, lead, training, origin._version)
        run.entries[origin] = entry
        frame = _checkpoint_frame()
        if frame is not None:  # the region's first merge of this chain: kept as long as the region
            frame.__dict__.setdefault("_resctl_chain_entries", {}).setdefault(id(run), entry)
    return phase, state, k, lead, training


def _leave_chain(site: MergeSite, run: ChainRun, phase: Optional[str], k: int, after: ChainEntry,
                 h: torch.Tensor) -> None:
    """The bookkeeping after merge ``k`` of a chain returned ``h``; ``after``: the chain's state and the position
    of the merge that reads it next. The live run moves on, except in a recomputation, where the next merge of
    the recomputed region finds that state by the tensor ``h`` its stream operand is. ``phase`` as in
    :func:`_enter_chain`."""
    if phase == "now":
        phase = _checkpoint_phase()
    if phase == "recompute":
        if after.k < run.num_merges:
            run.entries[h] = after._replace(version=h._version)
        return
    run.lead = after.lead
    run.last = k
    run.last_site = site.location
    if after.k >= run.num_merges:
        run.state = None  # nothing kept alive after the chain's output
        run.done = True
    else:
        run.state = after.state


def _move_entry(run: ChainRun, merged: torch.Tensor, out: torch.Tensor) -> None:
    """An in-place merge wrote ``merged`` into ``out``: ``out`` now stands for what ``merged`` did."""
    entry = run.entries.get(merged)
    if entry is not None:
        run.entries[out] = entry._replace(version=out._version)


@torch.compiler.assume_constant_result
def _traced_in_higher_order_op() -> bool:
    """True while dynamo traces the body of a higher-order op (``torch.utils.checkpoint`` inside a compiled model),
    where it refuses side effects; a constant of the trace (no guard)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx().output.current_tracer.parent is not None
    except (ImportError, AttributeError):  # another torch: count as outside (the side effect is then traced)
        return False


def counting() -> bool:
    """Whether a module's merge tally (:mod:`.tally`) is kept in this call: always, except in a checkpointed region traced into a compiled
    model (a higher-order op's body), where a side effect would make dynamo give up the whole frame (run it
    eagerly); the module's hooks and its merges are then traced in the same body, so none of them counts."""
    return not torch.compiler.is_compiling() or not _traced_in_higher_order_op()


@torch.compiler.assume_constant_result
def _phase_when_traced() -> Optional[str]:
    """The checkpoint phase while dynamo traces a merge (baked into the graph as a constant)."""
    return _checkpoint_phase()


def _bookkeeping_in_eager_code() -> Optional[bool]:
    """Where a chain merge's bookkeeping runs. False: eager code, the merge itself runs eagerly. True: a graph
    dynamo traces inside a checkpointed region (a block compiled on its own under ``torch.utils.checkpoint``):
    the bookkeeping (saved-tensor hooks, tensor-keyed weak mappings: nothing dynamo traces) runs eagerly at a
    graph break before and after the merge's math, so that it reads the checkpoint phase when the graph runs and
    the math's graph is the same in the forward and in its recomputation. None: a graph traced outside any
    region (whole-model compile, ``fullgraph=True`` without checkpointing around the compiled code): the
    bookkeeping of the live run is traced into the graph."""
    if not torch.compiler.is_compiling():
        return False
    return None if _phase_when_traced() is None else True


_GRAPH_BREAK = (
    "a chain rule's merge (lightning_resctl) inside a block compiled on its own and checkpointed from outside "
    "(torch.utils.checkpoint around the compiled block) keeps the chain's state for the recomputation in eager "
    "code, at a graph break, which torch.compile(fullgraph=True) refuses. Compile the block without fullgraph, or "
    "checkpoint inside the compiled block (checkpoint_wrapper before torch.compile, with "
    "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint=True), or compile the whole model")
_enter_chain_eagerly = torch.compiler.disable(_enter_chain, reason=_GRAPH_BREAK)
_leave_chain_eagerly = torch.compiler.disable(_leave_chain, reason=_GRAPH_BREAK)
_move_entry_eagerly = torch.compiler.disable(_move_entry, reason=_GRAPH_BREAK)


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None




def decode_record(state: Any) -> Any:
    """A site record from its state_dict form (uint8 JSON tensor); anything else is returned as is."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        try:
            return json.loads(bytes(state.cpu().tolist()).decode())
        except ValueError:
            return state
    return state


def _plain(value: Any) -> Any:
    """Options as plain Python values (comparable, and loadable with ``weights_only=True``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)
