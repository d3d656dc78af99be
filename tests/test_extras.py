"""Every package the test suite imports is installed by the README's test command: by the project's
dependencies, its ``test`` extra (with their own requirements), or a ``pip install`` of that command.
A package that was only installed by hand on some machine fails here instead of on a user's."""
from __future__ import annotations

import ast
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PROJECT = "lightning-resctl"


def _test_command() -> str:
    """The README line CI runs (the same pattern as ``.ci/run``)."""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if re.match(r"^pip install .*python -m pytest", line):
            return line
    raise AssertionError("README.md has no `pip install ... python -m pytest` line")


def _command_requirements(command: str) -> tuple[list[Requirement], set[str], set[str]]:
    """What the command's ``pip install`` parts name: requirements installed with their dependencies, the
    extras of the project it installs, and the distributions installed with ``--no-deps`` (alone)."""
    requirements, extras, alone = [], set(), set()
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] != ["pip", "install"]:
            continue
        for word in words[2:]:
            if word.startswith("-"):
                continue
            if word.startswith("."):  # the project itself, e.g. ".[test]"
                extras |= set(re.findall(r"\[([^\]]*)\]", word)[0].split(",")) if "[" in word else set()
            elif "--no-deps" in words:
                alone.add(canonicalize_name(Requirement(word).name))
            else:
                requirements.append(Requirement(word))
    return requirements, {e.strip() for e in extras if e.strip()}, alone


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**default_environment(), "extra": e}) for e in (extras or {""}))


def _installed_closure(roots: list[Requirement]) -> set[str]:
    """Canonical names of the distributions the roots pull in, following installed metadata."""
    seen: set[str] = set()
    stack = [(r, set(r.extras)) for r in roots]
    while stack:
        requirement, extras = stack.pop()
        name = canonicalize_name(requirement.name)
        key = f"{name}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: the import check below reports what is missing
        for line in requires:
            dep = Requirement(line)
            if _applies(dep, extras):
                stack.append((dep, set(dep.extras)))
    return {key.split("[", 1)[0] for key in seen}


def _imported_top_level_modules() -> dict[str, set[str]]:
    """Top-level module -> test files importing it (``import``, ``from ... import``, ``importorskip``)."""
    found: dict[str, set[str]] = {}
    # the test files, and the benchmarks' helpers the tests import (benchmarks/models.py, timm_import.py)
    shared_helpers = [ROOT / "benchmarks" / "models.py", ROOT / "benchmarks" / "timm_import.py"]
    for path in [*sorted(TESTS.rglob("*.py")), *shared_helpers]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.name)
    return found


def _written_by_the_tests() -> set[str]:
    """Module files the tests write themselves (e.g. a pickled model's module in a temporary folder)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in TESTS.glob("*.py"))
    return set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)\.py"\)\.write_text', text))


def test_every_imported_package_is_installed_by_the_test_command():
    requirements, extras, alone = _command_requirements(_test_command())
    assert "test" in extras, "the README's test command installs the project without its test extra"
    provided = _installed_closure([*requirements, Requirement(f"{PROJECT}[{','.join(sorted(extras))}]")]) | alone
    module_to_dists = metadata.packages_distributions()
    # the repository's own: the package, the test modules, and benchmarks (the sweeps and the helpers the tests
    # share with them)
    local = ({p.stem for p in TESTS.glob("*.py")} | {"lightning_resctl", "tests", "benchmarks", "__future__"}
             | _written_by_the_tests())

    missing = {}
    for module, files in sorted(_imported_top_level_modules().items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = {canonicalize_name(d) for d in module_to_dists.get(module, [])}
        if not dists & provided:
            missing[module] = (sorted(dists) or ["(not installed here)"], sorted(files))
    assert not missing, "imported by the tests but not installed by the README's test command " \
        "(add them to the `test` extra in pyproject.toml): " + "; ".join(
            f"{m} (distribution {', '.join(d)}; in {', '.join(f)})" for m, (d, f) in missing.items())


# Requirements of a ``--no-deps`` package that the suite deliberately goes without, with the reason.
NOT_INSTALLED_ON_PURPOSE = {
    "torchvision": "timm requires it; its PyPI build is a CUDA build that does not load beside the CPU torch pin "
                   "(the suite imports timm through benchmarks.timm_import.import_timm)",
}


def _unconditional_requirement_names(distribution: str) -> set[str]:
    """Names a distribution requires whatever extras it is installed with (version bounds left out: they
    are why it is installed ``--no-deps``)."""
    return {canonicalize_name(Requirement(line).name) for line in metadata.requires(distribution) or []
            if _applies(Requirement(line), set())}


def test_a_package_installed_alone_finds_its_own_requirements():
    """``pip install --no-deps X`` skips X's requirements; X's ``import`` still needs them (litgpt imports
    psutil), so each must come from the rest of the command under some version."""
    requirements, extras, alone = _command_requirements(_test_command())
    provided = _installed_closure([*requirements, Requirement(f"{PROJECT}[{','.join(sorted(extras))}]")]) | alone
    missing = {dist: sorted(_unconditional_requirement_names(dist) - provided - set(NOT_INSTALLED_ON_PURPOSE))
               for dist in sorted(alone)}
    missing = {dist: names for dist, names in missing.items() if names}
    assert not missing, "installed with --no-deps, but their requirements are not installed by the rest of " \
        "the README's test command (add them to the `test` extra): " + "; ".join(
            f"{d} needs {', '.join(n)}" for d, n in missing.items())


def test_the_check_sees_a_package_outside_the_extras():
    """The closure is what the command installs, not what this machine happens to have."""
    requirements, extras, alone = _command_requirements(
        'pip install torch==2.13.0 -e ".[test]" && pip install --no-deps Foo_Bar==1.0 && python -m pytest')
    assert [r.name for r in requirements] == ["torch"] and extras == {"test"} and alone == {"foo-bar"}
    provided = _installed_closure([Requirement(f"{PROJECT}[test]")])
    assert {"torch", "lightning", "pytest", "hyper-connections", "einops"} <= provided
    # pip itself is on every machine but no requirement of the project or its test extra brings it
    assert "pip" not in provided


def test_the_tested_versions_pin_everything_the_test_command_installs():
    """``lightning_resctl/tested_versions.txt`` reproduces a green run as pip constraints: it pins every
    distribution the README's test command installs (the project's dependencies and test extra with all of theirs,
    the command's own requirements, the ``--no-deps`` ones), once each, and not the project itself."""
    from lightning_resctl.__main__ import tested_versions

    requirements, extras, alone = _command_requirements(_test_command())
    project = Requirement(f"{PROJECT}[{','.join(sorted(extras))}]")
    needed = (_installed_closure([project, *requirements]) | alone) - {PROJECT}
    pins = [canonicalize_name(name) for name in tested_versions()]
    assert len(pins) == len(set(pins)) and PROJECT not in pins
    assert needed - set(pins) == set(), "installed by the test command but not pinned"
