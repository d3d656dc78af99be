"""The blocks of a model, found without the user naming them: the repeated children (the largest ``ModuleList`` /
``ModuleDict`` / ``Sequential`` of children of one class) that hold the patched merges; ``block_cls`` (a class, a
tuple of classes or a predicate ``(name, module) -> bool``) overrides. Each block is what the strategy checkpoints,
compiles, shards and puts on a pipeline stage on its own."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from ..surgery import MergeSite

__all__ = ["check_block_cls", "find_blocks", "CONTAINERS"]

#: the containers whose children can be the blocks
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def check_block_cls(block_cls: Any) -> Any:
    """``block_cls`` as :func:`find_blocks` takes it: None, an ``nn.Module`` subclass (or its dotted path, the
    YAML form: ``"torch.nn.Sequential"``), a tuple of them, or a callable predicate; TypeError otherwise."""
    if block_cls is None:
        return None
    if isinstance(block_cls, str):
        module_name, _, name = block_cls.rpartition(".")
        try:
            block_cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            raise TypeError(f"block_cls={block_cls!r} names no importable class ('package.module.Class')") from None
    classes = block_cls if isinstance(block_cls, tuple) else (block_cls,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes) and classes:
        return block_cls
    if not isinstance(block_cls, (type, tuple)) and callable(block_cls):
        return block_cls
    raise TypeError(f"block_cls must be an nn.Module class, a tuple of them or a predicate (name, module) -> bool, "
                    f"got {block_cls!r}")


def _sites(module: nn.Module) -> int:
    return sum(isinstance(m, MergeSite) for m in module.modules())


def _outermost(module: nn.Module, keep) -> list[tuple[str, nn.Module]]:
    found: list = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(f"{f}.") for f, _ in found):
            continue
        if keep(name, sub):
            found.append((name, sub))
    return found


def find_blocks(module: nn.Module, block_cls: Any = None) -> list[tuple[str, nn.Module]]:
    """``[(path, block)]`` in ``module``'s order. ``block_cls``: the outermost modules that are instances of the
    class(es) or that the predicate ``(path, module)`` accepts (ValueError when none is). Default: the children of
    the ``ModuleList`` / ``Sequential`` of at least two children of one class holding the most patched merges (the
    most children when the model is not patched); ValueError when there is none, naming ``block_cls=``."""
    if block_cls is not None:
        if isinstance(block_cls, (type, tuple)):
            found = _outermost(module, lambda name, sub: isinstance(sub, block_cls))
        else:
            found = _outermost(module, lambda name, sub: bool(block_cls(name, sub)))
        if not found:
            raise ValueError(f"block_cls={block_cls!r} matches no module of {type(module).__name__}")
        return found
    patched = _sites(module) > 0
    candidates = []
    for name, sub in module.named_modules():
        children = list(sub.children()) if isinstance(sub, CONTAINERS) else []
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            sites = _sites(sub)
            if sites or not patched:
                candidates.append(((sites, len(children)), name, sub))
    if not candidates:
        what = "holding the patched merges " if patched else ""
        raise ValueError(f"found no repeated blocks in {type(module).__name__} (a ModuleList, ModuleDict or Sequential "
                         f"of at least two modules of one class {what}): name them with block_cls= (a class or a "
                         "predicate (name, module) -> bool)")
    _, name, container = max(candidates, key=lambda c: c[0])
    return [(f"{name}.{i}" if name else i, child) for i, child in container.named_children()]
