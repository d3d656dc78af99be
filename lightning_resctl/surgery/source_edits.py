"""Rewrite additions in a function's source into site calls (the patched classes: :mod:`.rewrite`).

For one method of a module class and a set of *edits* (source span -> site attribute, stream operand), the
function's source (read from its file, so line/column positions are exact) is parsed; each addition node
at an edited span — ``a + b``, ``torch.add(a, b)``, ``a.add(b)``, ``a += b``, ``a.add_(b)`` — becomes
``self.<attr>(stream, update)`` (in-place forms rebind their target: ``a = self.<attr>(a, b)``). The
new function is compiled against the original globals and closure cells (``super()``'s ``__class__``
included; private names keep their mangling), decorators that wrap it (``functools.wraps`` style, the
wrapped function held in a closure cell) are rebuilt around it (:mod:`.rewrite`). An addition in a free function
called from the method is a :class:`CallEdit` at the call: the call runs a rewritten copy of that function.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import linecache
import types
import weakref
from dataclasses import dataclass
from types import CodeType
from typing import Optional

__all__ = ["Edit", "CallEdit", "RewriteError", "rewrite_function", "annotate_edits", "check_callee", "OWNER_PARAM"]

# keyword-only parameter added to a rewritten copy of a free function: the module owning its sites
OWNER_PARAM = "_resctl_owner_"


class RewriteError(RuntimeError):
    """The source of an addition cannot be rewritten (reason in the message)."""


@dataclass(frozen=True)
class Edit:
    """Rewrite the addition at ``position`` into ``self.<attr>(stream, update)``.

    ``text`` (the addition's source as ``ast.unparse`` writes it) and ``nth`` (which occurrence of that text
    in the function, in source order) re-find the addition when the positions moved (a patched model
    unpickled after its file was edited); an addition whose text is gone is an error naming the site."""

    position: tuple        # (lineno, end_lineno, col, end_col) from co_positions
    attr: str              # attribute name of the MergeSite on the module
    stream_operand: int    # 0: the left operand / target / first argument is the stream; 1: the other one
    text: str = ""
    nth: int = 0

    def describe(self) -> str:
        side = "left" if self.stream_operand == 0 else "right"
        return f"site {self.attr} (`{self.text or '?'}`, stream on the {side})"


@dataclass(frozen=True)
class CallEdit:
    """Redirect the call at ``position`` (a call of the free function ``callee`` holding merges) to a
    copy of that function rewritten with ``edits`` for this call site only; the copy's sites are looked up
    on the calling module (passed as the keyword-only ``OWNER_PARAM``)."""

    position: tuple
    callee: str            # __qualname__ of the function the call runs
    edits: tuple           # Edit / CallEdit inside the callee
    text: str = ""
    nth: int = 0

    @property
    def attr(self) -> str:
        return ",".join(e.attr for e in self.edits)

    def describe(self) -> str:
        return f"call of {self.callee} holding site(s) {self.attr} (`{self.text or '?'}`)"


# ---------------------------------------------------------------------------------------------- source
@functools.lru_cache(maxsize=64)
def _parse_file(filename: str, text: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def _function_def(code: CodeType) -> ast.FunctionDef:
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise RewriteError(f"source of {code.co_name} not available ({code.co_filename})")
    tree = _parse_file(code.co_filename, "".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if code.co_firstlineno in (first, node.lineno):
                return node
    raise RewriteError(f"could not find the definition of {code.co_name} at "
                       f"{code.co_filename}:{code.co_firstlineno} (source changed since import?)")


def _span(node: ast.AST) -> tuple:
    return (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset)


def _load(expr: ast.expr) -> ast.expr:
    """A copy of ``expr`` read as a value. Only the top-level context changes: a walrus target or a
    comprehension target inside the expression keeps its Store context."""
    expr = copy.deepcopy(expr)
    if hasattr(expr, "ctx"):
        expr.ctx = ast.Load()
    return expr


def _call_operands(call: ast.Call) -> Optional[tuple]:
    """(operand0, operand1, inplace) for torch.add(a, b) / a.add(b) / a.add_(b), else None."""
    if not isinstance(call.func, ast.Attribute) or call.func.attr not in ("add", "add_", "__add__", "__iadd__"):
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg is not None}
    if set(kw) - {"input", "other"} or any(k.arg is None for k in call.keywords):
        return None
    pos = list(call.args) + [kw[k] for k in ("input", "other") if k in kw]
    inplace = call.func.attr in ("add_", "__iadd__")
    if len(pos) == 2:
        return pos[0], pos[1], inplace
    if len(pos) == 1:
        return call.func.value, pos[0], inplace
    return None


def _is_addition(node: ast.AST) -> bool:
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        return isinstance(node.op, ast.Add)
    return isinstance(node, ast.Call) and _call_operands(node) is not None


def _candidates(fdef: ast.AST, calls: bool) -> list:
    """The nodes an edit can target (additions, or calls for a CallEdit), in source order."""
    pick = (lambda n: isinstance(n, ast.Call)) if calls else _is_addition
    nodes = [n for n in ast.walk(fdef) if pick(n)]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    return nodes


def _resolve(fdef: ast.AST, edits: list, where: str) -> dict:
    """id(node) -> edit. An edit is found at its position when the source there still reads ``edit.text``;
    otherwise by its text (``nth`` occurrence): positions move when lines are added above."""
    found: dict = {}
    cache: dict = {}
    for edit in edits:
        calls = isinstance(edit, CallEdit)
        if calls not in cache:
            cands = _candidates(fdef, calls)
            cache[calls] = (cands, {_span(n): n for n in reversed(cands)}, [ast.unparse(n) for n in cands])
        cands, by_span, texts = cache[calls]
        node = by_span.get(edit.position)
        if node is not None and edit.text and texts[cands.index(node)] != edit.text:
            node = None
        if node is None and edit.text:
            same = [n for n, t in zip(cands, texts) if t == edit.text]
            if edit.nth < len(same):
                node = same[edit.nth]
        if node is None:
            if edit.text:
                raise RewriteError(
                    f"{where}: {edit.describe()}, at line {edit.position[0]} when the model was patched, is no "
                    "longer in the source (the code changed since; e.g. its operands were swapped): patch the "
                    "unpatched model again")
            raise RewriteError(f"no addition found in the source of {where} at span {edit.position}")
        if id(node) in found:
            raise RewriteError(f"{where}: two sites ({found[id(node)].attr}, {edit.attr}) on one expression")
        found[id(node)] = edit
    return found


def annotate_edits(code: CodeType, edits: list) -> tuple:
    """``edits`` with ``text``/``nth`` filled from the source of ``code`` (what re-finds them later)."""
    fdef = _function_def(code)
    out = []
    for edit in edits:
        calls = isinstance(edit, CallEdit)
        cands = _candidates(fdef, calls)
        node = next((n for n in cands if _span(n) == edit.position), None)
        if node is None:
            raise RewriteError(f"no {'call' if calls else 'addition'} found in the source of {code.co_qualname} "
                               f"at line {edit.position[0]}")
        text = ast.unparse(node)
        nth = [n for n in cands if ast.unparse(n) == text].index(node)
        out.append(dataclasses.replace(edit, text=text, nth=nth))
    return tuple(out)


class _Rewriter(ast.NodeTransformer):
    def __init__(self, by_node: dict, self_name: str):
        self.by_node = by_node
        self.self_name = self_name
        self.done: set = set()
        self.redirects: dict = {}   # closure name -> _Redirect

    def _site_call(self, edit: Edit, op0: ast.expr, op1: ast.expr, like: ast.AST) -> ast.Call:
        stream, update = (op0, op1) if edit.stream_operand == 0 else (op1, op0)
        call = ast.Call(
            func=ast.Attribute(value=ast.Name(id=self.self_name, ctx=ast.Load()), attr=edit.attr, ctx=ast.Load()),
            args=[_load(stream), _load(update)], keywords=[])
        return ast.copy_location(call, like)

    def _edit(self, node, kind=Edit):
        edit = self.by_node.get(id(node))
        return edit if isinstance(edit, kind) else None

    def visit_BinOp(self, node: ast.BinOp):
        edit = self._edit(node)
        node = self.generic_visit(node)
        if edit is None or not isinstance(node.op, ast.Add):
            return node
        self.done.add(edit)
        return self._site_call(edit, node.left, node.right, node)

    def visit_AugAssign(self, node: ast.AugAssign):
        edit = self._edit(node)
        node = self.generic_visit(node)
        if edit is None or not isinstance(node.op, ast.Add):
            return node
        self.done.add(edit)
        value = self._site_call(edit, _load(node.target), node.value, node)
        return ast.copy_location(ast.Assign(targets=[node.target], value=value), node)

    def visit_Expr(self, node: ast.Expr):
        if isinstance(node.value, ast.Call):
            edit = self._edit(node.value)
            ops = _call_operands(node.value) if edit is not None else None
            if ops is not None and ops[2]:
                call = node.value
                call.args = [self.visit(a) for a in call.args]
                call.func = self.visit(call.func)
                ops = _call_operands(call)
                target = ops[0]
                if not isinstance(target, (ast.Name, ast.Attribute, ast.Subscript)):
                    raise RewriteError(f"in-place addition on an expression at line {node.lineno}")
                self.done.add(edit)
                store = copy.deepcopy(target)
                store.ctx = ast.Store()
                value = self._site_call(edit, ops[0], ops[1], call)
                return ast.copy_location(ast.Assign(targets=[store], value=value), node)
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        redirect = self._edit(node, CallEdit)
        edit = self._edit(node)
        node = self.generic_visit(node)
        if redirect is not None:
            # f(args) -> _resctl_callK_(f, self)(args): f is still evaluated as written (a partial, a bound
            # method, a module-level function looked up at run time) and swapped for its rewritten copy
            self.done.add(redirect)
            name = f"_resctl_call{len(self.redirects)}_"
            self.redirects[name] = _Redirect(redirect)
            node.func = ast.copy_location(ast.Call(
                func=ast.Name(id=name, ctx=ast.Load()),
                args=[node.func, ast.Name(id=self.self_name, ctx=ast.Load())], keywords=[]), node.func)
            return node
        if edit is None:
            return node
        ops = _call_operands(node)
        if ops is None:
            return node
        self.done.add(edit)
        call = self._site_call(edit, ops[0], ops[1], node)
        if ops[2]:  # a.add_(b) used as a value: rebind a when it is a name
            if not isinstance(ops[0], ast.Name):
                raise RewriteError(f"in-place addition on an expression used as a value at line {node.lineno}")
            return ast.copy_location(ast.NamedExpr(target=ast.Name(id=ops[0].id, ctx=ast.Store()), value=call),
                                     node)
        return call


def _class_name(qualname: str) -> Optional[str]:
    parts = qualname.split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return parts[-2]
    return None


def _rewrite_code(code: CodeType, qualname: str, edits: list, owner_param: bool) -> tuple:
    """(new code object, {closure name: _Redirect}) of the function running ``code`` with ``edits`` applied.
    ``owner_param``: a free function; its sites are reached through a new keyword-only ``OWNER_PARAM``."""
    fdef = copy.deepcopy(_function_def(code))
    fdef.decorator_list = []
    if owner_param:
        fdef.args.kwonlyargs.append(ast.arg(arg=OWNER_PARAM))
        fdef.args.kw_defaults.append(ast.Constant(value=None))
        self_name = OWNER_PARAM
    else:
        args = fdef.args.posonlyargs + fdef.args.args
        if not args:
            raise RewriteError(f"{qualname} has no 'self' argument")
        self_name = args[0].arg
    by_node = _resolve(fdef, list(edits), qualname)
    rewriter = _Rewriter(by_node, self_name)
    fdef = rewriter.visit(fdef)
    missing = set(by_node.values()) - rewriter.done
    if missing:
        raise RewriteError(f"could not rewrite {', '.join(e.describe() for e in missing)} in {qualname}")
    # factory(freevars...) -> [class <Owner>:] def fn: keeps closures, super() and name mangling
    body: list = [fdef]
    cls_name = _class_name(qualname)
    if cls_name:
        body = [ast.ClassDef(name=cls_name, bases=[], keywords=[], body=[fdef], decorator_list=[])]
    freevars = [v for v in code.co_freevars if v != "__class__"] + list(rewriter.redirects)
    factory = ast.FunctionDef(
        name="__resctl_factory__",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=v) for v in freevars], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=body + [ast.Return(value=ast.Constant(value=None))], decorator_list=[], returns=None)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    try:
        compiled = compile(module, code.co_filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as err:
        raise RewriteError(f"the rewritten source of {qualname} does not compile ({type(err).__name__}: {err})") \
            from None
    new_code = _find_code(compiled, code.co_name, fdef.lineno)
    if new_code is None:
        raise RewriteError(f"compiled code for {qualname} not found")
    return new_code, rewriter.redirects


def _closure(new_code: CodeType, freevars: tuple, closure, redirects: dict, qualname: str):
    cells = dict(zip(freevars, closure or ()))
    cells.update({name: types.CellType(r) for name, r in redirects.items()})
    try:
        return tuple(cells[name] for name in new_code.co_freevars) or None
    except KeyError as err:
        raise RewriteError(f"free variable {err} of {qualname} has no cell") from None


def _copy_function(fn: types.FunctionType, new_code: CodeType, redirects: dict) -> types.FunctionType:
    closure = _closure(new_code, fn.__code__.co_freevars, fn.__closure__, redirects, fn.__qualname__)
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    new.__dict__.update(fn.__dict__)
    new.__resctl_original__ = fn
    return new


def rewrite_function(fn: types.FunctionType, edits: list) -> types.FunctionType:
    """A copy of ``fn`` (the method whose code ran the additions) with ``edits`` applied."""
    new_code, redirects = _rewrite_code(fn.__code__, fn.__qualname__, edits, owner_param=False)
    return _copy_function(fn, new_code, redirects)


_CALLEE_CACHE: dict = {}


def check_callee(code: CodeType, edits: tuple) -> tuple:
    """The rewritten code of the free function running ``code`` (cached); raises RewriteError."""
    key = (code, edits)
    hit = _CALLEE_CACHE.get(key)
    if hit is None:
        hit = _CALLEE_CACHE[key] = _rewrite_code(code, code.co_qualname, list(edits), owner_param=True)
    return hit


class _Redirect:
    """Run time of a redirected call site: ``_Redirect(f, owner)`` is the rewritten copy of the function
    ``f`` evaluates to (through ``functools.partial`` and bound methods) with the owner bound."""

    def __init__(self, edit: CallEdit):
        self.edit = edit
        self._copies = weakref.WeakKeyDictionary()   # original function -> rewritten copy

    def __call__(self, fn, owner):
        if isinstance(fn, functools.partial):
            return functools.partial(self(fn.func, owner), *fn.args, **fn.keywords)
        if isinstance(fn, types.MethodType):
            return types.MethodType(self(fn.__func__, owner), fn.__self__)
        new = self._copies.get(fn) if isinstance(fn, types.FunctionType) else None
        if new is None:
            if not isinstance(fn, types.FunctionType) or fn.__code__.co_qualname != self.edit.callee:
                raise RuntimeError(
                    f"patched residual merge: the call `{self.edit.text}` was patched as a call of "
                    f"{self.edit.callee} holding site(s) {self.edit.attr}, but it now calls {fn!r}: the "
                    "function was replaced after patching; unpatch and patch again")
            new_code, redirects = check_callee(fn.__code__, self.edit.edits)
            new = self._copies[fn] = _copy_function(fn, new_code, redirects)
        return functools.partial(new, **{OWNER_PARAM: owner})


def _find_code(code: CodeType, name: str, lineno: int) -> Optional[CodeType]:
    for const in code.co_consts:
        if isinstance(const, CodeType):
            if const.co_name == name and const.co_firstlineno == lineno:
                return const
            found = _find_code(const, name, lineno)
            if found is not None:
                return found
    return None
