"""Standalone 2-process CPU DDP run for tests/test_surgery_lightning.py (strategy="ddp" relaunches sys.argv).

    python tests/ddp_surgery_script.py OUT_DIR [METHOD[,METHOD...]]

For each METHOD in turn (default "mgr"; one launch of the two processes serves them all), a tiny NanoGPT in a
LightningModule is patched with it from a Callback's ``setup`` (before ``configure_optimizers`` and before DDP wraps
it) and trains 3 SGD steps on 2 gloo processes. Each rank writes ``{method}_rank{r}.pt``: the parameters the patch
added, at init and after training, the names of the optimizer's parameters, the number of patched sites and whether
the model that DDP wrapped is the patched one.
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
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals  # noqa: E402
from models import NanoGPT  # noqa: E402


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = NanoGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
        self.example_input_array = torch.randint(0, 32, (2, 8))

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class PatchInSetup(L.Callback):
    def __init__(self, method: str = "mgr"):
        self.init = None
        self.method = method
        self.new = []

    def setup(self, trainer, pl_module, stage):
        self.new = patch_residuals(pl_module, method=self.method).new_parameters
        self.init = {n: pl_module.get_parameter(n).detach().clone() for n in self.new}


def main(out_dir: str, method: str = "mgr") -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0)))
    model = LitGPT()
    cb = PatchInSetup(method)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    trainer.fit(model, DataLoader(data, batch_size=4))
    names = {id(p): n for n, p in model.named_parameters()}
    in_opt = sorted(names[id(p)] for g in trainer.optimizers[0].param_groups for p in g["params"])
    wrapped = trainer.strategy.model
    inner = getattr(wrapped, "module", wrapped)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "sites": len(get_patch_report(model).sites),
        "merge_sites": len(merge_sites(model)),
        "optimizer_params": in_opt,
        "wrapped_is_patched_model": inner is model or getattr(inner, "module", None) is model,
        "init": cb.init,
        "final": {n: model.get_parameter(n).detach().clone() for n in cb.new},
        "all_final": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    torch.save(result, Path(out_dir) / f"{method}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for name in (sys.argv[2] if len(sys.argv) > 2 else "mgr").split(","):
        main(sys.argv[1], name)
