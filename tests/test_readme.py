"""The README and the docs/ pages: every ```python block of a page runs as written, in order, in one fresh
interpreter (after the blocks of the page it names in ``<!-- test: runs after PAGE -->``), printing what its
comments say, and each block also runs on its own unless its first line says it continues another
(``# (continues ...)``); the commands of the ```bash blocks name existing flags and files; every relative link
points to an existing file and heading; every module, name and path the prose names exists; the figures a page
quotes from a results file (``<!-- figures: docs/results/FILE -->`` before the paragraph or table) are in that
file; the README stays a front page."""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_LINE = 'pip install torch==2.13.0 -e ".[test]" && pip install --no-deps litgpt==0.5.13 timm==1.0.31 && python -m ruff check . && python -m pytest -q -n 2 --dist loadfile tests'  # noqa: E501  (the README's line, exactly)
#: the README is the front page; the rest lives in docs/ (PEFT's README is 191 lines, torchao's 319, Liger's 539)
MAX_README_LINES = 400

#: the written pages (docs/results/ holds the output of runs, linked but not written by hand)
PAGES = [README, *sorted(p for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts)]
ALL_MD = [README, *sorted(DOCS.rglob("*.md"))]

#: what a page's blocks print, as their comments say (each an output line; checked after the page's own marker)
PRINTS = {
    "README.md": ["patched 4 residual merges (mgr-competitive, n=4) · added 197 parameters (0.55% of 35.7 k) · full "
                  "report: lightning_resctl.get_patch_report(model)",
                  "torch.Size([2, 10, 64])", "['resctl/alpha_mean/00', 'resctl/alpha_mean/02']"],
    "docs/lightning.md": ["True"],
    "docs/distributed.md": ["ResidualParallelStrategy: mgr patch (callback) · tensor parallel (read from the plan), "
                            "rule parameters on the mesh, 2 plan entries over 1 rank · 2 blocks (Block), 2 "
                            "checkpointed · no FSDP2 (1 data-parallel rank)"],
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
    parts = ["import sys"]
    for p in [*_runs_after(page), page]:
        parts.append(f"print({_name(p)!r} + ' ---'); print({_name(p)!r} + ' ---', file=sys.stderr)")
        parts += [f"# --- {_name(p)} python block {i} ---\n{b}" for i, b in enumerate(_blocks(p, "python"))]
    proc = _run_script("\n\n".join(parts), tmp_path)
    assert proc.returncode == 0, f"{_name(page)}'s python blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    own = "\n".join(out.split(f"{_name(page)} ---\n", 1)[1] for out in (proc.stdout, proc.stderr))
    lines = {line.strip() for line in re.split(r"[\r\n]", own)}
    for expected in PRINTS.get(_name(page), []):
        assert expected in lines, f"{_name(page)}: no output line {expected!r}:\n{own[-3000:]}"


def _run_script(text: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "page_blocks.py").write_text(text)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "page_blocks.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


#: the first line of a block that uses the names of the blocks before it (it is run only in its page's sequence)
CONTINUES = re.compile(r"# \(continues [^)\n]+\)\n")


def _alone(page: Path) -> list[int]:
    """The blocks of ``page`` that must run on their own: all but those that say they continue another (and the
    first block of a page that runs after no other, which the in-order run already runs on its own)."""
    blocks = _blocks(page, "python")
    first = 0 if _runs_after(page) else 1
    return [i for i, b in enumerate(blocks) if i >= first and not CONTINUES.match(b)]


@pytest.mark.parametrize("page", [p for p in PYTHON_PAGES if _alone(p)], ids=_name)
def test_python_blocks_run_on_their_own(page, tmp_path):
    """A reader copies one block: it imports and defines what it uses. Each block runs as a script of its own, in a
    namespace of its own (one interpreter per page: modules an earlier block imported stay imported, which a
    missing import or name still shows)."""
    blocks = _blocks(page, "python")
    lines = ["import runpy, sys, traceback", "failed = []"]
    for i in _alone(page):
        (tmp_path / f"block_{i}.py").write_text(blocks[i])  # a file: the surgery reads the source of what it patches
        lines += [f"try:\n    runpy.run_path('block_{i}.py', run_name='__main__')",
                  f"except Exception:\n    failed.append({i}); traceback.print_exc()"]
    lines.append("sys.exit(f'blocks that fail on their own: {failed}' if failed else 0)")
    proc = _run_script("\n".join(lines), tmp_path)
    assert proc.returncode == 0, (f"{_name(page)}: a python block fails on its own (start it with the imports and "
                                  f"names it uses, or with `# (continues ...)`):\n{proc.stderr[-6000:]}")


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
    assert lines <= MAX_README_LINES, \
        f"README.md has {lines} lines; move sections to docs/ (at most {MAX_README_LINES})"
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


#: a paragraph or table whose figures come from results files: ``<!-- figures: docs/results/A[, docs/results/B] -->``
FIGURES = re.compile(r"<!-- figures: ([^>]+?) -->\n+((?:[^\n]+\n)+)")
#: a quoted figure: a decimal (sign allowed; not a percentage and not a goal after <, >, =, ≤, ≥, ~, ≈) or a
#: duration in seconds (``1295 s``, ``21 min 35 s``)
_FIGURE = re.compile(r"(?<![<>=≤≥~≈] )(?<![\w.<>=≤≥~≈])([−+-]?\d+\.\d+)(?![\d%])|(?:(\d+) min )?\b(\d+) s\b")
_NUMBER = re.compile(r"[−+-]?\d+(?:\.\d+)?")


def _figures(text: str) -> list[str]:
    """The figures quoted in ``text``, as decimal strings (durations in seconds)."""
    out = []
    for decimal, minutes, seconds in _FIGURE.findall(text):
        out.append(decimal.replace("−", "-") if decimal else str(60 * int(minutes or 0) + int(seconds)))
    return out


def _held(figure: str, numbers: set[str]) -> bool:
    """Whether a number of a results file, rounded to the figure's decimals (half up or half even), is ``figure``."""
    quoted = Decimal(figure.lstrip("+"))
    step = Decimal(1).scaleb(quoted.as_tuple().exponent)
    for n in numbers:
        value = Decimal(n.replace("−", "-").lstrip("+"))
        if value.as_tuple().exponent <= quoted.as_tuple().exponent and any(
                value.quantize(step, rounding=r) == quoted for r in (ROUND_HALF_UP, ROUND_HALF_EVEN)):
            return True
    return False


def _unheld_figures(text: str) -> list[str]:
    """``'FIGURE (not in FILES)'`` for each figure of a marked paragraph of ``text`` that its results files lack."""
    bad = []
    for sources, block in FIGURES.findall(text):
        files = [ROOT / name.strip() for name in sources.split(",")]
        missing = [f.relative_to(ROOT).as_posix() for f in files if not f.is_file()]
        if missing:
            bad.append(f"no results file {missing}")
            continue
        numbers = {n for f in files for n in _NUMBER.findall(f.read_text(encoding="utf-8"))}
        bad += [f"{fig} (not in {sources.strip()})" for fig in _figures(block) if not _held(fig, numbers)]
    return bad


def test_a_quoted_figure_that_no_results_file_holds_is_caught(tmp_path, monkeypatch):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "run.txt").write_text("rescontroller 1.092 1.129\nplain 176.7 ms\nloss -0.0263 [-0.0920, +0.0394]\n"
                                     "Total wall time: 1295 s.\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = ("<!-- figures: docs/results/run.txt -->\n\n| rule | step | saved |\n|---|---|---|\n"
            "| rescontroller | 1.092× | 1.13× |\n\nA goal of ≤ 1.08× and 0.12% are not figures of a run.\n")
    assert _unheld_figures(page) == []
    assert _unheld_figures(page.replace("1.092×", "1.051×")) == ["1.051 (not in docs/results/run.txt)"]
    assert _unheld_figures(page.replace("| 1.13× |", "| measured 1.14× |")) == ["1.14 (not in docs/results/run.txt)"]
    prose = "<!-- figures: docs/results/run.txt -->\nIt took 21 min 35 s; {}, interval [−0.0920, +0.0394].\n"
    assert _unheld_figures(prose.format("−0.0263")) == []
    assert _unheld_figures(prose.format("+0.0263")) == ["+0.0263 (not in docs/results/run.txt)"]
    assert _unheld_figures(prose.replace("21 min 35 s", "21 min 41 s").format("−0.0263")) == [
        "1301 (not in docs/results/run.txt)"]
    assert _unheld_figures("<!-- figures: docs/results/gone.txt -->\n1.0\n") == [
        "no results file ['docs/results/gone.txt']"]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_quoted_figures_are_in_the_results_files_they_come_from(page):
    assert not _unheld_figures(_text(page)), f"{_name(page)}: {_unheld_figures(_text(page))}"


def test_the_pages_that_quote_results_say_where_from():
    """The front page's tables, the paper-set results, the peers' and the scaling benchmarks are marked (a marker
    dropped in an edit would let their figures drift from the results files)."""
    marked = {(_name(p), src.strip())
              for p in PAGES for srcs, _ in FIGURES.findall(_text(p)) for src in srcs.split(",")}
    for page, source in [("README.md", "docs/results/paper/summary.md"),
                         ("README.md", "docs/results/bench_peers_cpu.txt"),
                         ("docs/compare.md", "docs/results/paper/summary.md"),
                         ("docs/benchmarks.md", "docs/results/bench_peers_cpu.txt"),
                         ("docs/benchmarks.md", "docs/results/bench_scaling_cpu.md"),
                         ("docs/rules/mgr.md", "docs/results/bench_scaling_cpu.md")]:
        assert (page, source) in marked, (page, source)


def test_the_rescontroller_page_names_every_backend_the_rule_accepts():
    from lightning_resctl.runtime.backends import RULE_BACKENDS

    section = _text(DOCS / "rules" / "rescontroller.md").split("## Execution paths", 1)[1].split("\n## ", 1)[0]
    assert not [b for b in RULE_BACKENDS if f'`"{b}"`' not in section]


#: the papers the rules implement (arXiv ids): the README links and cites them, CITATION.cff lists them
PAPERS = {"2605.23259", "2603.15031", "2409.19606", "2512.24880", "2601.05732", "2402.02622", "2411.07501",
          "2601.00417", "2601.21579"}


def test_the_readme_links_and_cites_each_rules_paper_and_citation_cff_lists_the_same():
    import yaml

    import lightning_resctl

    readme = _text(README)
    assert set(re.findall(r"\(https://arxiv\.org/abs/([\d.]+)\)", _prose(readme))) == PAPERS  # linked
    bibtex = "".join(body for tag, body in _fences(readme) if tag == "bibtex")
    assert set(re.findall(r"eprint = \{([\d.]+)\}", bibtex)) == PAPERS  # cited
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["version"] == lightning_resctl.__version__ and cff["license"] == "Apache-2.0"
    assert {ref["doi"].removeprefix("10.48550/arXiv.") for ref in cff["references"]} == PAPERS
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def test_the_tested_versions_are_quoted_as_written_once():
    """The versions the suite last passed with are written once, in lightning_resctl/tested_versions.txt: the
    README and docs/install.md name it as pip constraints (and quote no version of their own), the README's test
    command pins that torch; the changelog's policy and the package version agree with pyproject."""
    import tomllib

    from lightning_resctl.__main__ import TESTED_WITH

    for page in (README, DOCS / "install.md"):
        text = " ".join(_text(page).split())
        assert "-c lightning_resctl/tested_versions.txt" in text, page
        assert not any(f"{dist} {version}" in text for dist, version in TESTED_WITH.items() if dist != "torch"), page
    assert f"torch=={TESTED_WITH['torch']}" in CI_LINE
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_resctl.__version__"}
    assert "## Version policy" in _text(ROOT / "CHANGELOG.md")
