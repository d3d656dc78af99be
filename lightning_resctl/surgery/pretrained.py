"""Hugging Face ``save_pretrained`` folders of patched models: the patch travels in the folder, and
:func:`from_pretrained` rebuilds the patched model (PEFT's ``PeftModel.from_pretrained`` convention).

What a folder holds: the weights carry one site record per merge (``..._resctl_siteN._extra_state``, see
:meth:`MergeSite.get_extra_state`) and the rule's new parameters (MGR's queries and biases); ``config.json``
says ``"model_type": "lightning_resctl"`` and carries the patch's note (``"lightning_resctl": {"method",
"options", "merges", "load_with", "base_model_type"}``: the model's own type), written on the model's ``config`` when it
is patched (:func:`.record.note_patch_on_config`) and removed by ``unpatch_residuals``.

transformers alone (``AutoModelForCausalLM.from_pretrained(path)`` without ``lightning_resctl`` imported) fails on
that model type instead of building the unpatched network; with ``lightning_resctl`` imported the Auto classes
load it through :func:`from_pretrained`. transformers is imported only when needed.
"""
from __future__ import annotations

import contextlib
import json
import logging
import warnings
from typing import Any

import torch
from torch import nn

from .checkpoint import patch_from_checkpoint
from .record import CONFIG_KEY, folder_model_config, is_site_key, register_folder_config

__all__ = ["from_pretrained", "example_input_for"]

_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def example_input_for(model: nn.Module) -> Any:
    """The input a patch of ``model`` runs one forward on: ``model.example_input_array`` when set, else a
    transformers model's ``dummy_inputs`` (on the model's device). None when neither exists."""
    example = getattr(model, "example_input_array", None)
    if example is not None:
        return example
    dummy = getattr(model, "dummy_inputs", None)
    if not isinstance(dummy, dict) or not dummy:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dummy.items()}


# ------------------------------------------------------------------ reading the folder
def _with_variant(name: str, variant: str | None) -> str:
    if not variant:
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}.{variant}.{ext}"


def _weight_files(path: Any, variant: str | None, hub: dict) -> list[str]:
    """The weight files of a ``save_pretrained`` folder (or Hub repo): safetensors or ``pytorch_model.bin``,
    single or sharded (``*.index.json``). Empty when none is found (transformers then says what is missing)."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
        cached_file,
    )

    def find(name: str) -> str | None:
        return cached_file(str(path), _with_variant(name, variant), _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub)

    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        file = find(single)
        if file:
            return [file]
        index_file = find(index)
        if index_file:
            with open(index_file, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [f for f in (cached_file(str(path), s, **hub) for s in shards) if f]
    return []


def _file_keys(files: list[str]) -> dict[str, str]:
    """``{key: file}`` of every tensor in ``files``."""
    out: dict[str, str] = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                out.update(dict.fromkeys(f.keys(), file))
        else:
            out.update(dict.fromkeys(torch.load(file, map_location="cpu", weights_only=True, mmap=True), file))
    return out


def _read(keys: list[str], where: dict[str, str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted({where[k] for k in keys}):
        wanted = [k for k in keys if where[k] == file]
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in wanted})
        else:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            out.update({k: sd[k] for k in wanted})
    return out


class _HoldLoadReport(logging.Filter):
    """Holds back transformers' load report (it would list the patch's keys as UNEXPECTED); :meth:`release`
    logs it after all when something else in it needs saying."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def _held_load_report():
    logger = logging.getLogger("transformers.modeling_utils")
    hold = _HoldLoadReport()
    logger.addFilter(hold)
    try:
        yield hold
    except BaseException:
        logger.removeFilter(hold)
        for record in hold.held:  # the report explains the error
            logger.handle(record)
        raise
    logger.removeFilter(hold)


def from_pretrained(model_class: Any, pretrained_model_name_or_path: Any, *model_args: Any,
                    example_input: Any = None, **kwargs: Any) -> Any:
    """Load a ``save_pretrained`` folder (or Hub repo) of a patched model as the patched model::

        model = lightning_resctl.from_pretrained(AutoModelForCausalLM, "out/")        # any transformers class

    transformers builds and loads the model as ``model_class.from_pretrained(path, *model_args, **kwargs)`` does
    (dtype, device_map, tied weights, sharded files: all its own); the patch recorded in the weights (one site
    record per merge: rule, options, which modules) is then re-applied — one forward on ``example_input``
    (default ``model.dummy_inputs``) — and its own weights (the site records, MGR's parameters) are loaded from the
    folder. A folder saved from an unpatched model loads unpatched, exactly as transformers loads it.

    transformers' load report would list the patch's keys as UNEXPECTED: it is held back, and shown (with a
    warning) only when something else is missing, unexpected or mismatched. ``output_loading_info=True`` returns
    ``(model, info)`` as transformers does, the patch's keys taken out of ``info["unexpected_keys"]``.

    Raises TypeError when ``model_class`` has no ``from_pretrained``; RuntimeError when the folder lacks a weight
    the recorded patch needs; ValueError from :func:`patch_from_state_dict`'s checks (several patches, a renamed
    state dict)."""
    if not callable(getattr(model_class, "from_pretrained", None)):
        raise TypeError(f"model_class must be a transformers model class with from_pretrained (e.g. "
                        f"AutoModelForCausalLM), got {model_class!r}")
    register_folder_config()
    want_info = bool(kwargs.pop("output_loading_info", False))
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    where = _file_keys(_weight_files(pretrained_model_name_or_path, kwargs.get("variant"), hub))
    if kwargs.get("config") is None and any(is_site_key(k) for k in where):  # the model's own config (hf_auto)
        kwargs["config"] = folder_model_config(pretrained_model_name_or_path, hub)
    if not any(is_site_key(k) for k in where):
        loaded = model_class.from_pretrained(pretrained_model_name_or_path, *model_args,
                                             output_loading_info=want_info, **kwargs)
        config = getattr(loaded[0] if want_info else loaded, "config", None)
        if config is not None and getattr(config, CONFIG_KEY, None):
            warnings.warn(f"{pretrained_model_name_or_path}: config.json says the model was patched "
                          f"({getattr(config, CONFIG_KEY).get('method')!r}), but its weights hold no merge site: "
                          "loaded unpatched, as the weights were saved", UserWarning, stacklevel=2)
        return loaded
    with _held_load_report() as hold:
        model, info = model_class.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                  output_loading_info=True, **kwargs)
    before = set(model.state_dict())
    extra = [k for k in where if k not in before]
    tensors = _read(extra, where)
    if example_input is None:
        example_input = example_input_for(model)
    patch_from_checkpoint(model, tensors, example_input=example_input)
    new = [k for k in model.state_dict() if k not in before]
    lacking = [k for k in new if k not in tensors]
    if lacking:
        raise RuntimeError(f"{pretrained_model_name_or_path} holds the patch's site records but not its weights "
                           f"{lacking}: the folder is incomplete")
    model.load_state_dict({k: tensors[k] for k in new}, strict=False)
    unexpected = sorted(set(info.get("unexpected_keys", ())) - set(new))
    info["unexpected_keys"] = type(info.get("unexpected_keys", []))(unexpected)
    if unexpected or info.get("missing_keys") or info.get("mismatched_keys"):
        logger = logging.getLogger("transformers.modeling_utils")
        for record in hold.held:
            logger.handle(record)
        warnings.warn(f"{pretrained_model_name_or_path}: after re-applying the patch, transformers' load report "
                      f"still lists missing keys {sorted(info.get('missing_keys', ()))}, unexpected keys "
                      f"{unexpected}, mismatched keys {list(info.get('mismatched_keys', ()))}", UserWarning,
                      stacklevel=2)
    return (model, info) if want_info else model
