"""Standalone Lightning runs for tests/test_distributed_callbacks.py (DDP relaunches sys.argv).

    python tests/_resctl_dist_script.py {single|ddp|fsdp} OUT_DIR [GATING]

A tiny NanoGPT wrapped in a LightningModule trains 2 SGD steps with ResidualControlCallback(method="mgr",
log_every_n_steps=1) on a fixed token set (8 sequences; batch 4 in one process = the union of the two ranks'
batches of 2). Writes TensorBoard events under OUT_DIR/<mode>/ and, per rank, ``params_rank{r}.pt`` (the
state dict, full tensors) and ``checks_rank{r}.json``.

``fsdp``: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) on CPU/gloo; the model is
built in configure_model, patched there by ``patch_in_configure_model(self, self.model)``, then sharded
with ``fully_shard`` (no rule parameter is 0-d, which ``fully_shard`` refuses).
"""
from __future__ import annotations

import json
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
from lightning_resctl.callbacks import ResidualAblationCallback, ResidualControlCallback  # noqa: E402
from models import NanoGPT  # noqa: E402

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
STREAMS = 2  # MGR streams: with 4 merges, merges 1..3 are gated


def data(n: int = 8, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, CFG["vocab_size"], (n, CFG["block_size"] + 1), generator=g)
    return TensorDataset(tok[:, :-1], tok[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self, build: bool = True):
        super().__init__()
        self.model = NanoGPT(**CFG) if build else None
        self.example_input_array = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        # unshuffled shards: rank r gets samples r, r + 2, ... so the ranks' first batches together are the
        # single-process first batch (Lightning's own distributed sampler would shuffle)
        world = self.trainer.world_size
        sampler = DistributedSampler(data(), num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(data(), batch_size=4 // world, sampler=sampler)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        world = self.trainer.world_size
        val = data(seed=7)
        sampler = DistributedSampler(val, num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(val, batch_size=4 // world, sampler=sampler)


class ShardedLitGPT(LitGPT):
    def __init__(self):
        super().__init__(build=False)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        self.model = NanoGPT(**CFG)
        patch_in_configure_model(self, self.model)  # the one line: patch between building and sharding
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class Recorder(L.Callback):
    """Records which parameters are new (MGR) and their values at train start."""

    def on_train_start(self, trainer, pl_module):
        self.start = {n: _full(p).detach().clone() for n, p in pl_module.named_parameters()}



def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(mode: str, out: Path, gating: str = "competitive", name: str | None = None) -> None:
    L.seed_everything(0, workers=True)
    name = name or mode
    cb = ResidualControlCallback(method="mgr", log_every_n_steps=1, per_depth="all", streams=STREAMS, gating=gating)
    rec = Recorder()
    abl = ResidualAblationCallback(max_batches=1)
    logger = L.pytorch.loggers.TensorBoardLogger(save_dir=str(out), name=name, version=0)
    common = dict(
        accelerator="cpu", max_steps=2, logger=logger, callbacks=[cb, abl, rec], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        limit_val_batches=1,
        use_distributed_sampler=False,
    )
    if mode == "single":
        trainer = L.Trainer(devices=1, **common)
        module = LitGPT()
    elif mode == "ddp":
        trainer = L.Trainer(devices=2, strategy="ddp", **common)
        module = LitGPT()
    elif mode == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        trainer = L.Trainer(devices=2, strategy=strategy, **common)
        module = ShardedLitGPT()
    else:
        raise ValueError(f"mode must be single, ddp or fsdp, got {mode!r}")
    trainer.fit(module)

    from lightning_resctl.surgery import merge_sites

    rank = trainer.global_rank
    if hasattr(module.model, "reshard"):  # FSDP2 keeps the root unsharded after a forward without backward
        module.model.reshard()
    params = dict(module.named_parameters())
    state = {n: _full(p).detach().cpu().clone() for n, p in params.items()}
    torch.save(state, out / f"{name}_params_rank{rank}.pt")
    new = [n for n in params if "pool_query" in n or "gate_" in n or "forget_bias" in n]
    opt_ids = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    checks = {
        "world_size": trainer.world_size,
        "num_sites": len(merge_sites(module)),
        "methods": sorted({s.method for s in merge_sites(module)}),
        "new_params": new,
        "new_params_dtensor": [type(params[n]).__name__ == "DTensor" for n in new],
        "new_params_in_optimizer": [id(params[n]) in opt_ids for n in new],
        "new_params_changed": [not torch.equal(rec.start[n], state[n]) for n in new],
        "all_params_dtensor": all(type(p).__name__ == "DTensor" for p in params.values()),
        "depth_profile": cb.depth_profile,
        "loss_increase": abl.loss_increase,
        "base_loss": abl.base_loss,
        "finite": all(torch.isfinite(v).all().item() for v in state.values()),
    }
    (out / f"{name}_checks_rank{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:4])
