"""The package's layout (issue 32): imports run one way, compare -> callbacks -> diagnostics -> surgery -> rules ->
runtime."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import lightning_resctl

PACKAGE = Path(lightning_resctl.__file__).resolve().parent

# a module's layer is the first part of its path under lightning_resctl/; higher imports lower, never upward
LAYERS = ("runtime", "rules", "surgery", "diagnostics", "callbacks", "compare")
# top-level modules and packages not yet (or never) inside a layer folder -> the layer they belong to
TOP_LEVEL = {
    "backends": "runtime", "_background_compile": "runtime", "_triton": "runtime", "math_context": "runtime",
    "memory": "runtime", "_logging": "runtime", "kernels": "runtime",
    "rescontroller": "rules", "mgr": "rules", "metrics": "rules",
}
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
    from lightning_resctl.backends import ALIASES, BACKENDS

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
