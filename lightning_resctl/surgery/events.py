"""What the observing forwards record (:mod:`.observe`), read by every later step: :class:`Node` (one op of the
forward's dataflow), :class:`AddEvent` (one addition of two tensors, with its source and, once classified, its
stream and branch) and :class:`Observation` (one forward's); which additions share one site (:func:`site_key`),
their source text (:func:`source_line`) and the additions of one parallel block (:func:`parallel_block`)."""
from __future__ import annotations

import linecache
import os
from dataclasses import dataclass, field
from types import CodeType
from typing import Optional

from torch import nn

__all__ = ["Node", "AddEvent", "Observation", "short_path", "callees", "site_key", "source_line", "parallel_block"]


@dataclass
class Node:
    """One op of the observed forward (or a leaf: an input, a parameter, a buffer, a constant)."""

    index: int
    op: str
    inputs: tuple
    learned: bool = False      # consumes an nn.Parameter, or a tensor computed from parameters only
    module: str = ""           # innermost module running when the op ran
    shape: Optional[tuple] = None
    floating: bool = True
    static: bool = False       # an nn.Parameter, or computed from parameters only (``W.t()``, weight_norm)


@dataclass
class AddEvent:
    """One executed addition of two tensors."""

    index: int
    result: int
    operands: tuple            # node ids of the two operands, in argument order
    shapes: tuple
    floating: bool
    ndim: int
    inplace: bool              # a += b / a.add_(b): operand 0 is mutated
    code: Optional[CodeType]
    position: Optional[tuple]  # (lineno, end_lineno, col, end_col) of the expression
    filename: str
    lineno: int
    owner: Optional[nn.Module]
    method_name: Optional[str]  # name on type(owner) of the method whose code ran the addition
    function_name: str
    # call sites from the owner's method down to the free function holding the addition, outermost first:
    # ((code, position of the call), ...); empty when the addition is in the method's own source
    calls: tuple = ()
    method_code: Optional[CodeType] = None  # code of owner's method (== code when calls is empty)
    not_candidate: Optional[str] = None  # alpha/out= etc.
    stream_operand: Optional[int] = None  # 0 or 1 once classified as a merge
    reason: Optional[str] = None          # why it is not a merge
    branch_ops: frozenset = field(default_factory=frozenset)
    branch_modules: frozenset = field(default_factory=frozenset)  # paths of the modules that ran in the branch
    branch_learned: tuple = ()            # module paths of the branch's learned ops, in execution order
    feature_dim: int = -1                 # 1 when the branch starts with a convolution (channels-first)
    checkpointed: bool = False            # ran inside torch.utils.checkpoint (activation recomputation)
    # a parallel block written as several additions (``x = attn + x; return mlp + x``): this addition adds a
    # branch of the block's input ``parallel_stream`` to the result of the block's previous addition
    # ``parallel_of`` (an event index); that one is then ``joined_by`` this one (a partial sum, not a merge
    # of its own). ``refusal``: why such a block cannot be patched (the partial sum is read elsewhere)
    parallel_of: Optional[int] = None
    parallel_stream: Optional[int] = None
    joined_by: Optional[int] = None
    refusal: Optional[str] = None
    # set by the patch for a merge of a line that runs in one mode only (``else: x = x + f(x)`` beside a
    # training line ``x = x + checkpoint(f, x)``): the site key of the other mode's merge whose site it calls
    same_site: Optional[tuple] = None

    @property
    def is_merge(self) -> bool:
        return self.stream_operand is not None

    @property
    def is_partial(self) -> bool:
        """An addition of a parallel block before its last one: merged by the block's last addition."""
        return self.joined_by is not None

    @property
    def stream_node(self) -> int:
        """The node of the stream this merge merges into (a parallel block's input for its last addition)."""
        return self.parallel_stream if self.parallel_stream is not None else self.operands[self.stream_operand]

    @property
    def location(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno}"

    @property
    def call_location(self) -> str:
        """"file:line" of the call in the owner's method that led to the function holding the addition."""
        if not self.calls:
            return ""
        code, pos = self.calls[0]
        return f"{short_path(code.co_filename)}:{pos[0] if pos else code.co_firstlineno}"


@dataclass
class Observation:
    nodes: list
    events: list
    module_paths: dict        # id(module) -> path
    num_modules: int
    num_ops: int
    call_counts: dict = field(default_factory=dict)   # id(module) -> forward calls in the observed forward


def short_path(filename: str) -> str:
    """``filename`` relative to site-packages or the working directory when under them."""
    norm = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in norm:
            return norm.rsplit(marker, 1)[1]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def site_key(ev: AddEvent) -> tuple:
    """One MergeSite per (module, method, call sites leading to the addition, addition's position); a line
    that runs in one mode only calls the site of the same merge in the other mode (``ev.same_site``)."""
    if ev.same_site is not None:
        return ev.same_site
    return (id(ev.owner), ev.method_name, tuple(p for _, p in ev.calls), ev.position)


def source_line(ev: AddEvent) -> str:
    """The source line of the addition; for an addition spanning lines, the expression itself on one line."""
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


def parallel_block(ev: AddEvent, events: list) -> list:
    """The additions of the parallel block ``ev`` belongs to (just ``[ev]`` for an ordinary merge)."""
    first = ev
    while first.parallel_of is not None and events[first.parallel_of].joined_by == first.index:
        first = events[first.parallel_of]
    block = [first]
    while block[-1].joined_by is not None:
        block.append(events[block[-1].joined_by])
    return block


def callees(ev: AddEvent) -> list:
    """Code objects of the free functions between the owner's method and the addition (outermost first)."""
    return [code for code, _ in ev.calls[1:]] + ([ev.code] if ev.calls else [])
