"""mHC-lite: mHC with ``res`` an exact convex combination of the n! permutation matrices.

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle),
:mod:`.modules` (MHCLiteLayer), :mod:`.rule` (the registered rule ``mhc-lite``); diagnostics: ``frame.FrameStats``.
"""
from .config import MAX_STREAMS, MHCLiteConfig
from .modules import MHCLiteLayer
from .reference import mhc_lite_coefficients_reference, permutation_matrices
from .rule import MHCLiteRule

__all__ = ["MHCLiteConfig", "MHCLiteRule", "MHCLiteLayer", "permutation_matrices", "mhc_lite_coefficients_reference",
           "MAX_STREAMS"]
