"""PEFT models patched after their adapters were added (LoRA, then the patch): the rule's parameters train and
travel in the adapter folder the way PEFT's own extra modules do (the adapter's ``modules_to_save``).

``patch_residuals(peft_model, ...)`` puts the rule's modules that hold parameters (chain rules' chain modules, a
per-merge rule's merge modules) into the active adapter's ``modules_to_save``: PEFT wraps each (a frozen original
and a trainable copy, which the merges run: :func:`~.sites.running_module`), and ``save_pretrained`` writes the
copies beside the LoRA weights; ``adapter_config.json`` names them. The folder reloads into the base model patched
the same way (``patch_residuals(base, ...)``, then ``PeftModel.from_pretrained(base, folder)``), the reload of the
other order (patch, then LoRA) too. Loaded into the unpatched base, those weights have nowhere to go (PEFT skips
them): a patch of such a model is refused, naming the order that works. peft is never imported here.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Optional

from torch import nn

from ..rules import get_merge_rule, merge_rules
from .record import SITE_PREFIX
from .sites import MergeSite

__all__ = ["peft_adapter", "refuse_adapter_without_its_rule", "save_rule_with_adapter"]



def peft_adapter(model: nn.Module) -> Optional[tuple]:
    """``(adapter name, its config)`` of the active adapter when ``model`` is a PEFT model, else None."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    name = model.active_adapter
    return name, model.peft_config[name]


def _patch_module_names(names: list) -> list:
    """The names among ``names`` of modules a patch adds (sites, the rules' chain modules, a per-merge rule's merge
    module: ``<site>.merge``)."""
    prefixes = (SITE_PREFIX, *{get_merge_rule(m).rule_class.chain_attr for m in merge_rules()
                               if get_merge_rule(m).kind == "chain"})

    def added(name: str) -> bool:
        parts = name.split(".")
        return parts[-1].startswith(prefixes) or (parts[-1] == "merge" and len(parts) > 1
                                                  and parts[-2].startswith(SITE_PREFIX))
    return [n for n in names if added(n)]


def refuse_adapter_without_its_rule(model: nn.Module) -> None:
    """Raise when ``model`` is a PEFT model whose adapter was saved from a patched model (its ``modules_to_save``
    names the patch's modules) but was loaded into the unpatched base: the rule's trained weights were dropped."""
    adapter = peft_adapter(model)
    if adapter is None:
        return
    name, config = adapter
    named = _patch_module_names(list(getattr(config, "modules_to_save", None) or []))
    present = [path for path, _ in model.named_modules() if any(path.endswith(n) for n in named)]
    if named and not present:
        raise RuntimeError(
            f"this PeftModel's adapter {name!r} was saved from a patched model (its modules_to_save names the "
            f"patch's modules {named}), but it was loaded into the unpatched base model, so their trained weights "
            "were not loaded: patch the base model first, the same way (patch_residuals(base, ...)), then "
            "PeftModel.from_pretrained(base, folder)")


def save_rule_with_adapter(model: nn.Module) -> list:
    """When ``model`` is a PEFT model (just patched): add the rule's modules that hold parameters to the active
    adapter's ``modules_to_save`` and let PEFT wrap them; returns their names (relative to the base model)."""
    adapter = peft_adapter(model)
    if adapter is None:
        return []
    from peft.utils import set_additional_trainable_modules

    name, config = adapter
    base = model.get_base_model()
    paths = {id(m): path for path, m in base.named_modules()}
    wanted = []
    for site in base.modules():
        if isinstance(site, MergeSite):
            for module in (site.chain_module, site.merge):
                if module is not None and any(True for _ in module.parameters()) and id(module) in paths:
                    wanted.append(paths[id(module)])
    wanted = sorted(set(wanted))
    if wanted:
        config.modules_to_save = sorted(set(config.modules_to_save or []) | set(wanted))
        set_additional_trainable_modules(model.base_model, SimpleNamespace(
            modules_to_save=wanted, inference_mode=config.inference_mode), {}, name)
    return wanted
