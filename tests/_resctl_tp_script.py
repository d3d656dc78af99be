"""Tensor / sequence parallel runs (CPU, gloo) for tests/test_combinations_parallel.py.

    python tests/_resctl_tp_script.py {raw|lightning|recipe} OUT_DIR

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
parallel) and calls ``parallelize_residuals``, one SGD step; rank r writes ``lightning_rank{r}.pt``. Then
``configure_model`` parallelizes without patching first: the callback's refusal (``add`` and the chain rule, the
messages).

``recipe``: the whole at-scale recipe on a 2 x 2 mesh (4 processes), see :func:`run_recipe`.

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
from lightning_resctl import get_merge_rule, merge_rules, parallelize_residuals, patch_residuals  # noqa: E402
from models import NanoGPT  # noqa: E402

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
RULES = tuple(m for m in merge_rules() if m != "mgr")  # ("mgr" is mgr-competitive)
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
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

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
        for layout in ("tp", "sp"):
            model = base_model()
            parallelize_module(model, mesh, plan(model, layout))
            result["patch_after"][layout, method] = _message(
                lambda: patch_residuals(model, method=method, **options(method)))
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

    from lightning_resctl import patch_in_configure_model
    from lightning_resctl.callbacks import ResidualControlCallback
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


RECIPE_CASES = ("plain", "rescontroller", "mgr-competitive")


def run_recipe(out: Path) -> None:
    """The whole recipe on a 2 x 2 mesh (4 processes): data-parallel FSDP2 shards x sequence parallel, each block
    compiled (aot_eager) with activation checkpointing around the compiled block, bf16 MixedPrecisionPolicy. Per
    case of :data:`RECIPE_CASES` (``plain``: the unpatched model, the bf16 baseline): one forward / backward, each
    data-parallel rank on its half of :func:`batch`; rank 0 writes the full gradients (or the error)."""
    import lightning as L
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy="ddp")
    fabric.launch()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = (t.chunk(2)[mesh["dp"].get_local_rank()] for t in batch())
    result = {}
    for case in RECIPE_CASES:
        def step():
            model = (base_model() if case == "plain" else build(case)).float()
            parallelize_module(model, mesh["tp"], plan(model, "sp"))
            if case != "plain":
                parallelize_residuals(model, mesh["tp"], sequence_parallel=True)
            for i, block in enumerate(model.h):
                block.compile(backend="aot_eager")
                model.h[i] = checkpoint_wrapper(block)
                fully_shard(model.h[i], mesh=mesh["dp"], mp_policy=policy)
            fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
            loss_of(model(x), y).backward()  # FSDP2 averages the gradients over the data-parallel ranks
            return {n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).detach().clone()
                    for n, p in model.named_parameters() if p.grad is not None}

        try:
            result[case] = step()
        except Exception as err:  # noqa: BLE001 - the message is the result
            result[case] = f"{type(err).__name__}: {err}"
    if fabric.global_rank == 0:
        torch.save(result, out / "recipe_rank0.pt")


def main(mode: str, out: Path) -> None:
    if mode == "raw":
        run_raw(out)
    elif mode == "lightning":
        run_lightning(out)
    elif mode == "recipe":
        run_recipe(out)
    else:
        raise ValueError(f"mode must be raw, lightning or recipe, got {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
