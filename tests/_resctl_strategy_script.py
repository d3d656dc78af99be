"""ResidualParallelStrategy runs (CPU, gloo, 2 processes) for tests/test_strategy.py.

    python tests/_resctl_strategy_script.py {tp|dp|mesh} OUT_DIR

The model is the fp64 NanoGPT of tests/_resctl_tp_script.py, built in ``configure_model`` and nothing else; each run
is a Trainer of two SGD steps (with momentum) on :func:`_resctl_tp_script.batch` (the same batch twice: the first
step moves the rule's parameters from their init, the second runs from there). Rank r writes ``{mode}_rank{r}.pt``:
``{case: {"after": full parameters after the steps, "rule_local": the rule's parameters as the rank holds them,
"applied": the strategy's line}}``.

``tp``: tensor (``tp``) and sequence (``sp``) parallel, ``tensor_parallel_size=2``: the strategy (the plan of
tests/_resctl_tp_script.py, each block checkpointed; the method from the Trainer's ResidualControlCallback) for
:data:`RULES` (``sp``: :data:`EVERY_RULE`) and, for :data:`RULES`, the hand-written recipe of docs/distributed.md
(``patch_in_configure_model``, ``parallelize_module``, ``parallelize_residuals`` in ``configure_model``), case
``(layout, method, "strategy" | "hand")``; ``"diagnostics"``: the callback's last depth profile of
:data:`OBSERVED`'s sequence-parallel run. ``dp``: ``data_parallel_size=2`` (FSDP2 per block and the root, each
rank half the batch) with the strategy's own ``method=``, each block checkpointed (and compiled, aot_eager, for
:data:`COMPILED`), case ``method``; then :data:`RESUMED` stopped after one step, saved (``sharded.ckpt``:
a distributed checkpoint; ``full.ckpt``: one file) and resumed for the second step by a new Trainer, case
``("resumed", "sharded" | "full")``. ``mesh``: 4 processes, ``data_parallel_size=2`` x ``tensor_parallel_size=2``
(FSDP2 x sequence parallel, each block checkpointed), :data:`MESH_RULE` from the strategy's ``method=``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's lightning_resctl, as conftest.py
os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from _resctl_tp_script import LR, _full, _local, _rule_names, base_model, batch, loss_of, options, plan  # noqa: E402
from lightning_resctl import (  # noqa: E402
    ResidualParallelStrategy,
    merge_rules,
    parallelize_residuals,
    patch_in_configure_model,
)
from lightning_resctl.callbacks import ResidualControlCallback  # noqa: E402

RULES = ("rescontroller", "mgr-competitive", "hc")  # compared with the hand-written recipe too
EVERY_RULE = tuple(m for m in merge_rules() if m != "mgr")  # sequence parallel ("mgr" is mgr-competitive)
COMPILED = ("hc",)
RESUMED = "mgr-competitive"
MESH_RULE = "hc"
OBSERVED = "hc"  # its diagnostics recorded under sequence parallel
OBSERVING = dict(log_every_n_steps=1, per_depth="all", histograms=False, depth_images=False)
MOMENTUM = 0.9  # an optimizer state, which a resumed run must get back
STEPS = 2
WRAPPED = "_checkpoint_wrapped_module."


class GPT(L.LightningModule):
    """``configure_model`` builds the model; ``hand``: the layout for which it also runs the hand-written recipe."""

    def __init__(self, hand: str | None = None, batch_size: int = 4):
        super().__init__()
        self.hand, self.batch_size = hand, batch_size
        self.model = None
        self.example_input_array = batch()[0]

    def configure_model(self):
        if self.model is not None:
            return
        self.model = base_model()
        if self.hand is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            tp_mesh = self.device_mesh["tensor_parallel"]
            patch_in_configure_model(self, self.model)
            parallelize_module(self.model, tp_mesh, plan(self.model, self.hand))
            parallelize_residuals(self.model, tp_mesh, sequence_parallel=self.hand == "sp")

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_of(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*batch()), batch_size=self.batch_size)


def model_plan(layout: str):
    """The plan of tests/_resctl_tp_script.py, its paths from the LightningModule."""
    return lambda module, tp_mesh: {f"model.{k}": v for k, v in plan(module.model, layout).items()}


def fit(module: GPT, strategy, callbacks=(), distributed_sampler: bool = False, steps: int = STEPS,
        ckpt_path=None, save_to=None, devices: int = 2) -> dict:
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                        callbacks=list(callbacks), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=distributed_sampler)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    params = {n.replace(WRAPPED, "").removeprefix("model."): p for n, p in module.named_parameters()}
    return {"after": {n: _full(p).detach().clone() for n, p in params.items()},
            "rule_local": {n: _local(params[n]).detach().clone()
                           for n in (m.replace(WRAPPED, "") for m in _rule_names(module.model)) if n in params},
            "applied": getattr(strategy, "applied", None), "rank": trainer.global_rank}


def run_tp(out: Path) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    result = {}
    for layout in ("tp", "sp"):
        for method in EVERY_RULE if layout == "sp" else RULES:
            observed = (layout, method) == ("sp", OBSERVED)
            callback = ResidualControlCallback(method=method, **options(method), **(OBSERVING if observed else {}),
                                               dirpath=str(out / "figures") if observed else None)
            strategy = ResidualParallelStrategy(plan=model_plan(layout), activation_checkpointing="blocks")
            result[layout, method, "strategy"] = fit(GPT(), strategy, [callback])
            if observed:
                result["diagnostics"] = callback.depth_profile
            if method not in RULES:
                continue
            callback = ResidualControlCallback(method=method, **options(method))
            hand = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
            result[layout, method, "hand"] = fit(GPT(hand=layout), hand, [callback])
    return result


def run_dp(out: Path) -> dict:
    result = {}
    for method in RULES:
        strategy = ResidualParallelStrategy(method, activation_checkpointing="blocks", **options(method),
                                            compile={"backend": "aot_eager"} if method in COMPILED else False)
        result[method] = fit(GPT(batch_size=2), strategy, distributed_sampler=True)
    for kind, distributed in (("sharded", True), ("full", False)):  # stop after one step, resume for the second
        def strategy():
            return ResidualParallelStrategy(RESUMED, activation_checkpointing="blocks", **options(RESUMED),
                                            save_distributed_checkpoint=distributed)

        path = out / f"{kind}.ckpt"
        fit(GPT(batch_size=2), strategy(), distributed_sampler=True, steps=1, save_to=path)
        result["resumed", kind] = fit(GPT(batch_size=2), strategy(), distributed_sampler=True, ckpt_path=path)
    return result


def run_mesh(out: Path) -> dict:
    """4 processes, a 2 x 2 mesh: FSDP2 over the data-parallel pairs x sequence parallel, each block checkpointed."""
    strategy = ResidualParallelStrategy(MESH_RULE, plan=model_plan("sp"), activation_checkpointing="blocks",
                                        data_parallel_size=2, tensor_parallel_size=2, **options(MESH_RULE))
    return {MESH_RULE: fit(GPT(batch_size=2), strategy, distributed_sampler=True, devices=4)}


def main(mode: str, out: Path) -> None:
    runs = {"tp": run_tp, "dp": run_dp, "mesh": run_mesh}
    if mode not in runs:
        raise ValueError(f"mode must be tp, dp or mesh, got {mode!r}")
    result = runs[mode](out)
    rank = next(iter(result.values()))["rank"]
    torch.save(result, out / f"{mode}_rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
