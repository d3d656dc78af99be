"""Plan: which additions of the observed forwards become merge sites, and how (the second step of
:func:`~lightning_resctl.surgery.patch_residuals`: observe -> **plan** -> bind -> describe).

* checks — the model can be patched (not wrapped, not patched already; the rule accepts it), include/exclude
  patterns, a rule that cannot run inside activation checkpointing;
* the plan — the merges to patch (training-mode forward, plus eval-only lines calling the site of the same
  branch), what is skipped and why, one site per expression (:func:`site_key`);
* the rewrite preparation — per owner module, the edits of its methods and its patched subclass; what cannot be
  rewritten is dropped with the reason (a parallel block whole or not at all);
* the chains — merges grouped by the stream they continue (:func:`build_chains`);
* the branch kind — a label of each merge's branch from its modules' names (:func:`branch_kind`).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from .observe import AddEvent, Observation
from .report import SkippedInfo
from .rewrite import (
    CallEdit,
    Edit,
    RewriteError,
    annotate_edits,
    check_callee,
    is_patched_class,
    patched_subclass,
    unwrap_depth,
)
from .sites import MergeSite

__all__ = ["Plan", "make_plan", "check_model", "check_patterns", "refuse_checkpointed", "branch_kind", "site_key",
           "source_line", "parallel_block", "build_chains", "chain_dim"]

#: where a patched module keeps its patch's state (read by unpatch_residuals / get_patch_report)
STATE_ATTR = "_resctl_patch"
#: attribute names of the sites registered on a patched module: ``_resctl_site0``, ``_resctl_site1``, ...
SITE_PREFIX = "_resctl_site"
#: modules that iterate their children as layers: nothing is registered on them
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


# ---------------------------------------------------------------------------------------------- checks
def check_model(model: nn.Module, rule) -> None:
    """Refuse a model that cannot be patched with ``rule``: wrapped (DDP/FSDP/compiled: TypeError), patched
    already (RuntimeError), or refused by the rule (:meth:`MergeRule.refuse`: ValueError)."""
    _check_unwrapped(model)
    _check_not_patched(model)
    refusal = rule.refuse(model)
    if refusal:
        raise ValueError(refusal)


def _check_unwrapped(model: nn.Module) -> None:
    name = type(model).__name__
    wrapped = name in ("DistributedDataParallel", "FullyShardedDataParallel", "OptimizedModule", "DataParallel")
    if wrapped or hasattr(model, "_orig_mod"):
        raise TypeError(f"patch_residuals got a wrapped model ({name}): patch the model before wrapping it in "
                        "DDP/FSDP or torch.compile")


def _check_not_patched(model: nn.Module) -> None:
    for path, mod in model.named_modules():
        state = mod.__dict__.get(STATE_ATTR)
        if state is not None:
            where = f" (submodule {path!r})" if path else ""
            raise RuntimeError(f"{type(model).__name__}{where} is already patched with method="
                               f"{state.report.method!r} ({len(state.report.sites)} merges): patching twice is "
                               "refused; call unpatch_residuals(model) first")
        if isinstance(mod, MergeSite) or is_patched_class(type(mod)):
            raise RuntimeError(f"module {path!r} of {type(model).__name__} is already patched: patching twice is "
                               "refused; call unpatch_residuals on the model that was patched first")


def check_patterns(value, name: str) -> Optional[list]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} must be a string or a list of module-path patterns, got {value!r}") from None
    if not all(isinstance(p, str) for p in items):
        raise TypeError(f"{name} must hold strings, got {items!r}")
    return items


def _matches(path: str, patterns: list) -> bool:
    for p in patterns:
        if fnmatch.fnmatchcase(path, p) or path == p or path.startswith(p + "."):
            return True
    return False


def refuse_checkpointed(plan: "Plan", rule) -> None:
    """A rule without ``supports_checkpointing`` cannot patch a merge that ran inside ``torch.utils.checkpoint``:
    ValueError naming the first such merge."""
    if rule.supports_checkpointing:
        return
    for ev in plan.merges + plan.aliases:
        if ev.checkpointed:
            raise ValueError(
                f"method={rule.name!r} cannot patch merges that run inside torch.utils.checkpoint (the merge at "
                f"{ev.location}, {source_line(ev)!r}, in {plan.paths.get(id(ev.owner), '?')!r}): its state "
                "travels beside the model between merges and the recomputation in backward would replay them. "
                "Checkpoint outside the residual chain, disable activation checkpointing, or use a per-merge "
                "rule (e.g. method='rescontroller', which supports it)")


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    merges: list                # AddEvents to patch, execution order
    chains: list                # list of lists of AddEvents
    groups: dict                # key -> list of AddEvents (one MergeSite each)
    skipped: list               # SkippedInfo
    methods: dict               # id(owner) -> (owner, spec, {site key: attr})
    rewritten: dict             # id(owner) -> patched subclass
    paths: dict
    aliases: list = field(default_factory=list)  # merges of eval-only lines calling a training merge's site


def site_key(ev: AddEvent) -> tuple:
    """One MergeSite per (module, method, call sites leading to the addition, addition's position); a line
    that runs in one mode only calls the site of the same merge in the other mode (``ev.same_site``)."""
    if ev.same_site is not None:
        return ev.same_site
    return (id(ev.owner), ev.method_name, tuple(p for _, p in ev.calls), ev.position)


def _callees(ev: AddEvent) -> list:
    """Code objects of the free functions between the owner's method and the addition (outermost first)."""
    return [code for code, _ in ev.calls[1:]] + ([ev.code] if ev.calls else [])


def source_line(ev: AddEvent) -> str:
    """The source line of the addition; for an addition spanning lines, the expression itself on one line."""
    import linecache

    line = linecache.getline(ev.filename, ev.lineno).strip()
    pos = ev.position
    if pos is None or pos[1] is None or pos[1] == pos[0] or pos[2] is None or pos[3] is None:
        return line
    lines = [linecache.getline(ev.filename, n).encode() for n in range(pos[0], pos[1] + 1)]
    if not all(lines):
        return line
    lines[-1] = lines[-1][: pos[3]]
    lines[0] = lines[0][pos[2]:]
    return " ".join(b.decode(errors="replace").strip() for b in lines if b.strip())


def make_plan(model: nn.Module, obs: Observation, rule, include, exclude,
          other: Optional[Observation] = None) -> Plan:
    """What to patch: the merges of the training-mode observation ``obs``, and the merges of lines that ran
    only in the eval-mode observation ``other`` (each calls the site of the training-mode merge of the same
    branch; see :func:`_match_other_mode`)."""
    paths = obs.module_paths
    skip_reasons: dict = {}   # event index -> reason

    def path_of(ev):
        if ev.owner is None or id(ev.owner) not in paths:
            return f"<function {ev.function_name}>"
        return paths[id(ev.owner)]

    candidates = _candidates(obs, include, exclude, skip_reasons, path_of)
    other_only: list = []   # the events of lines that ran in the other mode only
    extras: list = []       # those that are merges to patch
    if other is not None:
        _renumber(other, len(obs.events))  # one index space: skip reasons and rewrite failures are keyed by it
        seen = {_line_key(ev) for ev in obs.events}
        other_only = [ev for ev in other.events if _line_key(ev) not in seen]
        only = {ev.index for ev in other_only}
        extras = [ev for ev in _candidates(other, include, exclude, skip_reasons, path_of) if ev.index in only]
    unmatched = _match_other_mode(extras, candidates, rule, path_of)

    # rewrite feasibility, per owner instance; a parallel block is patched whole or not at all; the line of
    # one mode is patched with the line of the other mode it shares a site with, or not at all
    def prepare(primary, extras):
        while True:
            both, methods, rewritten = _prepare_whole_blocks(primary + extras, obs.events, skip_reasons)
            kept = {ev.index for ev in both}
            primary = [ev for ev in primary if ev.index in kept]
            keys = {site_key(ev) for ev in primary}
            orphans = {ev.index for ev in extras if ev.index in kept and ev.same_site is not None
                       and ev.same_site not in keys}
            for i in orphans:  # its other-mode line is not patched: neither is this one
                skip_reasons[i] = "the merge of the same branch in the other mode is not patched"
            extras = [ev for ev in extras if ev.index in kept - orphans]
            if not orphans:
                return primary, extras, methods, rewritten

    candidates, extras, methods, rewritten = prepare(candidates, extras)

    # chains (and, for MGR, one chain per site)
    while True:
        chains = build_chains([ev for ev in candidates if not ev.is_partial], obs.nodes)
        if rule.kind != "chain":
            break
        chain_of = {}
        for ci, chain in enumerate(chains):
            for ev in chain:
                chain_of.setdefault(site_key(ev), set()).add(ci)
        bad = {key for key, cs in chain_of.items() if len(cs) > 1}
        if not bad:
            break
        for ev in candidates + extras:
            if site_key(ev) in bad:
                skip_reasons[ev.index] = (f"one expression runs merges of several chains (shared module): "
                                          f"method={rule.name!r} carries one chain's state per site")
        candidates = [ev for ev in candidates if site_key(ev) not in bad]
        extras = [ev for ev in extras if site_key(ev) not in bad]
        candidates, extras, methods, rewritten = prepare(candidates, extras)

    _check_both_lines(other_only, candidates, skip_reasons, path_of)
    # a per-merge rule's merge that ran in the other mode only, with a branch of its own: a site of its own
    own = [ev for ev in extras if ev.index in unmatched]
    chains += build_chains(own, other.nodes) if own else []
    groups: dict = {}
    for ev in candidates + own:
        groups.setdefault(site_key(ev), []).append(ev)

    skipped: dict = {}
    for ev in obs.events + other_only:
        reason = skip_reasons.get(ev.index)
        if reason is None:
            continue
        p = path_of(ev)
        key = (p, ev.location, reason)
        if key in skipped:
            skipped[key].count += 1
        else:
            skipped[key] = SkippedInfo(p, ev.location, source_line(ev), reason)
    return Plan(candidates + own, chains, groups, list(skipped.values()), methods, rewritten, paths,
                 [ev for ev in extras if ev.index not in unmatched])


def _candidates(obs: Observation, include, exclude, skip_reasons: dict, path_of) -> list:
    """The merges of ``obs`` that may be patched, in execution order; the others get their reason in
    ``skip_reasons``."""
    candidates = []
    for ev in obs.events:
        if not ev.is_merge:
            skip_reasons[ev.index] = ev.reason
            continue
        if ev.owner is None or ev.method_name is None:
            skip_reasons[ev.index] = (f"the addition runs in function {ev.function_name!r}, which was not called "
                                      "from a method of a module of the model (e.g. from a hook, or through "
                                      f"more than a few function calls): cannot rewrite it")
            continue
        if id(ev.owner) not in obs.module_paths:
            skip_reasons[ev.index] = "the addition runs in a module outside the model"
            continue
        if isinstance(ev.owner, CONTAINERS):
            skip_reasons[ev.index] = (f"the addition runs in a container module ({type(ev.owner).__name__} is an "
                                      "nn.Sequential/ModuleList/ModuleDict): a merge module registered on it would "
                                      "be iterated as one of its layers")
            continue
        if ev.position is None or any(pos is None for _, pos in ev.calls):
            skip_reasons[ev.index] = "no source position for the addition"
            continue
        lambdas = [c.co_name for c in _callees(ev) if c.co_name.startswith("<")]
        if lambdas:
            skip_reasons[ev.index] = (f"the addition runs in {lambdas[0]} defined outside the module's method: "
                                      "only a function written with def can be rewritten per call site")
            continue
        p = path_of(ev)
        if include is not None and not _matches(p, include):
            skip_reasons[ev.index] = "not matched by include"
            continue
        if exclude is not None and _matches(p, exclude):
            skip_reasons[ev.index] = "matched by exclude"
            continue
        if ev.refusal:
            prev = obs.events[ev.parallel_of - obs.events[0].index]
            raise ValueError(
                f"cannot patch the addition at {ev.location} ({source_line(ev)!r}, in {p!r}): it adds a branch of "
                f"the input of the merge at {prev.location} ({source_line(prev)!r}) to that merge's result, like "
                f"the second addition of a parallel block, but {ev.refusal}. Patching the two additions as two "
                "merges would feed that branch a stream the rule never produced, and patching one alone would "
                f"leave the other raw (a half-patched network): exclude the module (exclude=[{p!r}]) or write "
                "the block as one addition of the branches' sum (x + (attn_out + mlp_out))")
        candidates.append(ev)

    # an expression is patched only when every execution of it is the same kind of merge
    all_by_key: dict = {}
    for ev in obs.events:
        if ev.owner is not None and ev.position is not None:
            all_by_key.setdefault(site_key(ev), []).append(ev)
    ok = []
    for ev in candidates:
        group = all_by_key[site_key(ev)]
        kinds = {(g.is_merge, g.stream_operand, g.is_partial, g.parallel_of is not None) for g in group}
        if len(kinds) > 1:
            skip_reasons[ev.index] = ("this expression is a merge in some executions and not in others "
                                      "(or swaps stream and update, or ends a parallel block in some only)")
        else:
            ok.append(ev)
    return ok


def _renumber(obs: Observation, offset: int) -> None:
    """Shift the event indices of ``obs`` (and its events' references to each other) by ``offset``."""
    for ev in obs.events:
        ev.index += offset
        for name in ("parallel_of", "joined_by"):
            if getattr(ev, name) is not None:
                setattr(ev, name, getattr(ev, name) + offset)


def _mode_line(ev: AddEvent, path_of) -> str:
    return f"the merge at {ev.location} ({source_line(ev)!r}, in {path_of(ev)!r})"


def _match_other_mode(extras: list, primary: list, rule, path_of) -> list:
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


def _check_both_lines(other_only: list, patched: list, skip_reasons: dict, path_of) -> None:
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


def _line_key(ev: AddEvent) -> tuple:
    """What identifies an addition's line across two observations."""
    if ev.owner is not None and ev.position is not None:
        return site_key(ev)
    return (ev.filename, ev.lineno, ev.position)


def parallel_block(ev: AddEvent, events: list) -> list:
    """The additions of the parallel block ``ev`` belongs to (just ``[ev]`` for an ordinary merge)."""
    first = ev
    while first.parallel_of is not None and events[first.parallel_of].joined_by == first.index:
        first = events[first.parallel_of]
    block = [first]
    while block[-1].joined_by is not None:
        block.append(events[block[-1].joined_by])
    return block


# ---------------------------------------------------------------------------------------------- rewrite preparation
def _prepare_whole_blocks(candidates: list, events: list, skip_reasons: dict):
    """:func:`_prepare_rewrites`, dropping every parallel block one of whose additions is not patched (its
    partial sums would be added raw, its last addition would wait for them): a block is patched whole or not
    at all."""
    while True:
        kept = {ev.index for ev in candidates}
        drop = {}
        for ev in candidates:
            block = parallel_block(ev, events)
            missing = [m for m in block if m.index not in kept]
            if missing:
                drop[ev.index] = (f"part of the parallel block merged at {block[-1].location}, whose addition at "
                                  f"{missing[0].location} is not patched"
                                  + (f" ({skip_reasons[missing[0].index]})" if missing[0].index in skip_reasons
                                     else ""))
        skip_reasons.update(drop)
        candidates = [ev for ev in candidates if ev.index not in drop]
        candidates, methods, rewritten = _prepare_rewrites(candidates, skip_reasons)
        if all(m.index in {ev.index for ev in candidates} for ev in candidates for m in parallel_block(ev, events)):
            return candidates, methods, rewritten


def _prepare_rewrites(candidates: list, skip_reasons: dict):
    """Assign site attribute names per owner and build the owners' patched classes; drop what cannot be
    rewritten (with the reason).

    Per owner and method the edits form a tree: an addition in the method's source is an :class:`Edit`; an
    addition in a free function called from it is a :class:`CallEdit` at the call, holding the edits of a
    copy of that function rewritten for this call site only (nested calls nest)."""
    while True:
        per_owner: dict = {}
        for ev in candidates:
            entry = per_owner.setdefault(id(ev.owner), (ev.owner, {}))
            entry[1].setdefault(ev.method_name, []).append(ev)
        methods: dict = {}
        classes: dict = {}
        failed: set = set()
        for oid, (owner, by_method) in per_owner.items():
            attrs: dict = {}
            spec = []
            counter = [0]
            cls = type(owner)
            for mname in sorted(by_method):
                evs = by_method[mname]
                try:
                    callee_failures: dict = {}
                    edits = _edit_tree(evs, 0, oid, mname, attrs, counter, callee_failures)
                    if callee_failures:  # only the merges reached through that call are dropped
                        for ev in evs:
                            if ev.index in callee_failures:
                                skip_reasons[ev.index] = callee_failures[ev.index]
                                failed.add(ev.index)
                        continue
                    spec.append((mname, unwrap_depth(cls, mname, evs[0].method_code), edits))
                except RewriteError as err:
                    _fail(candidates, oid, {mname}, f"cannot rewrite {cls.__name__}.{mname}: {err}", skip_reasons,
                          failed)
            spec = tuple(spec)
            try:
                classes[oid] = patched_subclass(cls, spec)
            except RewriteError as err:
                _fail(candidates, oid, {m for m, _, _ in spec}, f"cannot rewrite {err}", skip_reasons, failed)
            except Exception as err:  # noqa: BLE001 - any failure to build the class becomes a skip reason
                _fail(candidates, oid, {m for m, _, _ in spec}, f"cannot rewrite {cls.__name__}: "
                      f"{type(err).__name__}: {err}", skip_reasons, failed)
            methods[oid] = (owner, spec, attrs)
        if not failed:
            return candidates, methods, classes
        candidates = [ev for ev in candidates if ev.index not in failed]


def _edit_tree(evs: list, level: int, oid: int, mname: str, attrs: dict, counter: list, failures: dict) -> tuple:
    """The edits, at call depth ``level``, of the function reached by ``evs`` (all at that level's code).

    Assigns site attributes (``attrs[site key] = name``), annotates each edit with its source text, and
    compiles each free function's rewritten copy once here so that a failure is a skip reason, not an error
    at the first forward: ``failures[event index] = reason`` for the merges of a call that cannot be
    redirected."""
    direct: dict = {}
    via: dict = {}
    for ev in evs:
        if len(ev.calls) > level:
            via.setdefault(ev.calls[level][1], []).append(ev)
        else:
            direct.setdefault(ev.position, ev)
    code = evs[0].calls[level][0] if len(evs[0].calls) > level else evs[0].code
    edits = []
    for pos in sorted(set(direct) | set(via)):
        if pos in direct:
            ev = direct[pos]
            key = site_key(ev)
            if key not in attrs:
                attrs[key] = f"{SITE_PREFIX}{counter[0]}"
                counter[0] += 1
            edits.append(Edit(pos, attrs[key], ev.stream_operand))
        else:
            group = via[pos]
            callee = group[0].calls[level + 1][0] if len(group[0].calls) > level + 1 else group[0].code
            try:
                inner = _edit_tree(group, level + 1, oid, mname, attrs, counter, failures)
                check_callee(callee, inner)
            except RewriteError as err:
                for ev in group:
                    failures.setdefault(ev.index, f"cannot rewrite the function {callee.co_qualname} (called at "
                                                  f"line {pos[0]} of {mname}): {err}")
                continue
            edits.append(CallEdit(pos, callee.co_qualname, inner))
    return annotate_edits(code, edits)


def _fail(candidates, oid, mnames, reason, skip_reasons, failed) -> None:
    for ev in candidates:
        if id(ev.owner) == oid and ev.method_name in mnames:
            skip_reasons[ev.index] = reason
            failed.add(ev.index)


# ---------------------------------------------------------------------------------------------- chains
# ops that only rename or re-view a tensor: a stream reaching the next merge through them is still the stream
_TRANSPARENT = {"view", "reshape", "flatten", "unflatten", "contiguous", "clone", "squeeze", "unsqueeze"}


def build_chains(merges: list, nodes: list) -> list:
    """Group merges into chains: a merge continues the chain whose last result is its stream (the same
    tensor, or that tensor re-viewed by reshape-like ops that keep the feature dim)."""
    chains: list = []
    tail_of: dict = {}   # result node of a chain's last merge -> chain index

    def tail(stream: int):
        s = stream
        for _ in range(8):
            if s in tail_of:
                if s == stream:
                    return s
                a, b = nodes[s].shape, nodes[stream].shape
                if a and b and a[-1] == b[-1] and _numel(a) == _numel(b):
                    return s
                return None
            node = nodes[s]
            if node.op not in _TRANSPARENT or len(node.inputs) != 1:
                return None
            s = node.inputs[0]
        return None

    for ev in merges:
        stream = ev.stream_node
        t = tail(stream)
        ci = None if t is None or (ev.feature_dim != -1 and t != stream) else tail_of.pop(t)
        if ci is None:
            ci = len(chains)
            chains.append([])
        chains[ci].append(ev)
        tail_of[ev.result] = ci
    return chains


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def chain_dim(chain: list) -> int:
    """Feature dim of a chain's stream: 1 (channels-first) when its branches start with a convolution, else -1."""
    return chain[0].feature_dim


# ---------------------------------------------------------------------------------------------- branch kind
_ATTN_WORDS = ("attn", "attention")


_MLP_WORDS = ("mlp", "ffn", "feed_forward", "feedforward", "intermediate", "ff", "fc", "dense_h_to_4h",
              "dense_4h_to_h", "moe", "experts", "block_sparse_moe")


def _kind_of(component: str) -> str:
    c = component.lower()
    if "norm" in c or c in ("ln", "ln_1", "ln_2", "ln_f") or c.isdigit():
        return ""
    if any(w in c for w in _ATTN_WORDS):
        return "attn"
    if c in _MLP_WORDS or any(w in c.split("_") for w in ("mlp", "ffn", "ff")) or "feed_forward" in c \
            or "mlp" in c:
        return "mlp"
    if "conv" in c:
        return "conv"
    return ""


def branch_kind(ev: AddEvent) -> str:
    """A short label of the merge's branch: "attn", "mlp", "attn+mlp" (a parallel block), "conv" or "".

    Each learned op of the branch (the dataflow between stream and update) is labelled by the deepest
    component of its module path that names a kind (``self_attn``/``attention``/``attn`` -> attn,
    ``mlp``/``ffn``/``feed_forward``/``intermediate`` -> mlp, ``*conv*`` -> conv; norms are ignored)."""
    kinds = []
    for path in ev.branch_learned:
        for comp in reversed(path.split(".")):
            k = _kind_of(comp)
            if k:
                kinds.append(k)
                break
    found = set(kinds)
    if "attn" in found and "mlp" in found:
        return "attn+mlp"
    for k in ("attn", "mlp", "conv"):
        if k in found:
            return k
    return "conv" if any("conv" in op for op in ev.branch_ops) else ""
