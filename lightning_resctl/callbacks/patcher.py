"""ResidualPatcher: the one owner of a callback's residual patch, from ``setup`` to ``teardown``."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from . import _common as C

__all__ = ["ResidualPatcher", "merge_options"]


def merge_options(options: Mapping[str, Any] | None, method_options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (the YAML / LightningCLI form) and ``**method_options`` (the Python form) as one dict;
    an option given both ways raises ValueError."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of merge-rule options or None, got {type(options).__name__}")
    both = sorted(set(options or {}) & set(method_options))
    if both:
        raise ValueError(f"option(s) {both} given both in options= and as keyword arguments; give each once")
    return {**dict(options or {}), **dict(method_options)}


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
      (whatever the callback order), so two callbacks never patch one model twice.
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
        self.method = C.check_method(method, self.options)
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
        """An observing patcher leaves the patch to another callback's patcher that has a method."""
        if self.method is not None:
            return False
        for cb in getattr(trainer, "callbacks", None) or []:
            other = ResidualPatcher.of(cb)
            if other is not None and other is not self and other.method is not None:
                return True
        return False

    # ------------------------------------------------------------------ lifecycle
    def patch(self, pl_module: nn.Module, model: nn.Module | None = None) -> bool:
        """Patch ``model`` (default ``pl_module``; a submodule such as ``self.model`` is fine) now; no-op when
        ``pl_module`` holds merge sites already. Returns True when this call patched."""
        target = pl_module if model is None else model
        if model is not None and model is not pl_module and C._surgery().merge_sites(pl_module):
            return False
        patched = C.ensure_patched(target, self.method, example_from=pl_module, **self._kwargs())
        if patched:
            self.owns_patch = self.owns_patch or self.method is None
            self.report = C._surgery().get_patch_report(target)
            if self.announce and self.method is not None:
                C.rank_zero_line(patch_line(target, self.report))
        return patched

    def setup(self, trainer: Any, pl_module: nn.Module) -> None:
        """Patch ``pl_module`` (after ``configure_model`` if it overrides it) and the copies other callbacks hold."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if self._defers(trainer):
            return

        def patch_all() -> None:
            self.patch(pl_module)
            C.patch_copies(trainer, pl_module, self.method, **self._kwargs())

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
            surgery = C._surgery()
            if surgery.get_patch_report(pl_module) is not None or surgery.merge_sites(pl_module):
                surgery.unpatch_residuals(pl_module)
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
    sites = C._surgery().merge_sites(model)
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
