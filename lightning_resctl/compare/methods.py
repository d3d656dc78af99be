"""Which methods the compare job can run, and what the registry says about each: the merge-rule registry.

A method is ``"plain"`` (the model as written, unpatched) or any name registered with
:func:`lightning_resctl.register_merge_rule` (:func:`lightning_resctl.merge_rules` lists them); it is applied
by ``patch_residuals(model, method=name, **options)``. Nothing here branches on a rule's name: descriptions,
option names and the identity-at-init claim (the rule class's ``identity_at_init``) come from the registry.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["PLAIN", "PRESETS", "DEFAULT_METHODS", "available_methods", "describe_method", "check_methods",
           "check_method_options", "apply_method", "claims_identity_at_init", "resolve_methods",
           "UnknownMethodError"]

PLAIN = "plain"

#: The quick default: sized to finish within 15 minutes on 2 CPU cores with the built-in model (see docs/compare.md).
DEFAULT_METHODS = ("plain", "rescontroller", "mgr-independent", "mgr-competitive")

#: Named method sets (``--preset``).
PRESETS: dict[str, tuple[str, ...]] = {
    "quick": DEFAULT_METHODS,
    # the methods of the MGR paper's comparison: PreNorm (the model unpatched), mHC-lite, Block and Full Attention
    # Residuals, both MGR gatings, and ResController
    "paper": ("plain", "mhc-lite", "attnres-block", "attnres", "mgr-independent", "mgr-competitive",
              "rescontroller"),
}

_PLAIN_DESCRIPTION = "the model as written (its residual additions unpatched)"


class UnknownMethodError(ValueError):
    """A method name that is neither ``plain`` nor a registered merge rule, or an option a rule does not have."""


def _registry():
    from ..rules import get_merge_rule, make_rule, merge_rules

    return merge_rules, get_merge_rule, make_rule


def available_methods() -> tuple[str, ...]:
    """``"plain"`` followed by every registered merge-rule name."""
    return (PLAIN, *_registry()[0]())


def describe_method(name: str) -> str:
    """One line saying what the method's merges compute (the registry's description)."""
    if name == PLAIN:
        return _PLAIN_DESCRIPTION
    return str(_registry()[1](name).description or "")


def resolve_methods(methods, preset: str | None) -> list[str]:
    """The methods of a job: ``methods`` when given (a list or a comma-separated string), else ``preset``'s, else
    :data:`DEFAULT_METHODS`; checked with :func:`check_methods`."""
    if preset is not None and preset not in PRESETS:
        raise UnknownMethodError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    if methods is None:
        methods = PRESETS[preset] if preset is not None else DEFAULT_METHODS
    return check_methods(methods)


def check_methods(names) -> list[str]:
    """Validate a list of method names; :class:`UnknownMethodError` lists the registered names."""
    names = list(names)
    if not names:
        raise UnknownMethodError("methods must name at least one method")
    if len(set(names)) != len(names):
        raise UnknownMethodError(f"methods lists a method twice: {names}")
    valid = available_methods()
    unknown = [m for m in names if m not in valid]
    if unknown:
        raise UnknownMethodError(
            f"unknown method(s) {unknown}: not registered merge rules in this version of lightning_resctl. "
            f"Registered: {', '.join(valid)} (plain = the model unpatched).")
    return names


def check_method_options(options: Mapping[str, Mapping[str, Any]] | None, methods) -> dict[str, dict[str, Any]]:
    """``options`` maps a method of ``methods`` to its merge-rule options (``{"mgr-competitive": {"streams": 8}}``);
    every name and option is checked against the registry (UnknownMethodError / ValueError naming them)."""
    options = dict(options or {})
    for name, opts in options.items():
        if name not in methods:
            raise UnknownMethodError(f"options names method {name!r}, which is not among the methods {list(methods)}")
        if name == PLAIN:
            if opts:
                raise UnknownMethodError(f"options: plain takes no options, got {dict(opts)}")
            continue
        if not isinstance(opts, Mapping):
            raise UnknownMethodError(f"options[{name!r}] must be a mapping of option: value, got {opts!r}")
        try:
            _registry()[2](name, dict(opts))
        except (TypeError, ValueError) as err:
            raise UnknownMethodError(f"options[{name!r}]: {err}") from None
    return {k: dict(v or {}) for k, v in options.items()}


def claims_identity_at_init(name: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether the rule's docs call it identity (the unpatched model) at init with these options: the rule class's
    ``identity_at_init`` (True, False, or the options under which it holds), read through the registry."""
    if name == PLAIN:
        return True
    entry = _registry()[1](name)
    claim = getattr(entry.rule_class, "identity_at_init", False)
    if isinstance(claim, Mapping):
        used = {**entry.defaults(), **dict(options or {})}
        return all(used.get(k) == v for k, v in claim.items())
    return bool(claim)


def apply_method(model: nn.Module, name: str, options: Mapping[str, Any] | None = None):
    """Patch ``model`` in place for method ``name``; returns the PatchReport (None for plain)."""
    if name == PLAIN:
        return None
    from ..surgery import patch_residuals

    return patch_residuals(model, method=name, **dict(options or {}))
