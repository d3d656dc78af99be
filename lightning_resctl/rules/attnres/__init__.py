"""Attention Residuals: ``attnres`` (Full) and ``attnres-block`` (Block AttnRes).

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle), :mod:`.ops`
(the training path), :mod:`.modules` (AttnResMerge, AttnResChain), :mod:`.stats` (diagnostics), :mod:`.rule`
(the registered rules).
"""
from .config import AttnResConfig, BlockAttnResConfig
from .modules import AttnResChain, AttnResMerge
from .ops import AttnResState
from .reference import (
                        attnres_chain_reference,
                        attnres_pool_reference,
                        attnres_sources_reference,
                        default_block_size,
                        num_sources,
)
from .rule import AttnResRule, BlockAttnResRule

__all__ = ["AttnResConfig", "BlockAttnResConfig", "AttnResRule", "BlockAttnResRule", "AttnResChain", "AttnResMerge",
           "AttnResState", "attnres_pool_reference", "attnres_sources_reference", "attnres_chain_reference",
           "default_block_size", "num_sources"]
