"""A chain's per-forward state (:class:`ChainRun`) and the bookkeeping of each of its merges, also when
activation checkpointing recomputes them (:class:`ChainEntry`) and under ``torch.compile``.

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
graph break before and after each merge's math (which ``fullgraph=True`` refuses, naming what to do instead) —
unless :func:`~.phase.checkpoint_block` checkpoints it, keeping the chains' state at the block
(:meth:`ChainRun.cursor`): the merges then trace the live run. Where the bookkeeping runs: :mod:`.phase`.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from .phase import checkpoint_frame, checkpoint_phase

__all__ = ["ChainRun", "ChainEntry", "ChainStart", "ChainEnd", "SWITCHED_LINES", "enter_chain", "leave_chain",
           "move_entry", "enter_chain_traced", "enter_chain_eagerly", "leave_chain_eagerly", "move_entry_eagerly",
           "storage_ptr"]

#: The likely cause and the fix, in every message about observed merges that did not run.
SWITCHED_LINES = (
    "Likely cause: a flag switched which lines the model runs after it was patched (e.g. activation checkpointing "
    "or another config flag turned on after patch_residuals or after the callback patched it); set such flags "
    "before patching, or patch again: unpatch_residuals(model), then patch_residuals(...). A data-dependent skip of "
    "merges inside a module is not supported (layer drop that skips whole blocks is, with a per-merge rule such "
    "as method='rescontroller')")

#: ``ChainRun.last`` after a merge traced outside any checkpointed region, whose position the graph does not read
TRACED = -2


class ChainEntry(NamedTuple):
    """What a stream tensor handed to the model's code inside a checkpointed region stands for: the chain state
    entering merge ``k`` (None: the chain starts there), the chain's leading shape, the mode and the tensor's
    version counter when it was recorded (a view of it is recognised by its storage and that version)."""

    state: Any
    k: int
    lead: Any
    training: bool
    version: int


class ChainRun:
    """Per-forward state of one chain, shared by the chain's sites (a plain object, not a Module).

    ``expected``: ``{"train": positions, "eval": positions}`` — the merges observed to run in each mode (a
    mode without an entry expects the training ones); ``sites``: per position, where its merge is
    ("module path: file:line", for error messages). ``members``: the chain's merge sites (each counts its own runs
    in a forward, ``site.calls_in_forward``, cleared by :meth:`reset`: the same value, no guard, in every block)."""

    def __init__(self, index: int, num_merges: int, expected: dict, sites: tuple = (), members: tuple = ()) -> None:
        self.index = index
        self.members: list = list(members)
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

    def reset(self, owner_traced: bool = False) -> None:
        self.state: Any = None
        self.last = -1            # position of the last merge run in this forward (TRACED: a traced merge's)
        self.done = False         # the chain produced its output in this forward
        self.last_site: Optional[str] = None
        self.lead: Any = None     # the chain's leading shape (the stream's, features last)
        self.owner_traced = owner_traced  # the owner's forward is traced with the merges (ChainStart says)
        for site in getattr(self, "members", ()):
            site.calls_in_forward = 0

    def cursor(self, sites: tuple) -> tuple:
        """Where this forward stands (what :meth:`reset` clears, and the run counts of ``sites``, some of
        :attr:`members`), for :meth:`restore`."""
        return (self.state, self.last, self.done, self.last_site, self.lead, self.owner_traced,
                tuple(site.calls_in_forward for site in sites))

    def restore(self, cursor: tuple, sites: tuple) -> None:
        """Stand where :meth:`cursor` noted (``phase.checkpoint_block``'s recomputation of a block: ``sites``, its
        merges of this chain)."""
        self.state, self.last, self.done, self.last_site, self.lead, self.owner_traced, calls = cursor
        for site, n in zip(sites, calls):
            site.__dict__["calls_in_forward"] = n  # (where the int lives: Module.__setattr__ costs µs per site)

    def first_expected(self, training: bool) -> int:
        """The position the chain starts at in this mode (``num_merges``: none runs)."""
        return self._next["train" if training else "eval"][-1]

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
        run = ChainRun(self.index, self.num_merges, self.expected, self.sites)
        memo[id(self)] = run
        run.members = [copy.deepcopy(site, memo) for site in self.members]
        return run

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("index", "num_merges", "expected", "sites", "members")}

    def __setstate__(self, state):
        self.__init__(state["index"], state["num_merges"], state["expected"], state.get("sites", ()),
                      state.get("members", ()))


class ChainStart:
    """Forward pre-hook of a chain's owner: a new forward starts a new chain run, on the chain module that runs, and
    notes whether the owner's forward is traced (False with blocks compiled one by one: ``ChainRule.start_apart``)."""

    def __init__(self, run: ChainRun) -> None:
        self.run = run

    def __call__(self, module, args):
        self.run.reset(owner_traced=torch.compiler.is_compiling())
        for site in self.run.members:  # the chain module that runs now (e.g. PEFT's copy of it while adapters are on)
            site.bind_positions()


class ChainEnd:
    """Forward hook (``always_call``) of a chain's owner: the run must have produced the chain's output, or
    run no merge in a mode where none was observed, and each merge site must have run as often as observed (what
    a traced merge does not check at the merge itself, see :func:`enter_chain_traced`)."""

    def __init__(self, run: ChainRun) -> None:
        self.run = run

    def __call__(self, module, args, output):
        run, mode = self.run, ("train" if module.training else "eval")
        ran = sum(s.calls_in_forward for s in run.members)
        where, last, name, done = run.last_site, run.last, type(module).__name__, run.done
        expected = run.expected.get(mode, run.expected.get("train", ()))
        observed = {site: len(site.mode_positions.get(mode, site.positions)) for site in run.members}
        wrong = "; ".join(f"{site.path or 'root'}: {site.location} ({site.source_line!r}) ran {site.calls_in_forward} "
                          f"times, observed {n}" for site, n in observed.items() if site.calls_in_forward != n)
        run.reset()
        mode, fix = ("training" if module.training else "eval"), f"the same merges in every forward. {SWITCHED_LINES}"
        if output is None:
            return
        if ran == 0 and expected:
            raise RuntimeError(
                f"residual chain {run.index} ran none of its {len(expected)} merges observed in {mode} mode (the "
                f"first: {run.site(expected[0])}) in this forward of {name}: the chain's output was never produced, "
                f"and the model's additions did not go through the rule. A stream-carrying rule needs {fix}")
        if ran > 0 and not done:
            after = f"merge {last} (site {where})" if last >= 0 else f"{ran} merges"
            raise RuntimeError(
                f"residual chain {run.index} stopped after {after} of {run.num_merges}: the merges that were observed "
                f"to follow it in {mode} mode did not run in this forward, so the chain's output was never produced. "
                f"A stream-carrying rule needs {fix}")
        if wrong:
            raise RuntimeError(f"residual chain {run.index} produced its output, but its merges did not run as "
                               f"observed in {mode} mode: {wrong}. A stream-carrying rule needs {fix}")


def enter_chain(site: nn.Module, run: ChainRun, stream: torch.Tensor, origin: torch.Tensor,
                phase: Optional[str]) -> tuple:
    """The bookkeeping entering one merge of a chain, in eager code: ``(phase, state, at, lead, training)``; ``at``:
    the merge's :class:`~lightning_resctl.rules.ChainPosition`; ``phase``: the checkpoint phase (``"now"``: read it
    here, see :func:`checkpoint_phase`). Recomputing a checkpointed region, the state comes from the entry the
    forward left on ``origin`` and the live run is not touched; otherwise the merge's position is checked against
    the live run, and inside a checkpointed region the state entering it is remembered for the recomputation."""
    site._mark_ran()  # here, not in the compiled forward: read there, the tally's int would be guarded per merge
    if phase == "now":
        phase = checkpoint_phase()
    if phase == "recompute":
        entry = site._replay_entry(run, origin)
        return phase, entry.state, site.position_module(entry.k, entry.training), entry.lead, entry.training
    if not torch.is_grad_enabled() and site.training:
        site._refuse_reentrant(stream, run)
    training = site.training
    k = site._position_now(run)
    run.check_order(k, training, f"{site.location}: {site.source_line!r}")
    state, lead = run.state, run.lead
    if phase == "region":
        entry = ChainEntry(state, k, lead, training, origin._version)
        run.entries[origin] = entry
        frame = checkpoint_frame()
        if frame is not None:  # the region's first merge of this chain: kept as long as the region
            frame.__dict__.setdefault("_resctl_chain_entries", {}).setdefault(id(run), entry)
    return phase, state, site.position_module(k, training), lead, training


def enter_chain_traced(site: nn.Module, run: ChainRun, stream: torch.Tensor) -> tuple:
    """:func:`enter_chain` of a merge dynamo traces outside checkpointed regions (a block compiled on its own, the
    whole model), reading no per-merge Python value (a guard per block): the site's run count selects its position;
    a merge out of order raises here or, one that did not run as observed, at the owner's end (:class:`ChainEnd`)."""
    site._mark_ran()
    if not torch.is_grad_enabled() and site.training:
        site._refuse_reentrant(stream, run)
    training = site.training
    table = site.position_table(training)
    n = site.calls_in_forward
    if n >= len(table):
        site._position_now(run)  # raises: ran more often than observed
    at = table[n]
    site.calls_in_forward = n + 1
    state = run.state
    if run.done or (state is None) != at.first:
        what = "after the chain's output" if run.done else "before its first merge" if state is None else "after others"
        raise RuntimeError(f"the merge at {site.location} ({site.path or 'root'}: {site.source_line!r}) of residual "
                           f"chain {site.chain} ran {what} in this forward: a stream-carrying rule needs each merge "
                           f"once per forward, in the order observed when the model was patched. {SWITCHED_LINES}")
    return None, state, at, run.lead, training


def leave_chain(site: nn.Module, run: ChainRun, phase: Optional[str], at: nn.Module, state: Any, lead: Any,
                training: bool, h: torch.Tensor) -> None:
    """The bookkeeping after merge ``at`` of a chain returned ``h`` and the chain's ``state`` read next (by merge
    ``at.next_k``). The live run moves on, except in a recomputation, where the next merge of the recomputed region
    finds that state by the tensor ``h`` its stream operand is. ``phase`` as in :func:`enter_chain`; None: traced
    outside checkpointed regions (:func:`enter_chain_traced`)."""
    if phase == "now":
        phase = checkpoint_phase()
    if phase == "recompute":
        if not at.output:
            run.entries[h] = ChainEntry(state, at.next_k, lead, training, h._version)
        return
    run.lead = lead
    if phase is None and torch.compiler.is_compiling():
        run.last = TRACED  # (reading the position would be a guard per merge; an eager merge next checks less)
    else:
        run.last = at.k
        run.last_site = site.location
    if at.output:
        run.state = None  # nothing kept alive after the chain's output
        run.done = True
    else:
        run.state = state


def move_entry(run: ChainRun, merged: torch.Tensor, out: torch.Tensor) -> None:
    """An in-place merge wrote ``merged`` into ``out``: ``out`` now stands for what ``merged`` did."""
    entry = run.entries.get(merged)
    if entry is not None:
        run.entries[out] = entry._replace(version=out._version)


_GRAPH_BREAK = (
    "a chain rule's merge (lightning_resctl) inside a block compiled on its own and checkpointed from outside "
    "(torch.utils.checkpoint around the compiled block) keeps the chain's state for the recomputation in eager "
    "code, at a graph break, which torch.compile(fullgraph=True) refuses. Compile the block without fullgraph, or "
    "checkpoint inside the compiled block (checkpoint_wrapper before torch.compile, with "
    "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint=True), or compile the whole model")

def _enter_chain_at_a_graph_break(site: nn.Module, run: ChainRun, stream: torch.Tensor, origin: torch.Tensor,
                                  phase: Optional[str]) -> tuple:
    """:func:`enter_chain` in a block compiled on its own inside a checkpointed region, at its graph break; names a
    recompile limit below the merges of a rule that compiles a graph per position (``shares_graphs`` False)."""
    out = enter_chain(site, run, stream, origin, phase)
    limit = torch._dynamo.config.recompile_limit
    if not out[2].shares_graphs and run.num_merges >= limit and not run.__dict__.get("_warned_recompile_limit"):
        run.__dict__["_warned_recompile_limit"] = True
        warnings.warn(
            f"residual chain {run.index} has {run.num_merges} merges, and each compiles a graph of its own in blocks "
            f"compiled on their own (method={site.method!r} runs its merges by their positions), but "
            f"torch._dynamo.config.recompile_limit is {limit}: dynamo runs the merges past it eagerly (the same "
            f"results, slower). Raise it before the first step: torch._dynamo.config.recompile_limit = "
            f"{2 * run.num_merges}", stacklevel=2)
    return out


enter_chain_eagerly = torch.compiler.disable(_enter_chain_at_a_graph_break, reason=_GRAPH_BREAK)
leave_chain_eagerly = torch.compiler.disable(leave_chain, reason=_GRAPH_BREAK)
move_entry_eagerly = torch.compiler.disable(move_entry, reason=_GRAPH_BREAK)


def storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None
