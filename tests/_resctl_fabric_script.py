"""Standalone runs for tests/test_fabric_monitor.py (Fabric's "ddp" launcher re-runs sys.argv).

    python tests/_resctl_fabric_script.py {trainer|fabric} OUT_DIR [DEVICES]

A tiny LitGPT ``GPT`` (2 sequential pre-norm layers of width 16) patched with MGR (2 streams) trains 2 SGD steps
on 8 fixed token sequences (batch 4 in one process = the union of two ranks' batches of 2), recording every step,
then measures the ablation on one validation batch of 4 (2 per rank):

* ``trainer``: a Lightning ``Trainer`` with ``ResidualControlCallback(method="mgr")`` and
  ``ResidualAblationCallback`` (one process);
* ``fabric``: ``Fabric(devices=DEVICES)`` (``strategy="ddp"`` for 2) with ``ResidualMonitor(method="mgr")``,
  ``monitor.log_to(fabric)`` every step, ``monitor.log_figures(fabric)`` and ``ablate()`` at the end.

Every run starts from the same weights (the GPT built from seed 0; MGR's own parameters start deterministic)
and writes TensorBoard events under ``OUT_DIR/<name>/version_0`` and, per rank, ``<name>_rank<r>.json`` and
``<name>_params_rank<r>.pt`` (the final weights).
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
from litgpt import GPT, Config  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_resctl import ResidualAblationCallback, ResidualControlCallback, ResidualMonitor, ablate  # noqa: E402

CONFIG = dict(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32, padded_vocab_size=32,
              parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
              intermediate_size=32)
STREAMS = 2
LR = 0.5
EXAMPLE = torch.zeros(2, 8, dtype=torch.long)
OPTIONS = dict(method="mgr", options={"streams": STREAMS}, per_depth="all", log_every_n_steps=1)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(Config(**CONFIG))


def tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, CONFIG["vocab_size"], (n, CONFIG["block_size"] + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def loss_of(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def shard(n: int, seed: int, batch: int, rank: int, world: int) -> list:
    """Rank r's batches: samples r, r + world, ... in batches of ``batch // world`` (together: the batches of one
    process, in another order)."""
    x, y = tokens(n, seed)
    idx = torch.arange(rank, n, world)
    per = batch // world
    return [(x[idx[i:i + per]], y[idx[i:i + per]]) for i in range(0, len(idx), per)]


class LitModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build()
        self.example_input_array = EXAMPLE

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        return loss_of(self.model, batch)

    def validation_step(self, batch, batch_idx):
        loss = loss_of(self.model, batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def run_trainer(out: Path, name: str) -> dict:
    cb = ResidualControlCallback(**OPTIONS)
    abl = ResidualAblationCallback(max_batches=1)
    train = DataLoader(TensorDataset(*tokens(8, 123)), batch_size=4, shuffle=False)
    val = DataLoader(TensorDataset(*tokens(4, 7)), batch_size=4, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=L.pytorch.loggers.TensorBoardLogger(
        str(out), name=name, version=0), callbacks=[cb, abl], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, limit_val_batches=1)
    module = LitModule()
    trainer.fit(module, train, val)
    return dict(rank=0, world=1, depth_profile=cb.depth_profile, loss_increase=abl.loss_increase,
                base_loss=abl.base_loss,
                state={k.removeprefix("model."): v.detach().clone() for k, v in module.state_dict().items()})


def run_fabric(out: Path, name: str, devices: int) -> dict:
    from lightning.fabric.loggers import TensorBoardLogger

    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                      loggers=TensorBoardLogger(str(out), name=name, version=0))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = build()
    monitor = ResidualMonitor(model, example_input=EXAMPLE, **OPTIONS)  # patches before the optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    for step, batch in enumerate(shard(8, 123, 4, rank, world)):
        with monitor.step(step):
            fabric.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        monitor.log_to(fabric)
    figures = monitor.log_figures(fabric)
    result = ablate(model, shard(4, 7, 4, rank, world), loss_of)
    result.log_to(fabric, step=step)  # the last step, as Lightning logs a validation at the end of it
    for logger in fabric.loggers:
        logger.finalize("success")
    return dict(rank=rank, world=world, depth_profile=monitor.depth_profile, loss_increase=result.loss_increase,
                base_loss=result.base_loss, figures=figures,
                state={k: v.detach().clone() for k, v in model.module.state_dict().items()})


def main(mode: str, out: Path, devices: int = 1, name: str | None = None) -> None:
    name = name or mode
    got = run_trainer(out, name) if mode == "trainer" else run_fabric(out, name, devices)
    rank = got.pop("rank")
    torch.save(got.pop("state"), out / f"{name}_params_rank{rank}.pt")
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1,
         sys.argv[4] if len(sys.argv) > 4 else None)
