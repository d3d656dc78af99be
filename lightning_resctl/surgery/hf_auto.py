"""A patched transformers model's folder names itself, and transformers' Auto classes learn that name.

Written: a patched transformers model's ``config`` gets a per-instance subclass (as patched modules do) whose
JSON — what ``save_pretrained`` writes to ``config.json`` — says ``"model_type": "lightning_resctl"`` and keeps the
model's own type in the patch's note (``"lightning_resctl": {"base_model_type": ...}``). Everything else reads the
config as before (``config.model_type``, ``to_dict()``: PEFT picks its target modules by them).

Read: a loader that does not know the patch (``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained``: the
lm-evaluation-harness, vLLM, TGI, most scripts) fails loudly on the unknown model type instead of building the
unpatched network. :func:`register_auto_classes` (run when ``lightning_resctl`` is imported, at once when
transformers is, else when transformers' Auto classes are imported; and by :func:`~.pretrained.from_pretrained`)
registers that type with ``AutoConfig`` and a loader with every ``AutoModel*`` class: ``from_pretrained(folder)``
then builds the patched network through :func:`~.pretrained.from_pretrained`.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
from typing import Any

__all__ = ["FOLDER_MODEL_TYPE", "folder_config_class", "original_config_class", "register_auto_classes",
           "folder_model_config", "register_when_transformers_loads"]

#: the ``model_type`` of a patched model's ``config.json``
FOLDER_MODEL_TYPE = "lightning_resctl"
_AUTO_MODULE = "transformers.models.auto.modeling_auto"
_CLASSES: dict = {}    # model config class -> its folder subclass
_REGISTERED: list = []


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
    from .pretrained import CONFIG_KEY

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


def register_auto_classes() -> None:
    """Let transformers' Auto classes load patched folders (``model_type`` ``"lightning_resctl"``): ``AutoConfig``
    reads such a folder's config, and every ``AutoModel*`` class builds the patched network from it. Idempotent;
    imports transformers."""
    if _REGISTERED:
        return
    from transformers import AutoConfig, PreTrainedConfig
    from transformers.models.auto import modeling_auto

    from .pretrained import CONFIG_KEY

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
    for name in sorted(n for n in dir(modeling_auto) if n.startswith("AutoModel")):
        auto = getattr(modeling_auto, name)
        if isinstance(auto, type) and getattr(auto, "_model_mapping", None) is not None:
            auto.register(PatchedFolderConfig, _loader(auto, PatchedFolderConfig), exist_ok=True)
    _REGISTERED.append(PatchedFolderConfig)


def folder_model_config(path: Any, hub: dict) -> Any:
    """The model's own config of a patched folder (its ``config.json`` names the model type
    ``"lightning_resctl"``), else None (a plain folder: transformers reads it as usual)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **hub)
    return config.__dict__.get("inner") if type(config) in _REGISTERED else None


def _loader(auto: type, config_class: type) -> type:
    """What ``auto`` builds from a patched folder: :func:`~.pretrained.from_pretrained` of ``auto`` with the
    folder's own config."""

    def from_pretrained(cls, path: Any, *model_args: Any, config: Any = None, **kwargs: Any) -> Any:
        from .pretrained import from_pretrained as load

        for key in ("_from_auto", "trust_remote_code", "adapter_kwargs"):
            kwargs.pop(key, None)
        return load(auto, path, *model_args, config=config.inner, **kwargs)

    def from_config(cls, config: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{auto.__name__}.from_config: the config of a patched model's folder builds the patched "
                         f"model only with its weights: use {auto.__name__}.from_pretrained(folder) (or "
                         f"lightning_resctl.from_pretrained({auto.__name__}, folder))")

    return type(f"LightningResctl{auto.__name__[len('AutoModel'):] or 'Model'}", (), {
        "__doc__": f"Loads a patched model's folder for {auto.__name__}.", "config_class": config_class,
        "from_pretrained": classmethod(from_pretrained), "from_config": classmethod(from_config),
        "_from_config": classmethod(from_config)})


class _AfterAutoImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: once transformers' Auto model classes are imported, :func:`register_auto_classes`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _AUTO_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            register_auto_classes()

        spec.loader.exec_module = exec_module
        return spec


def register_when_transformers_loads() -> None:
    """:func:`register_auto_classes` now when transformers' Auto model classes are imported, else right after they
    are (without importing transformers here)."""
    if _AUTO_MODULE in sys.modules:
        register_auto_classes()
    elif importlib.util.find_spec("transformers") is not None and \
            not any(isinstance(f, _AfterAutoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterAutoImport())
