"""The package layout of issue 32: the layers import one way only (compare -> callbacks -> diagnostics -> surgery ->
rules -> runtime), and each rule has one home. Each test is its own function."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_resctl
from lightning_resctl.rules import get_merge_rule

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_resctl"
RUNTIME = ("backends", "triton", "autograd", "tracer", "regions", "background", "memory", "log", "lazy")
#: what sits above the runtime (rescontroller / mgr / metrics: rules still at the package root on some branches)
ABOVE_RUNTIME = ("rules", "surgery", "callbacks", "diagnostics", "distributed", "compare", "rescontroller", "mgr",
                 "metrics", "plots", "testing")

# The package module without running its __init__ (which imports the public API, rules included): what is imported
# is what each runtime module itself pulls in, the package's modules forgotten between the imports (one process,
# torch imported once).
_IMPORT_EACH = """
import importlib, json, sys, types
loaded = {{}}
for name in {names!r}:
    for module in [m for m in sys.modules if m == "lightning_resctl" or m.startswith("lightning_resctl.")]:
        del sys.modules[module]
    package = types.ModuleType("lightning_resctl")
    package.__path__ = [{path!r}]
    sys.modules["lightning_resctl"] = package
    importlib.import_module("lightning_resctl.runtime." + name)
    loaded[name] = sorted(m for m in sys.modules if m.startswith("lightning_resctl."))
print(json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def runtime_imports() -> dict:
    """``{runtime module: the package's modules loaded by importing it alone}``."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH.format(path=str(PACKAGE), names=list(RUNTIME))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _above(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == "lightning_resctl" and parts[1] in ABOVE_RUNTIME


@pytest.mark.parametrize("name", RUNTIME)
def test_runtime_imports_no_rule(name, runtime_imports):
    """Importing a runtime module on its own pulls in nothing above the runtime; the background compiler (run in the
    child process) does not pull in the regions, which import it."""
    loaded = runtime_imports[name]
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
    "dwa": "dwa", "laurel": "laurel", "laurel-pa": "laurel", "ddl": "ddl", "kromhc": "kromhc",
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


# a module's layer is the first part of its path under lightning_resctl/; higher imports lower, never upward
LAYERS = ("runtime", "rules", "surgery", "diagnostics", "callbacks", "distributed", "compare")
# top-level packages outside the layer folders -> the layer they belong to
TOP_LEVEL = {"kernels": "runtime"}
EXEMPT = {"__init__", "__main__"}  # the package's front door imports every layer


def _layer(top: str) -> str | None:
    """The layer of ``lightning_resctl.<top>...``; None for the exempt top-level modules."""
    if top in EXEMPT:
        return None
    if top in LAYERS:
        return top
    if top in TOP_LEVEL:
        return TOP_LEVEL[top]
    raise AssertionError(f"lightning_resctl.{top} belongs to no layer: put it in one of {LAYERS} "
                         "(or map it in tests/test_layout.py)")


def _modules(root: Path):
    """(dotted name relative to the package, is a package __init__, path) of every module under ``root``."""
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = Path(folder) / f
                parts = list(path.relative_to(root).with_suffix("").parts)
                is_pkg = parts[-1] == "__init__"
                if is_pkg and len(parts) > 1:
                    parts = parts[:-1]
                yield ".".join(parts), is_pkg, path


def _imported(tree: ast.AST, name: str, is_pkg: bool, exports: dict):
    """(line, top-level part of lightning_resctl) of every import of the package in one module's tree: absolute,
    relative, inside functions, ``importlib.import_module("lightning_resctl...")``, and
    ``from lightning_resctl import <lazy export>`` (resolved to the module that defines it)."""
    package = ["lightning_resctl", *name.split(".")] if is_pkg else ["lightning_resctl", *name.split(".")[:-1]]
    for node in ast.walk(tree):
        targets: list = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "lightning_resctl":
                targets = [f"lightning_resctl.{exports.get(a.name, a.name)}" for a in node.names]
            else:
                targets = [module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            parts = target.split(".")
            if parts[0] == "lightning_resctl" and len(parts) > 1:
                yield node.lineno, parts[1]


def upward_imports(root: Path = PACKAGE, exports: dict | None = None) -> list[str]:
    """Every import in the package ``root`` of a higher layer than the importing module's, as readable lines."""
    exports = dict(lightning_resctl._EXPORTS if exports is None else exports)
    found = []
    for name, is_pkg, path in _modules(root):
        top = name.split(".")[0]
        layer = _layer(top)
        if layer is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target_top in _imported(tree, name, is_pkg, exports):
            target = _layer(target_top) if target_top not in EXEMPT else None
            if target is not None and LAYERS.index(target) > LAYERS.index(layer):
                found.append(f"lightning_resctl.{name} ({layer}) imports lightning_resctl.{target_top} ({target}) "
                             f"at {path.name}:{line}")
    return sorted(found)


def test_imports_run_one_way():
    assert upward_imports() == []


def test_imports_run_one_way_sees_an_upward_import(tmp_path):
    # the walker itself: a diagnostics module importing a callback (relative, inside a function) is caught,
    # and so is `from lightning_resctl import <lazy export of a higher layer>`
    pkg = tmp_path / "lightning_resctl"
    (pkg / "diagnostics").mkdir(parents=True)
    (pkg / "callbacks").mkdir()
    (pkg / "__init__.py").write_text("from .callbacks import X\n")
    (pkg / "callbacks" / "__init__.py").write_text("from ..diagnostics import m\n")
    (pkg / "diagnostics" / "__init__.py").write_text("")
    (pkg / "diagnostics" / "m.py").write_text("def f():\n    from ..callbacks.patcher import P\n"
                                              "from lightning_resctl import Callback\n")
    found = upward_imports(pkg, exports={"Callback": "callbacks"})
    said = "lightning_resctl.diagnostics.m (diagnostics) imports lightning_resctl.callbacks (callbacks) at m.py:"
    assert found == [said + "2", said + "3"]


def backend_names_in(folder: Path) -> list[str]:
    """Every string constant in the modules of ``folder`` that is a backend name or the ``backend`` option itself."""
    from lightning_resctl.runtime.backends import ALIASES, BACKENDS

    names = {*BACKENDS, *ALIASES, "backend"}
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_surgery_names_no_backend():
    # which backends a rule can run where is the rule's business (MergeRule.runnable_options), not the surgery's
    assert backend_names_in(PACKAGE / "surgery") == []


def test_every_package_folder_ships():
    """Each package folder of lightning_resctl is in pyproject's explicit package list (a folder missing there is
    absent from a wheel and from a non-editable install, while the suite, run from the checkout, still passes)."""
    import tomllib

    root = PACKAGE.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(root).parts) for p in PACKAGE.rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert folders - listed == set(), f"package folders missing from pyproject.toml: {sorted(folders - listed)}"
    assert "lightning_resctl.kernels" in listed


# --- issue 40: rules and kernels ---
KERNELS = PACKAGE.parent / "kernels"
RULES = PACKAGE / "rules"
#: the one function that loads a kernels module (runtime/triton.py)
KERNELS_LOADER = "load_kernels"


def _import_nodes(path: Path):
    """Every import statement in ``path`` (also inside functions) with the module it names as written, the dots
    of a relative import kept: ``(node, ".ops")``, ``(node, "..common")``, ``(node, "torch")``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name
        elif isinstance(node, ast.ImportFrom):
            yield node, "." * node.level + (node.module or "")


def _rule_folders() -> list[Path]:
    return sorted(p.parent for p in RULES.glob("*/__init__.py"))


def test_kernels_import_nothing_of_the_package():
    """``kernels/`` is a leaf: its modules import torch, triton, the standard library and each other (relative,
    one dot), nothing of ``lightning_resctl`` (also not inside a function)."""
    files = sorted(KERNELS.glob("*.py"))
    assert {f.stem for f in files} >= {"mgr", "rescontroller", "tiles", "rows"}
    found = []
    for f in files:
        for node, module in _import_nodes(f):
            if module.split(".")[0] == "lightning_resctl" or module.startswith(".."):
                found.append(f"{f.name}:{node.lineno} imports {module}")
    assert found == []


def test_rule_ops_import_no_modules():
    """In every rule folder the modules sit over the ops: ``ops.py`` imports no ``modules.py`` (not inside a
    function either)."""
    found = [f"{folder.name}/ops.py:{node.lineno} imports {module}"
             for folder in _rule_folders() if (folder / "ops.py").exists()
             for node, module in _import_nodes(folder / "ops.py")
             if module.lstrip(".").split(".")[-1] == "modules" or module.endswith("rules." + folder.name + ".modules")]
    assert found == []


def test_only_a_rules_ops_reaches_the_kernels():
    """``ops.py`` is the one public dispatch of a rule to the backends: only a rule folder's ``ops.py`` imports the
    kernels loader (nothing in ``rules/`` wraps it, no other file of a rule reaches the kernels)."""
    found = []
    for path in sorted(RULES.rglob("*.py")):
        for node, module in _import_nodes(path):
            names = [a.name for a in node.names]
            if module.endswith("runtime.triton") and KERNELS_LOADER in names and path.name != "ops.py":
                found.append(f"{path.relative_to(RULES)}:{node.lineno} imports {KERNELS_LOADER}")
            if path.name != "ops.py" and ("kernels" in module.split(".") or any("kernels" in n for n in names)):
                found.append(f"{path.relative_to(RULES)}:{node.lineno} imports {module} {names}")
    assert found == []
    users = sorted(str(p.relative_to(RULES)) for p in RULES.rglob("ops.py") if KERNELS_LOADER in p.read_text())
    assert users == ["attnres/ops.py", "mgr/ops.py", "rescontroller/ops.py"]


def test_rule_files_use_each_others_public_names_only():
    """Inside a rule folder a file imports only the public names of its siblings (what ``rule.py`` or
    ``modules.py`` needs from ``ops.py`` is ops' public API, not its private helpers)."""
    found = [f"{path.relative_to(RULES)}:{node.lineno} imports {a.name} from {module}"
             for path in sorted(RULES.rglob("*.py")) for node, module in _import_nodes(path)
             if isinstance(node, ast.ImportFrom) and module.startswith(".")
             for a in node.names if a.name.startswith("_")]
    assert found == []


def test_op_registration_is_written_once():
    """The ``torch.library`` registration (custom op, fake, autograd) is written once, in ``kernels/_library.py``;
    the kernel files and the rules call it and register nothing themselves."""
    calls = {"custom_op", "register_fake", "register_autograd"}
    found = []
    for path in sorted([*KERNELS.glob("*.py"), *PACKAGE.rglob("*.py")]):
        if path == KERNELS / "_library.py" or "kernels" in path.relative_to(PACKAGE.parent).parts[1:2]:
            continue  # lightning_resctl/kernels: the symlink of a source checkout to kernels/
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in calls:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.attr}")
    assert found == []
    assert calls <= {n.attr for n in ast.walk(ast.parse((KERNELS / "_library.py").read_text()))
                     if isinstance(n, ast.Attribute)}


def test_rule_configs_check_in_one_style():
    """Every rule's options are checked in one style: its ``config.py`` dataclasses' ``validate()`` calls the checks
    of ``rules/checks.py`` in sequence (no table of check lambdas, no other checking entry point beside it)."""
    found = []
    for folder in _rule_folders():
        path = folder / "config.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(n, ast.Lambda) for n in ast.walk(tree)):
            found.append(f"{folder.name}/config.py: a lambda (a table of checks)")
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            if "validate" not in methods:
                found.append(f"{folder.name}/config.py: {cls.name} has no validate()")
            found += [f"{folder.name}/config.py: {cls.name}.{m}() checks beside validate()" for m in methods
                      if m.startswith("check")]
    assert found == []


# --- issue 40: surgery ---
def _module_graph(root: Path = PACKAGE, exports: dict | None = None) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package ``root`` (dotted names relative to it, a package by its
    folder's name), every import counted: module level and inside functions, relative and absolute, and
    ``from lightning_resctl import <lazy export>`` (resolved to the module defining it). ``from package import
    name`` is an edge to the submodule ``package.name`` when there is one, else to the package; the implicit
    import of a module's parent packages is not an edge (Python runs those before the module, not from it)."""
    exports = dict(lightning_resctl._EXPORTS if exports is None else exports)
    modules = {name: (is_pkg, path) for name, is_pkg, path in _modules(root)}
    graph: dict[str, set[str]] = {}
    for name, (is_pkg, path) in modules.items():
        package = name.split(".") if is_pkg else name.split(".")[:-1]
        if name == "__init__":
            package = []
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ["lightning_resctl", *package][: len(package) + 2 - node.level] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found = [(module, a.name) for a in node.names]
            else:
                continue
            for module, attr in found:
                if module != "lightning_resctl" and not module.startswith("lightning_resctl."):
                    continue
                rel = module[len("lightning_resctl."):] if module != "lightning_resctl" else "__init__"
                if rel == "__init__" and attr in exports:
                    target = exports[attr]
                elif attr is not None and f"{rel}.{attr}".removeprefix("__init__.") in modules:
                    target = f"{rel}.{attr}".removeprefix("__init__.")
                else:
                    target = rel
                while target not in modules and "." in target:  # an attribute path: its module
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # a shortest way back from the group's first module to itself
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def test_the_package_imports_have_no_cycle():
    """No module of the package imports, however indirectly, a module that imports it back, counting imports
    inside functions too (a function-local import that hides a cycle is still a cycle)."""
    cycles = import_cycles(_module_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_import_cycles_sees_a_function_local_cycle(tmp_path):
    # the walker itself: a relative import inside a function closes a cycle through a package's submodule
    pkg = tmp_path / "lightning_resctl"
    (pkg / "surgery").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "surgery" / "__init__.py").write_text("from .api import f\n")
    (pkg / "surgery" / "api.py").write_text("from . import pretrained\n")
    (pkg / "surgery" / "pretrained.py").write_text("def g():\n    from .checkpoint import h\n")
    (pkg / "surgery" / "checkpoint.py").write_text("from lightning_resctl.surgery.api import f\n")
    cycles = import_cycles(_module_graph(pkg, exports={}))
    assert cycles == [["surgery.api", "surgery.pretrained", "surgery.checkpoint", "surgery.api"]]


SURGERY_MAX_LINES = 450


def test_no_surgery_module_is_over_450_lines():
    """Each surgery module holds one step of the pipeline (observe, classify, plan, rewrite, bind, describe) or one
    thing around it: none over 450 lines."""
    long = {f.name: n for f in sorted((PACKAGE / "surgery").glob("*.py"))
            if (n := len(f.read_text().splitlines())) > SURGERY_MAX_LINES}
    assert long == {}, f"surgery modules over {SURGERY_MAX_LINES} lines: {long}"
