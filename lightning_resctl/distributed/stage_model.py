"""A pipeline stage as the module ``torch.distributed.pipelining`` runs (:class:`PipelineStageModule`): the model's
own forward, on the stage's blocks only, cut at the stage's edges.

* The stage's first block (after the first stage) takes the stream the stage received in place of what the model's
  code computed before it (there from stand-ins, :class:`AbsentBefore`: zeros of the right shape), and the chain's
  state is rebuilt from the received tensors (:class:`ChainBoundary`: the rule's ``stage_state``) before its first
  merge.
* After the stage's last block (before the last stage) the stream and the packed chain state leave the model's
  forward (:class:`StageOutput`): nothing after it runs there (the head is :class:`AbsentAfter`).
* The last stage returns the model's output, flattened to its tensors (:meth:`PipelineStageModule.model_output`
  rebuilds it).

Nothing of a microbatch stays on a module between its forward and its backward: the chain's state goes out as stage
outputs, and the received tensors are the stage's inputs."""
from __future__ import annotations

import copy
import itertools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from .model_parts import block_stream

__all__ = ["StageOutput", "AbsentBefore", "AbsentAfter", "ChainBoundary", "PipelineStageModule", "INPUT_PREFIX",
           "encode_call", "first_block_hook", "last_block_hook", "outside_call_refused"]

#: the keyword under which a positional argument of the model's call reaches every stage (``{prefix}{i}``)
INPUT_PREFIX = "_resctl_arg"


def encode_call(args: tuple, kwargs: dict) -> dict:
    """The model's call as the keyword inputs every stage receives (positional ones under :data:`INPUT_PREFIX`)."""
    clash = [k for k in kwargs if k.startswith(INPUT_PREFIX)]
    if clash:
        raise ValueError(f"the model's keyword argument {clash[0]!r} clashes with the pipeline's names")
    return {**{f"{INPUT_PREFIX}{i}": a for i, a in enumerate(args)}, **kwargs}


def _decode_call(inputs: dict) -> tuple[tuple, dict]:
    positional = sorted((int(k[len(INPUT_PREFIX):]), v) for k, v in inputs.items() if k.startswith(INPUT_PREFIX))
    return tuple(v for _, v in positional), {k: v for k, v in inputs.items() if not k.startswith(INPUT_PREFIX)}


class StageOutput(Exception):
    """Raised after a stage's last block (before the last stage): ``payload``, what the stage sends."""

    def __init__(self, payload: tuple) -> None:
        super().__init__("pipeline stage output")
        self.payload = payload


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with its parameters and buffers on the meta device (no memory; the module is left as it is)."""
    memo: dict = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


class AbsentBefore(nn.Module):
    """On a stage after the first, a module that the model's code calls before the first block (the embedding): its
    output's shape, computed on the meta device, as zeros. What the first stage computed from it reaches this stage
    as the stream the stage receives; the module's parameters are the first stage's."""

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__()
        self.__dict__["meta"] = _meta_copy(module)
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        devices = [t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        out = self.meta(*on_meta[0], **on_meta[1])
        device = devices[0] if devices else None
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, out)

    def extra_repr(self) -> str:
        return f"{self.path!r} (on the first pipeline stage)"


class AbsentAfter(nn.Module):
    """On a stage before the last, a module of the last stage (the head): never called there (the stage's forward
    stops after its last block); a call raises."""

    def __init__(self, path: str, where: str) -> None:
        super().__init__()
        self.path, self.where = path, where

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the model called {self.path!r}, which runs on the {self.where} pipeline stage only, on "
                           "another stage")

    def extra_repr(self) -> str:
        return f"{self.path!r} (on the {self.where} pipeline stage)"


class ChainBoundary:
    """The one chain's state at a stage's edges: rebuilt from the received tensors before the stage's first merge
    (:meth:`restore`), packed after its last (:meth:`pack`), by the rule's ``stage_state``. ``run``: the chain's
    :class:`~lightning_resctl.surgery.chain_run.ChainRun` as the stage's merges see it; ``sites``: the stage's merge
    sites of that chain."""

    def __init__(self, run: Any, sites: list) -> None:
        self.run, self.sites = run, tuple(sites)
        self.rule = self.sites[0].rule

    @property
    def chain(self) -> nn.Module:
        return self.sites[0].chain_module

    def _first(self, training: bool) -> tuple:
        """(the position of the stage's first merge in this mode, the site that runs it)."""
        mode = "train" if training else "eval"
        return min((k, s) for s in self.sites for k in s.mode_positions.get(mode, s.positions))

    def restore(self, stream: torch.Tensor, packed: tuple) -> None:
        """Stand the chain where the previous stage left it: its state from ``packed``, after the merge before this
        stage's first one, the chain's leading shape read from ``stream`` (the stage's received stream)."""
        run = self.run
        training = self.sites[0].training
        k0, site = self._first(training)
        seq = run.expected.get("train" if training else "eval", run.expected.get("train", ()))
        i = seq.index(k0)
        if i == 0:  # the chain starts on this stage (the merges before it did not run in this mode)
            return
        run.state = self.rule.stage_state(self.chain, packed=packed)
        run.last, run.done, run.last_site = seq[i - 1], False, "the previous pipeline stage"
        d = site.dim
        run.lead = (stream.movedim(d, -1) if d not in (-1, stream.dim() - 1) else stream).shape[:-1]

    def pack(self) -> tuple:
        """The chain's state after the stage's last merge, as the rule packs it."""
        run = self.run
        if run.done or run.state is None:
            raise RuntimeError(f"residual chain {run.index} ended before the pipeline stage's last block: the stage "
                               "boundary has no chain state to send")
        packed = self.rule.stage_state(self.chain, run.state)
        if not isinstance(packed, tuple) or not all(isinstance(t, torch.Tensor) for t in packed):
            raise TypeError(f"method={self.rule.name!r}: stage_state(chain, state) must return a tuple of tensors, got "
                            f"{type(packed).__name__}")
        return packed


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense (a received tensor's gradient is sent back; c10d refuses a
    strided view, e.g. a slice of a stacked gradient)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def first_block_hook(stage: "PipelineStageModule"):
    """Forward pre-hook of a stage's first block (after the first stage): the received stream replaces the block's
    first argument, and the chain state is restored. Eager under ``torch.compile`` (a graph break)."""
    @torch.compiler.disable
    def hook(module, args, kwargs):
        received = stage.received
        if received is None:
            raise RuntimeError(f"pipeline stage {stage.index}'s first block ran outside the stage's forward")
        stream, *state = received
        if stage.boundary is not None:
            stage.boundary.restore(stream, tuple(state))
        return (stream, *args[1:]), kwargs
    return hook


def last_block_hook(stage: "PipelineStageModule"):
    """Forward hook of a stage's last block (before the last stage): the stream and the packed chain state leave
    the model's forward (:class:`StageOutput`). Eager under ``torch.compile``."""
    @torch.compiler.disable
    def hook(module, args, output):
        stream = block_stream(output, f"the block {type(module).__name__}")
        state = stage.boundary.pack() if stage.boundary is not None else ()
        raise StageOutput(tuple(t.contiguous() for t in (stream, *state)))
    return hook


class _Running:
    """How many stage forwards run now (on this rank): the pipelined model is called only by them."""

    depth = 0


def outside_call_refused(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a rank's pipelined model: a call that is not a stage's forward (the model holds this
    rank's stages only) raises, naming what to do instead."""
    if not _Running.depth:
        raise RuntimeError(f"{type(module).__name__} is split into pipeline stages and this rank holds some of them: "
                           "call it through the Trainer's steps (ResidualParallelStrategy runs the schedule there), or "
                           "load the consolidated checkpoint into one process to call it directly")


class PipelineStageModule(nn.Module):
    """Stage ``index`` of ``num_stages``: ``model`` (the model holding this stage's blocks, and the modules the
    stage runs) called on the model's own inputs (keyword inputs, every stage), with the previous stage's tensors
    (positional, after the first stage: the stream, then the chain state). ``boundary``: the chain's
    :class:`ChainBoundary` (None: no chain rule). ``sent``: what the stage sent per microbatch (name, shape, dtype,
    bytes), from its first forward."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, boundary: Optional[ChainBoundary]) -> None:
        super().__init__()
        self.model = model
        self.index, self.num_stages = index, num_stages
        self.__dict__["boundary"] = boundary
        self.inferring = False
        self.received: Optional[tuple] = None
        self.sent: Optional[list] = None
        self._layout: Any = None

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        args, kwargs = _decode_call(inputs)
        if self.inferring:  # the shape inference's received buffers are uninitialized memory: zeros (out of place)
            received = tuple(torch.where(torch.zeros_like(t, dtype=torch.bool), t, torch.zeros_like(t))
                             for t in received)
        self.received = tuple(_DenseGrad.apply(t) if t.requires_grad else t for t in received)
        _Running.depth += 1
        try:
            out = self.model(*args, **kwargs)
        except StageOutput as done:
            if self.sent is None and not self.inferring:
                self.sent = self._describe(done.payload)
            return done.payload
        finally:
            _Running.depth -= 1
            self.received = None
        if not self.is_last:
            raise RuntimeError(f"pipeline stage {self.index}'s forward ran to the model's end without its last block")
        leaves, spec = tree_flatten(out)
        self._layout = (spec, [None if isinstance(t, torch.Tensor) else t for t in leaves])
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    def model_output(self, tensors: Any) -> Any:
        """The model's output as its code returned it, from the last stage's tensors."""
        tensors = iter(tensors if isinstance(tensors, (tuple, list)) else (tensors,))
        spec, leaves = self._layout
        return tree_unflatten([next(tensors) if leaf is None else leaf for leaf in leaves], spec)

    def _describe(self, payload: tuple) -> list:
        state = f"{self.boundary.rule.name} state" if self.boundary is not None else "state"
        names = ["stream"] + [state] * (len(payload) - 1)
        return [(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.numel() * t.element_size())
                for name, t in zip(names, payload)]

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}"
