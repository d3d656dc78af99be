"""Where the Triton kernels come from, and whether they can run here.

:func:`load_kernels` is the only way a rule gets its kernels module (``kernels/<name>.py``, shipped as
``lightning_resctl.kernels.<name>``); :func:`triton_runs_on` is the one "can Triton run on this device" check.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["load_kernels", "interpreter_mode", "triton_available", "triton_runs_on"]


def _load_kernels_package() -> ModuleType:
    """Import ``lightning_resctl.kernels``.

    The top-level ``kernels/`` folder has no ``__init__.py``: from a checkout's root (on ``sys.path`` under
    ``python -m pytest`` or ``python -c``) a regular package there would hide Hugging Face's ``kernels``, which
    transformers imports. Installed distributions map the folder to ``lightning_resctl.kernels`` (a package without
    ``__init__.py`` inside this one). When this package is imported from a source checkout (``kernels/_library.py``
    and a ``pyproject.toml`` beside it), the checkout's own folder is loaded under that name: an installed mapping
    (an editable install of another checkout or worktree, or a non-editable ``pip install .``) could otherwise pair
    this package with kernels of a different version.
    """
    loaded = sys.modules.get("lightning_resctl.kernels")
    if loaded is not None:
        return loaded
    root = Path(__file__).resolve().parents[2]  # lightning_resctl/runtime/triton.py -> the checkout
    folder = root / "kernels"
    if (folder / "_library.py").exists() and (root / "pyproject.toml").exists():
        spec = importlib.machinery.ModuleSpec("lightning_resctl.kernels", None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        module = importlib.util.module_from_spec(spec)
        sys.modules["lightning_resctl.kernels"] = module
        setattr(sys.modules["lightning_resctl"], "kernels", module)
        return module
    return importlib.import_module("lightning_resctl.kernels")


# registered when the package is imported (a module object, nothing of Triton loaded), so that
# ``import lightning_resctl.kernels.<name>`` finds the checkout's folder in an editable install as well
_load_kernels_package()


_LOADED: dict[str, ModuleType] = {}


@torch.compiler.assume_constant_result
def _import_kernels(name: str) -> bool:
    """Import ``lightning_resctl.kernels.<name>`` once (the kernels package first). Under ``torch.compile`` it runs
    once at trace time instead of being traced (tracing an import would break the graph)."""
    if name not in _LOADED:
        _load_kernels_package()
        _LOADED[name] = importlib.import_module(f"lightning_resctl.kernels.{name}")
    return True


def load_kernels(name: str) -> ModuleType:
    """``lightning_resctl.kernels.<name>`` (e.g. ``"mgr"``, ``"rescontroller"``, ``"tiles"``): the one way to the
    kernels, called where they are used (a rule's ``ops.py``). Imported once, with the kernels package first;
    importing a rule's kernels registers its ``torch.ops.lightning_resctl`` ops. Under ``torch.compile`` the import
    runs at trace time and the module is a dict lookup."""
    _import_kernels(name)
    return _LOADED[name]


def interpreter_mode() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``; the kernels' own check,
    ``kernels/_env.py``)."""
    return load_kernels("_env").interpreter_mode()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton kernels can run here: on a CUDA device, or on CPU under ``TRITON_INTERPRET=1``."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return interpreter_mode() or torch.cuda.is_available()


@torch.compiler.assume_constant_result
def triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels run on tensors of ``device_type`` ("cuda"; "cpu" under ``TRITON_INTERPRET=1``).
    A constant under ``torch.compile``."""
    if not triton_available():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreter_mode())
