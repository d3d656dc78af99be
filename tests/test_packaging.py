"""The repository's folders never hide a package of the ecosystem, and the package loads its own kernels as
``lightning_resctl.kernels`` however it is installed (issue 44).

The repository root is on ``sys.path`` whenever something runs from it (``python -m pytest``, ``python -c``); the
test runner also puts ``tests/`` there (``from models import ...``). A regular package or module there named like
an installed distribution's top-level package wins over it: the root's ``kernels/`` once hid Hugging Face's
``kernels``, which transformers imports at load time.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from lightning_resctl.__main__ import TESTED_WITH

ROOT = Path(__file__).resolve().parent.parent

#: the folders whose modules run from a checkout import by their top-level names: the root (``python -m pytest``,
#: ``python -c``) and those the suite and the benchmarks put on ``sys.path`` (tests/conftest.py, the benchmarks'
#: ``from step_bench import ...``)
IMPORT_ROOTS = (ROOT, ROOT / "tests", ROOT / "benchmarks")

#: what a process run from the checkout must be able to do with transformers: import the model classes (which
#: import Hugging Face's ``kernels`` where it is installed) and run one
TRANSFORMERS_RUNS = textwrap.dedent("""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    print("logits", tuple(GPT2LMHeadModel(cfg)(torch.zeros(1, 4, dtype=torch.long)).logits.shape))
""")

#: where a process's package, its kernels and the top-level ``kernels`` (if any) come from
WHERE_FROM = textwrap.dedent("""
    import importlib.util, lightning_resctl
    import lightning_resctl.kernels.tiles  # the documented module path, imported as a user would, first
    print("tiles", lightning_resctl.kernels.tiles.__file__)
    from lightning_resctl.runtime.triton import load_kernels
    spec = importlib.util.find_spec("kernels")
    print("package", lightning_resctl.__file__)
    print("mgr", load_kernels("mgr").__file__)
    print("rescontroller", load_kernels("rescontroller").__file__)
    print("kernels", spec.origin if spec is not None else None)
    from lightning_resctl.__main__ import TESTED_WITH  # read from the package's tested_versions.txt
    print("tested-torch", TESTED_WITH["torch"])
""")


def _run(code: str, cwd: Path, env: dict | None = None, python: str = sys.executable) -> dict[str, str]:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TRITON_INTERPRET": "1", **(env or {})}
    done = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def _hf_kernels_installed() -> Path | None:
    """The folder of an installed distribution's top-level ``kernels`` package, if one is installed."""
    for dist in importlib.metadata.packages_distributions().get("kernels", ()):
        for file in importlib.metadata.distribution(dist).files or ():
            if file.parts[:1] == ("kernels",) and file.name == "__init__.py" and len(file.parts) == 2:
                return Path(file.locate()).parent.resolve()
    return None


def _names_the_checkout_makes_importable() -> dict[str, Path]:
    """Top-level names that, imported from the checkout, load a file of the checkout: modules and regular packages
    (a folder with ``__init__.py``) in the import roots, and folders without one that the checkout itself imports
    by that name (``benchmarks.models``). A folder without ``__init__.py`` is otherwise a namespace portion, which
    any installed regular package of the same name wins over."""
    imported_top = set()
    for path in ROOT.rglob("*.py"):
        if ".git" in path.parts or "__pycache__" in path.parts:
            continue
        for line in path.read_text(errors="replace").splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                imported_top.add(words[1].split(".")[0].rstrip(","))
    names = {}
    for folder in IMPORT_ROOTS:
        for entry in folder.iterdir():
            if entry.name.startswith((".", "_")) or entry.name == "__pycache__":
                continue
            if entry.suffix == ".py":
                names[entry.stem] = entry
            elif entry.is_dir() and ((entry / "__init__.py").exists() or entry.name in imported_top):
                names[entry.name] = entry
    return names


def test_no_name_the_checkout_makes_importable_is_a_package_an_installed_distribution_provides():
    ours = {"lightning_resctl"}  # this distribution's own package (editable or not)
    provided = importlib.metadata.packages_distributions()
    clashes = {name: (str(path.relative_to(ROOT)), provided[name])
               for name, path in _names_the_checkout_makes_importable().items()
               if name in provided and name not in ours}
    assert clashes == {}, f"the checkout hides these installed packages: {clashes}"


def test_the_lister_sees_the_checkouts_kinds_of_names():
    """The check above looks where the clash was: a regular package at the root, the test helpers, a namespace
    folder the checkout imports by name; and it does not count the root's ``kernels/`` folder, which is no regular
    package and which nothing imports as ``kernels``."""
    names = _names_the_checkout_makes_importable()
    assert {"lightning_resctl", "models", "conftest", "benchmarks", "step_bench"} <= set(names)
    assert "kernels" not in names and "docs" not in names


def test_transformers_imports_and_runs_from_the_repository_root():
    assert _run(TRANSFORMERS_RUNS, cwd=ROOT)["logits"] == "(1, 4, 32)"


def test_from_the_root_the_kernels_are_the_checkouts_and_kernels_is_the_installed_one():
    where = _run(WHERE_FROM, cwd=ROOT)
    assert Path(where["package"]).resolve() == ROOT / "lightning_resctl" / "__init__.py"
    assert Path(where["mgr"]).resolve() == ROOT / "kernels" / "mgr.py"
    assert Path(where["rescontroller"]).resolve() == ROOT / "kernels" / "rescontroller.py"
    assert Path(where["tiles"]).resolve() == ROOT / "kernels" / "tiles.py"
    hf = _hf_kernels_installed()
    if hf is not None:
        assert Path(where["kernels"]).resolve() == hf / "__init__.py"
    else:
        assert where["kernels"] == "None" or not where["kernels"].startswith(str(ROOT))


def test_the_editable_install_used_from_another_folder_loads_the_checkouts_kernels(tmp_path):
    """This environment's install of the checkout (the README's ``pip install -e``), used outside the checkout."""
    where = _run(WHERE_FROM, cwd=tmp_path)
    if Path(where["package"]).resolve() != ROOT / "lightning_resctl" / "__init__.py":
        pytest.skip("this environment's lightning_resctl is not this checkout's editable install")
    for name in ("mgr", "rescontroller", "tiles"):
        assert Path(where[name]).resolve() == ROOT / "kernels" / f"{name}.py"
    hf = _hf_kernels_installed()
    if hf is not None:
        assert Path(where["kernels"]).resolve() == hf / "__init__.py"


def _fresh_venv_over_this_one(where: Path) -> tuple[str, Path]:
    """A fresh virtual environment (no pip, no packages) that sees this one's installed dependencies after its own
    site-packages, through a ``.pth`` line; ``.pth`` files in that folder (this checkout's editable mapping among
    them) are not read from there, so the package comes only from what is installed into the fresh one."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_dependencies.pth").write_text(deps + "\n")
    return str(python), Path(site)


@pytest.mark.parametrize("how", ["wheel", "pip install ."])
def test_an_installed_copy_used_from_another_folder_loads_its_own_kernels_beside_hf_kernels(how, tmp_path):
    """Non-editable installs: a wheel built from the checkout, and ``pip install .``, each into a fresh virtual
    environment, used from a folder outside the checkout."""
    python, site = _fresh_venv_over_this_one(tmp_path / "venv")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", site]
    if how == "wheel":
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", tmp_path / "dist", ROOT], check=True, timeout=600)
        (wheel,) = (tmp_path / "dist").glob("lightning_resctl-*.whl")
        subprocess.run([*pip, wheel], check=True, timeout=600)
    else:
        subprocess.run([*pip, ROOT], check=True, timeout=600)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    where = _run(WHERE_FROM, cwd=elsewhere, python=python)
    installed = site / "lightning_resctl"
    assert Path(where["package"]).resolve() == (installed / "__init__.py").resolve()
    assert Path(where["mgr"]).resolve() == (installed / "kernels" / "mgr.py").resolve()
    assert Path(where["rescontroller"]).resolve() == (installed / "kernels" / "rescontroller.py").resolve()
    assert Path(where["tiles"]).resolve() == (installed / "kernels" / "tiles.py").resolve()
    hf = _hf_kernels_installed()
    if hf is not None:
        assert Path(where["kernels"]).resolve() == hf / "__init__.py"
    assert where["tested-torch"] == TESTED_WITH["torch"]  # the constraints file ships with the package
    assert _run(TRANSFORMERS_RUNS, cwd=elsewhere, python=python)["logits"] == "(1, 4, 32)"
