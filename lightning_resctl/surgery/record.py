"""What a patch writes into what is saved, in one place: the site keys of ``state_dict``, the site record's
encoding, and the patch's note in a transformers model's ``config.json``.

* site keys — a patched module registers its sites as ``_resctl_site0``, ``_resctl_site1``, ... (:data:`SITE_PREFIX`);
  each writes its record under ``<module path>._resctl_siteN._extra_state`` (:func:`is_site_record_key`);
* the record — the rule, its options and where the site is, as UTF-8 JSON in a uint8 tensor (:func:`encode_record`,
  :func:`decode_record`), so that state dicts stay tensor-only and load with ``weights_only=True``;
* the config note — ``"lightning_resctl": {"method", "options", "merges", "load_with", "note"}`` on the model's
  ``config`` (:func:`note_patch_on_config`), whose class becomes a subclass that writes ``"model_type":
  "lightning_resctl"`` into ``config.json`` (the model's own type moved into the note as ``base_model_type``);
  :func:`register_folder_config` lets ``AutoConfig`` read such a folder. transformers is imported only when needed.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["SITE_PREFIX", "is_site_key", "is_site_record_key", "site_record_owner", "encode_record", "decode_record",
           "plain", "CONFIG_KEY", "FOLDER_MODEL_TYPE", "note_patch_on_config", "forget_patch_on_config",
           "folder_config_class", "original_config_class", "register_folder_config", "folder_model_config"]

# ------------------------------------------------------------------ site keys
#: attribute names of the sites registered on a patched module: ``_resctl_site0``, ``_resctl_site1``, ...
SITE_PREFIX = "_resctl_site"
_EXTRA_STATE = "._extra_state"


def is_site_key(key: str) -> bool:
    """Whether the ``state_dict`` key ``key`` is under a merge site (``..._resctl_siteN...``)."""
    return f".{SITE_PREFIX}" in key


def is_site_record_key(key: str) -> bool:
    """Whether the ``state_dict`` key ``key`` is a site's record (``..._resctl_siteN._extra_state``)."""
    return site_record_owner(key) is not None


def site_record_owner(key: str) -> str | None:
    """The key prefix of the module holding the site whose record is at ``key``, or None when ``key`` is not a
    site record's."""
    if not key.endswith(_EXTRA_STATE):
        return None
    owner, _, attr = key[:-len(_EXTRA_STATE)].rpartition(".")
    return owner if attr.startswith(SITE_PREFIX) else None


# ------------------------------------------------------------------ the record
def encode_record(record: dict) -> torch.Tensor:
    """A site record as it travels in ``state_dict``: UTF-8 JSON in a uint8 tensor."""
    data = json.dumps(record, sort_keys=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode_record(state: Any) -> Any:
    """A site record from its state_dict form (uint8 JSON tensor); anything else is returned as is."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        try:
            return json.loads(bytes(state.cpu().tolist()).decode())
        except ValueError:
            return state
    return state


def plain(value: Any) -> Any:
    """Options as plain Python values (comparable, and loadable with ``weights_only=True``)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


# ------------------------------------------------------------------ the config note
#: the ``config.json`` attribute that says a folder holds a patched model
CONFIG_KEY = "lightning_resctl"
#: the ``model_type`` of a patched model's ``config.json``
FOLDER_MODEL_TYPE = "lightning_resctl"
_CLASSES: dict = {}    # model config class -> its folder subclass
_REGISTERED: list = []  # the folder config class, once registered with AutoConfig


def _hf_config(model: nn.Module) -> Any:
    """``model.config`` when it is a transformers ``PretrainedConfig`` (never imports transformers)."""
    tf = sys.modules.get("transformers")
    config = getattr(model, "config", None)
    base = getattr(tf, "PretrainedConfig", None) if tf is not None else None
    return config if base is not None and isinstance(config, base) else None


def _auto_class_name(model: nn.Module, config: Any) -> str:
    """The first transformers Auto class that builds ``type(model)`` from ``config`` (else the class's name)."""
    name = type(model).__name__
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # pragma: no cover
        return name
    for auto in sorted(n for n in dir(modeling_auto) if n.startswith("AutoModel")):
        names = getattr(getattr(getattr(modeling_auto, auto), "_model_mapping", None), "_model_mapping", None)
        found = names.get(getattr(config, "model_type", None)) if isinstance(names, dict) else None
        if found == name or (isinstance(found, (tuple, list)) and name in found):
            return auto
    return name


def _hf_models(model: nn.Module) -> list:
    """``(path, module)`` of the transformers models in ``model``: ``model`` itself when it is one, else the
    outermost ones inside it (a LightningModule's ``self.model``); a model's own inner models share its config."""
    found: list = []
    for name, module in model.named_modules():
        if _hf_config(module) is not None and not any(name.startswith(p + ".") or not p for p, _ in found):
            found.append((name, module))
    return found


def note_patch_on_config(model: nn.Module, report: Any) -> None:
    """Write the patch's note on the ``config`` of each transformers model in ``model`` (:func:`_hf_models`;
    anything else is left alone), so that ``save_pretrained`` puts it in ``config.json`` (``{"method", "options",
    "merges", "load_with"}``), and give the config the subclass whose ``config.json`` names the patched model type
    (:func:`folder_config_class`). A model inside the patched module gets the note too: its folder holds the
    patch's keys, and would otherwise load as the unpatched network (one holding no merge is left alone)."""
    for path, hf_model in _hf_models(model):
        merges = sum(1 for site in report.sites if not path or site.path == path or site.path.startswith(path + "."))
        if path and not merges:
            continue
        config = hf_model.config
        register_folder_config()
        config.__class__ = folder_config_class(type(config))
        auto = _auto_class_name(hf_model, config)
        load_with = (f"import lightning_resctl, then {auto}.from_pretrained(path) (or "
                     f"lightning_resctl.from_pretrained({auto}, path))") if not path else (
            f"patched as part of a {type(model).__name__} (this model is its {path!r}): its site records name paths "
            f"in that module, so load that module's checkpoint (lightning_resctl.patch_from_checkpoint), or patch "
            f"the {type(hf_model).__name__} itself to save a folder {auto}.from_pretrained loads")
        setattr(config, CONFIG_KEY, {
            "method": report.method,
            "options": plain(dict(report.options)),
            "merges": merges,
            "load_with": load_with,
            "note": "the weights hold lightning_resctl merge sites: transformers alone does not know this model type",
        })


def forget_patch_on_config(model: nn.Module) -> None:
    """Remove the notes of :func:`note_patch_on_config` and their config subclass (the model was unpatched)."""
    for _, hf_model in _hf_models(model):
        config = hf_model.config
        if hasattr(config, CONFIG_KEY):
            delattr(config, CONFIG_KEY)
            config.__class__ = original_config_class(type(config))


def folder_config_class(cls: type) -> type:
    """The subclass of the config class ``cls`` whose JSON names the patch (cached per class; pickled as ``cls``
    plus that class)."""
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_resctl_original_class": cls, "to_json_string": _folder_json_string, "__reduce_ex__": _reduce_config})
        _CLASSES[cls] = sub
    return sub


def original_config_class(cls: type) -> type:
    """``cls`` without the subclass of :func:`folder_config_class`."""
    return vars(cls).get("_resctl_original_class", cls)


def _folder_json_string(self, use_diff: bool = True) -> str:
    """``config.json`` of a patched model: the model's own type moved into the patch's note."""
    data = json.loads(original_config_class(type(self)).to_json_string(self, use_diff))
    if isinstance(data.get(CONFIG_KEY), dict):
        data[CONFIG_KEY] = {**data[CONFIG_KEY], "base_model_type": data.get("model_type")}
        data["model_type"] = FOLDER_MODEL_TYPE
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _reduce_config(self, protocol):
    return _rebuild_config, (original_config_class(type(self)),), dict(self.__dict__)


def _rebuild_config(cls: type) -> Any:
    obj = cls.__new__(cls)
    obj.__class__ = folder_config_class(cls)
    return obj


def register_folder_config() -> type:
    """Let ``AutoConfig`` read a patched folder's ``config.json`` (``model_type`` ``"lightning_resctl"``): its
    config class reads the model's own config (``inner``) with the model type restored from the patch's note.
    Idempotent; imports transformers. Returns that config class."""
    if _REGISTERED:
        return _REGISTERED[0]
    from transformers import AutoConfig, PreTrainedConfig

    class PatchedFolderConfig(PreTrainedConfig):
        """The config of a patched model's folder: the model's own config (``inner``), read from ``config.json``
        with its model type restored from the patch's note."""

        model_type = FOLDER_MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict: dict, **kwargs: Any) -> Any:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            note = dict(config_dict.get(CONFIG_KEY) or {})
            if "base_model_type" not in note:
                raise ValueError(f"config.json says model_type={FOLDER_MODEL_TYPE!r} but its {CONFIG_KEY!r} note "
                                 "names no model type: the folder was not written by a patched model")
            inner_dict = {**config_dict, "model_type": note["base_model_type"]}
            made = CONFIG_MAPPING[note["base_model_type"]].from_dict(inner_dict, **kwargs)
            inner, unused = made if kwargs.get("return_unused_kwargs") else (made, None)
            folder = cls()
            folder.__dict__["inner"] = inner
            return (folder, unused) if kwargs.get("return_unused_kwargs") else folder

    AutoConfig.register(FOLDER_MODEL_TYPE, PatchedFolderConfig, exist_ok=True)
    _REGISTERED.append(PatchedFolderConfig)
    return PatchedFolderConfig


def folder_model_config(path: Any, hub: dict) -> Any:
    """The model's own config of a patched folder (its ``config.json`` names the model type
    ``"lightning_resctl"``), else None (a plain folder: transformers reads it as usual)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **hub)
    return config.__dict__.get("inner") if type(config) in _REGISTERED else None
