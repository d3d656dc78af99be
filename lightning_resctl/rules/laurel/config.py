"""The options of ``laurel`` and ``laurel-pa``: their defaults and their checks, in one place."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_bool, check_choice, check_eps, check_int
from ..common import RMS_EPS

__all__ = ["LaurelConfig", "LaurelPAConfig", "VARIANTS", "PA_VARIANTS", "RW_NORMS", "LR_INITS"]

#: the variants without previous activations (a merge of its own stream and update: ``laurel``)
VARIANTS = ("rw", "lr", "rw+lr")
#: the variants with previous activations (a chain carrying the last streams: ``laurel-pa``)
PA_VARIANTS = ("pa", "rw+pa", "lr+pa", "rw+lr+pa")
#: how RW bounds its two weights: "sigmoid": alpha = 2 sigmoid(a), beta = 2 sigmoid(b) (1 and 1 at init: the plain
#: residual); "softmax": (alpha, beta) = softmax(a, b) (1/2 and 1/2 at init: a scaled residual)
RW_NORMS = ("sigmoid", "softmax")
#: the low-rank down-projection's init: the paper's LLM runs ("orthogonal": A[j, i] = 1/sqrt(rD) where i mod r = j)
#: or its ResNet runs ("xavier"); the up-projection starts at 0 (both)
LR_INITS = ("orthogonal", "xavier")


@dataclass
class LaurelConfig:
    """Options of ``laurel`` (LAuReL, Menghani et al., ICML 2025; docs/rules/laurel.md).

    variant: ``"rw"`` (learned residual weights), ``"lr"`` (a low-rank term) or ``"rw+lr"`` (both: the paper's
        "best trade-off", its 1B and 4B runs). Previous activations (PA): ``method="laurel-pa"``.
    rank: r >= 1 of the low-rank term (the paper's C4 ablation: 32).
    rw_norm: ``"sigmoid"`` (alpha = 2 sigmoid(a), beta = 2 sigmoid(b): the plain residual at init) or ``"softmax"``.
    rw_per_dim: RW weights per channel (alpha, beta in R^C, §2.4) instead of two scalars.
    lr_init: ``"orthogonal"`` (the paper's LLM runs) or ``"xavier"`` (its ResNet runs).
    lr_norm: an RMSNorm with a learned weight (ones) on the low-rank term, as Gemma 3n's deployed LAuReL block.
    eps: that norm's epsilon (>= 0; Gemma 3n: 1e-6).
    """

    variant: str = "rw+lr"
    rank: int = 32
    rw_norm: str = "sigmoid"
    rw_per_dim: bool = False
    lr_init: str = "orthogonal"
    lr_norm: bool = False
    eps: float = RMS_EPS

    #: the variants this name accepts
    VARIANTS = VARIANTS

    def validate(self):
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        if self.variant in PA_VARIANTS + VARIANTS and self.variant not in self.VARIANTS:
            other = "laurel-pa" if self.variant in PA_VARIANTS else "laurel"
            raise ValueError(f"variant={self.variant!r} is a variant of method={other!r}"
                             + (" (previous activations: a chain that carries the last streams)"
                                if other == "laurel-pa" else "") + f"; this method takes {self.VARIANTS}")
        check_choice("variant", self.variant, self.VARIANTS)
        check_int("rank", self.rank, 1)
        check_choice("rw_norm", self.rw_norm, RW_NORMS)
        check_bool("rw_per_dim", self.rw_per_dim)
        check_choice("lr_init", self.lr_init, LR_INITS)
        check_bool("lr_norm", self.lr_norm)
        check_eps("eps", self.eps)
        return self


@dataclass
class LaurelPAConfig(LaurelConfig):
    """Options of ``laurel-pa`` (LAuReL with previous activations; docs/rules/laurel.md).

    variant: ``"pa"``, ``"rw+pa"``, ``"lr+pa"`` or ``"rw+lr+pa"`` (the paper's full method, Eq. 6: a low-rank pair per
        previous activation).
    history: k >= 1 activations (the merge's own stream and the k - 1 before it; the paper: 3).
    rank, rw_norm, rw_per_dim, lr_init, lr_norm, eps: as for ``laurel``.
    """

    variant: str = "rw+lr+pa"
    history: int = 3

    VARIANTS = PA_VARIANTS

    def validate(self):
        """Raise ValueError/TypeError naming the option and the value; returns self."""
        super().validate()
        check_int("history", self.history, 1)
        return self
