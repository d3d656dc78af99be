"""The per-call check that the merges a patched module was observed to run did run (every rule).

A patched module whose forward takes another line than the one the patch rewrote (``if self.ckpt and
self.training: x = x + checkpoint(f, x)`` / ``else: x = x + f(x)``, patched with the flag off and switched on
afterwards) runs that line's addition unpatched: a different network. Each patched module gets a
:class:`SiteTally`: its merge sites set their bit when they run (one integer ``|=`` per merge), a forward pre-hook
clears it, and a forward hook checks, per mode, that every site observed to run in each call of the module
(when the model was patched) ran in this call. The check is on the module that holds the lines, so a module that
is not called at all (layer drop in the loop that calls the blocks) is not refused, nor a loop expression that
runs fewer times than observed.

Under ``torch.compile`` the same steps run while dynamo traces (:func:`traced`), and nothing of them is in the
graph: which lines a graph runs is fixed when it is traced (a switched flag fails its guards and the module is
traced again), so a check at trace time holds for every run of the graph; a side effect in the graph would, inside
a checkpointed block, make dynamo give up the whole forward. A call whose trace a graph break splits (its start and
end in different traces) is not checked there.
"""
from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["SWITCHED_LINES", "SiteTally", "hook_tallies", "traced"]

#: The likely cause and the fix, in every message about observed merges that did not run.
SWITCHED_LINES = (
    "Likely cause: a flag switched which lines the model runs after it was patched (e.g. activation checkpointing "
    "or another config flag turned on after patch_residuals or after the callback patched it); set such flags "
    "before patching, or patch again: unpatch_residuals(model), then patch_residuals(...). A data-dependent skip of "
    "merges inside a module is not supported (layer drop that skips whole blocks is, with a per-merge rule such "
    "as method='rescontroller')")


class SiteTally:
    """Which merge sites of one patched module ran in its current call (a plain object, not a Module).

    ``ran``: the bits of the sites that ran; ``expected``: ``{"train": bits, "eval": bits}``, the sites observed
    to run in every call of the module in that mode; ``sites``: per bit, where the site is (for messages);
    ``key``: how a graph being traced names it (:func:`traced`)."""

    def __init__(self, path: str, expected: dict, sites: tuple) -> None:
        self.path = path
        self.expected = dict(expected)
        self.sites = tuple(sites)
        self.ran = 0
        self.key = next(_KEYS)
        self.traced_ran = 0      # the same, for the call being traced ...
        self.traced_in = None    # ... and the trace (a weak reference to dynamo's tracing context) it started in
        _TALLIES[self.key] = self

    def __getstate__(self):
        return {"path": self.path, "expected": self.expected, "sites": self.sites}

    def __setstate__(self, state):
        self.__init__(state["path"], state["expected"], state["sites"])

    def check(self, ran: int, training: bool, module_type: str) -> None:
        """Raise if a site expected in this mode is not among ``ran``."""
        missing = self.expected["train" if training else "eval"] & ~ran
        if missing:
            where = [site for bit, site in enumerate(self.sites) if missing >> bit & 1]
            mode = "training" if training else "eval"
            raise RuntimeError(
                f"the patched merge {where[0]} of {self.path or 'the model'} ({module_type}) did not run "
                f"in this {mode} forward, though it ran in every {mode} call when the model was patched: the module "
                f"ran other lines instead, and their additions are not patched (not merged by the rule). "
                f"{SWITCHED_LINES}")


_KEYS = itertools.count()
_TALLIES: "weakref.WeakValueDictionary[int, SiteTally]" = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _traced_step(key: int, step: str, arg: int, training: bool, module_type: str) -> bool:
    """One step of the tally ``key`` (``"start"``, ``"mark"`` the site of bit ``arg``, ``"end"`` of a call in
    ``training`` mode), run once while dynamo traces; its constant result is all the graph holds of it."""
    tally = _TALLIES[key]
    context = torch._guards.TracingContext.try_get()
    if step == "start":
        tally.traced_ran, tally.traced_in = 0, (None if context is None else weakref.ref(context))
        return True
    same_trace = tally.traced_in is not None and context is not None and tally.traced_in() is context
    if step == "mark":
        tally.traced_ran |= 1 << arg
    elif same_trace:  # "end", of a call traced whole
        tally.traced_in = None
        tally.check(tally.traced_ran, training, module_type)
    return True


def traced(tally: SiteTally, step: str, arg: int = 0, training: bool = True, module_type: str = "") -> None:
    """Run ``tally``'s ``step`` (see :func:`_traced_step`) at trace time: for code dynamo is tracing."""
    _traced_step(tally.key, step, arg, training, module_type)


class TallyStart:
    """Forward pre-hook of a patched module: a new call, no site has run yet."""

    def __init__(self, tally: SiteTally) -> None:
        self.tally = tally

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            traced(self.tally, "start")
        else:
            self.tally.ran = 0


class TallyEnd:
    """Forward hook of a patched module: every site expected in this mode ran in this call."""

    def __init__(self, tally: SiteTally) -> None:
        self.tally = tally

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            traced(self.tally, "end", training=module.training, module_type=type(module).__name__)
        else:
            self.tally.check(self.tally.ran, module.training, type(module).__name__)


def hook_tallies(tallies: dict, hooks: list) -> None:
    """Register each tally's pre-hook and hook on its module; the handles go to ``hooks``."""
    for owner, tally, _ in tallies.values():
        hooks.append(owner.register_forward_pre_hook(TallyStart(tally)))
        hooks.append(owner.register_forward_hook(TallyEnd(tally)))
