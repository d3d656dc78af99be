"""The merge-rule registry (see :mod:`lightning_resctl.rules.base`) and the built-in rules.

Each built-in rule has one home, ``rules/<name>/`` (config, reference, ops, modules, stats, rule), and registers
itself when its package is imported; the order of the imports below is the order of :func:`merge_rules`. Shared
pieces: :mod:`.checks` (option checks), :mod:`.common` (RMS norm, compute dtype, backend names, kernel loading),
:mod:`.stats` (the depth-metric base), :mod:`.frame` (the HC family's frame).
"""
from .add import AddRule
from .attnres import AttnResRule, BlockAttnResRule
from .base import (
    ChainRule,
    MergeRule,
    NoOptions,
    RuleEntry,
    get_merge_rule,
    make_rule,
    merge_rules,
    register_merge_rule,
)
from .ddl import DDLRule
from .dwa import DWARule
from .hc import HCRule, MHCRule
from .kromhc import KromHCRule
from .laurel import LaurelPARule, LaurelRule
from .mgr import MGRRule
from .mhc_lite import MHCLiteRule
from .rescontroller import ResControllerRule

__all__ = ["MergeRule", "ChainRule", "NoOptions", "RuleEntry", "register_merge_rule", "merge_rules",
           "get_merge_rule", "make_rule", "AddRule", "ResControllerRule", "MGRRule", "AttnResRule",
           "BlockAttnResRule", "HCRule", "MHCRule", "MHCLiteRule", "DWARule", "LaurelRule",
           "LaurelPARule", "DDLRule", "KromHCRule"]
