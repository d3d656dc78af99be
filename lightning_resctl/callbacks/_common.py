"""Shared plumbing of the callbacks' patching: checking the method, patching the model and its copies, the
rank-zero log line. (Depths, records and logger output live in :mod:`lightning_resctl.diagnostics`.)"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..runtime.log import rank_zero_line  # noqa: F401 - used by the callbacks as C.rank_zero_line


def check_method(method: Any, options: Mapping[str, Any] | None = None) -> str | None:
    """``method`` must be None or a registered merge rule, and ``options`` valid options of it: checked when a
    callback is constructed, not inside ``fit``."""
    if method is None:
        if options:
            raise ValueError(f"method options {sorted(options)} given without a method (method=None)")
        return None
    from lightning_resctl.rules import get_merge_rule, make_rule

    try:
        get_merge_rule(method)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method must be None or a registered merge rule: {err}") from None
    make_rule(method, dict(options or {}))
    return method


def _surgery():
    from lightning_resctl import surgery

    return surgery


def _has_dtensor_params(module: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def ensure_patched(
    module: nn.Module,
    method: str | None,
    *,
    example_input: Any = None,
    include: Any = None,
    exclude: Any = None,
    method_options: Mapping[str, Any] | None = None,
    example_from: Any = None,
) -> bool:
    """Patch ``module`` with ``method`` unless it already is; ``method=None`` patches with ``"add"``
    (plain additions, outputs bitwise unchanged) just to find the merges.

    Returns True when this call patched the module (a module holding merge sites already, itself or in a
    submodule, is left as is). ``example_from``: a module whose ``example_input_array`` serves as the
    example input when neither ``example_input`` nor ``module.example_input_array`` is set. A module patched already with another method
    raises ValueError; MGR on an already sharded (FSDP2/DTensor) module raises RuntimeError, since its
    new parameters would not be sharded (patch inside ``configure_model`` before ``fully_shard``,
    see :func:`lightning_resctl.callbacks.patch_in_configure_model`).
    """
    surgery = _surgery()
    sites = surgery.merge_sites(module)  # also finds a patch applied to a submodule (e.g. self.model)
    if sites or surgery.get_patch_report(module) is not None:
        if method is not None:
            have = {getattr(s, "method", None) for s in sites}
            if have and have != {method}:
                raise ValueError(
                    f"the model is already patched with method {sorted(have)}, but the callback was given "
                    f"method={method!r}; pass method=None to only observe, or unpatch first"
                )
        return False
    use = method or "add"
    from lightning_resctl.rules import make_rule

    rule = make_rule(use, dict(method_options or {}))
    if rule.kind == "chain" and _has_dtensor_params(module):
        raise RuntimeError(
            f"the model's parameters are already sharded (DTensor) when the residual patch runs, so {use}'s new "
            "parameters would not be sharded. Call `lightning_resctl.callbacks.patch_in_configure_model(self)` "
            "in configure_model after building the layers and before fully_shard."
        )
    kwargs: dict[str, Any] = dict(method_options or {})
    if example_input is None and example_from is not None and not hasattr(module, "example_input_array"):
        example_input = getattr(example_from, "example_input_array", None)
    if example_input is not None:
        kwargs["example_input"] = example_input
    if include is not None:
        kwargs["include"] = include
    if exclude is not None:
        kwargs["exclude"] = exclude
    surgery.patch_residuals(module, method=use, **kwargs)
    return True


def patch_copies(trainer: Any, pl_module: nn.Module, method: str | None, **kwargs: Any) -> None:
    """Patch deep copies of ``pl_module`` held by other callbacks (e.g. StochasticWeightAveraging's average
    model, copied in its ``setup`` before this callback ran) the same way, and give them the patched weights."""
    surgery = _surgery()
    for cb in getattr(trainer, "callbacks", []):
        for name, value in list(vars(cb).items()):
            if (
                isinstance(value, nn.Module)
                and value is not pl_module
                and type(value) is type(pl_module)
                and surgery.get_patch_report(value) is None
            ):
                try:
                    ensure_patched(value, method, **kwargs)
                    value.load_state_dict(pl_module.state_dict())
                except Exception as err:  # noqa: BLE001 - a copy we cannot patch must not stop training
                    warnings.warn(
                        f"could not patch {type(cb).__name__}.{name} (a copy of the model) like the model: {err}",
                        stacklevel=2,
                    )
