"""DenseFormer's depth-weighted average: ``dwa`` (Pagliardini, Mohtashami, Fleuret, Jaggi; arXiv 2402.02622).

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle), :mod:`.ops`
(the training path), :mod:`.modules` (DWAWeights, DWAChain), :mod:`.stats` (diagnostics), :mod:`.rule` (the
registered rule).
"""
from .config import SCHEDULES, DWAConfig
from .modules import DWAChain, DWAWeights
from .ops import DWAState, depth_average
from .reference import (
    averaging_blocks,
    dwa_average_reference,
    dwa_chain_reference,
    dwa_num_weights,
    dwa_sources,
)
from .rule import DWARule

__all__ = ["DWAConfig", "DWARule", "DWAChain", "DWAWeights", "DWAState", "depth_average", "dwa_sources",
           "dwa_num_weights", "averaging_blocks", "dwa_average_reference", "dwa_chain_reference", "SCHEDULES"]
