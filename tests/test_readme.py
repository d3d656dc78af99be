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


def _subcommand(c: list[str]) -> tuple[str, list[str]] | None:
    """``(command, args)`` of ``lightning-resctl COMMAND ...`` or ``python -m lightning_resctl COMMAND ...``."""
    if c[:1] == ["lightning-resctl"]:
        return (c[1], c[2:]) if len(c) > 1 else ("", [])
    if c[:3] == ["python", "-m", "lightning_resctl"]:
        return (c[3], c[4:]) if len(c) > 3 else ("", [])
    return None


_MY_PKG = """
import lightning as L


class MyModule(L.LightningModule):
    def __init__(self, hidden: int = 64):
        super().__init__()


class MyDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
"""


def test_bash_commands_name_existing_flags_and_files(tmp_path, monkeypatch):
    """Every compare command of the README parses with the real command line (``my_pkg`` and ``my.yaml`` are the
    README's own examples, written here), every summarize command names only its flags, every script exists."""
    from lightning_resctl.compare.cli import CompareCLI

    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(_MY_PKG)
    monkeypatch.syspath_prepend(str(tmp_path))
    my_yaml = next(b for b in _blocks("yaml") if b.startswith("# my.yaml"))
    (tmp_path / "my.yaml").write_text(my_yaml)
    commands = _commands()
    compares = [sub[1] for sub in map(_subcommand, commands) if sub and sub[0] == "compare"]
    assert len(compares) >= 8
    for args in compares:
        if "--help" in args:
            continue
        args = [str(tmp_path / "my.yaml") if a == "my.yaml" else a for a in args]
        try:
            cli = CompareCLI(args)
            cli.compare_options()
        except SystemExit as err:  # --print_config exits 0 after printing; a bad flag exits 2 naming it
            if not ("--print_config" in args and err.code == 0):
                pytest.fail(f"README command `compare {' '.join(args)}` does not parse (exit {err.code})")
    for c in commands:
        if c[0] == "python" and c[1].endswith(".py"):
            assert (ROOT / c[1]).is_file(), c
        sub = _subcommand(c)
        if sub is None:
            continue
        command, args = sub
        assert command in ("compare", "summarize", "--version", "--help", "-h", ""), c
        if command == "summarize":
            assert [a for a in args if a.startswith("-")] in ([], ["--out"]), c
