"""The patched classes: per owner module, the edits of its methods (:mod:`.source_edits`) and the per-instance
subclass overriding them (cached per class and edit set, so that ``isinstance`` still holds; pickled as the
original class plus the edits). :func:`prepare_whole_blocks` builds them for the plan's candidate merges and
drops, with the reason, what cannot be rewritten (a parallel block whole or not at all).
"""
from __future__ import annotations

import copy
import types
from types import CodeType

from .events import parallel_block, site_key
from .record import SITE_PREFIX
from .source_edits import CallEdit, Edit, RewriteError, annotate_edits, check_callee, rewrite_function

__all__ = ["prepare_whole_blocks", "rewrite_method", "unwrap_depth", "patched_subclass", "original_class",
           "is_patched_class"]


# ---------------------------------------------------------------------------------------------- preparation per owner
def prepare_whole_blocks(candidates: list, events: list, skip_reasons: dict):
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


# ---------------------------------------------------------------------------------------------- rewriting one method
def _rewrap(wrappers: list, old_inner, new_inner):
    """Rebuild the decorator chain ``wrappers`` (outermost first) around ``new_inner``."""
    current_old, current_new = old_inner, new_inner
    for wrapper in reversed(wrappers):
        if not isinstance(wrapper, types.FunctionType) or not wrapper.__closure__:
            raise RewriteError(f"decorator wrapper {wrapper!r} cannot be rebuilt")
        cells = []
        replaced = False
        for cell in wrapper.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            if content is current_old:
                cells.append(types.CellType(current_new))
                replaced = True
            else:
                cells.append(cell)
        if not replaced:
            raise RewriteError(f"decorator {wrapper.__qualname__} does not hold the wrapped function in a closure")
        rebuilt = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__,
                                     wrapper.__defaults__, tuple(cells))
        rebuilt.__kwdefaults__ = copy.copy(wrapper.__kwdefaults__)
        rebuilt.__qualname__ = wrapper.__qualname__
        rebuilt.__module__ = wrapper.__module__
        rebuilt.__doc__ = wrapper.__doc__
        rebuilt.__dict__.update(wrapper.__dict__)
        rebuilt.__wrapped__ = current_new
        current_old, current_new = wrapper, rebuilt
    return current_new


def _method_attr(cls: type, method_name: str):
    for klass in cls.__mro__:
        if method_name in vars(klass):
            return vars(klass)[method_name]
    raise RewriteError(f"{cls.__name__} has no method {method_name}")


def unwrap_depth(cls: type, method_name: str, code: CodeType) -> int:
    """How many ``__wrapped__`` steps lead from ``cls.<method_name>`` to the function running ``code``."""
    fn = _method_attr(cls, method_name)
    depth = 0
    while getattr(fn, "__code__", None) is not code:
        fn = getattr(fn, "__wrapped__", None)
        depth += 1
        if fn is None or depth > 16:
            raise RewriteError(f"could not unwrap {cls.__name__}.{method_name} down to the code that ran")
    return depth


def rewrite_method(cls: type, method_name: str, depth: int, edits: list):
    """The rewritten attribute ``method_name`` of ``cls``: the function ``depth`` ``__wrapped__`` steps below
    it is edited and the decorators above it are rebuilt around the result."""
    attr = _method_attr(cls, method_name)
    if isinstance(attr, (staticmethod, classmethod)):
        raise RewriteError(f"{cls.__name__}.{method_name} is a static/class method")
    wrappers = []
    fn = attr
    for _ in range(depth):
        wrappers.append(fn)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            raise RewriteError(f"could not unwrap {cls.__name__}.{method_name}")
    new_inner = rewrite_function(fn, edits)
    return _rewrap(wrappers, fn, new_inner) if wrappers else new_inner


# ---------------------------------------------------------------------------------------------- classes
_SUBCLASS_CACHE: dict = {}
_METHOD_CACHE: dict = {}


def patched_subclass(cls: type, spec: tuple) -> type:
    """The subclass of ``cls`` whose methods are rewritten per ``spec``: a sorted tuple of
    ``(method name, unwrap depth, edits)``. Cached per ``(cls, spec)``; rebuilt from source when a patched
    module is unpickled in another process."""
    key = (cls, spec)
    sub = _SUBCLASS_CACHE.get(key)
    if sub is None:
        methods = {}
        for name, depth, edits in spec:
            mkey = (cls, name, depth, edits)
            if mkey not in _METHOD_CACHE:
                try:
                    _METHOD_CACHE[mkey] = rewrite_method(cls, name, depth, list(edits))
                except (RewriteError, SyntaxError, OSError) as err:
                    raise RewriteError(f"{cls.__name__}.{name}: {err}") from err
            methods[name] = _METHOD_CACHE[mkey]
        namespace = dict(methods)
        namespace.update({
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_resctl_original_class": cls,
            "_resctl_spec": spec,
            "__reduce_ex__": _reduce_patched,
        })
        sub = type(cls.__name__, (cls,), namespace)
        _SUBCLASS_CACHE[key] = sub
    return sub


def _reduce_patched(self, protocol):
    """Pickle/deepcopy a patched module as (original class, rewrite spec) + its state."""
    cls = type(self)
    return (_rebuild_patched, (vars(cls)["_resctl_original_class"], vars(cls)["_resctl_spec"]), self.__getstate__())


def _rebuild_patched(cls: type, spec: tuple):
    obj = cls.__new__(cls)
    obj.__class__ = patched_subclass(cls, spec)
    return obj


def is_patched_class(cls: type) -> bool:
    return "_resctl_original_class" in vars(cls)


def original_class(cls: type) -> type:
    return vars(cls)["_resctl_original_class"] if is_patched_class(cls) else cls
