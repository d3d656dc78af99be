"""patch_residuals / unpatch_residuals: rewrite the residual merges of any model, reversibly."""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from torch import nn

from .observe import AddEvent, Observation, observe
from .pretrained import forget_patch_on_config, note_patch_on_config
from .report import ChainInfo, PatchReport, SiteInfo, SkippedInfo
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
from .sites import ChainEnd, ChainRun, ChainStart, MergeSite, ParallelPart, ParallelRun

__all__ = ["patch_residuals", "unpatch_residuals", "get_patch_report", "merge_sites"]

_STATE_ATTR = "_resctl_patch"
_SITE_PREFIX = "_resctl_site"
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


@dataclass
class _PatchState:
    """What unpatch_residuals needs: the patched modules, their classes, and what was added where."""

    report: PatchReport
    owners: list = field(default_factory=list)   # (module, original class, [site attribute names])
    added: list = field(default_factory=list)    # (module, attribute name) of registered chain modules
    hooks: list = field(default_factory=list)    # hook handles of the chains' owners
    switched: list = field(default_factory=list)  # (module, attribute, original value): native fast paths turned off


#: Modules whose forward can take a native kernel instead of the Python lines the patch rewrites, in eval under
#: ``no_grad`` (how Lightning validates): ``nn.TransformerEncoderLayer``'s fused inference path and
#: ``nn.TransformerEncoder``'s nested-tensor path over such layers. For each: the attribute that turns the path off
#: and its value, set on every such module that is or holds a patched module (restored by unpatching). The
#: attributes are only read by those checks (and handed to the fused kernel): the Python forward is unchanged.
_NATIVE_FAST_PATHS = ((nn.TransformerEncoderLayer, "activation_relu_or_gelu", 0),
                      (nn.TransformerEncoder, "use_nested_tensor", False))


# ---------------------------------------------------------------------------------------------- public API
def patch_residuals(model: nn.Module, method: str = "rescontroller", example_input: Any = None,
                    include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None,
                    allow_empty: bool = False, **method_options) -> PatchReport:
    """Rewrite every residual merge of ``model`` in place and return a :class:`PatchReport`.

    A residual merge is an addition ``stream + update`` (any spelling: ``a + b``, ``b + a``,
    ``torch.add``, ``+=``, ``add_``) executed in a module's forward, where both operands have the same
    shape and the update is computed from the stream through a branch with learned parameters; the
    stream is the chain input or the previous merge's result. Merges are found by running the forward
    on ``example_input`` (default ``model.example_input_array``; a tuple is passed as ``*args``, a dict as
    ``**kwargs``) in training and in eval mode and watching every addition; buffers, module attributes,
    RNG state and the training flag are left exactly as they were. Each merge is rewritten in its
    forward's source into a call of a :class:`MergeSite` that runs the merge rule ``method`` — any name in
    :func:`lightning_resctl.merge_rules` (``"add"``, ``"rescontroller"``, ``"mgr"``, ``"mgr-competitive"``,
    ...; ``method_options`` are that rule's options, e.g. ``streams=4`` for MGR). Chain rules (MGR and
    the other stream-carrying rules) keep their state beside the model; the model's code between merges
    sees tensors of the original shape.

    The model object, its parameter names and its modules' ``isinstance`` are kept (patched modules get
    a per-instance subclass); :func:`unpatch_residuals` restores them exactly. The rule, its options and
    the sites travel with ``state_dict`` (one ``_extra_state`` entry per site), so a patched checkpoint
    fails to load into an unpatched model instead of loading silently.

    Args:
        include / exclude: module-path patterns (``fnmatch``; a plain name also matches its submodules)
            limiting which modules' additions may be patched.
        allow_empty: return an empty report instead of raising when nothing is found.

    Raises:
        ValueError: unknown ``method``/options, a rule that refuses the model, or no example input.
        RuntimeError: the model is already patched, or no merge was found (unless ``allow_empty``).
        TypeError: the model is wrapped (DDP/FSDP/compiled): patch it before wrapping.
    """
    from ..rules import make_rule

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    rule = make_rule(method, method_options)
    _check_unwrapped(model)
    _check_not_patched(model)
    refusal = rule.refuse(model)
    if refusal:
        raise ValueError(refusal)
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
        if example_input is None:
            raise ValueError("example_input is required (or set model.example_input_array): patch_residuals runs "
                             "one forward to find the merges")
    include = _patterns(include, "include")
    exclude = _patterns(exclude, "exclude")

    t0 = time.perf_counter()
    with preserved(model):
        model.train()
        obs = observe(model, example_input)
        model.eval()
        other = observe(model, example_input)
    plan = _plan(model, obs, rule, include, exclude, other)
    if not rule.supports_checkpointing:
        for ev in plan.merges + plan.aliases:
            if ev.checkpointed:
                raise ValueError(
                    f"method={rule.name!r} cannot patch merges that run inside torch.utils.checkpoint (the merge at "
                    f"{ev.location}, {_source_line(ev)!r}, in {plan.paths.get(id(ev.owner), '?')!r}): its state "
                    "travels beside the model between merges and the recomputation in backward would replay them. "
                    "Checkpoint outside the residual chain, disable activation checkpointing, or use a per-merge "
                    "rule (e.g. method='rescontroller', which supports it)")
    searched = (f"searched {obs.num_modules} modules of {type(model).__name__}: one forward on the example input "
                f"ran {obs.num_ops} torch ops, {len(obs.events)} additions of two tensors")
    report = PatchReport(method=method, options=rule.options(), skipped=plan.skipped, searched=searched)
    if not plan.merges:
        if allow_empty:
            report.patch_seconds = time.perf_counter() - t0
            return report
        reasons = "; ".join(sorted({s.reason for s in plan.skipped})) or "no addition of two tensors ran"
        raise RuntimeError(f"patch_residuals found no residual merge to patch: {searched}. "
                           f"Skipped additions: {reasons}. (Pass allow_empty=True to accept this.)")
    before = set(model.state_dict().keys())
    old = {id(p) for p in model.parameters()}  # by identity: wrappers (checkpoint_wrapper) rename state_dict keys
    state = _apply(model, plan, rule, report, obs, other)
    report.new_parameters = [k for k, p in model.named_parameters() if id(p) not in old]
    report.new_keys = [k for k in model.state_dict().keys() if k not in before]
    report.patch_seconds = time.perf_counter() - t0
    model.__dict__[_STATE_ATTR] = state
    note_patch_on_config(model, report)  # a transformers model: save_pretrained's config.json says it is patched
    return report


def unpatch_residuals(model: nn.Module) -> None:
    """Undo :func:`patch_residuals`: original classes back, sites and MGR chains removed.

    ``model`` is the module that was patched, or a module holding it (e.g. a LightningModule whose
    ``self.model`` was patched): every patch found in it is undone. Outputs are bitwise identical to the
    model before patching (MGR parameters are dropped). Raises RuntimeError when nothing is patched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch_residuals(model): model must be an nn.Module, got {type(model).__name__} "
                        f"({model!r:.60})")
    states = _patch_states(model)
    if not states:
        raise RuntimeError(f"{type(model).__name__} is not patched (no patch_residuals state on it or in it)")
    for holder, state in states:
        for module, original, attrs in state.owners:
            if vars(type(module)).get("_resctl_original_class") is not original:
                raise RuntimeError(f"the class of a patched {original.__name__} was changed after patching (to "
                                   f"{type(module).__name__}, e.g. by fully_shard): unpatch before wrapping it")
    for holder, state in states:
        for module, original, attrs in state.owners:
            for attr in attrs:
                if attr in module._modules:
                    del module._modules[attr]
            module.__class__ = original
        for module, attr in state.added:
            if attr in module._modules:
                del module._modules[attr]
        for handle in state.hooks:
            handle.remove()
        for module, attr, value in state.switched:
            setattr(module, attr, value)
        del holder.__dict__[_STATE_ATTR]
        forget_patch_on_config(holder)


def get_patch_report(model: nn.Module) -> Optional[PatchReport]:
    """The :class:`PatchReport` of a patched model (or of the first patched module inside it), or None."""
    states = _patch_states(model)
    return states[0][1].report if states else None


def _patch_states(model: nn.Module) -> list:
    own = model.__dict__.get(_STATE_ATTR)
    if own is not None:
        return [(model, own)]
    return [(m, m.__dict__[_STATE_ATTR]) for m in model.modules() if _STATE_ATTR in m.__dict__]


def merge_sites(model: nn.Module) -> list:
    """The :class:`MergeSite` modules of ``model`` (found through ``model.modules()``), by chain then position."""
    sites = [m for m in model.modules() if isinstance(m, MergeSite)]
    return sorted(sites, key=lambda s: (s.chain, s.position))


# ---------------------------------------------------------------------------------------------- checks
def _check_unwrapped(model: nn.Module) -> None:
    name = type(model).__name__
    wrapped = name in ("DistributedDataParallel", "FullyShardedDataParallel", "OptimizedModule", "DataParallel")
    if wrapped or hasattr(model, "_orig_mod"):
        raise TypeError(f"patch_residuals got a wrapped model ({name}): patch the model before wrapping it in "
                        "DDP/FSDP or torch.compile")


def _check_not_patched(model: nn.Module) -> None:
    for path, mod in model.named_modules():
        state = mod.__dict__.get(_STATE_ATTR)
        if state is not None:
            where = f" (submodule {path!r})" if path else ""
            raise RuntimeError(f"{type(model).__name__}{where} is already patched with method="
                               f"{state.report.method!r} ({len(state.report.sites)} merges): patching twice is "
                               "refused; call unpatch_residuals(model) first")
        if isinstance(mod, MergeSite) or is_patched_class(type(mod)):
            raise RuntimeError(f"module {path!r} of {type(model).__name__} is already patched: patching twice is "
                               "refused; call unpatch_residuals on the model that was patched first")


def _patterns(value, name: str) -> Optional[list]:
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


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class _Plan:
    merges: list                # AddEvents to patch, execution order
    chains: list                # list of lists of AddEvents
    groups: dict                # key -> list of AddEvents (one MergeSite each)
    skipped: list               # SkippedInfo
    methods: dict               # id(owner) -> (owner, spec, {site key: attr})
    rewritten: dict             # id(owner) -> patched subclass
    paths: dict
    aliases: list = field(default_factory=list)  # merges of eval-only lines calling a training merge's site


def _site_key(ev: AddEvent) -> tuple:
    """One MergeSite per (module, method, call sites leading to the addition, addition's position); a line
    that runs in one mode only calls the site of the same merge in the other mode (``ev.same_site``)."""
    if ev.same_site is not None:
        return ev.same_site
    return (id(ev.owner), ev.method_name, tuple(p for _, p in ev.calls), ev.position)


def _callees(ev: AddEvent) -> list:
    """Code objects of the free functions between the owner's method and the addition (outermost first)."""
    return [code for code, _ in ev.calls[1:]] + ([ev.code] if ev.calls else [])


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


def _source_line(ev: AddEvent) -> str:
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


def _plan(model: nn.Module, obs: Observation, rule, include, exclude,
          other: Optional[Observation] = None) -> _Plan:
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
            keys = {_site_key(ev) for ev in primary}
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
        chains = _build_chains([ev for ev in candidates if not ev.is_partial], obs.nodes)
        if rule.kind != "chain":
            break
        chain_of = {}
        for ci, chain in enumerate(chains):
            for ev in chain:
                chain_of.setdefault(_site_key(ev), set()).add(ci)
        bad = {key for key, cs in chain_of.items() if len(cs) > 1}
        if not bad:
            break
        for ev in candidates + extras:
            if _site_key(ev) in bad:
                skip_reasons[ev.index] = (f"one expression runs merges of several chains (shared module): "
                                          f"method={rule.name!r} carries one chain's state per site")
        candidates = [ev for ev in candidates if _site_key(ev) not in bad]
        extras = [ev for ev in extras if _site_key(ev) not in bad]
        candidates, extras, methods, rewritten = prepare(candidates, extras)

    _check_both_lines(other_only, candidates, skip_reasons, path_of)
    # a per-merge rule's merge that ran in the other mode only, with a branch of its own: a site of its own
    own = [ev for ev in extras if ev.index in unmatched]
    chains += _build_chains(own, other.nodes) if own else []
    groups: dict = {}
    for ev in candidates + own:
        groups.setdefault(_site_key(ev), []).append(ev)

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
            skipped[key] = SkippedInfo(p, ev.location, _source_line(ev), reason)
    return _Plan(candidates + own, chains, groups, list(skipped.values()), methods, rewritten, paths,
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
        if isinstance(ev.owner, _CONTAINERS):
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
                f"cannot patch the addition at {ev.location} ({_source_line(ev)!r}, in {p!r}): it adds a branch of "
                f"the input of the merge at {prev.location} ({_source_line(prev)!r}) to that merge's result, like "
                f"the second addition of a parallel block, but {ev.refusal}. Patching the two additions as two "
                "merges would feed that branch a stream the rule never produced, and patching one alone would "
                f"leave the other raw (a half-patched network): exclude the module (exclude=[{p!r}]) or write "
                "the block as one addition of the branches' sum (x + (attn_out + mlp_out))")
        candidates.append(ev)

    # an expression is patched only when every execution of it is the same kind of merge
    all_by_key: dict = {}
    for ev in obs.events:
        if ev.owner is not None and ev.position is not None:
            all_by_key.setdefault(_site_key(ev), []).append(ev)
    ok = []
    for ev in candidates:
        group = all_by_key[_site_key(ev)]
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
    return f"the merge at {ev.location} ({_source_line(ev)!r}, in {path_of(ev)!r})"


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
        key = _site_key(ev)
        if match is None:
            unmatched.append(ev)
            continue
        taken.add(id(match))
        if target.setdefault(key, _site_key(match)) != _site_key(match):
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
        if _site_key(ev) in target:
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode; some of its runs merge the branch of the "
                f"training-mode line at {first[_site_key(ev)].location}, others a branch no training-mode merge "
                "ran: one line calls one merge site")
        if rule.kind == "chain":
            raise ValueError(
                f"{_mode_line(ev, path_of)} runs only in eval mode, and no merge of the training-mode forward ran "
                f"the same branch: method={rule.name!r} carries a chain's state across the merges observed in "
                "training, and has no position (no parameters) for a merge added in eval. Run the merge in both "
                "modes, exclude its module, or use a per-merge rule (e.g. method='rescontroller')")
    for ev in extras:
        if ev.index not in lone:
            ev.same_site = target[_site_key(ev)]
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
        return _site_key(ev)
    return (ev.filename, ev.lineno, ev.position)


def _parallel_block(ev: AddEvent, events: list) -> list:
    """The additions of the parallel block ``ev`` belongs to (just ``[ev]`` for an ordinary merge)."""
    first = ev
    while first.parallel_of is not None and events[first.parallel_of].joined_by == first.index:
        first = events[first.parallel_of]
    block = [first]
    while block[-1].joined_by is not None:
        block.append(events[block[-1].joined_by])
    return block


def _prepare_whole_blocks(candidates: list, events: list, skip_reasons: dict):
    """:func:`_prepare_rewrites`, dropping every parallel block one of whose additions is not patched (its
    partial sums would be added raw, its last addition would wait for them): a block is patched whole or not
    at all."""
    while True:
        kept = {ev.index for ev in candidates}
        drop = {}
        for ev in candidates:
            block = _parallel_block(ev, events)
            missing = [m for m in block if m.index not in kept]
            if missing:
                drop[ev.index] = (f"part of the parallel block merged at {block[-1].location}, whose addition at "
                                  f"{missing[0].location} is not patched"
                                  + (f" ({skip_reasons[missing[0].index]})" if missing[0].index in skip_reasons
                                     else ""))
        skip_reasons.update(drop)
        candidates = [ev for ev in candidates if ev.index not in drop]
        candidates, methods, rewritten = _prepare_rewrites(candidates, skip_reasons)
        if all(m.index in {ev.index for ev in candidates} for ev in candidates for m in _parallel_block(ev, events)):
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
            key = _site_key(ev)
            if key not in attrs:
                attrs[key] = f"{_SITE_PREFIX}{counter[0]}"
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


# ops that only rename or re-view a tensor: a stream reaching the next merge through them is still the stream
_TRANSPARENT = {"view", "reshape", "flatten", "unflatten", "contiguous", "clone", "squeeze", "unsqueeze"}


def _build_chains(merges: list, nodes: list) -> list:
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


def _chain_dim(chain: list) -> int:
    """Feature dim of a chain's stream: 1 (channels-first) when its branches start with a convolution, else -1."""
    return chain[0].feature_dim


# ---------------------------------------------------------------------------------------------- apply
def _common_path(paths: list) -> list:
    """The longest common prefix of dotted module paths, as a list of names."""
    common = []
    for parts in zip(*[p.split(".") if p else [] for p in paths]):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return common


def _lca_owner(model: nn.Module, paths: list) -> tuple:
    """The nearest common ancestor of module paths that is not a container (ModuleList, Sequential...)."""
    common = _common_path(paths)
    while True:
        path = ".".join(common)
        mod = model.get_submodule(path) if path else model
        if not isinstance(mod, _CONTAINERS) or not common:
            return path, mod
        common.pop()


def _chain_owner(model: nn.Module, plan: _Plan, chain: list) -> tuple:
    """Where a chain's module is registered: the nearest common ancestor of its merges' modules that is not
    a container (a Sequential/ModuleList would iterate it as a layer)."""
    owner_path, owner = _lca_owner(model, [plan.paths[id(ev.owner)] for ev in chain])
    if isinstance(owner, _CONTAINERS):  # the model itself is a Sequential/ModuleList
        owner_path, owner = plan.paths[id(chain[0].owner)], chain[0].owner
    return owner_path, owner


def _chain_scope(model: nn.Module, obs: Observation, paths: list) -> nn.Module:
    """The module whose forward delimits one run of a chain: from the common ancestor of the chain's
    modules ``paths`` up, the first module that the observed forward called exactly once (at worst the
    model itself)."""
    path = ".".join(_common_path(paths))
    while True:
        mod = model.get_submodule(path) if path else model
        if obs.call_counts.get(id(mod), 0) == 1 or not path:
            return mod
        path = path.rpartition(".")[0]


def _expected_positions(plan: _Plan, sites: dict, other: Optional[Observation], chain_of: dict) -> dict:
    """Per chain: the positions observed to run in eval mode. Each eval-mode merge is matched to the
    training-mode merge of the same expression whose branch ran the same modules (a loop over blocks
    skipping one of them), else to the next one in order (a weight-tied loop)."""
    if other is None:
        return {}
    out: dict = {}
    used: dict = {}
    for ev in other.events:
        if ev.owner is None or ev.position is None or not ev.is_merge:
            continue
        key = _site_key(ev)
        site = sites.get(key)
        if site is None:
            continue
        taken = used.setdefault(key, set())
        group = plan.groups[key]
        pick = next((i for i, g in enumerate(group) if i not in taken and g.branch_modules == ev.branch_modules),
                    None)
        if pick is None:
            pick = next((i for i in range(len(group)) if i not in taken), None)
        if pick is None:
            continue
        taken.add(pick)
        out.setdefault(chain_of[id(site)], []).append(site.positions[pick])
        site.mode_positions.setdefault("eval", []).append(site.positions[pick])
    return out


def _apply(model: nn.Module, plan: _Plan, rule, report: PatchReport, obs: Observation,
           other: Optional[Observation]) -> _PatchState:
    state = _PatchState(report=report)
    chain_index = {}
    position_of = {}
    for ci, chain in enumerate(plan.chains):
        for k, ev in enumerate(chain):
            chain_index[ev.index] = ci
            position_of[ev.index] = k
    chain_dims = [_chain_dim(chain) for chain in plan.chains]
    is_chain = rule.kind == "chain"

    # chain modules (chain rules): one per chain, registered on the chain's owner
    chain_modules: list = [None] * len(plan.chains)
    owners: list = [None] * len(plan.chains)
    for ci, chain in enumerate(plan.chains):
        d = chain_dims[ci]
        if not is_chain:
            report.chains.append(ChainInfo(ci, len(chain), chain[0].shapes[0], d))
            continue
        width = chain[0].shapes[0][d]
        mod = rule.build_chain(width, len(chain))
        ref = chain[0].owner
        device = _first_tensor_device(ref)
        dtype = _first_float_dtype(ref)
        if device is not None or dtype is not None:
            mod.to(device=device, dtype=dtype)
        owner_path, owner = _chain_owner(model, plan, chain)
        n = 0
        while f"{rule.chain_attr}{n}" in owner._modules:
            n += 1
        attr = f"{rule.chain_attr}{n}"
        mod.train(owner.training)  # new modules follow the mode of the module they are added to
        owner.add_module(attr, mod)
        state.added.append((owner, attr))
        chain_modules[ci] = mod
        owners[ci] = _chain_scope(model, obs, [plan.paths[id(ev.owner)] for ev in chain])
        report.chains.append(ChainInfo(ci, len(chain), chain[0].shapes[0], d,
                                       owner=(owner_path + "." if owner_path else "") + attr, module=mod,
                                       note=getattr(mod, "init_note", None)))

    # sites
    sites: dict = {}
    for key, group in plan.groups.items():
        ev0 = group[0]
        if ev0.is_partial:
            continue
        ci = chain_index[ev0.index]
        d = chain_dims[ci]
        positions = tuple(position_of[ev.index] for ev in group)
        inplace = None
        if ev0.inplace:
            inplace = "stream" if ev0.stream_operand == 0 else "update"
        merge = None if is_chain else rule.build_merge(d)
        sites[key] = MergeSite(
            rule, path=plan.paths[id(ev0.owner)], location=ev0.location, source_line=_source_line(ev0),
            stream_shape=ev0.shapes[0], chain=ci, positions=positions, dim=d, inplace=inplace, merge=merge,
            chain_module=chain_modules[ci], run=None if not is_chain else _PENDING)
        sites[key].stream_first = ev0.stream_operand == 0
        sites[key].train(ev0.owner.training)  # new modules follow the mode of the module they are added to
        # set after construction (sites.py is not concerned): branch label and free-function provenance
        sites[key].branch = branch_kind(ev0)
        sites[key].function = ev0.function_name if ev0.calls else ""
        sites[key].called_at = ev0.call_location

    # parallel blocks written as several additions: each addition before the last is a ParallelPart feeding
    # the last one's site
    parts: dict = {}
    for key, group in plan.groups.items():
        ev0 = group[0]
        if not ev0.is_partial:
            continue
        block = _parallel_block(ev0, obs.events)
        final = sites[_site_key(block[-1])]
        if final.parallel is None:
            final.__dict__["_parallel"] = ParallelRun()
        inplace = None
        if ev0.inplace:
            inplace = "stream" if ev0.stream_operand == 0 else "update"
        parts[key] = ParallelPart(final.parallel, first=ev0 is block[0], location=ev0.location,
                                  source_line=_source_line(ev0), inplace=inplace,
                                  stream_first=ev0.stream_operand == 0, merged_at=final.location)

    # chain runs: expected merges per mode, reset/check hooks on each chain's owner
    if is_chain:
        chain_of = {id(site): site.chain for site in sites.values()}
        eval_positions = _expected_positions(plan, sites, other, chain_of)
        runs = {}
        for ci, chain in enumerate(plan.chains):
            expected = {"train": range(len(chain)), "eval": eval_positions.get(ci, ())}
            run = ChainRun(ci, len(chain), expected,
                           tuple(f"{plan.paths[id(ev.owner)] or 'root'}: {ev.location}" for ev in chain))
            runs[ci] = run
            state.hooks.append(owners[ci].register_forward_pre_hook(ChainStart(run)))
            state.hooks.append(owners[ci].register_forward_hook(ChainEnd(run), always_call=True))
        for site in sites.values():
            site.__dict__["_run"] = runs[site.chain]
            site.mode_positions = {"train": site.positions, "eval": tuple(site.mode_positions.get("eval", ()))}

    # bind: register sites, swap classes
    for oid, (owner, spec, attrs) in plan.methods.items():
        cls = type(owner)
        sub = plan.rewritten[oid]
        names = []
        for key, attr in attrs.items():
            owner.add_module(attr, sites[key] if key in sites else parts[key])
            names.append(attr)
        owner.__class__ = sub
        state.owners.append((owner, cls, names))
    _turn_off_native_fast_paths(model, state)

    # report entries: one per merge execution
    for ev in sorted((e for e in plan.merges if not e.is_partial),
                     key=lambda e: (chain_index[e.index], position_of[e.index])):
        site = sites[_site_key(ev)]
        report.sites.append(SiteInfo(
            path=site.path, location=site.location, source_line=site.source_line, stream_shape=site.stream_shape,
            chain=chain_index[ev.index], position=position_of[ev.index], method=rule.name, dim=site.dim,
            stream_operand="left" if ev.stream_operand == 0 else "right", site=site,
            branch=getattr(site, "branch", ""), function=getattr(site, "function", ""),
            called_at=getattr(site, "called_at", ""),
            parallel_parts=tuple(f"{m.location}: {_source_line(m)}" for m in _parallel_block(ev, obs.events)[:-1])))
    return state


def _turn_off_native_fast_paths(model: nn.Module, state: _PatchState) -> None:
    """The patched lines must run in every mode: see :data:`_NATIVE_FAST_PATHS`."""
    patched = {id(owner) for owner, _, _ in state.owners}
    for module in model.modules():
        for fast_cls, attr, off in _NATIVE_FAST_PATHS:
            if (isinstance(module, fast_cls) and hasattr(module, attr)
                    and any(id(m) in patched for m in module.modules())):
                state.switched.append((module, attr, getattr(module, attr)))
                setattr(module, attr, off)


_PENDING = ChainRun(-1, 0, {})  # placeholder until the chain's run is built


def _first_tensor_device(module: nn.Module):
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def _first_float_dtype(module: nn.Module):
    for t in module.parameters():
        if t.is_floating_point():
            return t.dtype
    return None


# ---------------------------------------------------------------------------------------------- observation
class preserved:
    """Context manager: whatever a forward run inside does to ``model`` — buffers (BatchNorm running stats,
    ``num_batches_tracked``), plain Python attributes of its modules (counters, caches), the training flags
    and the global RNG state — is undone on exit."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        import copy

        import torch

        self.training = [(m, m.training) for m in self.model.modules()]
        self.buffers = [(m, name, b, b.detach().clone()) for m in self.model.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.buffer_names = [(m, set(m._buffers)) for m in self.model.modules()]
        self.attrs = []
        for m in self.model.modules():
            plain = {}
            for k, v in vars(m).items():
                if k.startswith("_") and k in _MODULE_INTERNALS:
                    continue
                plain[k] = (v, copy.copy(v) if isinstance(v, (list, dict, set)) else None)
            self.attrs.append((m, plain))
        self.rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        import torch

        for m, names in self.buffer_names:
            for name in list(m._buffers):
                if name not in names:
                    del m._buffers[name]
        with torch.no_grad():
            for m, name, b, saved in self.buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                if b.shape == saved.shape:
                    b.copy_(saved)
                else:
                    m._buffers[name] = saved
        for m, plain in self.attrs:
            d = vars(m)
            for k in [k for k in d if k not in plain and not (k.startswith("_") and k in _MODULE_INTERNALS)]:
                del d[k]
            for k, (v, shallow) in plain.items():
                d[k] = v
                if shallow is not None:
                    v.clear()
                    v.update(shallow) if not isinstance(v, list) else v.extend(shallow)
        for m, flag in self.training:
            m.training = flag
        torch.random.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
                     "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"}
