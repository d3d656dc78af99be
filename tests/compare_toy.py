"""A user's own LightningModule and LightningDataModule (not the built-in GPT) for the compare job's tests.

``ToyLM``: a small pre-norm residual language model with dropout (so matching and resume must get the RNG
right); it logs ``val_loss`` and returns its loss. ``ToyData``: a fixed token corpus (a deterministic mix of
repeating patterns, so the loss falls), a shuffled training loader (``shuffle=True``: the order follows the global
seed) and a plain validation loader. ``KillOnce``: a callback that kills the process with SIGKILL at a given
step of a given run of the process, once (a marker file remembers it), to test ``--resume``; ``TermOnce``: the same
with SIGTERM (what a cluster sends before pre-empting), during a training step or a validation. ``BatchLog``: appends
every training batch's fingerprint to a file, one line per step (run index in the process, step, digest).
``MixerLM``: ``ToyLM`` with its blocks as modules of one class (a causal MLP-mixer), for the strategy's per-block
compile; ``GraphsPerRun``: the graphs dynamo compiles with the ``"resctl_counting"`` backend, per run and step.
"""
from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ToyLM(L.LightningModule):
    def __init__(self, vocab: int = 24, dim: int = 16, depth: int = 3, dropout: float = 0.1, lr: float = 0.01,
                 seq: int = 12):
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout),
                                                nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)
        self.example_input_array = torch.zeros(2, seq, dtype=torch.long)

    def forward(self, idx):
        x = self.emb(idx)
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return self.head(x)

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)



class MixerBlock(nn.Module):
    """A causal MLP-mixer block: a token-mixing linear map masked to the past, then a channel MLP, each added to the
    stream (two merges per block)."""

    def __init__(self, dim: int, seq: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Linear(seq, seq)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq)))

    def forward(self, x):
        mixed = nn.functional.linear(self.norm1(x).transpose(1, 2), self.tokens.weight * self.causal, self.tokens.bias)
        x = x + mixed.transpose(1, 2)
        x = x + self.mlp(self.norm2(x))
        return x


class MixerLM(ToyLM):
    """:class:`ToyLM` with its residual blocks as modules of one class (:class:`MixerBlock`), which
    ResidualParallelStrategy finds, compiles and checkpoints one by one."""

    def __init__(self, vocab: int = 24, dim: int = 16, depth: int = 4, lr: float = 0.01, seq: int = 12):
        super().__init__(vocab=vocab, dim=dim, depth=1, dropout=0.0, lr=lr, seq=seq)
        self.save_hyperparameters()
        del self.norms, self.mlps
        self.blocks = nn.ModuleList(MixerBlock(dim, seq) for _ in range(depth))

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

class ToyData(L.LightningDataModule):
    def __init__(self, vocab: int = 24, seq: int = 12, train_size: int = 96, val_size: int = 16, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage):
        hp = self.hparams
        g = torch.Generator().manual_seed(1234)  # the corpus itself is fixed; only the order follows the seed
        n = hp.train_size + hp.val_size
        start = torch.randint(0, hp.vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        tokens = (start + step * torch.arange(hp.seq + 1)) % hp.vocab
        self.train_set = TensorDataset(tokens[:hp.train_size, :-1], tokens[:hp.train_size, 1:])
        self.val_set = TensorDataset(tokens[hp.train_size:, :-1], tokens[hp.train_size:, 1:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class KillOnce(Callback):
    """SIGKILL this process when its ``run``-th fit reaches ``step`` and ``marker`` does not exist yet (it is
    created first)."""

    fits = 0  # fits started in this process

    def __init__(self, step: int, marker: str, run: int = 1):
        self.step, self.marker, self.run = step, Path(marker), run

    def on_fit_start(self, trainer, pl_module):
        KillOnce.fits += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if KillOnce.fits == self.run and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


class TermOnce(Callback):
    """Send this process SIGTERM once (``marker`` remembers it) in its ``run``-th fit: during the training step that
    makes ``global_step`` reach ``step`` (``where="train"``), during the first batch of the validation at ``step``
    (``where="validation"``; the validation must have more batches, so that the signal comes mid-way), in
    ``on_train_epoch_end`` of the epoch that ends at ``step`` (``where="epoch_end"``), or in the fit's ``setup``,
    before Lightning installs its SIGTERM handler (``where="setup"``)."""

    fits = 0

    def __init__(self, step: int, marker: str, run: int = 1, where: str = "train"):
        if where not in ("train", "validation", "epoch_end", "setup"):
            raise ValueError(f"where must be 'train', 'validation', 'epoch_end' or 'setup', got {where!r}")
        self.step, self.marker, self.run, self.where = step, Path(marker), run, where

    def setup(self, trainer, pl_module, stage):
        if stage == "fit":
            TermOnce.fits += 1
            if self.where == "setup" and TermOnce.fits == self.run and not self.marker.exists():
                self._term()

    def _term(self):
        self.marker.write_text("terminated")
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (self.where == "train" and TermOnce.fits == self.run and trainer.global_step == self.step - 1
                and not self.marker.exists()):
            self._term()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if (self.where == "validation" and TermOnce.fits == self.run and not trainer.sanity_checking
                and trainer.global_step == self.step and batch_idx == 0 and not self.marker.exists()):
            self._term()


    def on_train_epoch_end(self, trainer, pl_module):
        if (self.where == "epoch_end" and TermOnce.fits == self.run and trainer.global_step == self.step
                and not self.marker.exists()):
            self._term()


class BatchLog(Callback):
    """Append ``fit index, step, digest of the batch`` to ``path`` at every training step."""

    fits = 0

    def __init__(self, path: str):
        self.path = Path(path)

    def on_fit_start(self, trainer, pl_module):
        BatchLog.fits += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in batch)).hexdigest()[:12]
        with self.path.open("a") as f:
            f.write(f"{BatchLog.fits} {trainer.global_step} {digest}\n")


class GraphsPerRun(Callback):
    """The graphs compiled with the ``"resctl_counting"`` backend (aot_eager, counted), per run of the process:
    ``runs[i]`` is ``[(stage, graphs compiled so far in the run)]`` at each training step's start, each validation's
    end and the fit's end."""

    runs: list = []

    def _note(self, stage: str) -> None:
        GraphsPerRun.runs[-1].append((stage, COUNTING.frame_count - self._start))

    def on_fit_start(self, trainer, pl_module):
        self._start = COUNTING.frame_count
        GraphsPerRun.runs.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._note(f"step {trainer.global_step}")

    def on_validation_end(self, trainer, pl_module):
        self._note(f"validation at {trainer.global_step}")

    def on_fit_end(self, trainer, pl_module):
        self._note("end")


def _register_counting_backend():
    import torch._dynamo
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.register_backend(counter, name="resctl_counting")
    return counter


COUNTING = _register_counting_backend()
