"""README.md's code blocks: every ```python block runs as written, in order, in one fresh interpreter,
and the commands of the ```bash blocks name existing flags and files."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_LINE = 'pip install torch==2.13.0 -e ".[test]" && pip install --no-deps litgpt==0.5.13 timm==1.0.31 && python -m pytest -q tests'


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_ci_reads_the_test_command_line():
    assert CI_LINE in README.read_text(encoding="utf-8").splitlines()


def test_python_blocks_run_in_order_in_one_fresh_interpreter(tmp_path):
    blocks = _blocks("python")
    assert len(blocks) >= 4
    script = "\n\n".join(f"# --- README python block {i} ---\n{b}" for i, b in enumerate(blocks))
    (tmp_path / "readme_blocks.py").write_text(script)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"README python blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "torch.Size([2, 10, 64])" in proc.stdout


def _commands() -> list[list[str]]:
    out = []
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part:
                    out.append(shlex.split(part))
    return out


def test_bash_commands_name_existing_flags_and_files():
    from lightning_resctl.compare.cli import build_parser

    commands = _commands()
    compares = [c[4:] for c in commands if c[:4] == ["python", "-m", "lightning_resctl", "compare"]]
    assert len(compares) >= 5
    parser = build_parser()
    for args in compares:
        if "--help" in args or "--version" in args:
            continue
        try:
            parser.parse_args(args)  # flags and their types; --config files are examples, not read here
        except SystemExit as err:  # pragma: no cover - the message names the bad flag
            pytest.fail(f"README command `compare {' '.join(args)}` does not parse (exit {err.code})")
    for c in commands:
        if c[0] == "python" and c[1].endswith(".py"):
            assert (ROOT / c[1]).is_file(), c
        if c[:3] == ["python", "-m", "lightning_resctl"] and len(c) > 3 and c[3] != "compare":
            assert c[3] in ("--version", "--help", "-h"), c
