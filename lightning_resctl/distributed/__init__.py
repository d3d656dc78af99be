"""The distributed recipe as one Trainer argument: :class:`ResidualParallelStrategy` (Lightning's
``ModelParallelStrategy`` that patches, parallelizes, checkpoints, compiles and shards the model in the order that
works) and its parts: the plan (:mod:`.plan`), the blocks (:mod:`.blocks`), the per-block recipe (:mod:`.recipe`).

The pieces below it stay where the layers put them: ``parallelize_residuals`` and the refusal to patch a
tensor-parallel model are the surgery's (``surgery/tensor_parallel.py``: the patch itself refuses), and
``patch_in_configure_model`` is the callbacks' (``callbacks/sharded.py``: the hand-written recipe's one line)."""
from .strategy import ResidualParallelStrategy

__all__ = ["ResidualParallelStrategy"]
