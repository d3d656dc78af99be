"""The quick subset (``python -m pytest -m quick``, tests/conftest.py): the marker is registered, every test it
names exists (a renamed test would drop out of it silently), and the README's test command stays the whole suite."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from conftest import QUICK, is_quick

TESTS = Path(__file__).resolve().parent


def test_the_quick_marker_is_registered():
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("quick:") for marker in config["markers"])


def test_every_quick_test_exists():
    missing = []
    for file_name, names in QUICK.items():
        tree = ast.parse((TESTS / file_name).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        missing += [f"{file_name}::{name}" for name in names or () if name not in defined]
        assert any(name.startswith("test_") for name in defined), file_name
    assert not missing, missing


def test_quick_leaves_out_the_triton_interpreter_and_unlisted_tests():
    assert is_quick("test_rescontroller.py", "test_fp32_matches_reference", "test_fp32_matches_reference[shape0-torch]")
    assert not is_quick("test_rescontroller.py", "test_fp32_matches_reference",
                        "test_fp32_matches_reference[shape0-triton]")
    assert not is_quick("test_rescontroller.py", "test_gpt_saved_bytes_and_gradients",
                        "test_gpt_saved_bytes_and_gradients")
    assert is_quick("test_rule_attnres.py", "test_anything", "test_anything") and not is_quick("test_mgr.py", "t", "t")


def test_the_readme_test_command_is_the_whole_suite():
    readme = (TESTS.parent / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("pip install") and "python -m pytest" in line)
    assert line.endswith("python -m pytest -q -n 2 --dist loadfile tests") and "-m quick" in readme
