"""Hyper-Connections: ``hc`` (dynamic / static HC) and ``mhc`` (Manifold-Constrained HC), on the frame the HC
family shares (:mod:`lightning_resctl.rules.frame`).

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formulas and the oracles),
:mod:`.modules` (HCLayer, MHCLayer), :mod:`.rule` (the registered rules); diagnostics: ``frame.FrameStats``.
"""
from .config import INITS, SINKHORNS, HCConfig, MHCConfig
from .modules import HCLayer, MHCLayer
from .reference import hc_coefficients_reference, mhc_coefficients_reference, sinkhorn, sinkhorn_dsv4
from .rule import HCRule, MHCRule

__all__ = ["HCConfig", "MHCConfig", "HCRule", "MHCRule", "HCLayer", "MHCLayer", "hc_coefficients_reference",
           "mhc_coefficients_reference", "sinkhorn", "sinkhorn_dsv4", "SINKHORNS", "INITS"]
