"""Standalone Lightning run for tests/test_checkpointing.py: a chain rule under FSDP2 with activation checkpointing.

    python tests/_resctl_ckpt_dist_script.py METHOD[,METHOD...] OUT_DIR

ModelParallelStrategy(data_parallel_size=2) on CPU/gloo, 2 processes: a NanoGPT built in configure_model, patched
with METHOD, each block wrapped in ``checkpoint_wrapper`` (non-reentrant torch.utils.checkpoint), then sharded with
``fully_shard``. One training step on a fixed batch (each rank half of it); rank 0 writes the full gradients of
that step (``grads.pt``, names without the wrapper's prefix), the parameters at the step's start (``start.pt``)
and the batch (``batch.pt``), under ``OUT_DIR/METHOD``, for each METHOD in turn (one launch of the processes): the test
compares them with the non-checkpointed patched model in one process.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_resctl import patch_in_configure_model  # noqa: E402
from models import NanoGPT  # noqa: E402

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
PREFIX = "_checkpoint_wrapped_module."


def data(n: int = 4, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, CFG["vocab_size"], (n, CFG["block_size"] + 1), generator=g)
    return TensorDataset(tok[:, :-1], tok[:, 1:])


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def randomize_rule(model, report, std=0.3, seed=3):
    """Move the rule's parameters away from their init (zero-init queries would hide wrong gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


class CheckpointedGPT(L.LightningModule):
    def __init__(self, method: str, out: Path):
        super().__init__()
        self.method, self.out = method, out
        self.model = None
        self.example_input_array = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))

    def configure_model(self):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = NanoGPT(**CFG)
        report = patch_in_configure_model(self, self.model, method=self.method)
        randomize_rule(self.model, report)
        if self.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in self.model.state_dict().items()}, self.out / "start.pt")
        for i, block in enumerate(self.model.h):
            self.model.h[i] = checkpoint_wrapper(block)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        return loss_of(self.model, *batch)

    def on_before_optimizer_step(self, optimizer):
        grads = {n.replace(PREFIX, ""): p.grad.full_tensor().detach().clone()
                 for n, p in self.model.named_parameters() if p.grad is not None}
        if self.global_rank == 0:
            torch.save(grads, self.out / "grads.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        world = self.trainer.world_size
        sampler = DistributedSampler(data(), num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(data(), batch_size=4 // world, sampler=sampler)


def main(method: str, out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    L.seed_everything(0, workers=True)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(CheckpointedGPT(method, out))


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        (Path(sys.argv[2]) / name).mkdir(parents=True, exist_ok=True)
        main(name, Path(sys.argv[2]) / name)
