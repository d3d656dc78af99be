"""The strategy's recipe under pipeline parallel (:func:`build_pipeline`), after the patch and before the optimizer:

1. the blocks (:func:`~.blocks.find_blocks`) and the model holding them; the one chain whose state crosses the
   stages, checked (:func:`~.stage_build.chain_of`);
2. one forward on the example input places the other modules (:func:`~.model_parts.observe_placement`);
3. the split (:func:`~.stage_split.split_blocks`); the model trimmed to this rank's stages
   (:func:`~.stage_build.trim_to_rank`);
4. its blocks compiled and checkpointed (:func:`~.recipe.wrap_blocks`), each stage as a module
   (:class:`~.stage_model.PipelineStageModule`), ``fully_shard`` per block and per stage over the data-parallel
   ranks, the boundary hooks on the stages' first and last blocks (after FSDP2's own);
5. the parameters held by several ranks made equal (:class:`~.shared.SharedParameters`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..surgery.observe import run_example
from .blocks import find_blocks
from .model_parts import capture_call, observe_placement, pipelined_model
from .pipeline import PipelineRunner
from .recipe import fsdp_said, policy_for_precision, wrap_blocks
from .shared import SharedParameters
from .stage_build import StagePlan, chain_of, holders_of, refresh_views, stage_models, trim_to_rank
from .stage_model import PipelineStageModule, first_block_hook, last_block_hook, outside_call_refused
from .stage_split import split_blocks, stage_rank

__all__ = ["build_pipeline"]


def _example_call(strategy: Any, trainer: Any, module: nn.Module, model: nn.Module) -> tuple:
    """The model's arguments on the example input: the LightningModule's forward on its example (the strategy's
    ``example_input``, a callback's, or ``example_input_array``), captured at its call of the model; else the
    model's own ``example_input_array``."""
    examples = [strategy.patcher.example_input, getattr(module, "example_input_array", None)]
    callback = strategy._callback_patcher(trainer)
    if callback is not None:
        examples.insert(1, callback.example_input)
    example = next((e for e in examples if e is not None), None)
    if example is not None:
        return capture_call(model, lambda: run_example(module, example), f"{type(module).__name__}.forward")
    own = getattr(model, "example_input_array", None)
    if own is None:
        raise ValueError("pipeline parallel runs the model once on an example input to place its modules on the "
                         "stages: give example_input= or set example_input_array on the LightningModule")
    return (own if isinstance(own, tuple) else (own,)), {}


def build_pipeline(strategy: Any, trainer: Any, module: nn.Module) -> tuple[PipelineRunner, list]:
    """Split the patched LightningModule's model into this rank's pipeline stages; the runner and what was done (for
    the strategy's line)."""
    from torch.distributed.fsdp import fully_shard

    spec = strategy.pipeline_spec
    if getattr(trainer, "gradient_clip_val", None):
        raise ValueError(f"gradient_clip_val={trainer.gradient_clip_val} under pipeline parallel is not supported (the "
                         "norm would be each stage's own): clip in the optimizer, or train without it")
    if not module.automatic_optimization:
        raise ValueError("automatic_optimization=False under pipeline parallel is not supported: the strategy runs "
                         "the schedule's forward and backward where Lightning runs training_step")
    blocks = find_blocks(module, strategy.block_cls)
    name, model, container = pipelined_model(module, blocks)
    chain = chain_of(model, blocks)
    placement = observe_placement(model, container, [b for _, b in blocks], _example_call(strategy, trainer, module,
                                                                                            model))
    plan = StagePlan(spec, container, list(model.get_submodule(container)._modules), split_blocks(len(blocks), spec),
                     placement)
    mesh = strategy.device_mesh
    pp_mesh, dp_mesh = mesh["pipeline_parallel"], mesh["data_parallel"]
    rank = pp_mesh.get_local_rank()
    holders = holders_of(module, name, plan, blocks)
    trim_to_rank(model, plan, rank)
    mine = [(path, block) for i, (path, block) in enumerate(blocks) if stage_rank(plan.stage_of_block(i), spec) == rank]
    wrapped, flags = wrap_blocks(module, mine, strategy.activation_checkpointing, strategy.compile_options)
    models, pairs = stage_models(model, plan, rank, chain)
    stages = {s: PipelineStageModule(m, s, spec.num_stages, boundary) for s, (m, boundary) in models.items()}
    policy = strategy.mp_policy or policy_for_precision(trainer.precision)
    if dp_mesh.size() > 1:
        if len(stages) > 1:
            raise ValueError(f"stages_per_rank={spec.stages_per_rank} with data_parallel_size={dp_mesh.size()} is not "
                             "supported (a stage's FSDP2 root would share the rule's modules with the rank's other "
                             "stages): one stage per rank on a pipeline x data mesh")
        for block in wrapped:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        for stage in stages.values():  # its inputs as received: a rule's fp32 state stays fp32 under a bf16 policy
            fully_shard(stage, mesh=dp_mesh, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
    held = model.get_submodule(container)._modules
    for s, stage in stages.items():
        keys = [plan.keys[i] for i in plan.ranges[s]]
        if s > 0:
            held[keys[0]].register_forward_pre_hook(first_block_hook(stage), prepend=True, with_kwargs=True)
        if s < spec.num_stages - 1:
            held[keys[-1]].register_forward_hook(last_block_hook(stage))
    model.register_forward_pre_hook(outside_call_refused, prepend=True)
    shared = SharedParameters.build(holders, mesh, rank, module)
    shared.broadcast()
    last = int(pp_mesh.mesh.tolist()[stage_rank(spec.num_stages - 1, spec)])
    runner = PipelineRunner(spec, stages, model, pp_mesh.get_group(), last, strategy.root_device, shared,
                            refresh=lambda: refresh_views(pairs))
    said = [f"pipeline over {spec.size} rank{'s' if spec.size != 1 else ''} ({spec.said()}): {plan.said()}"]
    if chain is not None:
        said[0] += f", {chain[1][0].rule.name} state across the boundaries"
    if mine:
        said.append("this rank's " + strategy.blocks_said(mine, flags))
    shared_said = shared.said()
    if shared_said:
        said.append(shared_said)
    said.append(fsdp_said(dp_mesh, policy))
    return runner, said
