"""Plan: which of the merges (:mod:`.classify`) become merge sites, and how (the third step of
:func:`~lightning_resctl.surgery.patch_residuals`: observe -> classify -> **plan** -> bind -> describe).

* checks — the model can be patched (not wrapped, not patched already; the rule accepts it), include/exclude
  patterns, a rule that cannot run inside activation checkpointing;
* the plan — the merges to patch (training-mode forward, plus eval-only lines calling the site of the same
  branch), what is skipped and why, one site per expression (:func:`site_key`);
* what can be rewritten — the patched classes are built for the candidates (:func:`.rewrite.prepare_whole_blocks`);
  the lines that ran in one mode only call the site of the same branch in the other mode (:mod:`.modes`);
* the chains — merges grouped by the stream they continue (:func:`build_chains`), and a chain's merges grouped
  by the block of the model that runs them (:func:`chain_blocks`, for the rules that act per block);
* the branch kind — a label of each merge's branch from its modules' names (:func:`branch_kind`).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from .events import AddEvent, Observation, callees, site_key, source_line
from .modes import check_both_lines, line_key, match_other_mode, renumber
from .report import SkippedInfo
from .rewrite import is_patched_class, prepare_whole_blocks
from .sites import MergeSite

__all__ = ["Plan", "make_plan", "check_model", "check_patterns", "refuse_checkpointed", "branch_kind", "build_chains",
           "chain_dim", "chain_blocks"]

#: where a patched module keeps its patch's state (read by unpatch_residuals / get_patch_report)
STATE_ATTR = "_resctl_patch"
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


def make_plan(model: nn.Module, obs: Observation, rule, include, exclude,
          other: Optional[Observation] = None) -> Plan:
    """What to patch: the merges of the training-mode observation ``obs``, and the merges of lines that ran
    only in the eval-mode observation ``other`` (each calls the site of the training-mode merge of the same
    branch; see :func:`match_other_mode`)."""
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
        renumber(other, len(obs.events))  # one index space: skip reasons and rewrite failures are keyed by it
        seen = {line_key(ev) for ev in obs.events}
        other_only = [ev for ev in other.events if line_key(ev) not in seen]
        only = {ev.index for ev in other_only}
        extras = [ev for ev in _candidates(other, include, exclude, skip_reasons, path_of) if ev.index in only]
    unmatched = match_other_mode(extras, candidates, rule, path_of)

    # rewrite feasibility, per owner instance; a parallel block is patched whole or not at all; the line of
    # one mode is patched with the line of the other mode it shares a site with, or not at all
    def prepare(primary, extras):
        while True:
            both, methods, rewritten = prepare_whole_blocks(primary + extras, obs.events, skip_reasons)
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

    check_both_lines(other_only, candidates, skip_reasons, path_of)
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
        lambdas = [c.co_name for c in callees(ev) if c.co_name.startswith("<")]
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


def chain_blocks(model: nn.Module, chain: list, paths: dict) -> tuple:
    """A chain's merges grouped by the block that runs them: the number of merges of each block, in order (they
    sum to ``len(chain)``). A merge's block is the module holding it (its owner) or the owner's innermost ancestor
    that is an item of a container (``ModuleList`` / ``Sequential`` / ``ModuleDict``: the model's stack of
    blocks); consecutive merges of one block form one group, and a merge whose expression already ran in the
    group starts a new one (the same block called again: a weight-tied loop). GPT-2, Llama, the nanoGPT: two
    merges per block; a ResNet: one."""
    def block_of(ev) -> str:
        path = paths.get(id(ev.owner), "")
        parts = path.split(".") if path else []
        for end in range(len(parts), 0, -1):
            parent = ".".join(parts[:end - 1])
            if isinstance(model.get_submodule(parent) if parent else model, CONTAINERS):
                return ".".join(parts[:end])
        return path

    sizes: list = []
    block, seen = None, set()
    for ev in chain:
        b, key = block_of(ev), site_key(ev)
        if b != block or key in seen:
            sizes.append(0)
            block, seen = b, set()
        sizes[-1] += 1
        seen.add(key)
    return tuple(sizes)


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
