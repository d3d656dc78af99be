"""The distributed pieces in one home:

* :class:`ResidualParallelStrategy` (:mod:`.strategy`): Lightning's ``ModelParallelStrategy`` that patches,
  parallelizes, checkpoints, compiles, shards and pipelines the model in the order that works, and its parts: the
  plan (:mod:`.plan`), the blocks (:mod:`.blocks`), the per-block recipe (:mod:`.recipe`), the pipeline (the split
  :mod:`.stage_split`, the placement :mod:`.model_parts`, the stages :mod:`.stage_build` / :mod:`.stage_model`, the
  parameters several stages hold :mod:`.shared`, the schedule inside Lightning's loop :mod:`.pipeline`, built by
  :mod:`.pipeline_setup`; torch's private pipelining API only in :mod:`.torch_pipelining`);
* :func:`parallelize_residuals` (:mod:`.tensor_parallel`): the rules' parameters on a tensor-parallel mesh, by hand;
* :func:`patch_in_configure_model` (:mod:`.sharded`): the hand-written FSDP2 recipe's one line.

The refusals to patch a tensor-parallel model stay with the patch (``surgery/tensor_parallel_check.py``: the surgery
imports nothing above it). The names are imported on first use (``lightning_resctl.distributed.tensor_parallel``
imports no Lightning)."""
from ..runtime.lazy import lazy_exports as _lazy_exports

_EXPORTS = {
    "ResidualParallelStrategy": "strategy",
    "parallelize_residuals": "tensor_parallel",
    "patch_in_configure_model": "sharded",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
