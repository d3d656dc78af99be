"""The package layout of issue 32: the layers import one way only (compare -> callbacks -> diagnostics -> surgery ->
rules -> runtime), and each rule has one home. Each test is its own function."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_resctl.rules import get_merge_rule

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_resctl"
RUNTIME = ("backends", "triton", "autograd", "tracer", "regions", "background", "memory", "log")
#: what sits above the runtime (rescontroller / mgr / metrics: rules still at the package root on some branches)
ABOVE_RUNTIME = ("rules", "surgery", "callbacks", "diagnostics", "compare", "rescontroller", "mgr", "metrics",
                 "plots", "testing")

# The package module without running its __init__ (which imports the public API, rules included): what is imported
# is what the runtime module itself pulls in.
_IMPORT_ONE = """
import importlib, json, sys, types
package = types.ModuleType("lightning_resctl")
package.__path__ = [{path!r}]
sys.modules["lightning_resctl"] = package
importlib.import_module("lightning_resctl.runtime.{name}")
print(json.dumps(sorted(m for m in sys.modules if m.startswith("lightning_resctl."))))
"""


def _above(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == "lightning_resctl" and parts[1] in ABOVE_RUNTIME


@pytest.mark.parametrize("name", RUNTIME)
def test_runtime_imports_no_rule(name):
    """Importing a runtime module in a fresh process pulls in nothing above the runtime; the background compiler
    (run in the child process) does not pull in the regions, which import it."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_ONE.format(path=str(PACKAGE), name=name)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert f"lightning_resctl.runtime.{name}" in loaded
    assert [m for m in loaded if _above(m)] == []
    if name == "background":
        assert "lightning_resctl.runtime.regions" not in loaded


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``, also those inside functions."""
    package = "lightning_resctl.runtime"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}" if not node.module else base) for a in node.names]
    return out


def test_runtime_sources_import_nothing_above_even_lazily():
    """The same one way for imports inside functions (which the import test above does not run)."""
    files = sorted((PACKAGE / "runtime").glob("*.py"))
    assert {f.stem for f in files} >= set(RUNTIME)
    upward = [(f.name, line, m) for f in files for line, m in _imports(f) if _above(m)]
    assert upward == []
    background = [m for _, m in _imports(PACKAGE / "runtime" / "background.py")]
    assert "lightning_resctl.runtime.regions" not in background


def test_runtime_public_names_are_top_level_exports():
    """``wait_for_compiles``, ``region_calls`` and ``saved_tensor_bytes`` live in the runtime and are exported by
    the package (lazily), like ``triton_available``."""
    import lightning_resctl
    from lightning_resctl.runtime import memory, regions, triton

    assert lightning_resctl.wait_for_compiles is regions.wait_for_compiles
    assert lightning_resctl.region_calls is regions.region_calls
    assert lightning_resctl.saved_tensor_bytes is memory.saved_tensor_bytes
    assert lightning_resctl.triton_available is triton.triton_available
    assert {"wait_for_compiles", "region_calls", "saved_tensor_bytes"} <= set(lightning_resctl.__all__)


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
