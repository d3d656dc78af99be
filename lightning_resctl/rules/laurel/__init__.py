"""LAuReL, the Learned Augmented Residual Layer: ``laurel`` (RW, LR, RW+LR at every merge) and ``laurel-pa`` (the
variants with previous activations, a chain).

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle),
:mod:`.modules` (LaurelMerge, LaurelChain), :mod:`.stats` (diagnostics), :mod:`.rule` (the registered rules).
"""
from .config import LR_INITS, PA_VARIANTS, RW_NORMS, VARIANTS, LaurelConfig, LaurelPAConfig
from .modules import LaurelChain, LaurelMerge, LaurelPosition, LaurelState
from .reference import laurel_reference, low_rank_reference, orthogonal_down_init, rw_weights_reference
from .rule import LaurelPARule, LaurelRule

__all__ = ["LaurelConfig", "LaurelPAConfig", "LaurelRule", "LaurelPARule", "LaurelMerge", "LaurelChain",
           "LaurelState", "LaurelPosition", "laurel_reference", "low_rank_reference", "rw_weights_reference",
           "orthogonal_down_init", "VARIANTS", "PA_VARIANTS", "RW_NORMS", "LR_INITS"]
