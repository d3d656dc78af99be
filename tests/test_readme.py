"""The README and the docs/ pages: every ```python block of a page runs as written, in order, in one fresh
interpreter (after the blocks of the page it names in ``<!-- test: runs after PAGE -->``), printing what its
comments say; the commands of the ```bash blocks name existing flags and files; every relative link points to an
existing file and heading; every module, name and path the prose names exists; the README stays a front page."""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_LINE = 'pip install torch==2.13.0 -e ".[test]" && pip install --no-deps litgpt==0.5.13 timm==1.0.31 && python -m pytest -q tests'
#: the README is the front page; the rest lives in docs/ (PEFT's README is 191 lines, torchao's 319, Liger's 539)
MAX_README_LINES = 400

#: the written pages (docs/results/ holds the output of runs, linked but not written by hand)
PAGES = [README, *sorted(p for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts)]
ALL_MD = [README, *sorted(DOCS.rglob("*.md"))]

#: what a page's blocks print, as their comments say (each an output line; checked after the page's own marker)
PRINTS = {
    "README.md": ["torch.Size([2, 10, 64])", "['resctl/alpha_mean/00', 'resctl/alpha_mean/02']"],
    "docs/lightning.md": ["True"],
    "docs/fabric.md": ["4 4"],
    "docs/transformers.md": ["True"],
    "docs/rules/your_own.md": ["3 {'scale': 0.25}"],
}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _fences(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```[ \t]*$", text, flags=re.S | re.M)


def _blocks(page: Path, lang: str) -> list[str]:
    return [body for tag, body in _fences(_text(page)) if tag == lang]


def _prose(text: str) -> str:
    """The text without its fenced blocks."""
    return re.sub(r"^```[\w-]*\n.*?^```[ \t]*$", "", text, flags=re.S | re.M)


def _runs_after(page: Path) -> list[Path]:
    """The pages whose blocks run before this page's (the first first), from ``<!-- test: runs after PAGE -->``."""
    m = re.search(r"<!-- test: runs after ([\w./-]+) -->", _text(page))
    if m is None:
        return []
    before = ROOT / m.group(1)
    assert before.is_file(), f"{_name(page)} runs after {m.group(1)}, which does not exist"
    return [*_runs_after(before), before]


PYTHON_PAGES = [p for p in PAGES if _blocks(p, "python")]
BASH_PAGES = [p for p in PAGES if _blocks(p, "bash")]


def test_ci_reads_the_test_command_line():
    assert CI_LINE in _text(README).splitlines()


def test_every_page_that_prints_has_python_blocks():
    """The expectations above name pages whose blocks run (a page renamed or a fence relabelled fails here)."""
    assert set(PRINTS) <= {_name(p) for p in PYTHON_PAGES}
    for name, lines in PRINTS.items():
        assert all(line in _text(ROOT / name) for line in lines), name


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_blocks_run_in_order_in_one_fresh_interpreter(page, tmp_path):
    parts = []
    for p in [*_runs_after(page), page]:
        parts.append(f"print({_name(p)!r} + ' ---')")
        parts += [f"# --- {_name(p)} python block {i} ---\n{b}" for i, b in enumerate(_blocks(p, "python"))]
    (tmp_path / "page_blocks.py").write_text("\n\n".join(parts))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "page_blocks.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{_name(page)}'s python blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    own = proc.stdout.split(f"{_name(page)} ---\n", 1)[1]
    lines = {line.strip() for line in re.split(r"[\r\n]", own)}
    for expected in PRINTS.get(_name(page), []):
        assert expected in lines, f"{_name(page)}: no output line {expected!r}:\n{own[-3000:]}"


def _commands(page: Path) -> list[list[str]]:
    out = []
    for block in _blocks(page, "bash"):
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


def test_the_pages_show_the_compare_commands():
    compares = [c for p in BASH_PAGES for c in map(_subcommand, _commands(p)) if c and c[0] == "compare"]
    assert len(compares) >= 8
    assert any(c[0] == "compare" for c in map(_subcommand, _commands(README)) if c)


@pytest.mark.parametrize("page", BASH_PAGES, ids=_name)
def test_bash_commands_name_existing_flags_and_files(page, tmp_path, monkeypatch):
    """Every compare command parses with the real command line (``my_pkg`` and ``my.yaml`` are the README's own
    examples, written here), every summarize command names only its flags, every script exists."""
    from lightning_resctl.compare.cli import CompareCLI

    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(_MY_PKG)
    monkeypatch.syspath_prepend(str(tmp_path))
    my_yaml = next(b for b in _blocks(README, "yaml") if b.startswith("# my.yaml"))
    (tmp_path / "my.yaml").write_text(my_yaml)
    commands = _commands(page)
    for args in [sub[1] for sub in map(_subcommand, commands) if sub and sub[0] == "compare"]:
        if "--help" in args:
            continue
        args = [str(tmp_path / "my.yaml") if a == "my.yaml" else a for a in args]
        try:
            cli = CompareCLI(args)
            cli.compare_options()
        except SystemExit as err:  # --print_config exits 0 after printing; a bad flag exits 2 naming it
            if not ("--print_config" in args and err.code == 0):
                pytest.fail(f"{_name(page)}: `compare {' '.join(args)}` does not parse (exit {err.code})")
    for c in commands:
        if (c[0] == "python" and c[1].endswith(".py")) or (c[0] == "bash" and c[1].endswith(".sh")):
            assert (ROOT / c[1]).is_file(), (_name(page), c)
        sub = _subcommand(c)
        if sub is None:
            continue
        command, args = sub
        assert command in ("compare", "summarize", "--version", "--help", "-h", ""), c
        if command == "summarize":
            assert [a for a in args if a.startswith("-")] in ([], ["--out"]), c


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(_text(page)), flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _prose(_text(page)))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose)


def test_readme_is_a_front_page():
    """At most MAX_README_LINES lines, and every docs/ page is reachable from it (directly or through the docs
    index), so that nothing moved out of the README is lost."""
    lines = len(_text(README).splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move sections to docs/ (at most {MAX_README_LINES})"
    reached = set()
    for page in (README, DOCS / "README.md"):
        for target in _links(page):
            reached.add((page.parent / target.split("#", 1)[0]).resolve())
    missing = [_name(p) for p in PAGES if p != README and p.resolve() not in reached]
    assert not missing, f"docs pages linked neither from README.md nor docs/README.md: {missing}"


@pytest.mark.parametrize("page", ALL_MD, ids=_name)
def test_relative_links_point_to_existing_files_and_headings(page):
    bad = []
    for target in _links(page):
        if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{_name(page)}: " + "; ".join(bad)


#: folders that a path in the prose may start with; the package's own folders may be named without its prefix
_TOP = ("lightning_resctl", "kernels", "benchmarks", "tests", "examples", "docs")
_PKG = ("rules", "runtime", "surgery", "diagnostics", "callbacks", "compare")


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
            except ModuleNotFoundError:
                return False
    return True


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_prose_names_existing_modules_and_paths(page):
    """Every ``lightning_resctl.x.y`` and every repository path the page's inline code names exists: a module or a
    file that moved is renamed in the docs too."""
    spans = re.findall(r"`([^`\n]+)`", _prose(_text(page)))
    bad = []
    for span in spans:
        span = re.sub(r"--(out|logdir)[ =]\S+", "", span)  # what a command writes need not exist yet
        for dotted in re.findall(r"\blightning_resctl(?:\.[A-Za-z_]\w*)+", span):
            if not _resolve(dotted):
                bad.append(dotted)
        # (a pattern such as tests/test_*.py or rules/<name>/ is not a path)
        for path in re.findall(r"(?<![\w/.-])((?:%s)/[\w./-]*)(?![\w*<{}./-])" % "|".join(_TOP + _PKG), span):
            path = path.rstrip(".:")
            first = path.split("/", 1)[0]
            dest = ROOT / path if first in _TOP else ROOT / "lightning_resctl" / path
            if not dest.exists():
                bad.append(path)
    assert not bad, f"{_name(page)} names what does not exist: {sorted(set(bad))}"
