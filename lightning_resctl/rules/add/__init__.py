"""``add``: the plain residual addition, rewritten by the same machinery (the surgery's control; no options)."""
from .rule import AddRule

__all__ = ["AddRule"]
