"""The options of ``ddl``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_choice, check_eps, check_interval, check_positive

__all__ = ["DDLConfig", "VALUES"]

#: the value branch: "paper" (§3, App. A.1: ``v = w_v . c``, linear in the normed stream) or "code" (the official
#: model files: ``v = value_scale * sigmoid(w_v . x + b_v)`` on the raw stream, bounded to (0, value_scale))
VALUES = ("paper", "code")


@dataclass
class DDLConfig:
    """Options of ``ddl`` (Deep Delta Learning, scalar value d_v = 1; docs/rules/ddl.md).

    value: ``"paper"`` (v = w_v . c) or ``"code"`` (v = value_scale * sigmoid(w_v . x + b_v), the official code).
    value_scale: the code value's bound (> 0; official 4.0).
    beta_init: beta_0 in [0, 2], the gate's init through its bias ``logit(beta_0 / 2)`` (official default 1.0; 0
        skips the merge's write at init).
    k_eps: eps_k >= 0 of the key ``k = h / sqrt(|h|^2 + eps_k^2)`` (official 1e-5).
    eps: the RMSNorm eps of ``c = RMSNorm(x)``, the normed stream the gate reads (>= 0; the official blocks' 1e-5).
    """

    value: str = "paper"
    value_scale: float = 4.0
    beta_init: float = 1.0
    k_eps: float = 1e-5
    eps: float = 1e-5

    def validate(self) -> "DDLConfig":
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        check_choice("value", self.value, VALUES)
        check_positive("value_scale", self.value_scale)
        check_interval("beta_init", self.beta_init, 0.0, 2.0, closed="both")
        check_eps("k_eps", self.k_eps)
        check_eps("eps", self.eps)
        return self
