"""patch_residuals / unpatch_residuals: rewrite the residual merges of any model, reversibly."""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from torch import nn

from .observe import AddEvent, Observation, observe
from .report import ChainInfo, PatchReport, SiteInfo, SkippedInfo
from .rewrite import Edit, RewriteError, is_patched_class, patched_subclass, unwrap_depth
from .sites import METHODS, ChainState, MergeSite

__all__ = ["patch_residuals", "unpatch_residuals", "get_patch_report", "merge_sites", "load_unpatched_state_dict"]

_STATE_ATTR = "_resctl_patch"
_SITE_PREFIX = "_resctl_site"
_CHAIN_PREFIX = "_resctl_mgr"
_RESCONTROLLER_OPTIONS = ("update_ratio", "stream_ratio", "update_softness", "stream_softness", "eps", "backend")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


@dataclass
class _PatchState:
    """What unpatch_residuals needs: the patched modules, their classes, and what was added where."""

    report: PatchReport
    owners: list = field(default_factory=list)   # (module, original class, [site attribute names])
    added: list = field(default_factory=list)    # (module, attribute name) of registered MGR chains


# ---------------------------------------------------------------------------------------------- public API
def patch_residuals(model: nn.Module, method: str = "rescontroller", example_input: Any = None,
                    include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None,
                    allow_empty: bool = False, **method_options) -> PatchReport:
    """Rewrite every residual merge of ``model`` in place and return a :class:`PatchReport`.

    A residual merge is an addition ``stream + update`` (any spelling: ``a + b``, ``b + a``,
    ``torch.add``, ``+=``, ``add_``) executed in a module's forward, where both operands have the same
    shape and the update is computed from the stream through a branch with learned parameters; the
    stream is the chain input or the previous merge's result. Merges are found by running one forward
    on ``example_input`` (default ``model.example_input_array``; a tuple is passed as ``*args``, a dict as
    ``**kwargs``) and watching every addition; each one is rewritten in its forward's source into a call
    of a :class:`MergeSite` computing

    * ``method="add"``: ``stream + update`` (the control: bitwise equal to the unpatched model);
    * ``method="rescontroller"``: ``r + s_u * s_s * u`` (``ResController``; options ``update_ratio``,
      ``stream_ratio``, ``update_softness``, ``stream_softness``, ``eps``, ``backend``);
    * ``method="mgr"``: Multi-Gate Residuals over each chain (options ``streams=4``,
      ``gating="competitive"`` and the other ``MGRChain`` options). The model's code between merges sees
      the pooled view that the next branch reads, with the original shape; the chain's last merge returns
      the chain's output pool.

    The model object, its parameter names and its modules' ``isinstance`` are kept (patched modules get
    a per-instance subclass); :func:`unpatch_residuals` restores them exactly.

    Args:
        include / exclude: module-path patterns (``fnmatch``; a plain name also matches its submodules)
            limiting which modules' additions may be patched.
        allow_empty: return an empty report instead of raising when nothing is found.

    Raises:
        ValueError: unknown ``method``/options, or no example input.
        RuntimeError: the model is already patched, or no merge was found (unless ``allow_empty``).
        TypeError: the model is wrapped (DDP/FSDP/compiled): patch it before wrapping.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_unwrapped(model)
    _check_not_patched(model)
    options = _check_options(method, method_options)
    if method == "mgr":
        for path, mod in model.named_modules():
            if getattr(mod, "gradient_checkpointing", False) is True:
                raise ValueError(f"method='mgr' cannot be used with activation checkpointing (enabled on "
                                 f"{path or type(model).__name__!r}): MGR's streams travel beside the model "
                                 "between merges and a recomputed block would replay its merges. Disable "
                                 "gradient checkpointing or use method='rescontroller'")
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
        if example_input is None:
            raise ValueError("example_input is required (or set model.example_input_array): patch_residuals runs "
                             "one forward to find the merges")
    include = _patterns(include, "include")
    exclude = _patterns(exclude, "exclude")

    t0 = time.perf_counter()
    obs = observe(model, example_input)
    plan = _plan(model, obs, method, include, exclude)
    searched = (f"searched {obs.num_modules} modules of {type(model).__name__}: one forward on the example input "
                f"ran {obs.num_ops} torch ops, {len(obs.events)} additions of two tensors")
    report = PatchReport(method=method, options=dict(options), skipped=plan.skipped, searched=searched)
    if not plan.merges:
        if allow_empty:
            report.patch_seconds = time.perf_counter() - t0
            return report
        reasons = "; ".join(sorted({s.reason for s in plan.skipped})) or "no addition of two tensors ran"
        raise RuntimeError(f"patch_residuals found no residual merge to patch: {searched}. "
                           f"Skipped additions: {reasons}. (Pass allow_empty=True to accept this.)")
    before = set(model.state_dict().keys())
    state = _apply(model, plan, method, options, report)
    report.new_parameters = [k for k in model.state_dict().keys() if k not in before]
    report.patch_seconds = time.perf_counter() - t0
    model.__dict__[_STATE_ATTR] = state
    return report


def unpatch_residuals(model: nn.Module) -> None:
    """Undo :func:`patch_residuals`: original classes back, sites and MGR chains removed.

    ``model`` is the module that was patched, or a module holding it (e.g. a LightningModule whose
    ``self.model`` was patched): every patch found in it is undone. Outputs are bitwise identical to the
    model before patching (MGR parameters are dropped). Raises RuntimeError when nothing is patched."""
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
        del holder.__dict__[_STATE_ATTR]


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


def load_unpatched_state_dict(model: nn.Module, state_dict: dict) -> list:
    """Load a checkpoint of the *unpatched* model into the patched ``model``.

    Every key of ``state_dict`` must match; the only keys allowed to be missing are the parameters the
    patch added (``report.new_parameters``: MGR's queries and biases), which keep their init. Returns the
    list of those new keys. Raises RuntimeError for any other missing or unexpected key."""
    report = get_patch_report(model)
    if report is None:
        raise RuntimeError("model is not patched: use model.load_state_dict")
    result = model.load_state_dict(state_dict, strict=False)
    new = set(report.new_parameters)
    missing = [k for k in result.missing_keys if k not in new]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not match the unpatched model: missing keys {missing}, "
                           f"unexpected keys {list(result.unexpected_keys)}")
    return [k for k in result.missing_keys if k in new]


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


def _check_options(method: str, options: dict) -> dict:
    if method == "add":
        if options:
            raise ValueError(f"method='add' takes no options, got {sorted(options)}")
        return {}
    if method == "rescontroller":
        bad = set(options) - set(_RESCONTROLLER_OPTIONS) - {"dim"}
        if bad:
            raise ValueError(f"unknown option(s) for method='rescontroller': {sorted(bad)} "
                             f"(valid: {list(_RESCONTROLLER_OPTIONS)})")
        return dict(options)
    import inspect

    from ..mgr import MGRChain

    valid = [p for p in inspect.signature(MGRChain.__init__).parameters if p not in ("self", "dim", "num_merges")]
    bad = set(options) - set(valid)
    if bad:
        raise ValueError(f"unknown option(s) for method='mgr': {sorted(bad)} (valid: {valid}; dim and num_merges "
                         "come from the model)")
    out = dict(options)
    out.setdefault("streams", 4)
    out.setdefault("gating", "competitive")
    return out


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


def _site_key(ev: AddEvent) -> tuple:
    return (id(ev.owner), ev.method_name, ev.position)


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


def _plan(model: nn.Module, obs: Observation, method: str, include, exclude) -> _Plan:
    paths = obs.module_paths
    skip_reasons: dict = {}   # event index -> reason

    def path_of(ev):
        if ev.owner is None or id(ev.owner) not in paths:
            return f"<function {ev.function_name}>"
        return paths[id(ev.owner)]

    candidates = []
    for ev in obs.events:
        if not ev.is_merge:
            skip_reasons[ev.index] = ev.reason
            continue
        if ev.owner is None or ev.method_name is None:
            skip_reasons[ev.index] = (f"the addition runs in function {ev.function_name!r}, not in a method of a "
                                      "module of the model: cannot rewrite it")
            continue
        if id(ev.owner) not in paths:
            skip_reasons[ev.index] = "the addition runs in a module outside the model"
            continue
        if isinstance(ev.owner, _CONTAINERS):
            skip_reasons[ev.index] = (f"the addition runs in a container module ({type(ev.owner).__name__} is an "
                                      "nn.Sequential/ModuleList/ModuleDict): a merge module registered on it would "
                                      "be iterated as one of its layers")
            continue
        if ev.position is None:
            skip_reasons[ev.index] = "no source position for the addition"
            continue
        p = path_of(ev)
        if include is not None and not _matches(p, include):
            skip_reasons[ev.index] = "not matched by include"
            continue
        if exclude is not None and _matches(p, exclude):
            skip_reasons[ev.index] = "matched by exclude"
            continue
        candidates.append(ev)

    # an expression is patched only when every execution of it is the same kind of merge
    all_by_key: dict = {}
    for ev in obs.events:
        if ev.owner is not None and ev.position is not None:
            all_by_key.setdefault(_site_key(ev), []).append(ev)
    ok = []
    for ev in candidates:
        group = all_by_key[_site_key(ev)]
        kinds = {(g.is_merge, g.stream_operand) for g in group}
        if len(kinds) > 1:
            skip_reasons[ev.index] = ("this expression is a merge in some executions and not in others "
                                      "(or swaps stream and update)")
        else:
            ok.append(ev)
    candidates = ok

    # rewrite feasibility, per owner instance
    candidates, methods, rewritten = _prepare_rewrites(candidates, skip_reasons)

    # chains (and, for MGR, one chain per site)
    while True:
        chains = _build_chains(candidates, obs.nodes)
        if method != "mgr":
            break
        chain_of = {}
        for ci, chain in enumerate(chains):
            for ev in chain:
                chain_of.setdefault(_site_key(ev), set()).add(ci)
        bad = {key for key, cs in chain_of.items() if len(cs) > 1}
        if not bad:
            break
        for ev in candidates:
            if _site_key(ev) in bad:
                skip_reasons[ev.index] = "one expression runs merges of several chains (shared module): MGR needs one"
        candidates = [ev for ev in candidates if _site_key(ev) not in bad]
        candidates, methods, rewritten = _prepare_rewrites(candidates, skip_reasons)

    groups: dict = {}
    for ev in candidates:
        groups.setdefault(_site_key(ev), []).append(ev)

    skipped: dict = {}
    for ev in obs.events:
        reason = skip_reasons.get(ev.index)
        if reason is None:
            continue
        p = path_of(ev)
        key = (p, ev.location, reason)
        if key in skipped:
            skipped[key].count += 1
        else:
            skipped[key] = SkippedInfo(p, ev.location, _source_line(ev), reason)
    return _Plan(candidates, chains, groups, list(skipped.values()), methods, rewritten, paths)


def _prepare_rewrites(candidates: list, skip_reasons: dict):
    """Assign site attribute names per owner and build the owners' patched classes; drop what cannot be
    rewritten (with the reason)."""
    while True:
        per_owner: dict = {}
        for ev in candidates:
            entry = per_owner.setdefault(id(ev.owner), (ev.owner, {}))
            entry[1].setdefault(ev.method_name, {})[ev.position] = (ev.code, ev.stream_operand)
        methods: dict = {}
        classes: dict = {}
        failed: set = set()
        for oid, (owner, by_method) in per_owner.items():
            attrs: dict = {}
            spec = []
            j = 0
            cls = type(owner)
            for mname in sorted(by_method):
                edits = []
                code = None
                for pos in sorted(by_method[mname]):
                    code, stream_operand = by_method[mname][pos]
                    attr = f"{_SITE_PREFIX}{j}"
                    j += 1
                    attrs[(oid, mname, pos)] = attr
                    edits.append(Edit(pos, attr, stream_operand))
                try:
                    spec.append((mname, unwrap_depth(cls, mname, code), tuple(edits)))
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
        stream = ev.operands[ev.stream_operand]
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
def _lca_owner(model: nn.Module, paths: list) -> tuple:
    """The nearest common ancestor of module paths that is not a container (ModuleList, Sequential...)."""
    split = [p.split(".") if p else [] for p in paths]
    common = []
    for parts in zip(*split):
        if all(p == parts[0] for p in parts):
            common.append(parts[0])
        else:
            break
    while True:
        path = ".".join(common)
        mod = model.get_submodule(path) if path else model
        if not isinstance(mod, _CONTAINERS) or not common:
            return path, mod
        common.pop()


def _apply(model: nn.Module, plan: _Plan, method: str, options: dict, report: PatchReport) -> _PatchState:
    state = _PatchState(report=report)
    chain_index = {}
    position_of = {}
    for ci, chain in enumerate(plan.chains):
        for k, ev in enumerate(chain):
            chain_index[ev.index] = ci
            position_of[ev.index] = k
    chain_dims = [options.get("dim", _chain_dim(chain)) if method == "rescontroller" else _chain_dim(chain)
                  for chain in plan.chains]

    # merge modules
    mgr_chains: list = [None] * len(plan.chains)
    mgr_states: list = [None] * len(plan.chains)
    if method == "mgr":
        from ..mgr import MGRChain

        taken: dict = {}
        for ci, chain in enumerate(plan.chains):
            d = chain_dims[ci]
            width = chain[0].shapes[0][d]
            mod = MGRChain(dim=width, num_merges=len(chain), **options)
            ref = chain[0].owner
            device = _first_tensor_device(ref)
            dtype = _first_float_dtype(ref)
            if device is not None or dtype is not None:
                mod.to(device=device, dtype=dtype)
            owner_path, owner = _lca_owner(model, [plan.paths[id(ev.owner)] for ev in chain])
            if isinstance(owner, _CONTAINERS):  # the model itself is a Sequential/ModuleList: it would iterate it
                owner_path, owner = plan.paths[id(chain[0].owner)], chain[0].owner
            n = taken.get(id(owner), 0)
            while f"{_CHAIN_PREFIX}{n}" in owner._modules:
                n += 1
            taken[id(owner)] = n + 1
            attr = f"{_CHAIN_PREFIX}{n}"
            owner.add_module(attr, mod)
            state.added.append((owner, attr))
            mgr_chains[ci] = mod
            mgr_states[ci] = ChainState()
            report.chains.append(ChainInfo(ci, len(chain), chain[0].shapes[0], d,
                                           owner=(owner_path + "." if owner_path else "") + attr, module=mod,
                                           note=getattr(mod, "init_note", None)))
    else:
        for ci, chain in enumerate(plan.chains):
            report.chains.append(ChainInfo(ci, len(chain), chain[0].shapes[0], chain_dims[ci]))

    # sites
    sites: dict = {}
    for key, group in plan.groups.items():
        ev0 = group[0]
        ci = chain_index[ev0.index]
        d = chain_dims[ci]
        positions = tuple(position_of[ev.index] for ev in group)
        inplace = None
        if ev0.inplace:
            inplace = "stream" if ev0.stream_operand == 0 else "update"
        merge = None
        if method == "rescontroller":
            from ..rescontroller import ResController

            opts = {k: v for k, v in options.items() if k != "dim"}
            merge = ResController(**opts, dim=d)
        sites[key] = MergeSite(
            method, path=plan.paths[id(ev0.owner)], location=ev0.location, source_line=_source_line(ev0),
            stream_shape=ev0.shapes[0], chain=ci, positions=positions, dim=d, inplace=inplace, merge=merge,
            mgr_chain=mgr_chains[ci], mgr_state=mgr_states[ci])

    # bind: register sites, swap classes
    for oid, (owner, spec, attrs) in plan.methods.items():
        cls = type(owner)
        sub = plan.rewritten[oid]
        names = []
        for key, attr in attrs.items():
            owner.add_module(attr, sites[key])
            names.append(attr)
        owner.__class__ = sub
        state.owners.append((owner, cls, names))

    # report entries: one per merge execution
    for ev in sorted(plan.merges, key=lambda e: (chain_index[e.index], position_of[e.index])):
        site = sites[_site_key(ev)]
        report.sites.append(SiteInfo(
            path=site.path, location=site.location, source_line=site.source_line, stream_shape=site.stream_shape,
            chain=chain_index[ev.index], position=position_of[ev.index], method=method, dim=site.dim,
            stream_operand="left" if ev.stream_operand == 0 else "right", site=site))
    return state


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
