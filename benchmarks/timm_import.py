"""Import ``timm`` on a machine without ``torchvision`` (the coverage sweep and its test sample use it).

``timm`` imports a few ``torchvision`` names when it is imported (``torchvision.ops.misc.FrozenBatchNorm2d``,
the ``torchvision.transforms`` and ``torchvision.datasets`` classes its data pipeline builds on) but its models
need none of them. Where torchvision is not installed (on a CPU-only torch, PyPI's torchvision is a CUDA build
whose ops fail to register; and once it is installed, ``import lightning`` fails because torchmetrics imports
it), :func:`import_timm` imports timm with a minimal stand-in visible during that import only:

* ``FrozenBatchNorm2d`` is a working module (torchvision's math: ``x * w / sqrt(var + eps) + b - mean * ...``);
* every other ``torchvision`` name is a placeholder class that raises ``ModuleNotFoundError`` naming it when it
  is instantiated or called (timm's transforms and datasets, not used by its models).

A real torchvision is never shadowed: when one is installed (importable or not), timm is imported as is.
After the import the stand-in is removed from ``sys.modules`` and from the import machinery, so
``import torchvision`` elsewhere still fails as before, and ``importlib.util.find_spec("torchvision")`` (which
Lightning and torchmetrics use to decide what to import) still says there is none.
"""
from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch
from torch import nn

__all__ = ["import_timm", "FrozenBatchNorm2d"]

_ROOT = "torchvision"


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine parameters (buffers): torchvision's
    ``FrozenBatchNorm2d``, ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias``."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        return x * scale + (b - rm * scale)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members (timm maps them to names when it is imported)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PROVIDED = {"torchvision.ops.misc": {"FrozenBatchNorm2d": FrozenBatchNorm2d},
             "torchvision.ops": {"FrozenBatchNorm2d": FrozenBatchNorm2d},
             "torchvision.transforms": {"InterpolationMode": InterpolationMode},
             "torchvision.transforms.functional": {"InterpolationMode": InterpolationMode}}


def _placeholder(module: str, name: str) -> type:
    qualified = f"{module}.{name}"

    def refuse(*args, **kwargs):
        raise ModuleNotFoundError(f"{qualified} is not available: torchvision is not installed (timm was imported "
                                  "with benchmarks.timm_import.import_timm's stand-in, which provides only "
                                  "FrozenBatchNorm2d and InterpolationMode)", name=_ROOT)

    return type(name, (), {"__init__": refuse, "__call__": refuse, "__module__": module, "__qualname__": name})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _ROOT or fullname.startswith(_ROOT + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__dict__.update(_PROVIDED.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


def _torchvision_installed() -> bool:
    if _ROOT in sys.modules:
        return True
    try:
        return importlib.util.find_spec(_ROOT) is not None
    except (ImportError, ValueError):
        return True   # something named torchvision is there: do not shadow it


def import_timm():
    """``import timm`` and return it; without torchvision, through the stand-in described in the module's
    docstring (visible during the import only). With torchvision installed this is a plain ``import timm``."""
    if "timm" in sys.modules or _torchvision_installed():
        import timm

        return timm
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == _ROOT or n.startswith(_ROOT + ".")]:
            del sys.modules[name]
    return timm
