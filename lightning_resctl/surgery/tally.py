"""The per-call check that the merges a patched module was observed to run did run (every rule).

A patched module whose forward takes another line than the one the patch rewrote (``if self.ckpt and
self.training: x = x + checkpoint(f, x)`` / ``else: x = x + f(x)``, patched with the flag off and switched on
afterwards) runs that line's addition unpatched: a different network. Each patched module gets a
:class:`SiteTally`: its merge sites set their bit when they run (one integer ``|=`` per merge), a forward pre-hook
clears it, and a forward hook checks, per mode, that every site observed to run in each call of the module
(when the model was patched) ran in this call. The check is on the module that holds the lines, so a module that
is not called at all (layer drop in the loop that calls the blocks) is not refused, nor a loop expression that
runs fewer times than observed.
"""
from __future__ import annotations

from typing import Optional

from .chain_run import SWITCHED_LINES
from .events import Observation, site_key, source_line
from .phase import checking, counting
from .plan import Plan

__all__ = ["SiteTally", "site_tallies", "hook_tallies"]


class SiteTally:
    """Which merge sites of one patched module ran in its current call (a plain object, not a Module).

    ``ran``: the bits of the sites that ran; ``expected``: ``{"train": bits, "eval": bits}``, the sites observed
    to run in every call of the module in that mode; ``sites``: per bit, where the site is (for messages)."""

    def __init__(self, path: str, expected: dict, sites: tuple) -> None:
        self.path = path
        self.expected = dict(expected)
        self.sites = tuple(sites)
        self.ran = 0

    def __getstate__(self):
        return {"path": self.path, "expected": self.expected, "sites": self.sites}

    def __setstate__(self, state):
        self.__init__(state["path"], state["expected"], state["sites"])


class TallyStart:
    """Forward pre-hook of a patched module: a new call, no site has run yet."""

    def __init__(self, tally: SiteTally) -> None:
        self.tally = tally

    def __call__(self, module, args):
        if counting():
            self.tally.ran = 0


class TallyEnd:
    """Forward hook of a patched module: every site expected in this mode ran in this call."""

    def __init__(self, tally: SiteTally) -> None:
        self.tally = tally

    def __call__(self, module, args, output):
        if not checking():
            return
        tally = self.tally
        expected = tally.expected["train" if module.training else "eval"]
        missing = expected & ~tally.ran
        if missing:
            where = [site for bit, site in enumerate(tally.sites) if missing >> bit & 1]
            mode = "training" if module.training else "eval"
            raise RuntimeError(
                f"the patched merge {where[0]} of {tally.path or 'the model'} ({type(module).__name__}) did not run "
                f"in this {mode} forward, though it ran in every {mode} call when the model was patched: the module "
                f"ran other lines instead, and their additions are not patched (not merged by the rule). "
                f"{SWITCHED_LINES}")


def site_tallies(plan: Plan, obs: Observation, other: Optional[Observation]) -> dict:
    """One :class:`SiteTally` per patched module of ``plan`` (``id(owner) -> (owner, tally, {site key: bit})``)
    from the training (``obs``) and eval (``other``) observations: a site is expected in a mode when it ran at
    least as often as its module was called there."""
    eval_runs: dict = {}
    for ev in (other.events if other is not None else ()):
        if ev.owner is not None and ev.position is not None and ev.is_merge:
            key = site_key(ev)
            eval_runs[key] = eval_runs.get(key, 0) + 1
    out = {}
    for oid, (owner, _, attrs) in plan.methods.items():
        keys = [key for key in attrs if not plan.groups[key][0].is_partial]
        bits = {key: i for i, key in enumerate(keys)}
        expected = {"train": 0, "eval": 0}
        for key, bit in bits.items():
            if len(plan.groups[key]) >= (obs.call_counts.get(oid) or 1):
                expected["train"] |= 1 << bit
            if other is not None and eval_runs.get(key, 0) >= (other.call_counts.get(oid) or 1):
                expected["eval"] |= 1 << bit
        sites = tuple(f"{plan.groups[key][0].location}: {source_line(plan.groups[key][0])!r}" for key in keys)
        out[oid] = (owner, SiteTally(plan.paths[oid], expected, sites), bits)
    return out


def hook_tallies(tallies: dict, hooks: list) -> None:
    """Register each tally's pre-hook and hook on its module; the handles go to ``hooks``."""
    for owner, tally, _ in tallies.values():
        hooks.append(owner.register_forward_pre_hook(TallyStart(tally)))
        hooks.append(owner.register_forward_hook(TallyEnd(tally)))
