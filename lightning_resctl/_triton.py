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

    Installed distributions map the top-level ``kernels/`` folder to
    ``lightning_resctl.kernels``. When the package is imported straight from a
    source checkout that was installed non-editably (``pip install .`` run from
    the repo root shadows the installed copy), that mapping is not on the path:
    load the checkout's ``kernels/`` folder under the same name instead.
    """
    try:
        return importlib.import_module("lightning_resctl.kernels")
    except ModuleNotFoundError as err:
        if err.name != "lightning_resctl.kernels":
            raise
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(
        "lightning_resctl.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or not (folder / "__init__.py").exists():
        raise ModuleNotFoundError("lightning_resctl.kernels is not installed", name="lightning_resctl.kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_resctl.kernels"] = module
    spec.loader.exec_module(module)
    return module


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
