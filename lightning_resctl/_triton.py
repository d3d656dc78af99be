"""Where the Triton kernels come from, and whether they can run here."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch


def _load_kernels_package() -> ModuleType:
    """Import ``lightning_resctl.kernels``.

    Installed distributions map the top-level ``kernels/`` folder to ``lightning_resctl.kernels``. When the
    package is imported from a source checkout (a ``kernels/`` folder and a ``pyproject.toml`` beside it), the
    checkout's own ``kernels/`` is loaded under that name: an installed mapping (an editable install of another
    checkout or worktree, or a non-editable ``pip install .``) could otherwise pair this package with kernels of
    a different version.
    """
    loaded = sys.modules.get("lightning_resctl.kernels")
    if loaded is not None:
        return loaded
    root = Path(__file__).resolve().parent.parent
    folder = root / "kernels"
    if (folder / "__init__.py").exists() and (root / "pyproject.toml").exists():
        spec = importlib.util.spec_from_file_location(
            "lightning_resctl.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["lightning_resctl.kernels"] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module("lightning_resctl.kernels")


def kernel_module(name: str) -> ModuleType:
    """Return ``lightning_resctl.kernels.<name>``, importing the kernels package first."""
    _load_kernels_package()
    return importlib.import_module(f"lightning_resctl.kernels.{name}")


def interpreter_mode() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton kernels can run here: on a CUDA device, or on CPU under ``TRITON_INTERPRET=1``."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return interpreter_mode() or torch.cuda.is_available()


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``tensor``'s device."""
    if not triton_available():
        return False
    return tensor.is_cuda or (interpreter_mode() and tensor.device.type == "cpu")
