"""Checkpoints of patched models: load an unpatched checkpoint into a patched model, re-apply a recorded patch.

Every merge site writes a record (rule, options, where) into ``state_dict`` (``..._resctl_siteN._extra_state``,
see :meth:`MergeSite.get_extra_state`), so a patched checkpoint carries what is needed to patch a fresh model
the same way:

* :func:`patch_from_state_dict` — re-apply the recorded patch to a fresh model, then load strictly;
* :func:`patch_from_checkpoint` — re-apply it only (a Lightning ``on_load_checkpoint`` hook: Lightning loads the
  state dict right after);
* :class:`PatchOnLoadMixin` — the opt-in that makes ``MyModule.load_from_checkpoint(path)`` (and a resume
  without the patching callback) just work.

The backend a model ran with is recorded but does not block a load (it changes how the math runs, not what it
computes): the recorded one is used where it can run, else ``"auto"``, with a warning.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..rules import make_rule
from .api import get_patch_report, merge_sites, patch_residuals
from .record import decode_record, site_record_owner
from .report import PatchReport

__all__ = ["load_unpatched_state_dict", "patch_from_state_dict", "patch_from_checkpoint", "PatchOnLoadMixin",
           "adapt_optimizer_state"]

_PATCH_ARGS = ("include", "exclude", "allow_empty")  # passed to patch_residuals; other keywords are rule options


def load_unpatched_state_dict(model: nn.Module, state_dict: dict) -> list:
    """Load a checkpoint of the *unpatched* model into the patched ``model``.

    Every key of ``state_dict`` must match; the only keys allowed to be missing are the parameters the
    patch added (``report.new_parameters``: MGR's queries and biases), which keep their init. Returns the
    list of those new keys (the sites' ``_extra_state`` records included). A tied weight (one tensor under two
    names, e.g. GPT-2's ``lm_head.weight``) may be missing when another of its names is loaded, as in the state
    dicts ``save_pretrained`` writes. Raises RuntimeError for any other missing or unexpected key."""
    report = get_patch_report(model)
    if report is None:
        raise RuntimeError("model is not patched: use model.load_state_dict")
    result = model.load_state_dict(state_dict, strict=False)
    new = set(report.new_parameters) | set(getattr(report, "new_keys", ()))
    missing = [k for k in _untied(model, result.missing_keys, state_dict) if k not in new]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not match the unpatched model: missing keys {missing}, "
                           f"unexpected keys {list(result.unexpected_keys)}")
    return [k for k in result.missing_keys if k in new]


def _untied(model: nn.Module, missing: list, state_dict: dict) -> list:
    """The keys of ``missing`` that are not filled by the load: a tied weight (a parameter or buffer the model
    holds under several names, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) is filled when
    ``state_dict`` holds another of its names (transformers' ``save_pretrained`` keeps one name per tie)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    loaded = {name for group in names.values() if any(n in state_dict for n in group) for name in group}
    return [k for k in missing if k not in loaded]


def load_tied_state_dict(model: nn.Module, state_dict: dict) -> None:
    """``model.load_state_dict(state_dict)`` (strict), except that a tied weight may be missing when another of its
    names is in ``state_dict`` (see :func:`_untied`). Raises RuntimeError naming the missing / unexpected keys."""
    result = model.load_state_dict(state_dict, strict=False)
    missing = _untied(model, result.missing_keys, state_dict)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: missing keys {missing}, "
                           f"unexpected keys {list(result.unexpected_keys)}")


def _records(state_dict: dict) -> list:
    """``[(key prefix of the site's owner, record)]`` for every site record in ``state_dict``."""
    out = []
    for key, value in state_dict.items():
        owner = site_record_owner(key)
        if owner is not None:
            record = decode_record(value)
            if isinstance(record, dict) and "method" in record:
                out.append((owner, record))
    return out


def _patched_root(records: list) -> str:
    """The path (in the state dict) of the module that was patched: each record's owner key minus its ``path``
    (relative to the patched module)."""
    roots = set()
    for owner, record in records:
        path = record.get("path") or ""
        if not path:
            roots.add(owner)
        elif owner == path or owner.endswith("." + path):
            roots.add(owner[:len(owner) - len(path)].rstrip("."))
        else:
            raise ValueError(f"the site record at {owner!r} names the module path {path!r}, which does not end its "
                             "key: the state dict was renamed; patch the model by hand, then load")
    if len(roots) > 1:
        raise ValueError(f"the state dict holds patches of several modules {sorted(roots)}: patch each by hand, "
                         "then load")
    return roots.pop()


def _runnable_options(method: str, options: dict, overrides: dict) -> dict:
    """The recorded options as the rule can run them here (:meth:`MergeRule.runnable_options`), with a warning
    naming each option it changed; an option the caller overrides is left to the override."""
    runnable = make_rule(method, options).runnable_options(options)
    changed = [k for k in runnable if k not in overrides and (k not in options or runnable[k] != options[k])]
    if changed:
        def said(opts: dict) -> str:
            return ", ".join(f"{k}={opts.get(k)!r}" for k in changed)

        warnings.warn(f"the checkpoint's {method!r} merges ran with {said(options)}, which cannot run here: "
                      f"re-applying the patch with {said(runnable)} (it changes how the math runs, not what it "
                      "computes)", UserWarning, stacklevel=4)
    return {**options, **{k: runnable[k] for k in changed}}


def _reapply(model: nn.Module, records: list, example_input: Any, **kwargs) -> PatchReport:
    """Patch ``model`` (or its submodule that was patched) as the records say."""
    rules = {(r["method"], repr(sorted(make_rule(r["method"], r["options"]).math_options().items())))
             for _, r in records}
    if len(rules) > 1:
        raise ValueError(f"state_dict mixes several patches {sorted(rules)}: patch the model by hand, then load")
    method, options = records[0][1]["method"], dict(records[0][1]["options"])
    root = _patched_root(records)
    try:
        target = model.get_submodule(root) if root else model
    except AttributeError:
        raise ValueError(f"the checkpoint's patch was applied to the submodule {root!r}, which "
                         f"{type(model).__name__} does not have") from None
    if example_input is None and target is not model and getattr(target, "example_input_array", None) is None:
        example_input = getattr(model, "example_input_array", None)
    if "include" not in kwargs and "exclude" not in kwargs:  # exactly the modules the records name
        kwargs["include"] = sorted({r.get("path") or "" for _, r in records})
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k not in _PATCH_ARGS}
    options = _runnable_options(method, options, overrides)
    return patch_residuals(target, method=method, example_input=example_input, **kwargs, **{**options, **overrides})


def patch_from_state_dict(model: nn.Module, state_dict: dict, example_input: Any = None, **kwargs) -> PatchReport:
    """Re-apply the patch a checkpoint was saved with, then load it: for a checkpoint of a patched model and
    a fresh, unpatched ``model`` of the same config (e.g. ``MyModule(...)`` built by hand)::

        model = MyModule(**hparams)
        patch_from_state_dict(model, torch.load(path)["state_dict"])

    The rule and its options are read from the sites' records in ``state_dict`` (see
    :meth:`MergeSite.get_extra_state`), and so is which module was patched (the model or a submodule such as
    ``self.model``) and which of its modules (``include``/``exclude`` of the original patch). A recorded backend
    that cannot run here (``"triton"`` without a GPU) becomes ``"auto"``, with a warning. ``example_input`` and
    ``include``/``exclude`` (instead of the records') are passed to :func:`patch_residuals`; other ``kwargs``
    override recorded options (e.g. ``backend="torch-eager"``; an option that changes the math then fails the
    strict load, naming it). The load is strict, except that a tied weight may be missing when another of its names
    is loaded (``save_pretrained`` keeps one name per tie: GPT-2's ``lm_head.weight`` is left out). Raises
    ValueError when ``state_dict`` holds no record. (A ``save_pretrained`` folder: :func:`from_pretrained`.)"""
    records = _records(state_dict)
    if not records:
        raise ValueError("state_dict holds no lightning_resctl site record (it is not from a patched model): use "
                         "model.load_state_dict")
    report = _reapply(model, records, example_input, **kwargs)
    load_tied_state_dict(model, state_dict)
    return report


def patch_from_checkpoint(module: nn.Module, checkpoint: dict, example_input: Any = None,
                          **kwargs) -> Optional[PatchReport]:
    """Re-apply the patch recorded in ``checkpoint`` (a Lightning checkpoint dict, or a state dict) to ``module``,
    without loading: call it first in ``on_load_checkpoint(self, checkpoint)``, which Lightning runs before it
    loads the state dict (in ``load_from_checkpoint`` and when ``Trainer.fit/validate/test(ckpt_path=...)``
    restores a checkpoint). :class:`PatchOnLoadMixin` does exactly that.

    Returns the :class:`PatchReport`, or None when there is nothing to do: ``module`` holds merge sites already
    (patched by hand or by a callback's ``setup``; the strict load then checks that the records match) or the
    checkpoint holds no record. ``example_input`` (default ``module.example_input_array``) and ``kwargs`` as for
    :func:`patch_from_state_dict`. The patch keeps tied weights tied; a state dict that leaves a tied copy out
    (``save_pretrained``'s) loads afterwards with :func:`load_tied_state_dict`."""
    if not isinstance(checkpoint, dict):
        raise TypeError(f"checkpoint must be a dict (a Lightning checkpoint or a state dict), got "
                        f"{type(checkpoint).__name__}")
    state_dict = checkpoint.get("state_dict", checkpoint)
    records = _records(state_dict) if isinstance(state_dict, dict) else []
    if not records or merge_sites(module) or get_patch_report(module) is not None:
        return None
    return _reapply(module, records, example_input, **kwargs)


class PatchOnLoadMixin:
    """Opt-in for LightningModules whose checkpoints hold a residual patch: put it first among the bases, ::

        class MyModule(PatchOnLoadMixin, L.LightningModule):
            ...

        model = MyModule.load_from_checkpoint(path)       # patched like the trained model, weights loaded

    Its ``on_load_checkpoint`` re-applies the patch recorded in the checkpoint (:func:`patch_from_checkpoint`)
    before Lightning loads the state dict; a module patched already (the callback patches in ``setup``, before
    a resume restores the checkpoint) is left as it is. The patch runs one forward on ``example_input_array``
    (set it in ``__init__``). Its ``on_fit_start`` lets the optimizers take older checkpoints' state
    (:func:`adapt_optimizer_state`). A module that overrides ``on_load_checkpoint`` or ``on_fit_start`` calls
    ``super().on_load_checkpoint(checkpoint)`` / ``super().on_fit_start()`` first.
    """

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        patch_from_checkpoint(self, checkpoint)
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)

    def on_fit_start(self) -> None:
        """Before a resume restores the optimizers: :func:`adapt_optimizer_state` (a module that overrides
        ``on_fit_start`` calls ``super().on_fit_start()``)."""
        adapt_optimizer_state(self, self.trainer.optimizers)
        parent = getattr(super(), "on_fit_start", None)
        if parent is not None:
            parent()


def adapt_optimizer_state(model: nn.Module, optimizers: Iterable[Any]) -> None:
    """Let ``optimizers`` load a state that holds a rule parameter's per-element state (Adam's moments, momentum)
    in an older shape of the same size: checkpoints written when competitive MGR's ``forget_bias`` was 0-d (it is
    (1,), which FSDP2 can shard). Registers a ``load_state_dict`` post-hook on each optimizer that reshapes such
    state to the parameter's shape (``step``, torch's scalar counter, stays). Call it after building the
    optimizers and before loading their state; :class:`ResidualControlCallback` and :class:`PatchOnLoadMixin` do
    (``on_fit_start``, before Lightning restores a checkpoint's optimizer states)."""
    rule_params = {id(p) for site in merge_sites(model)
                   for m in (site, site.chain_module) if m is not None for p in m.parameters()}
    if rule_params:
        for optimizer in optimizers or []:
            optimizer.register_load_state_dict_post_hook(functools.partial(_reshape_state, rule_params))


def _reshape_state(rule_params: set, optimizer: Any) -> None:
    for p, state in optimizer.state.items():
        if id(p) in rule_params:
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value) and value.shape != p.shape \
                        and value.numel() == p.numel():
                    state[key] = value.reshape(p.shape)
