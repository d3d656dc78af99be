"""Tensor / sequence parallel runs (2 CPU processes, gloo, fp64) for tests/test_combinations_parallel.py.

    python tests/_resctl_tp_script.py {raw|lightning} OUT_DIR

``raw``: Fabric's "ddp" launcher starts the 2 processes (as tests/_resctl_fabric_script.py); the model is made
parallel with the raw DTensor API. For every rule and both layouts of the residual stream (``tp``: ``ColwiseParallel``
/ ``RowwiseParallel`` MLPs, the stream replicated; ``sp``: the same plus ``SequenceParallel`` norms, the stream
sharded on the sequence between blocks), a patched NanoGPT goes through ``parallelize_module`` and
``parallelize_residuals``, one forward / backward / SGD step on a fixed batch; rank r writes
``raw_rank{r}.pt``: the logits, the full gradients, the parameters after the step (full) and the rule's own
parameters as that rank holds them. Then the refusals: patching after ``parallelize_module``, and a forward with the
rules' parameters left plain (their messages, per rule).

``lightning``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))`` with
``ResidualControlCallback``: ``configure_model`` patches (``patch_in_configure_model``), parallelizes (sequence
parallel) and calls ``parallelize_residuals``, one SGD step; rank r writes ``lightning_rank{r}.pt``. Then, last (a
failed fit ends the group), ``configure_model`` parallelizes without patching first: the callback's refusal.

The single-process references are computed by the test with :func:`build`, :func:`batch` and :func:`loss_of`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _resctl_ckpt_dist_script import randomize_rule  # noqa: E402
from models import NanoGPT  # noqa: E402
from lightning_resctl import get_merge_rule, merge_rules, parallelize_residuals, patch_residuals  # noqa: E402

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
RULES = merge_rules()
LR = 0.5


def options(method: str) -> dict:
    """The eager torch path (no background compile between the compared runs)."""
    return {"backend": "torch-eager"} if "backend" in get_merge_rule(method).option_names() else {}


def base_model() -> torch.nn.Module:
    """The fp64 NanoGPT every run starts from."""
    torch.manual_seed(0)
    return NanoGPT(**CFG).double()


def build(method: str) -> torch.nn.Module:
    """:func:`base_model` patched with ``method`` (its rule's parameters moved away from their init)."""
    model = base_model()
    randomize_rule(model, patch_residuals(model, method=method, **options(method)))
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    tok = torch.randint(0, CFG["vocab_size"], (4, CFG["block_size"] + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def plan(model: torch.nn.Module, layout: str) -> dict:
    """The parallelize_module plan. The MLPs are tensor parallel; the attention (its fused ``c_attn`` does not
    split by heads) and the tied embedding / head stay replicated. ``sp``: the stream between blocks is each rank's
    part of the sequence (``Shard(1)``): norms ``SequenceParallel``, the attention gathers its input and keeps its
    part of the output, the final norm gathers the stream."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    out = {}
    for i in range(len(model.h)):
        b = f"h.{i}"
        if layout == "tp":
            out.update({f"{b}.mlp.c_fc": ColwiseParallel(), f"{b}.mlp.c_proj": RowwiseParallel()})
            continue
        out.update({
            f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel(),
            f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True),
            f"{b}.attn.resid_dropout": PrepareModuleOutput(output_layouts=(Replicate(),),
                                                           desired_output_layouts=(Shard(1),)),
            f"{b}.mlp.c_fc": ColwiseParallel(input_layouts=Shard(1)),
            f"{b}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    if layout == "sp":
        out["h.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                        use_local_output=True)
        out["ln_f"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rule_names(model: torch.nn.Module) -> list:
    return [n for n, _ in model.named_parameters() if "_resctl" in n]


def _message(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def train_step(model: torch.nn.Module) -> dict:
    """One forward / backward / SGD step on :func:`batch`: logits, full gradients, parameters after the step (full)
    and the rule's parameters as this rank holds them."""
    x, y = batch()
    logits = model(x)
    loss_of(logits, y).backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = dict(model.named_parameters())
    return {"logits": _full(logits).detach().clone(), "grads": grads,
            "after": {n: _full(p).detach().clone() for n, p in params.items()},
            "rule_local": {n: _local(params[n]).detach().clone() for n in _rule_names(model)}}


def run_raw(out: Path) -> None:
    import lightning as L
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    result: dict = {"runs": {}, "patch_after": {}, "not_parallelized": {}}
    for layout in ("tp", "sp"):
        for method in RULES:
            model = build(method)
            parallelize_module(model, mesh, plan(model, layout))
            parallelize_residuals(model, mesh, sequence_parallel=layout == "sp")
            result["runs"][layout, method] = train_step(model)
    for method in RULES:
        model = base_model()
        parallelize_module(model, mesh, plan(model, "sp"))
        result["patch_after"][method] = _message(lambda: patch_residuals(model, method=method, **options(method)))
        model = build(method)
        parallelize_module(model, mesh, plan(model, "sp"))
        result["not_parallelized"][method] = _message(lambda: model(batch()[0]))
    torch.save(result, out / f"raw_rank{fabric.global_rank}.pt")


LIGHTNING_RULE = "mgr-competitive"


def run_lightning(out: Path) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_resctl.callbacks import ResidualControlCallback, patch_in_configure_model
    from lightning_resctl.surgery import get_patch_report

    class GPT(L.LightningModule):
        def __init__(self, patch_first: bool):
            super().__init__()
            self.patch_first = patch_first
            self.model = None

        def configure_model(self):
            if self.model is not None:
                return
            self.model = base_model()
            tp_mesh = self.device_mesh["tensor_parallel"]
            if self.patch_first:
                patch_in_configure_model(self, self.model)
                randomize_rule(self.model, get_patch_report(self.model))
            parallelize_module(self.model, tp_mesh, plan(self.model, "sp"))
            if self.patch_first:
                parallelize_residuals(self.model, tp_mesh, sequence_parallel=True)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_of(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):
            return DataLoader(TensorDataset(*batch()), batch_size=4)

    def trainer(method):
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        cb = ResidualControlCallback(method=method, log_every_n_steps=1, **options(method))
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1,
                         callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)

    module = GPT(patch_first=True)
    fit = trainer(LIGHTNING_RULE)
    fit.fit(module)
    params = dict(module.model.named_parameters())
    result = {"after": {n: _full(p).detach().clone() for n, p in params.items()},
              "rule_local": {n: _local(params[n]).detach().clone() for n in _rule_names(module.model)},
              "refused": {}}
    for method in ("add", LIGHTNING_RULE):
        result["refused"][method] = _message(lambda: trainer(method).fit(GPT(patch_first=False)))
    torch.save(result, out / f"lightning_rank{fit.global_rank}.pt")


def main(mode: str, out: Path) -> None:
    if mode == "raw":
        run_raw(out)
    elif mode == "lightning":
        run_lightning(out)
    else:
        raise ValueError(f"mode must be raw or lightning, got {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
