"""The merge-rule registry (see :mod:`lightning_resctl.rules.base`) and the built-in rules."""
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
from .add import AddRule
from .mgr import MGRRule
from .rescontroller import ResControllerRule
from .attnres import AttnResRule, BlockAttnResRule
from .hc import HCRule, MHCRule
from .mhc_lite import MHCLiteRule

register_merge_rule("add", AddRule)
register_merge_rule("rescontroller", ResControllerRule)
register_merge_rule("mgr", MGRRule)
register_merge_rule("mgr-competitive", MGRRule, gating="competitive",
                    description="Multi-Gate Residuals with competitive gating (softmax with a forget logit)")
register_merge_rule("mgr-independent", MGRRule, gating="independent",
                    description="Multi-Gate Residuals with independent sigmoid gates")
register_merge_rule("attnres", AttnResRule)
register_merge_rule("attnres-block", BlockAttnResRule)
register_merge_rule("hc", HCRule)
register_merge_rule("mhc", MHCRule)
register_merge_rule("mhc-lite", MHCLiteRule)

__all__ = ["MergeRule", "ChainRule", "NoOptions", "RuleEntry", "register_merge_rule", "merge_rules",
           "get_merge_rule", "make_rule", "AddRule", "ResControllerRule", "MGRRule", "AttnResRule",
           "BlockAttnResRule", "HCRule", "MHCRule", "MHCLiteRule"]
