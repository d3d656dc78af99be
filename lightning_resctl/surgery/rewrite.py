"""Rewrite additions in a method's source into site calls, and bind the result to a per-instance subclass.

For one method of a module class and a set of *edits* (source span -> site attribute, stream operand), the
function's source (read from its file, so line/column positions are exact) is parsed; each addition node
at an edited span — ``a + b``, ``torch.add(a, b)``, ``a.add(b)``, ``a += b``, ``a.add_(b)`` — becomes
``self.<attr>(stream, update)`` (in-place forms rebind their target: ``a = self.<attr>(a, b)``). The
new function is compiled against the original globals and closure cells (``super()``'s ``__class__``
included; private names keep their mangling), decorators that wrap it (``functools.wraps`` style, the
wrapped function held in a closure cell) are rebuilt around it, and a subclass of the block's class
overriding that method is created (cached per class and edit set) so that ``isinstance`` still holds.
"""
from __future__ import annotations

import ast
import copy
import functools
import linecache
import types
from dataclasses import dataclass
from types import CodeType
from typing import Optional

__all__ = ["Edit", "RewriteError", "rewrite_function", "rewrite_method", "unwrap_depth", "patched_subclass",
           "original_class", "is_patched_class"]


class RewriteError(RuntimeError):
    """The source of an addition cannot be rewritten (reason in the message)."""


@dataclass(frozen=True)
class Edit:
    position: tuple        # (lineno, end_lineno, col, end_col) from co_positions
    attr: str              # attribute name of the MergeSite on the module
    stream_operand: int    # 0: the left operand / target / first argument is the stream; 1: the other one


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
    expr = copy.deepcopy(expr)
    for n in ast.walk(expr):
        if hasattr(n, "ctx"):
            n.ctx = ast.Load()
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


class _Rewriter(ast.NodeTransformer):
    def __init__(self, edits: dict, self_name: str):
        self.edits = edits
        self.self_name = self_name
        self.done: set = set()

    def _site_call(self, edit: Edit, op0: ast.expr, op1: ast.expr, like: ast.AST) -> ast.Call:
        stream, update = (op0, op1) if edit.stream_operand == 0 else (op1, op0)
        call = ast.Call(
            func=ast.Attribute(value=ast.Name(id=self.self_name, ctx=ast.Load()), attr=edit.attr, ctx=ast.Load()),
            args=[_load(stream), _load(update)], keywords=[])
        return ast.copy_location(call, like)

    def visit_BinOp(self, node: ast.BinOp):
        edit = self.edits.get(_span(node))
        node = self.generic_visit(node)
        if edit is None or not isinstance(node.op, ast.Add):
            return node
        self.done.add(edit.position)
        return self._site_call(edit, node.left, node.right, node)

    def visit_AugAssign(self, node: ast.AugAssign):
        edit = self.edits.get(_span(node))
        node = self.generic_visit(node)
        if edit is None or not isinstance(node.op, ast.Add):
            return node
        self.done.add(edit.position)
        value = self._site_call(edit, _load(node.target), node.value, node)
        return ast.copy_location(ast.Assign(targets=[node.target], value=value), node)

    def visit_Expr(self, node: ast.Expr):
        if isinstance(node.value, ast.Call):
            edit = self.edits.get(_span(node.value))
            ops = _call_operands(node.value) if edit is not None else None
            if ops is not None and ops[2]:
                call = node.value
                call.args = [self.visit(a) for a in call.args]
                call.func = self.visit(call.func)
                ops = _call_operands(call)
                target = ops[0]
                if not isinstance(target, (ast.Name, ast.Attribute, ast.Subscript)):
                    raise RewriteError(f"in-place addition on an expression at line {node.lineno}")
                self.done.add(edit.position)
                store = copy.deepcopy(target)
                for n in ast.walk(store):
                    if n is store and hasattr(n, "ctx"):
                        n.ctx = ast.Store()
                value = self._site_call(edit, ops[0], ops[1], call)
                return ast.copy_location(ast.Assign(targets=[store], value=value), node)
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        edit = self.edits.get(_span(node))
        node = self.generic_visit(node)
        if edit is None:
            return node
        ops = _call_operands(node)
        if ops is None:
            return node
        self.done.add(edit.position)
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


def rewrite_function(fn: types.FunctionType, edits: list) -> types.FunctionType:
    """A copy of ``fn`` (the function whose code ran the additions) with ``edits`` applied."""
    code = fn.__code__
    fdef = copy.deepcopy(_function_def(code))
    fdef.decorator_list = []
    args = fdef.args.posonlyargs + fdef.args.args
    if not args:
        raise RewriteError(f"{fn.__qualname__} has no 'self' argument")
    edit_map = {e.position: e for e in edits}
    rewriter = _Rewriter(edit_map, args[0].arg)
    fdef = rewriter.visit(fdef)
    missing = set(edit_map) - rewriter.done
    if missing:
        raise RewriteError(f"no addition found in the source of {fn.__qualname__} at span(s) {sorted(missing)}")
    # factory(freevars...) -> [class <Owner>:] def fn: keeps closures, super() and name mangling
    body: list = [fdef]
    cls_name = _class_name(fn.__qualname__)
    if cls_name:
        body = [ast.ClassDef(name=cls_name, bases=[], keywords=[], body=[fdef], decorator_list=[])]
    freevars = [v for v in code.co_freevars if v != "__class__"]
    factory = ast.FunctionDef(
        name="__resctl_factory__",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=v) for v in freevars], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=body + [ast.Return(value=ast.Constant(value=None))], decorator_list=[], returns=None)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    compiled = compile(module, code.co_filename, "exec", dont_inherit=True)
    new_code = _find_code(compiled, code.co_name, fdef.lineno)
    if new_code is None:
        raise RewriteError(f"compiled code for {fn.__qualname__} not found")
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    try:
        closure = tuple(cells[name] for name in new_code.co_freevars)
    except KeyError as err:
        raise RewriteError(f"free variable {err} of {fn.__qualname__} has no cell") from None
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, closure or None)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    new.__dict__.update(fn.__dict__)
    new.__resctl_original__ = fn
    return new


def _find_code(code: CodeType, name: str, lineno: int) -> Optional[CodeType]:
    for const in code.co_consts:
        if isinstance(const, CodeType):
            if const.co_name == name and const.co_firstlineno == lineno:
                return const
            found = _find_code(const, name, lineno)
            if found is not None:
                return found
    return None


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
