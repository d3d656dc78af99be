"""Classify: which observed additions are residual merges (the second step of
:func:`~lightning_resctl.surgery.patch_residuals`: observe -> **classify** -> plan -> bind -> describe).

An addition is a *merge* when both operands have the same shape (floating point, at least 1-D) and one
operand, the *stream*, is an ancestor of the other, the *update*, through a branch holding learned
parameters. A parallel block written as several additions (``x = attn + x; return mlp + x``) is one merge
of the block's input and the branches' sum: each addition after the first adds a branch of the first one's
stream to the previous one's result (``AddEvent.parallel_of``). Everything else is reported with the reason
it is not a merge (``AddEvent.reason``).
"""
from __future__ import annotations

from typing import Optional

from .events import AddEvent, Observation

__all__ = ["classify"]

# ops taking a part of their first input (a stream may be the part of a tensor its branch reads whole)
_SLICES = {"__getitem__", "narrow", "select"}


def classify(obs: Observation) -> None:
    """Decide, in execution order, which additions of ``obs`` are merges: each :class:`AddEvent` gets its stream
    operand and branch, or the reason it is not a merge; the parallel blocks are linked (``joined_by``)."""
    merge_of: dict = {}   # result node of a merge -> its event
    for ev in obs.events:
        _classify(ev, obs.nodes, merge_of)
        if ev.is_merge:
            merge_of[ev.result] = ev
        if ev.parallel_of is not None:
            obs.events[ev.parallel_of].joined_by = ev.index
    _check_partial_sums(obs.events, obs.nodes)


def _path_between(nodes: list, src: int, dst: int):
    """Nodes on paths src -> dst (excluding src), or None when src is not an ancestor of dst."""
    if src >= dst:
        return None
    seen = {dst}
    stack = [dst]
    while stack:
        n = stack.pop()
        for i in nodes[n].inputs:
            if i >= src and i not in seen:
                seen.add(i)
                stack.append(i)
    if src not in seen:
        return None
    reach = {src}
    for n in sorted(seen):
        if n != src and any(i in reach for i in nodes[n].inputs):
            reach.add(n)
    reach.discard(src)
    return reach


def _ancestors(nodes: list, start: int, limit: int = 200000) -> set:
    seen = {start}
    stack = [start]
    while stack and len(seen) < limit:
        n = stack.pop()
        for i in nodes[n].inputs:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def _classify(ev: AddEvent, nodes: list, merge_of: Optional[dict] = None) -> None:
    a, b = ev.operands
    if ev.not_candidate:
        ev.reason = ev.not_candidate
        return
    if ev.shapes[0] != ev.shapes[1]:
        ev.reason = (f"shapes differ ({_fmt(ev.shapes[0])} + {_fmt(ev.shapes[1])}): a broadcast addition "
                     "(bias, mask or positional term)")
        return
    if not ev.floating:
        ev.reason = "not floating point"
        return
    if ev.ndim == 0:
        ev.reason = "0-dim tensors (a counter or a scalar)"
        return
    if a == b:
        ev.reason = "adds a tensor to itself"
        return
    for stream, update, idx in ((a, b, 0), (b, a, 1)):
        between = _path_between(nodes, stream, update)
        if between is None:
            continue
        if not any(nodes[n].learned for n in between):
            ev.reason = ("the update is computed from the stream without learned parameters "
                         "(an elementwise expression, not a branch)")
            return
        # a merge on the way merges into a stream of its own (not this one, nor one computed from it): this
        # operand is a tensor reused across layers, not a stream. A merge into this stream or into a tensor of
        # the branch is a residual nested in the branch (a block inside a residual group, a residual norm)
        foreign = _foreign_merges(stream, between, merge_of or {})
        if foreign:
            ev.reason = ("the other operand depends on this one only through another residual merge "
                         f"({merge_of[foreign[0]].location}): a tensor reused across layers (e.g. an attention "
                         "position bias added to every layer's scores), not a stream and its branch")
            return
        _set_branch(ev, idx, nodes, between)
        return
    # neither operand depends on the other. A part of a tensor (``x[:, :1]``, a class token; DPN's residual
    # channels) whose branch reads the whole tensor: the part is the stream, the branch its update
    for stream, update, idx in ((a, b, 0), (b, a, 1)):
        node = nodes[stream]
        if node.op not in _SLICES or not node.inputs:
            continue
        whole = node.inputs[0]
        between = _path_between(nodes, whole, update)
        if between is None or stream in between or not any(nodes[n].learned for n in between):
            continue
        if _foreign_merges(whole, between, merge_of or {}):
            continue
        _set_branch(ev, idx, nodes, between)
        return
    # A parallel block written as several additions
    # (``x = attn + x; return mlp + x``, ``x + attn + mlp``): one operand is the result of a merge, the other a
    # branch of that merge's stream (the block's input) -- the block's next partial sum, or its last addition
    for stream, update, idx in ((a, b, 0), (b, a, 1)):
        prev = (merge_of or {}).get(stream)
        if prev is None:
            continue
        root = prev.stream_node
        between = _path_between(nodes, root, update)
        if between is None or not any(nodes[n].learned for n in between) or any(n in merge_of for n in between):
            continue
        ev.stream_operand = idx
        ev.parallel_of = prev.index
        ev.parallel_stream = root
        ev.branch_ops = prev.branch_ops | frozenset(nodes[n].op for n in between)
        ev.branch_modules = prev.branch_modules | frozenset(nodes[n].module for n in between)
        ev.branch_learned = tuple(dict.fromkeys(prev.branch_learned + _learned_modules(nodes, between)))
        ev.feature_dim = prev.feature_dim
        return
    anc_a = _ancestors(nodes, a)
    anc_b = _ancestors(nodes, b)
    common = [n for n in anc_a & anc_b if nodes[n].op != "param" and nodes[n].floating]
    if not common:
        ev.reason = ("combines independent tensors (neither operand depends on the other: "
                     "e.g. a positional embedding, a mask or a bias)")
        return
    nca = max(common)
    src = nodes[nca]
    where = f"the output of {src.module}" if src.module else "one tensor"
    if src.shape is not None and src.shape != ev.shapes[0]:
        ev.reason = (f"projection shortcut: both operands are computed from {where} {_fmt(src.shape)}, "
                     f"the sum has shape {_fmt(ev.shapes[0])}: there is no identity stream to merge into")
    else:
        ev.reason = ("combines two branches of one input (neither operand is the other's ancestor: "
                     "e.g. parallel branches or a learned shortcut)")


def _foreign_merges(stream: int, between: set, merge_of: dict) -> list:
    """Merges on the path ``between`` that merge into a stream of their own (neither ``stream`` nor a tensor
    computed from it), in order."""
    return sorted(n for n in between if n in merge_of
                  and merge_of[n].stream_node != stream and merge_of[n].stream_node not in between)


def _set_branch(ev: AddEvent, idx: int, nodes: list, between: set) -> None:
    """Classify ``ev`` as a merge whose stream is operand ``idx`` and whose branch is the nodes ``between``."""
    ev.stream_operand = idx
    ev.branch_ops = frozenset(nodes[n].op for n in between)
    ev.branch_modules = frozenset(nodes[n].module for n in between)
    ev.branch_learned = _learned_modules(nodes, between)
    first = nodes[min(n for n in between if nodes[n].learned)]
    ev.feature_dim = 1 if ev.ndim >= 3 and "conv" in first.op else -1


def _check_partial_sums(events: list, nodes: list) -> None:
    """A parallel block is one merge only when each partial sum feeds the block's next addition and nothing
    else; otherwise its last addition gets a ``refusal`` naming the reader."""
    readers: dict = {}
    for node in nodes:
        for i in node.inputs:
            readers.setdefault(i, []).append(node.index)

    def read_by(n: int, depth: int = 0) -> set:
        out = set()
        for r in readers.get(n, ()):
            if nodes[r].op == "written_alias" and depth < 8:   # another name of the tensor: who reads it
                out |= read_by(r, depth + 1)
            else:
                out.add(r)
        return out

    for ev in events:
        if ev.parallel_of is None:
            continue
        prev = events[ev.parallel_of]
        others = read_by(prev.result) - {ev.result}
        if others:
            other = nodes[min(others)]
            where = f" in {other.module}" if other.module else ""
            ev.refusal = (f"the sum of the merge at {prev.location} is also read by a {other.op!r} op{where}, not "
                          "only by this addition of another branch of the same input")
            prev.joined_by = None   # not a partial sum: a merge of its own


def _learned_modules(nodes: list, between: set) -> tuple:
    """Module paths running the learned ops of a branch, in execution order, each once."""
    return tuple(dict.fromkeys(nodes[n].module for n in sorted(between) if nodes[n].learned))


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
