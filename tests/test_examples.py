"""Every script in ``examples/`` answers ``--help`` and names a bad argument (exit 2, argparse's message, no
traceback) before it starts any work."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

#: one bad argument per example and what the error must say (the argument and the value)
BAD = {
    "compare_residuals.py": (["not_a_path"], ["model", "not_a_path"]),
    "rescontroller_demo.py": (["--dim", "0"], ["--dim", "0"]),
}


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def test_every_example_has_a_bad_argument_case():
    assert {p.name for p in EXAMPLES} == set(BAD)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_an_example_answers_help(script):
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr
    assert "--help" in proc.stdout


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_an_example_names_a_bad_argument(script):
    args, words = BAD[script.name]
    proc = _run(script, *args)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith(f"{script.name}: error:")
    assert all(word in last for word in words), last
