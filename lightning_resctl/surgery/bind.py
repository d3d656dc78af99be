"""Bind: build the plan's merge sites, chain modules and chain runs, and put them into the model (the fourth step
of :func:`~lightning_resctl.surgery.patch_residuals`: observe -> classify -> plan -> **bind** -> describe).

Every object is built complete, in dependency order, and never edited afterwards:

1. the chain modules (chain rules: one per chain, given its blocks, registered on the chain's owner) and the
   chains' report entries;
2. the chain runs (chain rules: the merges each chain expects per mode, the reset/check hooks on its scope);
3. the parallel runs (one per parallel block written as several additions);
4. the sites — :class:`MergeSite` per merge expression with its rule, chain module, run, positions per mode,
   parallel run, branch label, free-function provenance and the tally of its module (:mod:`.tally`) — and the
   :class:`ParallelPart` of each earlier addition of a parallel block;
5. the patched modules: sites registered, classes swapped to their patched subclasses, the tallies' hooks
   (every observed merge ran in each call), native fast paths that would skip the rewritten lines turned off.

:func:`bind` returns a :class:`Binding`: the :class:`PatchState` that :func:`unpatch_residuals` undoes, and what
:func:`~lightning_resctl.surgery.report.describe` reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from torch import nn

from .chain_run import ChainEnd, ChainRun, ChainStart
from .events import Observation, parallel_block, site_key, source_line
from .parallel import ParallelPart, ParallelRun
from .plan import CONTAINERS, Plan, branch_kind, chain_blocks, chain_dim
from .report import ChainInfo, PatchReport
from .sites import MergeSite, SitePlace, mark_rule_module
from .tally import hook_tallies, site_tallies

__all__ = ["bind", "Binding", "BoundMerge", "PatchState"]


@dataclass
class PatchState:
    """What unpatch_residuals needs: the patched modules, their classes, and what was added where."""

    report: PatchReport
    owners: list = field(default_factory=list)   # (module, original class, [site attribute names])
    added: list = field(default_factory=list)    # (module, attribute name) of registered chain modules
    hooks: list = field(default_factory=list)    # hook handles of the chains' owners
    switched: list = field(default_factory=list)  # (module, attribute, original value): native fast paths turned off


class BoundMerge(NamedTuple):
    """One merge execution of the observed forward, as bound: its site, chain and position in the chain, whether
    the stream is the left operand, and the earlier additions of its parallel block (``"file:line: source"``)."""

    site: MergeSite
    chain: int
    position: int
    stream_first: bool
    parallel_parts: tuple


@dataclass
class Binding:
    """What :func:`bind` put into the model: the patch's :class:`PatchState`, one :class:`ChainInfo` per chain and
    one :class:`BoundMerge` per merge execution (by chain, then position)."""

    state: PatchState
    chains: list
    merges: list


#: Modules whose forward can take a native kernel instead of the Python lines the patch rewrites, in eval under
#: ``no_grad`` (how Lightning validates): ``nn.TransformerEncoderLayer``'s fused inference path and
#: ``nn.TransformerEncoder``'s nested-tensor path over such layers. For each: the attribute that turns the path off
#: and its value, set on every such module that is or holds a patched module (restored by unpatching). The
#: attributes are only read by those checks (and handed to the fused kernel): the Python forward is unchanged.
_NATIVE_FAST_PATHS = ((nn.TransformerEncoderLayer, "activation_relu_or_gelu", 0),
                      (nn.TransformerEncoder, "use_nested_tensor", False))


def bind(model: nn.Module, plan: Plan, rule, report: PatchReport, obs: Observation,
         other: Optional[Observation]) -> Binding:
    """Build the sites, chain modules and chain runs of ``plan`` (see the module docstring) and put them into
    ``model``; ``report`` is the patch's report (kept in the :class:`PatchState`), ``obs`` / ``other`` the training /
    eval observations the plan was made from."""
    state = PatchState(report)
    chain_index, position_of = {}, {}
    for ci, chain in enumerate(plan.chains):
        for k, ev in enumerate(chain):
            chain_index[ev.index] = ci
            position_of[ev.index] = k
    dims = [chain_dim(chain) for chain in plan.chains]
    positions = {key: tuple(position_of[ev.index] for ev in group)
                 for key, group in plan.groups.items() if not group[0].is_partial}
    is_chain = rule.kind == "chain"

    chain_slots, chains = _chain_modules(model, plan, rule, dims, state) if is_chain else (
        [None] * len(plan.chains),
        [ChainInfo(ci, len(chain), chain[0].shapes[0], dims[ci]) for ci, chain in enumerate(plan.chains)])
    runs, eval_positions = ({}, {}) if not is_chain else _chain_runs(model, plan, obs, other, chain_index, positions,
                                                                     state)
    parallel: dict = {}   # site key of the last addition of a parallel block -> the block's run
    for group in plan.groups.values():
        if group[0].is_partial:
            parallel.setdefault(site_key(parallel_block(group[0], obs.events)[-1]), ParallelRun())

    tallies = site_tallies(plan, obs, other)
    tally_of = {key: (tally, bit) for _, tally, bits in tallies.values() for key, bit in bits.items()}
    sites: dict = {}
    for key, group in plan.groups.items():
        ev0 = group[0]
        if ev0.is_partial:
            continue
        ci = chain_index[ev0.index]
        mode_positions = {"train": positions[key], "eval": tuple(eval_positions.get(key, ()))} if is_chain else {}
        place = SitePlace(path=plan.paths[id(ev0.owner)], location=ev0.location, source_line=source_line(ev0),
                          branch=branch_kind(ev0), function=ev0.function_name if ev0.calls else "",
                          called_at=ev0.call_location)
        site = MergeSite(
            rule, place, stream_shape=ev0.shapes[0], chain=ci, positions=positions[key], dim=dims[ci],
            inplace=_inplace(ev0), merge=None if is_chain else _merge_module(rule, ev0, dims[ci]),
            chain_slot=chain_slots[ci],
            run=runs.get(ci), mode_positions=mode_positions, parallel=parallel.get(key),
            stream_first=ev0.stream_operand == 0, tally=tally_of[key])
        sites[key] = site.train(ev0.owner.training)  # new modules follow the mode of the module they are added to
        if is_chain:
            runs[ci].members.append(site)
    # each addition of a parallel block before the last is a ParallelPart feeding the last one's site
    parts: dict = {}
    for key, group in plan.groups.items():
        ev0 = group[0]
        if ev0.is_partial:
            block = parallel_block(ev0, obs.events)
            final = sites[site_key(block[-1])]
            parts[key] = ParallelPart(final.parallel, first=ev0 is block[0], location=ev0.location,
                                      source_line=source_line(ev0), inplace=_inplace(ev0),
                                      stream_first=ev0.stream_operand == 0, merged_at=final.location)

    # the patched modules: sites registered, classes swapped
    for oid, (owner, spec, attrs) in plan.methods.items():
        cls = type(owner)
        names = []
        for key, attr in attrs.items():
            owner.add_module(attr, sites[key] if key in sites else parts[key])
            names.append(attr)
        owner.__class__ = plan.rewritten[oid]
        state.owners.append((owner, cls, names))
    hook_tallies(tallies, state.hooks)
    for site in sites.values() if is_chain else ():
        site.bind_positions()
    _turn_off_native_fast_paths(model, state)

    merges = [BoundMerge(sites[site_key(ev)], chain_index[ev.index], position_of[ev.index], ev.stream_operand == 0,
                         tuple(f"{m.location}: {source_line(m)}" for m in parallel_block(ev, obs.events)[:-1]))
              for ev in plan.merges if not ev.is_partial]
    merges.sort(key=lambda m: (m.chain, m.position))
    return Binding(state, chains, merges)


def _inplace(ev) -> Optional[str]:
    """The operand an in-place addition writes ("stream" / "update"), or None."""
    if not ev.inplace:
        return None
    return "stream" if ev.stream_operand == 0 else "update"


def _merge_module(rule, ev, dim: int) -> Optional[nn.Module]:
    """A per-merge rule's module for the site of ``ev`` (given the stream's feature dim and its size), on the device
    and dtype of the module whose forward holds the addition (as a chain module is)."""
    mod = rule.build_merge_sized(dim, ev.shapes[0][dim])
    if mod is not None:
        device, dtype = _first_tensor_device(ev.owner), _first_float_dtype(ev.owner)
        if device is not None or dtype is not None:
            mod.to(device=device, dtype=dtype)
    return mod


def _chain_modules(model: nn.Module, plan: Plan, rule, dims: list, state: PatchState) -> tuple:
    """Chain rules: one chain module per chain, on the device and dtype of the chain's first module, registered on
    the chain's owner (:func:`_chain_owner`); returns where each is registered (``(owner, attribute)``, what the
    sites read it from) and the chains' report entries."""
    slots, infos = [], []
    for ci, chain in enumerate(plan.chains):
        d = dims[ci]
        mod = rule.build_chain_in_blocks(chain[0].shapes[0][d], chain_blocks(model, chain, plan.paths))
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
        owner.add_module(attr, mark_rule_module(mod))
        state.added.append((owner, attr))
        slots.append((owner, attr))
        infos.append(ChainInfo(ci, len(chain), chain[0].shapes[0], d,
                               owner=(owner_path + "." if owner_path else "") + attr, module=mod,
                               note=getattr(mod, "init_note", None)))
    return slots, infos


def _chain_runs(model: nn.Module, plan: Plan, obs: Observation, other: Optional[Observation], chain_index: dict,
                positions: dict, state: PatchState) -> tuple:
    """Chain rules: one :class:`ChainRun` per chain (the merges it expects in each mode), reset and checked by
    hooks on the module whose single call encloses the chain (:func:`_chain_scope`). Returns the runs by chain
    and the eval-mode positions by site key."""
    eval_by_chain, eval_by_key = _eval_positions(plan, other, chain_index, positions)
    runs = {}
    for ci, chain in enumerate(plan.chains):
        expected = {"train": range(len(chain)), "eval": eval_by_chain.get(ci, ())}
        run = ChainRun(ci, len(chain), expected,
                       tuple(f"{plan.paths[id(ev.owner)] or 'root'}: {ev.location}" for ev in chain))
        scope = _chain_scope(model, obs, [plan.paths[id(ev.owner)] for ev in chain])
        state.hooks.append(scope.register_forward_pre_hook(ChainStart(run)))
        state.hooks.append(scope.register_forward_hook(ChainEnd(run), always_call=True))
        runs[ci] = run
    return runs, eval_by_key


def _eval_positions(plan: Plan, other: Optional[Observation], chain_index: dict, positions: dict) -> tuple:
    """The positions observed to run in eval mode, per chain (in the order they ran) and per site key. Each
    eval-mode merge is matched to the training-mode merge of the same expression whose branch ran the same
    modules (a loop over blocks skipping one of them), else to the next one in order (a weight-tied loop)."""
    by_chain: dict = {}
    by_key: dict = {}
    if other is None:
        return by_chain, by_key
    used: dict = {}
    for ev in other.events:
        if ev.owner is None or ev.position is None or not ev.is_merge:
            continue
        key = site_key(ev)
        if key not in positions:
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
        by_chain.setdefault(chain_index[group[0].index], []).append(positions[key][pick])
        by_key.setdefault(key, []).append(positions[key][pick])
    return by_chain, by_key


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
        if not isinstance(mod, CONTAINERS) or not common:
            return path, mod
        common.pop()


def _chain_owner(model: nn.Module, plan: Plan, chain: list) -> tuple:
    """Where a chain's module is registered: the nearest common ancestor of its merges' modules that is not
    a container (a Sequential/ModuleList would iterate it as a layer)."""
    owner_path, owner = _lca_owner(model, [plan.paths[id(ev.owner)] for ev in chain])
    if isinstance(owner, CONTAINERS):  # the model itself is a Sequential/ModuleList
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


def _turn_off_native_fast_paths(model: nn.Module, state: PatchState) -> None:
    """The patched lines must run in every mode: see :data:`_NATIVE_FAST_PATHS`."""
    patched = {id(owner) for owner, _, _ in state.owners}
    for module in model.modules():
        for fast_cls, attr, off in _NATIVE_FAST_PATHS:
            if (isinstance(module, fast_cls) and hasattr(module, attr)
                    and any(id(m) in patched for m in module.modules())):
                state.switched.append((module, attr, getattr(module, attr)))
                setattr(module, attr, off)


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
