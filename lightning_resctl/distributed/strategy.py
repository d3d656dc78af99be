"""ResidualParallelStrategy: Lightning's ``ModelParallelStrategy`` that applies the whole at-scale recipe to a
LightningModule whose ``configure_model`` only builds the model (or that builds it in ``__init__``)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..rules import make_rule
from ..runtime.log import rank_zero_line
from ..surgery import merge_sites
from ..surgery.api import method_and_options
from ..surgery.patcher import ResidualPatcher, merge_options
from .blocks import check_block_cls, find_blocks
from .pipeline_setup import build_pipeline
from .plan import check_plan_argument, resolve_plan, sequence_parallel_of
from .recipe import (
    check_checkpointing,
    check_compile,
    fsdp_said,
    parallelized_already,
    policy_for_precision,
    without_checkpoint_wrappers,
    wrap_blocks,
)
from .stage_split import check_pipeline_arguments
from .tensor_parallel import parallelize_residuals

__all__ = ["ResidualParallelStrategy"]

Size = Union[Literal["auto"], int]


def _check_size(name: str, value: Any) -> None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")


class ResidualParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` that patches, parallelizes, checkpoints, compiles and shards the model itself,
    in the order that works for every merge rule. The LightningModule only builds the model (in ``configure_model``
    or ``__init__``); after ``configure_model`` and before the optimizer is built, the strategy:

    1. patches the residual merges: with the method and options of the Trainer's ``ResidualControlCallback`` (which
       patches them), or with its own ``method`` (a rule's name and options, or its config, e.g. ``MGRConfig``)
       when no callback has one (both given and different: refused, naming both);
    2. makes the model tensor / sequence parallel with ``plan`` (``parallelize_module`` on the LightningModule, so
       paths start at it, e.g. ``"model.h.*.mlp.c_fc"``), then puts the rules' parameters on the tensor-parallel mesh
       (``parallelize_residuals``), the residual stream read as sharded on the sequence or replicated from the plan
       (``sequence_parallel`` overrides; refused where the plan does not tell);
    3. per block (found by :func:`~lightning_resctl.distributed.blocks.find_blocks`, ``block_cls`` overrides):
       ``block.compile`` (``compile``) and ``checkpoint_wrapper`` around it (``activation_checkpointing``; with
       ``compile={"fullgraph": True}`` the checkpoint goes inside the compiled block), then ``fully_shard`` over the
       data-parallel mesh with ``mp_policy`` (default: from the Trainer's ``precision``);
    4. ``fully_shard`` of the LightningModule (with more than one data-parallel rank).

    With ``pipeline_parallel_size`` above 1 (or several ``stages_per_rank``) the blocks are split into pipeline stages
    (``torch.distributed.pipelining``, :mod:`.pipeline_setup`) after the patch: each rank holds its stages' blocks and
    the modules they run, a chain rule's state crosses the stage boundaries as the rule packs it
    (``ChainRule.stage_state``), and the strategy runs the schedule where Lightning runs ``training_step`` /
    ``validation_step`` / ``test_step`` (:mod:`.pipeline`: what it requires of the LightningModule). The blocks are
    checkpointed, compiled and sharded (FSDP2 over the data-parallel ranks of a ``pipeline x data`` mesh) as above.

    One line on rank zero says what was applied (:attr:`applied`). Refused, naming the argument: a plan entry naming
    no module, ``block_cls`` matching nothing, a mesh larger than the world, a ``tensor_parallel_size`` above 1
    without a plan, a model that ``configure_model`` parallelized already; under pipeline parallel also more stages
    than blocks, blocks that are not one chain of one class, a rule that declares no stage state, a plan,
    ``save_distributed_checkpoint=False``, several stages per rank with more than one data-parallel rank.

    Args:
        method: a registered merge rule (``lightning_resctl.merge_rules()``) or a rule's config; None: the Trainer's
            ``ResidualControlCallback`` patches (or nothing does: the model is taken as it is).
        options / **method_options: the rule's options (YAML form / Python form).
        plan: ``{module path pattern: ParallelStyle}`` or a callable ``(lightning_module, tp_mesh) -> dict``;
            None: no tensor parallelism.
        sequence_parallel: whether the residual stream between blocks is sharded on the sequence; None: read
            from ``plan``.
        activation_checkpointing: None (off), ``"blocks"``, every k-th block (an int: blocks 0, k, 2k, ...) or a
            predicate ``(name, block) -> bool``.
        compile: False, True (``block.compile()``) or a dict of ``torch.compile`` options.
        block_cls: a class (or its dotted path), a tuple of classes or a predicate ``(name, module) -> bool``
            naming the blocks.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (default: bf16 / fp16 parameters and fp32 reductions under
            ``precision="bf16-mixed"`` / ``"16-mixed"``, else none).
        data_parallel_size, tensor_parallel_size: the mesh (``"auto"``: one tensor-parallel group of every process of
            a node when a plan is given, else 1; data parallel over the rest).
        pipeline_parallel_size: ranks the blocks are split over (the mesh is ``pipeline x data x tensor``).
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved-1f1b"`` or ``"looped-bfs"`` (several stages per
            rank).
        microbatches: microbatches per step (default: the number of stages); the batch is split on dim 0.
        stages: blocks per stage (``pipeline_parallel_size x stages_per_rank`` ints; default: balanced by count).
        stages_per_rank: stages each rank runs (default 2 for the interleaved schedules, else 1).
        example_input, include, exclude: passed to ``patch_residuals``.
        save_distributed_checkpoint, process_group_backend, timeout: as ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        method: Any = None,
        *,
        options: Optional[dict] = None,
        plan: Union[dict, Callable[..., dict], None] = None,
        sequence_parallel: Optional[bool] = None,
        activation_checkpointing: Union[None, bool, str, int, Callable[[str, nn.Module], bool]] = None,
        compile: Union[bool, dict] = False,
        block_cls: Any = None,
        mp_policy: Any = None,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        pipeline_parallel_size: int = 1,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        stages: Optional[list] = None,
        stages_per_rank: Optional[int] = None,
        example_input: Any = None,
        include: Any = None,
        exclude: Any = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **method_options: Any,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        name, opts = method_and_options(method, merge_options(options, method_options))
        #: the strategy's own patch (used when no callback of the Trainer has a method)
        self.patcher = ResidualPatcher(name, opts, example_input=example_input, include=include, exclude=exclude)
        check_plan_argument(plan)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True, False or None (read from the plan), got "
                            f"{sequence_parallel!r}")
        if plan is None and sequence_parallel is not None:
            raise ValueError(f"sequence_parallel={sequence_parallel!r} without a plan: the residual stream is "
                             "sharded only by a tensor-parallel plan (give plan=)")
        check_checkpointing(activation_checkpointing)
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                            f"{type(mp_policy).__name__}")
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        if plan is None and tensor_parallel_size not in ("auto", 1):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} without a plan: give plan= (what "
                             "parallelize_module makes tensor parallel), or leave tensor_parallel_size='auto'")
        #: the checked pipeline arguments (:class:`~.stage_split.PipelineSpec`)
        self.pipeline_spec = check_pipeline_arguments(pipeline_parallel_size, schedule, microbatches, stages,
                                                      stages_per_rank)
        if self.pipeline_spec.active and plan is not None:
            raise ValueError("plan= (tensor parallel) together with pipeline_parallel_size > 1 is not supported: give "
                             "one of them")
        if self.pipeline_spec.active and not save_distributed_checkpoint:
            raise ValueError("save_distributed_checkpoint=False under pipeline parallel: each rank holds its stages "
                             "only, and a one-file checkpoint would hold rank 0's; save a distributed checkpoint "
                             "(Lightning's consolidate_checkpoint makes one file of it)")
        #: the pipeline's runner (:class:`~.pipeline.PipelineRunner`), once the stages are built
        self.pipeline: Any = None
        self.plan = plan
        self.sequence_parallel = sequence_parallel
        self.activation_checkpointing = activation_checkpointing
        self.compile_options = check_compile(compile)
        self.block_cls = check_block_cls(block_cls)
        self.mp_policy = mp_policy
        #: the line said on rank zero once the recipe was applied (None before)
        self.applied: Optional[str] = None

    @property
    def method(self) -> Optional[str]:
        """The strategy's own merge rule (None: the callback's, or none)."""
        return self.patcher.method

    # ------------------------------------------------------------------ the mesh and the patch's one source
    def _resolve_mesh(self) -> None:
        world = self.num_nodes * self.num_processes
        tp, dp, pp = self._tensor_parallel_size, self._data_parallel_size, self.pipeline_spec.size
        if tp == "auto":
            tp = 1 if self.plan is None else self.num_processes
        if dp == "auto":
            dp = max(world // (tp * pp), 1)
        mesh = f"data_parallel_size={dp} x tensor_parallel_size={tp}"
        if pp > 1:
            mesh = f"pipeline_parallel_size={pp} x {mesh}"
        if dp * tp * pp > world:
            raise ValueError(f"the mesh {mesh} needs {dp * tp * pp} processes, more than the world's {world} (devices "
                             "x num_nodes)")
        if dp * tp * pp != world:
            raise ValueError(f"the mesh {mesh} covers {dp * tp * pp} of the world's {world} processes: the product "
                             "must equal the world size")
        self._data_parallel_size, self._tensor_parallel_size = dp, tp

    def _callback_patcher(self, trainer: Any) -> Optional[ResidualPatcher]:
        """The patcher of the Trainer's callback that has a method, checked against the strategy's own."""
        for cb in getattr(trainer, "callbacks", None) or []:
            other = ResidualPatcher.of(cb)
            if other is None or other.method is None:
                continue
            if self.method is not None:
                mine = make_rule(self.method, self.patcher.options)
                theirs = make_rule(other.method, other.options)
                if (mine.name, mine.config) != (theirs.name, theirs.config):
                    raise ValueError(
                        f"ResidualParallelStrategy(method={self.method!r}, options={self.patcher.options}) and "
                        f"{type(cb).__name__}(method={other.method!r}, options={other.options}) disagree: give the "
                        "merge rule once, on the callback or on the strategy")
            return other
        return None

    def setup_environment(self) -> None:
        self._resolve_mesh()
        self._callback_patcher(getattr(self.lightning_module, "_trainer", None))
        if not self.pipeline_spec.active:
            super().setup_environment()
            return
        from torch.distributed.device_mesh import init_device_mesh

        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        shape = (self.pipeline_spec.size, self._data_parallel_size, self._tensor_parallel_size)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=(
            "pipeline_parallel", "data_parallel", "tensor_parallel"))
        self.lightning_module._device_mesh = self._device_mesh

    # ------------------------------------------------------------------ setup: the recipe, then Lightning's
    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` without its demand that ``configure_model`` parallelize: the recipe
        (:meth:`apply_recipe`) runs first, then the module is materialized, converted to the precision, moved, and
        the optimizers are built."""
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.apply_recipe(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ the steps (through the pipeline if any)
    def _pipelined(self, hook: str, context: Any, args: tuple, kwargs: dict, train: bool) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        if kwargs:
            raise TypeError(f"{hook} under pipeline parallel takes its arguments positionally, got {sorted(kwargs)}")
        module = self.lightning_module
        accumulate = module.trainer.accumulate_grad_batches if train else 1
        with context:
            return self.pipeline.run(module, hook, args[0], args[1:], train=train, accumulate=accumulate)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        return self._pipelined("training_step", self.precision_plugin.train_step_context(), args, kwargs, True)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipelined("validation_step", self.precision_plugin.val_step_context(), args, kwargs, False)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipelined("test_step", self.precision_plugin.test_step_context(), args, kwargs, False)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise RuntimeError("predict under pipeline parallel is not supported (the outputs live on the last stage): "
                               "predict with the consolidated checkpoint in one process")
        return super().predict_step(*args, **kwargs)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward; under pipeline parallel the schedule ran it in ``training_step``: its gradients are
        added here, after Lightning's ``zero_grad`` (the ``on_before_backward`` / ``on_after_backward`` hooks run as
        usual)."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.pipeline.apply_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    def teardown(self) -> None:
        set_aside = self.__dict__.pop("_set_aside", None)
        if set_aside is not None:
            set_aside[0].example_input_array = set_aside[1]
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        """``ModelParallelStrategy.load_checkpoint`` on the model as its checkpoints name it (the checkpoint
        wrappers set aside while it loads: Lightning's one-file loader would look for their names)."""
        with without_checkpoint_wrappers(self.lightning_module):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _patch(self, module: nn.Module, trainer: Any) -> str:
        callback = self._callback_patcher(trainer)
        if callback is None and self.method is not None:
            self.patcher.patch(module)
        methods = sorted({s.method for s in merge_sites(module)})
        if not methods:
            return "no residual patch"
        source = "callback" if callback is not None else ("strategy" if self.method is not None else "model")
        return f"{'/'.join(methods)} patch ({source})"

    def apply_recipe(self, trainer: Any) -> None:
        """Patch, parallelize, checkpoint, compile and shard the LightningModule (once: a later stage of the same
        Trainer finds it done)."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        module = self.lightning_module
        if getattr(module, "_resctl_recipe", None) is not None:
            return
        found = parallelized_already(module)
        if found:
            raise RuntimeError(
                f"the LightningModule is parallel already when ResidualParallelStrategy applies its recipe ({found}): "
                "with this strategy configure_model only builds the model. Remove parallelize_module / fully_shard "
                "from it (give the plan as plan=), or use Lightning's ModelParallelStrategy")
        said = [self._patch(module, trainer)]
        if self.pipeline_spec.active:
            self.pipeline, pipeline_said = build_pipeline(self, trainer, module)
            # a forward outside the schedule (Lightning's model summary, a logger's graph) cannot run the split model:
            # the example is set aside while the Trainer holds the module (back at teardown)
            self._set_aside = (module, module.example_input_array)
            module.example_input_array = None
            said += pipeline_said
            self._say_applied(module, said)
            return
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        shard = dp_mesh.size() > 1
        per_block = shard or self.compile_options is not None or self.activation_checkpointing not in (None, False)
        # found on the patched, plain model; only when something is done per block
        blocks = find_blocks(module, self.block_cls) if per_block or self.block_cls is not None else []
        if self.plan is not None:
            plan = resolve_plan(self.plan, module, tp_mesh)
            said.append(self._tensor_parallel(module, tp_mesh, plan, parallelize_module))
        wrapped, flags = wrap_blocks(module, blocks, self.activation_checkpointing, self.compile_options)
        policy = self.mp_policy or policy_for_precision(trainer.precision)
        for block in wrapped if shard else ():
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        if shard:
            fully_shard(module, mesh=dp_mesh, mp_policy=policy)
            _steps_gather_the_root(module)
        if blocks:
            said.append(self.blocks_said(blocks, flags))
        said.append(fsdp_said(dp_mesh, policy))
        self._say_applied(module, said)

    def _say_applied(self, module: nn.Module, said: list) -> None:
        self.applied = "ResidualParallelStrategy: " + " · ".join(said)
        module._resctl_recipe = self.applied
        rank_zero_line(self.applied)

    def _tensor_parallel(self, module: nn.Module, tp_mesh: Any, plan: dict, parallelize_module: Any) -> str:
        sp, source = self.sequence_parallel, "given"
        if sp is None:
            sp, source = sequence_parallel_of(plan), "read from the plan"
        patched = bool(merge_sites(module))
        if sp is None and patched:
            raise ValueError(
                "cannot tell from plan= whether the residual stream between blocks is sharded on the sequence (it "
                "has styles other than ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModule*, or "
                "Shard(0)): pass sequence_parallel=True (sharded) or False (replicated); a wrong value trains "
                "another network")
        parallelize_module(module, tp_mesh, plan)
        if patched:
            parallelize_residuals(module, tp_mesh, sequence_parallel=sp)
        layout = "sequence parallel" if sp else "tensor parallel"
        rules = f"{layout} ({source}), rule parameters on the mesh" if patched else layout
        ranks = tp_mesh.size()
        return f"{rules}, {len(plan)} plan entries over {ranks} rank{'s' if ranks != 1 else ''}"

    def blocks_said(self, blocks: list, flags: list) -> str:
        kinds = sorted({type(b).__name__ for _, b in blocks})
        said = f"{len(blocks)} blocks ({'/'.join(kinds)})"
        if any(flags):
            said += f", {sum(flags)} checkpointed"
        if self.compile_options is not None:
            limit = torch._dynamo.config.recompile_limit
            # (Full attnres compiles a graph per merge position; the other rules a constant number at any depth)
            torch._dynamo.config.recompile_limit = max(limit, 4 * len(blocks))
            said += f", compiled one by one ({self.compile_options or 'defaults'})"
        return said


def _steps_gather_the_root(module: nn.Module) -> None:
    """The LightningModule is FSDP2's root, but Lightning calls its step methods, not its ``forward``: each step
    method it overrides gathers the root's parameters as a forward would (``register_fsdp_forward_method``)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in ("training_step", "validation_step", "test_step", "predict_step"):
        if is_overridden(name, module):
            register_fsdp_forward_method(module, name)
