"""A patched transformers model's folder names itself, and transformers' Auto classes learn that name.

Written: a patched transformers model's ``config`` gets a per-instance subclass (as patched modules do) whose
JSON — what ``save_pretrained`` writes to ``config.json`` — says ``"model_type": "lightning_resctl"`` and keeps the
model's own type in the patch's note (``"lightning_resctl": {"base_model_type": ...}``). Everything else reads the
config as before (``config.model_type``, ``to_dict()``: PEFT picks its target modules by them).

Read: a loader that does not know the patch (``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained``: the
lm-evaluation-harness, vLLM, TGI, most scripts) fails loudly on the unknown model type instead of building the
unpatched network. :func:`register_auto_classes` (run when ``lightning_resctl`` is imported, at once when
transformers is, else when transformers' Auto classes are imported) registers that type with ``AutoConfig`` and
a loader with every ``AutoModel*`` class: ``from_pretrained(folder)`` then builds the patched network through
:func:`~.pretrained.from_pretrained`. The folder's config itself (its class, its note): :mod:`.record`.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from .record import register_folder_config

__all__ = ["register_auto_classes", "register_when_transformers_loads"]

_AUTO_MODULE = "transformers.models.auto.modeling_auto"
_REGISTERED: list = []


def register_auto_classes() -> None:
    """Let transformers' Auto classes load patched folders (``model_type`` ``"lightning_resctl"``): ``AutoConfig``
    reads such a folder's config (:func:`~.record.register_folder_config`), and every ``AutoModel*`` class builds
    the patched network from it. Idempotent; imports transformers."""
    if _REGISTERED:
        return
    from transformers.models.auto import modeling_auto

    folder_config = register_folder_config()
    for name in sorted(n for n in dir(modeling_auto) if n.startswith("AutoModel")):
        auto = getattr(modeling_auto, name)
        if isinstance(auto, type) and getattr(auto, "_model_mapping", None) is not None:
            auto.register(folder_config, _loader(auto, folder_config), exist_ok=True)
    _REGISTERED.append(folder_config)


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
