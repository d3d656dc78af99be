"""ResController: a parameter-free, energy-aware replacement for the residual merge ``r + u``.

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle), :mod:`.ops`
(the lean torch path, the Triton dispatch, :func:`rescontroller`), :mod:`.modules` (:class:`ResController`),
:mod:`.stats` (diagnostics), :mod:`.rule` (the registered rule ``rescontroller``). Kernels:
``lightning_resctl.kernels.rescontroller``.
"""
from ..common import BACKENDS
from .config import ResControllerConfig
from .modules import ResController
from .ops import rescontroller
from .reference import SCALE_THRESHOLD, ControllerScales, rescontroller_reference, rescontroller_scales
from .rule import ResControllerRule

__all__ = ["ResControllerConfig", "ResControllerRule", "ResController", "rescontroller", "rescontroller_reference",
           "rescontroller_scales", "ControllerScales", "SCALE_THRESHOLD", "BACKENDS"]
