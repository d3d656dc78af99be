"""How a pipeline step runs inside Lightning's loop (:class:`PipelineRunner`), the LightningModule's own
``training_step`` / ``validation_step`` unchanged:

1. the batch is split into microbatches of equal size (dim 0 of every tensor in it);
2. for each, the step method runs up to its call of the model, which is captured there (not run): the model's
   arguments for that microbatch (every stage gets them: positions, masks and token ids reach the later stages);
3. the schedule runs the stages (``torch.distributed.pipelining``); on the last stage, right after each
   microbatch's forward, the step method runs again on that microbatch, its call of the model answered with the
   pipeline's output: what it returns is the microbatch's loss (backward from there), what it logs is kept;
4. the mean loss and the logged values (averaged over the microbatches) go from the last stage to every rank of
   the pipeline, and every rank logs them (``sync_dist`` reductions then run on every rank, as Lightning expects);
5. training: the gradients are divided by microbatches x ``accumulate_grad_batches`` (the loss was each
   microbatch's mean), the shared parameters' summed over their holders (:class:`~.shared.SharedParameters`), and
   handed to Lightning's backward (:meth:`PipelineRunner.apply_gradients`), after its ``zero_grad``.

What it requires of the LightningModule: its step method calls the model (the child holding the blocks) once per
microbatch and returns the loss (a tensor, or a dict with ``"loss"``) computed from the model's output; the code
before that call is cheap and computes what the model's call needs (it runs once more per microbatch).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..runtime.log import rank_zero_line
from .model_parts import capture_call, replaced_call
from .stage_model import encode_call
from .stage_split import PipelineSpec
from .torch_pipelining import MULTI_STAGE, SCHEDULES, ResidualPipelineStage, run_microbatches

__all__ = ["PipelineRunner", "split_batch"]


def split_batch(batch: Any, n: int) -> list:
    """``batch`` as ``n`` microbatches of equal size: every tensor split on dim 0, anything else repeated.
    ValueError naming ``microbatches`` when a tensor's rows are not a multiple of ``n`` (the stages' buffers are
    sized by the first microbatch, and each microbatch's mean loss weighs the same)."""
    leaves, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension to split into microbatches")
    uneven = sorted(size for size in sizes if size % n)
    if uneven or min(sizes) < n:
        raise ValueError(f"a batch of {(uneven or sorted(sizes))[0]} rows does not split into microbatches={n} of "
                         "equal size: give a batch size that is a multiple of it (drop_last=True for the last batch "
                         "of an epoch)")
    parts = [t.chunk(n) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * n for t in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


def _signature(kwargs: dict) -> tuple:
    out = []
    for k, v in sorted(kwargs.items()):
        out.append((k, (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else repr(v)))
    return tuple(out)


def _as_loss(result: Any, what: str) -> Optional[torch.Tensor]:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"{what} returned {type(result).__name__}: under pipeline parallel it returns the loss (a "
                        "tensor, or a dict with 'loss')")
    return loss


class _Replay:
    """One step method's microbatches as the schedule sees them: the step method, its arguments, the log calls its
    replays made."""

    def __init__(self, module: nn.Module, hook: str, microbatches: list, rest: tuple) -> None:
        self.module, self.hook, self.microbatches, self.rest = module, hook, microbatches, rest
        self.logged: list = []


class PipelineRunner:
    """The schedule of this rank's stages (``stages``: ``{index: PipelineStageModule}``), run per step on the
    LightningModule ``module`` whose child ``model`` is the pipelined model. ``group``: the pipeline's process
    group; ``last_rank``: the global rank of this pipeline's last stage; ``shared``: the
    :class:`~.shared.SharedParameters`."""

    def __init__(self, spec: PipelineSpec, stages: dict, model: nn.Module, group: Any, last_rank: int,
                 device: torch.device, shared: Any, refresh: Callable[[], None]) -> None:
        self.spec, self.stages, self.model, self.group = spec, stages, model, group
        self.last_rank, self.device, self.shared = last_rank, device, shared
        self._refresh: Optional[Callable] = refresh
        self._schedules: dict = {}
        self._replay: Optional[_Replay] = None
        self._pending: dict = {}
        self._returned_none = False
        #: ``{stage: [(what, shape, dtype, bytes)]}``: what each stage sends per microbatch (from the first step)
        self.sent: Optional[dict] = None

    @property
    def holds_last(self) -> bool:
        return self.spec.num_stages - 1 in self.stages

    # ------------------------------------------------------------------ the schedule
    def _schedule(self, key: tuple) -> tuple:
        if key not in self._schedules:
            stages = [ResidualPipelineStage(self.stages[s], s, self.spec.num_stages, self.device, group=self.group)
                      for s in sorted(self.stages)]
            cls = SCHEDULES[self.spec.schedule]
            first = stages if self.spec.schedule in MULTI_STAGE else stages[0]
            schedule = cls(first, self.spec.microbatches, loss_fn=self._loss, scale_grads=False)
            self._schedules[key] = (schedule, stages)
        return self._schedules[key]

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the step method replayed on microbatch ``target``."""
        last = self.stages[self.spec.num_stages - 1]
        tensors = output if isinstance(output, (tuple, list)) else (output,)
        if last.inferring:  # the shape inference's backward: any loss of every output
            return sum(t.float().sum() for t in tensors if t.is_floating_point()) * 0.0
        replay = self._replay
        i = int(target)
        answered = [0]
        model_output = last.model_output(tensors)

        def forward(*args: Any, **kwargs: Any) -> Any:
            answered[0] += 1
            if answered[0] > 1:
                raise RuntimeError(f"{replay.hook} called the pipelined model twice for one microbatch: under pipeline "
                                   "parallel the step method calls the model once")
            return model_output

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError(f"self.log({name!r}, ...): under pipeline parallel give its options by keyword")
            replay.logged.append((name, value, kwargs))

        with replaced_call(self.model, forward), _replaced(replay.module, "log", log):
            result = getattr(replay.module, replay.hook)(replay.microbatches[i], *replay.rest)
        loss = _as_loss(result, replay.hook)
        if loss is None:
            self._returned_none = True
            return torch.zeros((), device=self.device)
        return loss

    # ------------------------------------------------------------------ one step
    def run(self, module: nn.Module, hook: str, batch: Any, rest: tuple, train: bool, accumulate: int = 1) -> Any:
        """One step of ``module.<hook>`` (``"training_step"``, ``"validation_step"``, ``"test_step"``) on ``batch``
        through the pipeline: the mean loss on every rank of the pipeline (None: the step method returned none)."""
        if self._refresh is not None:
            self._refresh()
            self._refresh = None
        for stage in self.stages.values():
            stage.train(module.training)
        microbatches = split_batch(batch, self.spec.microbatches)
        step = getattr(module, hook)
        with _replaced(module, "log", lambda *a, **k: None):
            calls = [capture_call(self.model, lambda mb=mb: step(mb, *rest), f"{type(module).__name__}.{hook}")
                     for mb in microbatches]
        inputs = [encode_call(args, kwargs) for args, kwargs in calls]
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(inputs)):
            raise ValueError(f"{hook} calls the model with a tensor that requires grad (computed from parameters "
                             "outside the model): under pipeline parallel the model's inputs reach every stage as "
                             "inputs, and no gradient would flow back to them; compute it inside the model")
        schedule, stages = self._schedule((train, *(_signature(k) for k in inputs)))
        previous = self._take_gradients(module) if train else {}
        self._replay = _Replay(module, hook, microbatches, rest)
        self._returned_none = False
        losses: list = []
        try:
            run_microbatches(schedule, stages, inputs, [torch.tensor(i) for i in range(len(inputs))], losses, train)
        finally:
            replay, self._replay = self._replay, None
        loss, logged = self._from_last_stage(losses, replay.logged)
        for name, value, kwargs in logged:
            module.log(name, value.to(self.device) if isinstance(value, torch.Tensor) else value, **kwargs)
        if train:
            self._finish_gradients(module, previous, accumulate)
            if self.sent is None:
                self._say_sent()
        return loss

    def _from_last_stage(self, losses: list, logged: list) -> tuple:
        """The mean loss and the logged values (averaged over the microbatches), sent from the pipeline's last stage
        to its other ranks."""
        message: list = [None, None]
        if self.holds_last:
            tensors = [loss.detach() for loss in losses if isinstance(loss, torch.Tensor)]
            mean = None
            if tensors and len(tensors) == len(losses) and not self._returned_none:
                mean = torch.stack([t.double() for t in tensors]).mean().to(tensors[0].dtype).cpu()
            message = [mean, _averaged(logged)]
        if dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(message, src=self.last_rank, group=self.group)
        loss, logged = message
        return (loss.to(self.device) if loss is not None else None), logged

    # ------------------------------------------------------------------ gradients
    @staticmethod
    def _params(module: nn.Module) -> list:
        return list({id(p): p for p in module.parameters()}.values())

    def _take_gradients(self, module: nn.Module) -> dict:
        """The gradients before this step (an accumulation window's), set aside while the schedule runs."""
        out = {}
        for p in self._params(module):
            out[p] = p.grad
            p.grad = None
        return out

    def _finish_gradients(self, module: nn.Module, previous: dict, accumulate: int) -> None:
        factor = 1.0 / (self.spec.microbatches * accumulate)
        params = self._params(module)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        self.shared.all_reduce_grads()
        self._pending = {p: p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = previous.get(p)

    def apply_gradients(self) -> None:
        """Lightning's backward: the step's gradients added to what the parameters hold (after its ``zero_grad``)."""
        with torch.no_grad():
            for p, g in self._pending.items():
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._pending = {}

    # ------------------------------------------------------------------ what crosses the boundaries
    def _say_sent(self) -> None:
        mine = {s: stage.sent for s, stage in self.stages.items() if stage.sent is not None}
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        self.sent = {s: sent for part in gathered for s, sent in part.items()}
        rank_zero_line("ResidualParallelStrategy: each microbatch crosses " + " · ".join(
            f"stage {s}->{s + 1} {sum(b for *_, b in sent):,} B ("
            + ", ".join(f"{what} {list(shape)} {dtype}" for what, shape, dtype, _ in sent) + ")"
            for s, sent in sorted(self.sent.items())))


def _averaged(logged: list) -> list:
    """One log call per name (in the order first logged): its values over the microbatches averaged."""
    by_name: dict = {}
    for name, value, kwargs in logged:
        by_name.setdefault(name, ([], kwargs))[0].append(value)
    out = []
    for name, (values, kwargs) in by_name.items():
        if all(isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool) for v in values):
            value = torch.stack([torch.as_tensor(v).detach().double().cpu() for v in values]).mean()
            dtype = values[0].dtype if isinstance(values[0], torch.Tensor) else torch.get_default_dtype()
            value = value.to(dtype) if dtype.is_floating_point else value.float()
        else:
            value = values[-1]
        out.append((name, value, kwargs))
    return out


class _replaced:
    """``obj.<name>`` replaced by ``value`` (an instance attribute) for a ``with`` block."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self) -> None:
        self.had = self.name in self.obj.__dict__
        self.saved = self.obj.__dict__.get(self.name)
        self.obj.__dict__[self.name] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.had:
            self.obj.__dict__[self.name] = self.saved
        else:
            del self.obj.__dict__[self.name]
