"""The options of ``rescontroller``: their defaults and their checks, in one place (the rule, the module
:class:`~lightning_resctl.rules.rescontroller.ResController` and the functional API take both from here)."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_positive
from ..common import check_rule_backend

__all__ = ["ResControllerConfig"]


@dataclass
class ResControllerConfig:
    """Options of ``rescontroller`` (see docs/rules/rescontroller.md).

    update_ratio: allowed update RMS relative to the residual RMS.
    stream_ratio: allowed candidate-stream RMS relative to the residual RMS.
    update_softness / stream_softness: sharpness of the soft caps.
    eps: inside every root and denominator.
    backend: "auto" (Triton on CUDA, else torch), "torch" (on CPU one compiled region per direction when a
        C++ compiler is present), "torch-eager", "torch-compiled", "triton" ("native" is an alias) or
        "reference" (plain autograd over the oracle: double backward, forward-mode AD and torch.func work).
        The backend changes how the math runs, not what it computes: a checkpoint loads whatever the backend.
    """

    update_ratio: float = 0.18
    stream_ratio: float = 1.08
    update_softness: float = 8.0
    stream_softness: float = 8.0
    eps: float = 1e-12
    backend: str = "auto"

    #: the options of the math (every one a finite number > 0), in the order the kernels take them
    MATH = ("update_ratio", "stream_ratio", "update_softness", "stream_softness", "eps")

    def validate(self) -> "ResControllerConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        for name in self.MATH:
            check_positive(name, getattr(self, name))
        check_rule_backend(self.backend)
        return self

    def math(self) -> tuple[float, ...]:
        """The math options, checked (:meth:`validate`), as floats: ``(update_ratio, stream_ratio,
        update_softness, stream_softness, eps)``."""
        self.validate()
        return tuple(float(getattr(self, name)) for name in self.MATH)
