"""KromHC: mHC with ``res`` a Kronecker product of doubly stochastic 2x2 factors (``kromhc``).

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle),
:mod:`.modules` (KromHCLayer), :mod:`.stats` (diagnostics), :mod:`.rule` (the registered rule ``kromhc``).
"""
from .config import KromHCConfig
from .modules import KromHCLayer
from .reference import kromhc_coefficients_reference, kronecker_factors, kronecker_product
from .rule import KromHCRule

__all__ = ["KromHCConfig", "KromHCRule", "KromHCLayer", "kromhc_coefficients_reference", "kronecker_factors",
           "kronecker_product"]
