"""The lines that ran in one mode only (``if self.training: x = x + checkpoint(f, x) else: x = x + f(x)``): each
merge of an eval-only line calls the site of the training-mode merge of the same branch, or is refused, naming
why (part of :mod:`.plan`).
"""
from __future__ import annotations

from .events import AddEvent, Observation, site_key, source_line

__all__ = ["renumber", "match_other_mode", "check_both_lines", "line_key"]


def renumber(obs: Observation, offset: int) -> None:
    """Shift the event indices of ``obs`` (and its events' references to each other) by ``offset``."""
    for ev in obs.events:
        ev.index += offset
        for name in ("parallel_of", "joined_by"):
            if getattr(ev, name) is not None:
                setattr(ev, name, getattr(ev, name) + offset)


def _mode_line(ev: AddEvent, path_of) -> str:
    return f"the merge at {ev.location} ({source_line(ev)!r}, in {path_of(ev)!r})"


def match_other_mode(extras: list, primary: list, rule, path_of) -> list:
    """Give each merge of a line that ran only in eval mode (``extras``) the site of the training-mode merge
    of the same module whose branch ran the same learned modules (``else: x = x + f(x)`` beside
    ``x = x + checkpoint(f, x)``): it sets ``ev.same_site``, so both lines call one site, which is that merge in
    either mode (a chain rule's position, a per-merge rule's parameters). Returns the extras without such a
    merge, by index (a per-merge rule gives them sites of their own).

    Raises ValueError for what would give another network than the one written: a chain rule's eval-only
    merge without a training merge of its branch (the chain has no position for it), one line matching
    the merges of several training lines, a merge written differently in the two modes (``x = x + f(x)`` /
    ``x += f(x)``), or a parallel block written as several additions in one mode only."""
    free = [ev for ev in primary if not ev.is_partial and ev.parallel_of is None]
    taken: set = set()
    target: dict = {}   # site key of an eval-only line -> site key of the training line it calls
    first: dict = {}    # site key of an eval-only line -> the training merge it first matched
    unmatched = []
    for ev in extras:
        if ev.is_partial or ev.parallel_of is not None:
            raise ValueError(
                f"{_mode_line(ev, path_of)} is part of a parallel block written as several additions that runs "
                "only in eval mode: such a block is patched only when it runs in training mode; exclude the "
                f"module (exclude=[{path_of(ev)!r}]) or write the block the same way in both modes")
        match = next((a for a in free if id(a) not in taken and _same_branch(a, ev)), None)
        key = site_key(ev)
        if match is None:
            unmatched.append(ev)
            continue
        taken.add(id(match))
        if target.setdefault(key, site_key(match)) != site_key(match):
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode and merges the branches of several training-mode "
                f"lines ({first[key].location} and {match.location}): one line calls one merge site; write the "
                "eval line as the training lines are written")
        first.setdefault(key, match)
        if (ev.inplace, ev.stream_operand) != (match.inplace, match.stream_operand):
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode where {_mode_line(match, path_of)} runs in "
                "training mode, on the same branch, but the two are written differently (in place or not, or with "
                "the operands swapped): both lines call one merge site, which reproduces one way of writing it; "
                "write the two lines the same way")
    lone = {ev.index for ev in unmatched}
    for ev in unmatched:
        if site_key(ev) in target:
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode; some of its runs merge the branch of the "
                f"training-mode line at {first[site_key(ev)].location}, others a branch no training-mode merge "
                "ran: one line calls one merge site")
        if rule.kind == "chain":
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode, and no merge of the training-mode forward ran "
                f"the same branch: method={rule.name!r} carries a chain's state across the merges observed in "
                "training, and has no position (no parameters) for a merge added in eval. Run the merge in both "
                "modes, exclude its module, or use a per-merge rule (e.g. method='rescontroller')")
    for ev in extras:
        if ev.index not in lone:
            ev.same_site = target[site_key(ev)]
    return lone


def check_both_lines(other_only: list, patched: list, skip_reasons: dict, path_of) -> None:
    """A merge of an eval-only line that is not patched while a training-mode merge of the same branch is:
    raise (the patched network in training, the original one in eval)."""
    for ev in other_only:
        if not ev.is_merge or ev.index not in skip_reasons or ev.owner is None:
            continue
        twin = next((a for a in patched if _same_branch(a, ev)), None)
        if twin is not None:
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode where {_mode_line(twin, path_of)} runs in "
                f"training mode, on the same branch, but it cannot be patched: {skip_reasons[ev.index]}. Leaving it "
                "raw would run another network in eval than in training; exclude the module "
                f"(exclude=[{path_of(ev)!r}]) or make the line rewritable")


def _same_branch(a: AddEvent, b: AddEvent) -> bool:
    """Merges of one module whose branches ran the same learned modules (the same merge, written on two
    lines, e.g. one per mode)."""
    return a.owner is b.owner and frozenset(a.branch_learned) == frozenset(b.branch_learned)


def line_key(ev: AddEvent) -> tuple:
    """What identifies an addition's line across two observations."""
    if ev.owner is not None and ev.position is not None:
        return site_key(ev)
    return (ev.filename, ev.lineno, ev.position)
