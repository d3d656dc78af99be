"""A tiny LightningModule (a 2-layer nanoGPT over 11 tokens) and its data, shared by the tests that train, save,
resume and reload checkpoints (imported as a sibling module: tests/ has no __init__.py)."""
from __future__ import annotations

import lightning as L
import torch
from torch import nn

from models import NanoGPT


def tiny_gpt(n_layer: int = 2) -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(vocab_size=11, block_size=8, n_layer=n_layer, n_head=2, n_embd=16)


class LitToy(L.LightningModule):
    def __init__(self, n_layer: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_gpt(n_layer)
        self.example_input_array = self.model.example_input_array

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def validation_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def toy_loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (8, 8), generator=g)
    return torch.utils.data.DataLoader(list(zip(x, x.roll(1, 1))), batch_size=4)
