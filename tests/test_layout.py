"""The package layout of issue 32 (each test is its own function: several helpers add theirs here)."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap

from lightning_resctl.rules import get_merge_rule

#: built-in rule name -> its folder under lightning_resctl/rules/
BUILTIN_HOMES = {
    "add": "add", "rescontroller": "rescontroller", "mgr": "mgr", "mgr-competitive": "mgr", "mgr-independent": "mgr",
    "attnres": "attnres", "attnres-block": "attnres", "hc": "hc", "mhc": "hc", "mhc-lite": "mhc_lite",
}
#: parameter names of the oracles that carry an option under another name
PARAM_OPTION = {"iters": "sinkhorn_iters", "variant": "sinkhorn"}


def _option_defaults(configs) -> dict:
    out: dict = {}
    for config in configs:
        for f in dataclasses.fields(config):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, []).append(f.default)
    return out


def _default_nodes(fn) -> dict:
    """parameter name -> the AST of its default as written in the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    a = node.args
    positional = a.posonlyargs + a.args
    out = {arg.arg: d for arg, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)}
    out.update({arg.arg: d for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    return out


def _is_literal(node) -> bool:
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


def test_each_rule_has_one_home():
    """Every built-in rule's class lives in ``lightning_resctl.rules.<folder>.rule`` and its Config in
    ``<folder>.config``; every public function and module of the folder takes an option's default from the config
    (same value, and not written again as a literal: a default written twice fails)."""
    folders: dict[str, set] = {}
    for name, folder in BUILTIN_HOMES.items():
        cls = get_merge_rule(name).rule_class
        assert cls.__module__ == f"lightning_resctl.rules.{folder}.rule", (name, cls.__module__)
        if dataclasses.fields(cls.Config):
            assert cls.Config.__module__ == f"lightning_resctl.rules.{folder}.config", (name, cls.Config)
            folders.setdefault(folder, set()).add(cls.Config)
        else:
            folders.setdefault(folder, set())
    checked = 0
    for folder, configs in folders.items():
        package = importlib.import_module(f"lightning_resctl.rules.{folder}")
        defaults = _option_defaults(configs)
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for attr, obj in vars(module).items():
                if attr.startswith("_") or obj in configs or getattr(obj, "__module__", None) != module.__name__:
                    continue
                fn = obj.__init__ if inspect.isclass(obj) else obj
                if not inspect.isfunction(fn):
                    continue
                nodes = None
                for p in inspect.signature(fn).parameters.values():
                    option = PARAM_OPTION.get(p.name, p.name)
                    want = [d for d in defaults.get(option, []) if d is not None]  # None: computed per model
                    if p.default is inspect.Parameter.empty or not want:
                        continue
                    where = f"{module.__name__}.{attr}({p.name}=...)"
                    assert p.default in want, f"{where}: default {p.default!r}, the config says {want}"
                    nodes = nodes if nodes is not None else _default_nodes(fn)
                    assert not _is_literal(nodes[p.name]), (
                        f"{where}: the default is written again as {ast.unparse(nodes[p.name])}; take it from the "
                        f"config ({'/'.join(c.__name__ for c in configs)}.{option})")
                    checked += 1
    assert checked >= 30, checked  # the functional APIs, the modules and the oracles of every rule were read
