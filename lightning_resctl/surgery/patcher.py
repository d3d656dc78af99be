"""ResidualPatcher: the one owner of a callback's residual patch, from ``setup`` to ``teardown``, and the
plumbing it shares with the callbacks (checking the method, patching the model and the copies other callbacks
hold, the one-line patch summary)."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..rules import get_merge_rule, make_rule
from ..runtime.log import rank_zero_line
from .api import get_patch_report, merge_sites, patch_residuals, unpatch_residuals
from .tensor_parallel_check import refuse_tensor_parallel

__all__ = ["ResidualPatcher", "merge_options", "check_method", "ensure_patched", "patch_copies", "patch_line"]


def merge_options(options: Mapping[str, Any] | None, method_options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (the YAML / LightningCLI form) and ``**method_options`` (the Python form) as one dict;
    an option given both ways raises ValueError."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of merge-rule options or None, got {type(options).__name__}")
    both = sorted(set(options or {}) & set(method_options))
    if both:
        raise ValueError(f"option(s) {both} given both in options= and as keyword arguments; give each once")
    return {**dict(options or {}), **dict(method_options)}


def check_method(method: Any, options: Mapping[str, Any] | None = None) -> str | None:
    """``method`` must be None or a registered merge rule, and ``options`` valid options of it: checked when a
    callback is constructed, not inside ``fit``."""
    if method is None:
        if options:
            raise ValueError(f"method options {sorted(options)} given without a method (method=None)")
        return None
    try:
        get_merge_rule(method)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method must be None or a registered merge rule: {err}") from None
    make_rule(method, dict(options or {}))
    return method


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
    example input when neither ``example_input`` nor ``module.example_input_array`` is set. A module patched already
    with another method raises ValueError; MGR on an already sharded (FSDP2/DTensor) module raises RuntimeError,
    since its new parameters would not be sharded (patch inside ``configure_model`` before ``fully_shard``,
    see :func:`lightning_resctl.patch_in_configure_model`).
    """
    sites = merge_sites(module)  # also finds a patch applied to a submodule (e.g. self.model)
    if sites or get_patch_report(module) is not None:
        if method is not None:
            have = {getattr(s, "method", None) for s in sites}
            if have and have != {method}:
                raise ValueError(
                    f"the model is already patched with method {sorted(have)}, but the callback was given "
                    f"method={method!r}; pass method=None to only observe, or unpatch first"
                )
        return False
    use = method or "add"
    rule = make_rule(use, dict(method_options or {}))
    refuse_tensor_parallel(module, use)
    if rule.kind == "chain" and _has_dtensor_params(module):
        raise RuntimeError(
            f"the model's parameters are already sharded (DTensor) when the residual patch runs, so {use}'s new "
            "parameters would not be sharded. Call `lightning_resctl.patch_in_configure_model(self)` "
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
    patch_residuals(module, method=use, **kwargs)
    return True


def patch_copies(trainer: Any, pl_module: nn.Module, method: str | None, **kwargs: Any) -> None:
    """Patch deep copies of ``pl_module`` held by other callbacks (e.g. StochasticWeightAveraging's average
    model, copied in its ``setup`` before this callback ran) the same way, and give them the patched weights."""
    for cb in getattr(trainer, "callbacks", []):
        for name, value in list(vars(cb).items()):
            if (
                isinstance(value, nn.Module)
                and value is not pl_module
                and type(value) is type(pl_module)
                and get_patch_report(value) is None
            ):
                try:
                    ensure_patched(value, method, **kwargs)
                    value.load_state_dict(pl_module.state_dict())
                except Exception as err:  # noqa: BLE001 - a copy we cannot patch must not stop training
                    warnings.warn(
                        f"could not patch {type(cb).__name__}.{name} (a copy of the model) like the model: {err}",
                        stacklevel=2,
                    )


class ResidualPatcher:
    """Patch the LightningModule's residual merges for the length of one Trainer stage.

    * :meth:`setup` patches now, or right after ``configure_model`` when the module overrides it (the model
      is built there); deep copies of the module held by other callbacks (StochasticWeightAveraging's
      average model) are patched the same way and given the patched weights.
    * ``method=None`` observes: a module patched already (by hand or by another callback) is left as is; an
      unpatched one is patched with ``"add"`` (outputs bitwise unchanged) only to find its merges, and that
      patch is removed at :meth:`teardown` (:attr:`owns_patch`). A patcher with a method always leaves its
      patch on the model (the weights it adds are trained).
    * An observing patcher defers to a patcher with a method held by another callback of the same Trainer
      (whatever the callback order) or by its strategy, so two never patch one model twice.
    * :meth:`teardown` restores ``configure_model`` and removes the observation patch it owns.

    ``method`` and ``options`` are checked on construction (an unknown method or option raises here, not
    inside ``fit``). When a patch is applied, one line is logged on rank zero (see :func:`patch_line`).
    """

    def __init__(
        self,
        method: str | None = None,
        options: Mapping[str, Any] | None = None,
        *,
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        announce: bool = True,
    ) -> None:
        self.options = dict(options or {})
        self.method = check_method(method, self.options)
        self.example_input = example_input
        self.include = include
        self.exclude = exclude
        self.announce = bool(announce)
        #: True while this patcher holds an observation-only ("add") patch that it removes at teardown.
        self.owns_patch = False
        #: the report of the last patch this patcher applied (None when it patched nothing).
        self.report: Any = None
        self._wrapped_configure = False

    # ------------------------------------------------------------------ helpers
    def _kwargs(self) -> dict[str, Any]:
        return dict(example_input=self.example_input, include=self.include, exclude=self.exclude,
                    method_options=self.options)

    @staticmethod
    def of(callback: Any) -> "ResidualPatcher | None":
        p = getattr(callback, "patcher", None)
        return p if isinstance(p, ResidualPatcher) else None

    def _defers(self, trainer: Any) -> bool:
        """An observing patcher leaves the patch to another callback's patcher that has a method, or to the strategy's
        (``ResidualParallelStrategy(method=...)``)."""
        if self.method is not None:
            return False
        for cb in [*(getattr(trainer, "callbacks", None) or []), getattr(trainer, "strategy", None)]:
            other = ResidualPatcher.of(cb)
            if other is not None and other is not self and other.method is not None:
                return True
        return False

    # ------------------------------------------------------------------ lifecycle
    def patch(self, pl_module: nn.Module, model: nn.Module | None = None) -> bool:
        """Patch ``model`` (default ``pl_module``; a submodule such as ``self.model`` is fine) now; no-op when
        ``pl_module`` holds merge sites already. Returns True when this call patched."""
        target = pl_module if model is None else model
        if model is not None and model is not pl_module and merge_sites(pl_module):
            return False
        patched = ensure_patched(target, self.method, example_from=pl_module, **self._kwargs())
        if patched:
            self.owns_patch = self.owns_patch or self.method is None
            self.report = get_patch_report(target)
            if self.announce and self.method is not None:
                rank_zero_line(patch_line(target, self.report))
        return patched

    def setup(self, trainer: Any, pl_module: nn.Module) -> None:
        """Patch ``pl_module`` (after ``configure_model`` if it overrides it) and the copies other callbacks hold."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if self._defers(trainer):
            return

        def patch_all() -> None:
            self.patch(pl_module)
            patch_copies(trainer, pl_module, self.method, **self._kwargs())

        if is_overridden("configure_model", pl_module):
            if self._wrapped_configure:
                return
            original = pl_module.configure_model

            @functools.wraps(original)
            def configure_model_then_patch(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                patch_all()
                return out

            pl_module.configure_model = configure_model_then_patch
            self._wrapped_configure = True
        else:
            patch_all()

    def teardown(self, pl_module: nn.Module) -> None:
        """Restore ``configure_model`` and remove the observation patch this patcher applied."""
        if self._wrapped_configure and "configure_model" in vars(pl_module):
            del pl_module.configure_model
        self._wrapped_configure = False
        if self.owns_patch:
            if get_patch_report(pl_module) is not None or merge_sites(pl_module):
                unpatch_residuals(pl_module)
            self.owns_patch = False


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def patch_line(model: nn.Module, report: Any) -> str:
    """The one-line summary of a patch, e.g. ``patched 32 residual merges (mgr-competitive, n=4) · added 8,081
    parameters (0.25% of 3.2 M) · full report: lightning_resctl.get_patch_report(model)``."""
    if report is None:
        return "patched no residual merges"
    sites = merge_sites(model)
    rule = next((s.rule for s in sites if getattr(s, "rule", None) is not None), None)
    detail = rule.summary() if rule is not None else ""
    what = f"{report.method}, {detail}" if detail else str(report.method)
    params = dict(model.named_parameters())
    added = sum(params[n].numel() for n in report.new_parameters if n in params)
    total = sum(p.numel() for p in model.parameters())
    base = total - added
    n = len(report.sites)
    line = f"patched {n} residual merge{'s' if n != 1 else ''} ({what})"
    if added:
        line += f" · added {added:,} parameters ({100.0 * added / max(base, 1):.2g}% of {_human(base)})"
    else:
        line += " · no new parameters"
    if report.skipped:
        k = sum(getattr(s, "count", 1) for s in report.skipped)
        line += f" · {k} other addition{'s' if k != 1 else ''} left as is"
    return line + " · full report: lightning_resctl.get_patch_report(model)"
