"""What of a model runs on which pipeline stage, found by running it once: the blocks are split among the stages;
every other module that holds parameters (the outermost such, outside the blocks and the rules' modules) goes to the
stages that use it:

* ``"first"``: called before the first block, or its parameters reach the first block's stream (the embedding);
* ``"last"``: called after the last block, or its parameters reach the model's output from the last block's stream
  on (the final norm, the head; a weight tied to the embedding is on both);
* ``"every"``: called between or inside the blocks, or its parameters reach another argument of a block (a bias
  table computed before the first block and given to each): every stage runs it.

A module used nowhere in that forward goes to the first stage. Parameters held directly by the model (or by the
modules on the way to the blocks) and the rules' modules (a chain's parameters are read by every stage's merges)
are on every stage. The model is the LightningModule's child that holds the blocks; its call is captured from the
LightningModule's own code (:func:`capture_call`)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .blocks import CONTAINERS

__all__ = ["ModelCall", "pipelined_model", "capture_call", "observe_placement", "block_stream", "rule_module"]

ModelCall = tuple  # (args, kwargs) of one call of the model


class _Called(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("the model was called")
        self.call = (args, kwargs)


@contextlib.contextmanager
def replaced_call(model: nn.Module, call: Callable) -> Iterator[None]:
    """A call of ``model`` answered by ``call`` (its hooks do not run: ``Module.__call__`` finds ``_call_impl`` on the
    instance), for a ``with`` block."""
    model.__dict__["_call_impl"] = call
    try:
        yield
    finally:
        del model.__dict__["_call_impl"]


def capture_call(model: nn.Module, run: Callable[[], Any], what: str) -> ModelCall:
    """The arguments of the first call of ``model`` in ``run()`` (stopped there: nothing after it runs); RuntimeError
    naming ``what`` when ``run`` does not call the model."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)

    with replaced_call(model, forward):
        try:
            run()
        except _Called as called:
            return called.call
    raise RuntimeError(f"{what} did not call the pipelined model ({type(model).__name__}): under pipeline parallel "
                       "the strategy runs the model's stages where the LightningModule's step calls the model")


def pipelined_model(module: nn.Module, blocks: list) -> tuple[str, nn.Module, str]:
    """``(name, model, container path in the model)``: the LightningModule's child that holds the blocks, and the
    path of the container they are the children of. Refused, naming ``block_cls``: blocks of several classes, not
    the children of one ModuleList / ModuleDict / Sequential, or a container that is the LightningModule's own
    child (the model must be a submodule whose forward runs the blocks)."""
    kinds = sorted({type(b).__name__ for _, b in blocks})
    if len(kinds) != 1:
        raise ValueError(f"pipeline parallel needs the blocks to be one chain of one class; block_cls= found "
                         f"{len(blocks)} blocks of the classes {kinds}")
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    container = module.get_submodule(next(iter(parents))) if len(parents) == 1 else None
    if not isinstance(container, CONTAINERS) or len(list(container.children())) != len(blocks):
        raise ValueError("pipeline parallel splits the blocks of one ModuleList / ModuleDict / Sequential into "
                         f"stages; block_cls= found blocks that are not all its children ({[n for n, _ in blocks][:4]}"
                         "...)")
    path = next(iter(parents))
    top, _, rest = path.partition(".")
    if not rest:
        raise ValueError(f"the blocks' container {path!r} is the LightningModule's own child: under pipeline parallel "
                         "keep the network in a submodule (e.g. self.model) whose forward runs the blocks")
    return top, getattr(module, top), rest


def rule_module(module: nn.Module) -> bool:
    """A module a rule built (a chain module): marked by the surgery, its parameters on every stage."""
    return module.__dict__.get("_resctl_rule_module") is not None


def candidates(model: nn.Module, container_path: str) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` that hold parameters, outside the blocks' container, the modules on the
    way to it and the rules' modules: what a stage holds or leaves out."""
    ancestors = {""} | {".".join(container_path.split(".")[:i]) for i in range(1, len(container_path.split(".")) + 1)}
    found: list = []

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path == container_path or rule_module(child):
                continue
            if path in ancestors:
                walk(path, child)
            elif any(True for _ in child.parameters()):
                found.append((path, child))

    walk("", model)
    return found


def block_stream(output: Any, what: str) -> torch.Tensor:
    """The stream in a block's output: the output itself, or the first item of a tuple / list."""
    stream = output[0] if isinstance(output, (tuple, list)) and output else output
    if not (isinstance(stream, torch.Tensor) and stream.is_floating_point()):
        raise TypeError(f"{what} returned {type(output).__name__}: under pipeline parallel a block returns the "
                        "residual stream, or a tuple whose first item is the stream")
    return stream


def _with_stream(output: Any, stream: torch.Tensor) -> Any:
    if isinstance(output, (tuple, list)):
        return type(output)([stream, *output[1:]])
    return stream


def _reached(tensors: list, params: list) -> set:
    """The ids of ``params`` that ``tensors`` depend on (through autograd)."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors or not params:
        return set()
    total = sum(t.sum() for t in tensors)
    grads = torch.autograd.grad(total, params, allow_unused=True, retain_graph=True)
    return {id(p) for p, g in zip(params, grads) if g is not None}


def observe_placement(model: nn.Module, container_path: str, blocks: list, call: ModelCall) -> dict:
    """``{module path: "first" | "last" | "first+last" | "every"}`` for each of :func:`candidates`, and
    ``"called_before"``: the paths called before the first block (their stand-in on a later stage computes their
    output's shape). One training-mode forward of ``model`` on ``call`` (the RNG and the buffers put back), with the
    last block's stream detached to tell the head's parameters from the blocks'.

    Refused (what a stage boundary would silently change): a block called other than once each, in order; a stream
    changed between two blocks (a block's input is not the previous block's output); an output that reads the first
    block's input or an earlier block's output other than through the last block (a skip around the blocks)."""
    cands = candidates(model, container_path)
    last = blocks[-1]
    phase = ["before"]
    calls: dict = {path: set() for path, _ in cands}
    ins: list = []   # (block, stream in)
    outs: list = []  # stream out
    extra: list = []

    def noted(path):
        return lambda mod, args: calls[path].add(phase[0])

    def enter(mod, args, kwargs):
        if not args or not (isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
            raise TypeError(f"the block {type(mod).__name__} was called without a floating-point tensor as its first "
                            "positional argument: under pipeline parallel a block takes the residual stream first")
        ins.append((mod, args[0]))
        phase[0] = "inside"
        extra.extend(t for t in tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad)

    def leave(mod, args, output):
        stream = block_stream(output, f"the block {type(mod).__name__}")
        outs.append(stream)
        if mod is not last:
            return None
        phase[0] = "after"
        return _with_stream(output, stream.detach().requires_grad_(stream.requires_grad))

    handles = [m.register_forward_pre_hook(noted(p)) for p, m in cands]
    handles += [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(leave) for b in blocks]
    buffers = {id(b): b.detach().clone() for b in model.buffers()}
    was_training = model.training
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    try:
        model.train()
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            args, kwargs = call
            output = model(*args, **kwargs)
            _check_one_chain(blocks, ins, outs)
            results = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            skipping = [t for t in [ins[0][1], *outs[:-1]] if t.requires_grad]
            if skipping and _reached(results, skipping):
                raise ValueError("the model's output reads the first block's input or an earlier block's output "
                                 "beside the last block's (a connection around the blocks): a pipeline stage boundary "
                                 "would cut it")
            params = list({id(p): p for _, m in cands for p in m.parameters() if p.requires_grad}.values())
            before = _reached([ins[0][1]], params)
            feeding = _reached(extra, params)
            after = _reached(results, params)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        with torch.no_grad():
            for b in model.buffers():
                if id(b) in buffers:
                    b.copy_(buffers[id(b)])
    out: dict = {"called_before": {p for p, c in calls.items() if "before" in c}}
    for path, mod in cands:
        ids = {id(p) for p in mod.parameters()}
        where = calls[path]
        if "inside" in where or ids & feeding:
            out[path] = "every"
            continue
        on = [s for s, used in (("first", "before" in where or ids & before), ("last", "after" in where or ids & after))
              if used]
        out[path] = "+".join(on) or "first"
    return out


def _check_one_chain(blocks: list, ins: list, outs: list) -> None:
    called = [mod for mod, _ in ins]
    if len(called) != len(blocks) or any(a is not b for a, b in zip(called, blocks)):
        raise ValueError(f"the model's forward called its {len(blocks)} blocks {len(called)} times, not once each in "
                         "order: pipeline parallel splits one chain of blocks into stages")
    for i in range(len(blocks) - 1):
        if ins[i + 1][1] is not outs[i]:
            raise ValueError(f"the stream entering block {i + 1} is not block {i}'s output (the model changes it "
                             "between the blocks): a pipeline stage boundary there would skip that change")
