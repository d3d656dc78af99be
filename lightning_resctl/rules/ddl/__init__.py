"""Deep Delta Learning: ``ddl`` (Zhang, Liu, Wang, Gu; arXiv 2601.00417), the scalar-value form.

One home: :mod:`.config` (options, defaults, checks), :mod:`.reference` (the formula and the oracle),
:mod:`.modules` (DDLMerge), :mod:`.stats` (diagnostics), :mod:`.rule` (the registered rule).
"""
from .config import VALUES, DDLConfig
from .modules import DDLMerge
from .reference import beta_bias_init, ddl_reference
from .rule import DDLRule

__all__ = ["DDLConfig", "DDLRule", "DDLMerge", "ddl_reference", "beta_bias_init", "VALUES"]
