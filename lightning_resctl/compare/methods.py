"""Which methods the compare job can run, and how one is applied: the merge-rule registry.

A method is ``"plain"`` (the model as written, unpatched) or any name registered with
:func:`lightning_resctl.merge_rules`; it is applied by ``patch_residuals(model, method=name)``.
Nothing here branches on a rule's name. The one option the compare job sets itself is ``streams``
(``--streams``), passed to every rule whose options include ``streams``.

Until the package has the registry (``lightning_resctl.merge_rules``), :data:`_FALLBACK` maps the
names onto the older ``patch_residuals`` methods.
"""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["PLAIN", "PRESETS", "DEFAULT_METHODS", "available_methods", "registered_rules", "describe_method",
           "method_options", "check_methods", "apply_method", "branch_labels", "UnknownMethodError"]

PLAIN = "plain"

#: The quick default: sized to finish within 15 minutes on 2 CPU cores (see README).
DEFAULT_METHODS = ("plain", "rescontroller", "mgr-independent", "mgr-competitive")

#: Named method sets for ``--preset``.
PRESETS: dict[str, tuple[str, ...]] = {
    "quick": DEFAULT_METHODS,
    # the methods of the MGR paper's comparison: PreNorm (our GPT unpatched), mHC-lite, Block and
    # Full Attention Residuals, both MGR gatings, and ResController
    "paper": ("plain", "mhc-lite", "attnres-block", "attnres", "mgr-independent", "mgr-competitive",
              "rescontroller"),
}

# registered name -> (older patch_residuals method, preset options, description); used only when
# lightning_resctl has no merge-rule registry yet.
_FALLBACK: dict[str, tuple[str, dict[str, Any], str]] = {
    "add": ("add", {}, "stream + update, rewritten by the surgery (the control: bitwise equal to plain)"),
    "rescontroller": ("rescontroller", {}, "ResController: parameter-free, energy-aware merge"),
    "mgr": ("mgr", {}, "Multi-Gate Residuals, n gated streams per token"),
    "mgr-independent": ("mgr", {"gating": "independent"}, "Multi-Gate Residuals, independent sigmoid gates"),
    "mgr-competitive": ("mgr", {"gating": "competitive"}, "Multi-Gate Residuals, competitive softmax gates"),
}
_PLAIN_DESCRIPTION = "the model as written (pre-norm residual x = x + f(x), unpatched)"


class UnknownMethodError(ValueError):
    """A method name that is neither ``plain`` nor a registered merge rule."""


def _registry():
    import lightning_resctl

    merge_rules = getattr(lightning_resctl, "merge_rules", None)
    get_merge_rule = getattr(lightning_resctl, "get_merge_rule", None)
    if merge_rules is None or get_merge_rule is None:
        return None
    return merge_rules, get_merge_rule


def registered_rules() -> tuple[str, ...]:
    """The merge-rule names ``patch_residuals`` accepts (the registry's, or the fallback's)."""
    reg = _registry()
    return tuple(reg[0]()) if reg is not None else tuple(_FALLBACK)


def available_methods() -> tuple[str, ...]:
    """``"plain"`` followed by every registered merge-rule name."""
    return (PLAIN, *registered_rules())


def describe_method(name: str) -> str:
    """One line saying what the method's merges compute."""
    if name == PLAIN:
        return _PLAIN_DESCRIPTION
    reg = _registry()
    if reg is not None:
        return str(getattr(reg[1](name), "description", "") or "")
    return _FALLBACK[name][2]


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


def method_options(name: str, streams: int | None = None) -> dict[str, Any]:
    """The options the compare job passes to ``patch_residuals`` for ``name``: ``streams`` for every
    rule that has that option (nothing else: the registered name carries its presets)."""
    if name == PLAIN or streams is None:
        return {}
    reg = _registry()
    if reg is not None:
        entry = reg[1](name)
        names = entry.option_names() if hasattr(entry, "option_names") else []
        return {"streams": streams} if "streams" in names else {}
    return {"streams": streams} if _FALLBACK[name][0] == "mgr" else {}


def apply_method(model: nn.Module, name: str, streams: int | None = None):
    """Patch ``model`` in place for method ``name``; returns the PatchReport (None for plain)."""
    if name == PLAIN:
        return None
    from ..surgery import patch_residuals

    options = method_options(name, streams)
    if _registry() is not None:
        return patch_residuals(model, method=name, **options)
    method, preset, _ = _FALLBACK[name]
    return patch_residuals(model, method=method, **preset, **options)


def branch_labels(report, num_merges: int, n_layer: int | None = None) -> list[str] | None:
    """Which kind of sub-layer feeds each merge ("attn", "mlp", ...), in depth order.

    Uses the surgery's ``branch`` label of each site when it has one; otherwise, for the compare
    job's own GPT (``2 * n_layer`` merges), the known alternation attention, MLP, attention, ...
    Returns None when neither is available."""
    sites = list(getattr(report, "sites", None) or [])
    if sites and len(sites) == num_merges:
        labels = [getattr(s, "branch", None) for s in sites]
        if all(isinstance(b, str) and b for b in labels):
            return labels
    if n_layer is not None and num_merges == 2 * n_layer:
        return ["attn", "mlp"] * n_layer
    return None
