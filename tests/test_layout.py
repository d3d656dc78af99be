"""The package's layers import one way only (issue 32): compare -> callbacks -> diagnostics -> surgery -> rules ->
runtime. These tests check the arrows from the bottom: the runtime knows no rule."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

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
