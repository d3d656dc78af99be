"""Pipeline-parallel runs of ResidualParallelStrategy (CPU, gloo) for tests/test_pipeline.py.

    python tests/_resctl_pipeline_script.py {pp2|pp4|mesh} OUT_DIR

The model is a 4-block fp64 NanoGPT (:data:`CFG`), built in the LightningModule's ``__init__``; each run is a Trainer
of two SGD steps (with momentum) on :func:`batch` (the same 4 rows twice), the rule from the strategy's ``method=``.
Rank r writes ``{mode}_rank{r}.pt``: ``{case: {"state": the state dict this rank holds (full tensors), "losses": the
loss of each step as the strategy returned it, "sent": what each stage sent per microbatch, "applied": the
strategy's line}}``.

``pp2``: 2 processes, 2 stages (one per rank), every rule, 4 microbatches, ``"gpipe"`` and ``"1f1b"`` alternating
over the rules (:func:`schedule_of`); then 4 stages on the 2 ranks (``"interleaved-1f1b"``) for :data:`INTERLEAVED`,
and :data:`MODULEDICT_RULE` on a model whose blocks are an ``nn.ModuleDict`` (no ``block_cls``), validated after
each step (its loss logged with ``sync_dist``). ``pp4``: 4
processes, 4 stages, every rule, each under the other schedule than at 2 stages. ``mesh``: 4 processes, pipeline 2 x
data 2 (FSDP2 per block and per stage, each block checkpointed and compiled, aot_eager) for :data:`MESH_RULE`; then
the same stopped after one step, saved (a distributed checkpoint: ``mesh.ckpt``) and resumed for the second by a new
Trainer (case ``"resumed"``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_resctl import ResidualParallelStrategy, get_merge_rule, merge_rules  # noqa: E402
from models import NanoGPT  # noqa: E402

CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
EVERY_RULE = tuple(m for m in merge_rules() if m != "mgr")  # ("mgr" is mgr-competitive)
INTERLEAVED = ("mgr-competitive", "attnres-block")
MODULEDICT_RULE = "hc"
MESH_RULE = "mgr-competitive"
LR, MOMENTUM, STEPS, ROWS, MICROBATCHES = 0.5, 0.9, 2, 4, 4


def options(method: str) -> dict:
    """The eager torch path (no background compile between the compared runs)."""
    return {"backend": "torch-eager"} if "backend" in get_merge_rule(method).option_names() else {}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    tok = torch.randint(0, CFG["vocab_size"], (ROWS, CFG["block_size"] + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class LlamaLike(nn.Module):
    """torchtitan's layout: ``layers`` an ``nn.ModuleDict`` keyed by the layer index (NanoGPT's blocks and
    embeddings, its weights: a stage keeps its parameters' names)."""

    def __init__(self):
        super().__init__()
        gpt = NanoGPT(**CFG)
        self.tok_embeddings, self.pos_embeddings, self.norm, self.output = gpt.wte, gpt.wpe, gpt.ln_f, gpt.lm_head
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(gpt.h)})

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def base_model(kind: str = "gpt") -> nn.Module:
    """The fp64 model every run (and the test's reference) starts from."""
    torch.manual_seed(0)
    return (LlamaLike() if kind == "moduledict" else NanoGPT(**CFG)).double()


class GPT(L.LightningModule):
    """The model built in ``__init__``; ``training_step`` calls it once, as in one process."""

    def __init__(self, kind: str = "gpt", rows: int = ROWS):
        super().__init__()
        self.model = base_model(kind)
        self.rows = rows
        self.example_input_array = batch()[0][:2]

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_of(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*batch()), batch_size=self.rows)


class Validated(GPT):
    """With a validation step, its loss logged with ``sync_dist`` (a reduction every rank must join)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_of(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self):
        return DataLoader(TensorDataset(*batch()), batch_size=self.rows)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fit(method: str, devices: int, steps: int = STEPS, kind: str = "gpt", rows: int = ROWS, ckpt_path=None,
        save_to=None, validate: bool = False, **strategy_args) -> dict:
    strategy = ResidualParallelStrategy(method, **options(method), **strategy_args)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, callbacks=[losses],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=rows != ROWS, num_sanity_val_steps=0)
    module = (Validated if validate else GPT)(kind, rows)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    state = {n.removeprefix("model."): _full(t).detach().clone() for n, t in module.state_dict().items()}
    return {"state": state, "losses": losses.losses, "sent": strategy.pipeline.sent, "applied": strategy.applied,
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()}, "rank": trainer.global_rank}


def run_pp2(out: Path) -> dict:
    result = {}
    for method in EVERY_RULE:
        schedule = schedule_of(method, 2)
        result[method, schedule, 2] = fit(method, 2, pipeline_parallel_size=2, schedule=schedule,
                                          microbatches=MICROBATCHES)
    for method in INTERLEAVED:
        result[method, "interleaved-1f1b", 4] = fit(method, 2, pipeline_parallel_size=2, schedule="interleaved-1f1b",
                                                    microbatches=MICROBATCHES)
    result["moduledict"] = fit(MODULEDICT_RULE, 2, kind="moduledict", validate=True, pipeline_parallel_size=2,
                               microbatches=MICROBATCHES)
    return result


def run_pp4(out: Path) -> dict:
    return {(method, schedule_of(method, 4), 4): fit(method, 4, pipeline_parallel_size=4,
                                                     schedule=schedule_of(method, 4), microbatches=MICROBATCHES)
            for method in EVERY_RULE}


def schedule_of(method: str, stages: int) -> str:
    """GPipe or 1F1B, alternating over the rules, the other one at 4 stages than at 2: each rule runs both."""
    return ("gpipe", "1f1b")[(EVERY_RULE.index(method) + (stages == 4)) % 2]


def run_mesh(out: Path) -> dict:
    """Pipeline 2 x data 2: FSDP2, each block checkpointed and compiled; then stopped, saved and resumed."""
    recipe = dict(pipeline_parallel_size=2, data_parallel_size=2, microbatches=2, activation_checkpointing="blocks",
                  compile={"backend": "aot_eager"})
    result = {"whole": fit(MESH_RULE, 4, rows=ROWS // 2, **recipe)}
    path = out / "mesh.ckpt"
    fit(MESH_RULE, 4, steps=1, rows=ROWS // 2, save_to=path, **recipe)
    result["resumed"] = fit(MESH_RULE, 4, rows=ROWS // 2, ckpt_path=path, save_to=out / "resumed.ckpt", **recipe)
    return result


def main(mode: str, out: Path) -> None:
    runs = {"pp2": run_pp2, "pp4": run_pp4, "mesh": run_mesh}
    if mode not in runs:
        raise ValueError(f"mode must be pp2, pp4 or mesh, got {mode!r}")
    result = runs[mode](out)
    rank = next(iter(result.values()))["rank"]
    torch.save(result, out / f"{mode}_rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
