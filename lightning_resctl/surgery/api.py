"""The surgery's public functions: :func:`patch_residuals` (observe -> classify -> plan -> bind -> describe),
:func:`unpatch_residuals`, :func:`get_patch_report`, :func:`merge_sites`.

* observe (:mod:`.observe`): one forward in training and one in eval mode record every addition of two tensors;
* classify (:mod:`.classify`): which of them are merges;
* plan (:mod:`.plan`): which merges to patch, one site per expression, the chains; the patched classes
  (:mod:`.rewrite`);
* bind (:mod:`.bind`): the sites, chain modules and runs built complete and put into the model;
* describe (:mod:`.report`): the :class:`PatchReport`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Optional

from torch import nn

from ..rules import make_rule
from ..rules.base import rule_name_for_config
from .bind import bind
from .classify import classify
from .observe import observe_modes
from .peft import refuse_adapter_without_its_rule, save_rule_with_adapter
from .plan import STATE_ATTR, check_model, check_patterns, make_plan, refuse_checkpointed
from .record import forget_patch_on_config, note_patch_on_config
from .report import PatchReport, describe
from .sites import MergeSite
from .tensor_parallel_check import TensorParallelCheck, refuse_tensor_parallel

__all__ = ["patch_residuals", "unpatch_residuals", "get_patch_report", "merge_sites"]


def patch_residuals(model: nn.Module, method: Any = "rescontroller", example_input: Any = None,
                    include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None,
                    allow_empty: bool = False, **method_options) -> PatchReport:
    """Rewrite every residual merge of ``model`` in place and return a :class:`PatchReport`.

    A residual merge is an addition ``stream + update`` (any spelling: ``a + b``, ``b + a``,
    ``torch.add``, ``+=``, ``add_``) executed in a module's forward, where both operands have the same
    shape and the update is computed from the stream through a branch with learned parameters; the
    stream is the chain input or the previous merge's result. Merges are found by running the forward
    on ``example_input`` (default ``model.example_input_array``; a tuple is passed as ``*args``, a dict as
    ``**kwargs``) in training and in eval mode and watching every addition; buffers, module attributes,
    RNG state and the training flag are left exactly as they were. Each merge is rewritten in its
    forward's source into a call of a :class:`MergeSite` that runs the merge rule ``method`` — any name in
    :func:`lightning_resctl.merge_rules` (``"add"``, ``"rescontroller"``, ``"mgr"``, ``"mgr-competitive"``,
    ...; ``method_options`` are that rule's options, e.g. ``streams=4`` for MGR), or that rule's config
    dataclass: ``patch_residuals(model, MGRConfig(streams=4))`` patches, checks and records exactly as
    ``patch_residuals(model, method="mgr", streams=4)`` (a config and keyword options together are refused).
    Chain rules (MGR and the other stream-carrying rules) keep their state beside the model; the model's code
    between merges sees tensors of the original shape.

    The model object, its parameter names and its modules' ``isinstance`` are kept (patched modules get
    a per-instance subclass); :func:`unpatch_residuals` restores them exactly. The rule, its options and
    the sites travel with ``state_dict`` (one ``_extra_state`` entry per site), so a patched checkpoint
    fails to load into an unpatched model instead of loading silently.

    Args:
        include / exclude: module-path patterns (``fnmatch``; a plain name also matches its submodules)
            limiting which modules' additions may be patched.
        allow_empty: return an empty report instead of raising when nothing is found.

    Raises:
        ValueError: unknown ``method``/options (or a config with options), a rule that refuses the model, or no
            example input.
        TypeError: ``method`` is a dataclass that is no registered rule's config.
        RuntimeError: the model is already patched, or tensor parallel already (patch before
            ``parallelize_module``), or no merge was found (unless ``allow_empty``).
        TypeError: the model is wrapped (DDP/FSDP/compiled): patch it before wrapping.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    method, method_options = method_and_options(method, method_options)
    rule = make_rule(method, method_options)
    check_model(model, rule)
    refuse_adapter_without_its_rule(model)
    refuse_tensor_parallel(model, method)
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
        if example_input is None:
            raise ValueError("example_input is required (or set model.example_input_array): patch_residuals runs "
                             "one forward to find the merges")
    include = check_patterns(include, "include")
    exclude = check_patterns(exclude, "exclude")
    t0 = time.perf_counter()

    obs, other = observe_modes(model, example_input)                    # observe
    classify(obs)                                                        # classify
    classify(other)
    plan = make_plan(model, obs, rule, include, exclude, other)          # plan
    refuse_checkpointed(plan, rule)
    searched = (f"searched {obs.num_modules} modules of {type(model).__name__}: one forward on the example input "
                f"ran {obs.num_ops} torch ops, {len(obs.events)} additions of two tensors")
    report = PatchReport(method=method, options=rule.options(), skipped=plan.skipped, searched=searched)
    if not plan.merges:
        if allow_empty:
            report.patch_seconds = time.perf_counter() - t0
            return report
        reasons = "; ".join(sorted({s.reason for s in plan.skipped})) or "no addition of two tensors ran"
        raise RuntimeError(f"patch_residuals found no residual merge to patch: {searched}. "
                           f"Skipped additions: {reasons}. (Pass allow_empty=True to accept this.)")
    before = set(model.state_dict().keys())
    old = {id(p) for p in model.parameters()}  # by identity: wrappers (checkpoint_wrapper) rename state_dict keys
    binding = bind(model, plan, rule, report, obs, other)                # bind
    describe(report, binding)                                            # describe
    save_rule_with_adapter(model)  # a PEFT model: the rule's modules train and save with the adapter
    report.new_parameters = [k for k, p in model.named_parameters() if id(p) not in old]
    if report.new_parameters:  # a tensor-parallel forward needs them on the mesh (parallelize_residuals)
        binding.state.hooks.append(model.register_forward_pre_hook(TensorParallelCheck(method)))
    report.new_keys = [k for k in model.state_dict().keys() if k not in before]
    report.patch_seconds = time.perf_counter() - t0
    model.__dict__[STATE_ATTR] = binding.state
    note_patch_on_config(model, report)  # a transformers model: save_pretrained's config.json says it is patched
    return report


def method_and_options(method: Any, method_options: dict) -> tuple:
    """``(name, options)`` of the ``method`` patch_residuals got: a rule's name with its keyword options as they
    are, or a rule's config dataclass as the name it is registered under and its fields as options."""
    if isinstance(method, str) or not dataclasses.is_dataclass(method) or isinstance(method, type):
        return method, method_options
    if method_options:
        given = ", ".join(f"{k}={v!r}" for k, v in method_options.items())
        raise ValueError(f"patch_residuals got a config ({method!r}) and rule options ({given}): pass one of them, "
                         f"the options in the config ({type(method).__name__}(..., {given})) or method=<name> with "
                         "the options as keywords")
    return rule_name_for_config(method), {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}


def unpatch_residuals(model: nn.Module) -> None:
    """Undo :func:`patch_residuals`: original classes back, sites and MGR chains removed.

    ``model`` is the module that was patched, or a module holding it (e.g. a LightningModule whose
    ``self.model`` was patched): every patch found in it is undone. Outputs are bitwise identical to the
    model before patching (MGR parameters are dropped). Raises RuntimeError when nothing is patched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch_residuals(model): model must be an nn.Module, got {type(model).__name__} "
                        f"({model!r:.60})")
    states = _patch_states(model)
    if not states:
        raise RuntimeError(f"{type(model).__name__} is not patched (no patch_residuals state on it or in it)")
    for holder, state in states:
        for module, original, attrs in state.owners:
            if vars(type(module)).get("_resctl_original_class") is not original:
                raise RuntimeError(f"the class of a patched {original.__name__} was changed after patching (to "
                                   f"{type(module).__name__}, e.g. by fully_shard): unpatch before wrapping it")
    for holder, state in states:
        for module, original, attrs in state.owners:
            for attr in attrs:
                if attr in module._modules:
                    del module._modules[attr]
            module.__class__ = original
        for module, attr in state.added:
            if attr in module._modules:
                del module._modules[attr]
        for handle in state.hooks:
            handle.remove()
        for module, attr, value in state.switched:
            setattr(module, attr, value)
        del holder.__dict__[STATE_ATTR]
        forget_patch_on_config(holder)


def get_patch_report(model: nn.Module) -> Optional[PatchReport]:
    """The :class:`PatchReport` of a patched model (or of the first patched module inside it), or None."""
    states = _patch_states(model)
    return states[0][1].report if states else None


def _patch_states(model: nn.Module) -> list:
    own = model.__dict__.get(STATE_ATTR)
    if own is not None:
        return [(model, own)]
    return [(m, m.__dict__[STATE_ATTR]) for m in model.modules() if STATE_ATTR in m.__dict__]


def merge_sites(model: nn.Module) -> list:
    """The :class:`MergeSite` modules of ``model`` (found through ``model.modules()``), by chain then position."""
    sites = [m for m in model.modules() if isinstance(m, MergeSite)]
    return sorted(sites, key=lambda s: (s.chain, s.position))
