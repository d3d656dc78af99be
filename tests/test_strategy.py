"""ResidualParallelStrategy (issue 46): the recipe of docs/distributed.md as one Trainer argument.

Three groups of gloo processes run at once (tests/_resctl_strategy_script.py): tensor and sequence parallel (2
processes), where the strategy's run and the hand-written recipe's (``configure_model`` with
``patch_in_configure_model``, ``parallelize_module``, ``parallelize_residuals``) must give the same parameters after
two SGD steps, for rescontroller, mgr-competitive and hc, and every rule sequence parallel; data parallel (2
processes: FSDP2 per block and the root, each block checkpointed, hc's compiled), with a checkpoint saved and
resumed; a 2 x 2 mesh (4 processes: FSDP2 x sequence parallel). Every fp64 run is also compared with the patched
model trained in this process by hand. In this process (a one-rank process group): the strategy with the whole
recipe against a plain Trainer with the callback, and the refusals, each naming the argument.
"""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn

import _resctl_strategy_script as strategy_script
import _resctl_tp_script as script
from lightning_resctl import ResidualParallelStrategy, merge_sites, patch_residuals
from lightning_resctl.callbacks import ResidualControlCallback
from lightning_resctl.distributed.blocks import find_blocks
from lightning_resctl.distributed.plan import sequence_parallel_of
from models import PreNormBlock
from processes import start_runs, wait_for_runs
from test_combinations_parallel import assert_close

REL = 1e-12  # fp64: the parallel runs sum the same products in another order
RANKS = {"tp": 2, "dp": 2, "mesh": 4}  # the process groups of tests/_resctl_strategy_script.py, run at once


def reference(method: str, steps: int = strategy_script.STEPS) -> dict:
    """The patched model trained in this process by hand: ``steps`` SGD steps on the batch."""
    model = script.base_model()
    patch_residuals(model, method=method, **script.options(method))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR, momentum=strategy_script.MOMENTUM)
    for _ in range(steps):
        script.loss_of(model(script.batch()[0]), script.batch()[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"start": start, "after": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy")
    procs = start_runs(strategy_script.__file__, {mode: (mode, out) for mode in RANKS}, LIGHTNING_RESCTL_COMPILE="0")
    references = {method: reference(method) for method in strategy_script.EVERY_RULE}  # meanwhile
    wait_for_runs(procs, timeout=400)
    loaded = {f"{mode}{r}": torch.load(out / f"{mode}_rank{r}.pt", weights_only=False)
              for mode, ranks in RANKS.items() for r in range(ranks)}
    return {**loaded, "single": references, "out": out}


def assert_rule_moved_and_ranks_agree(rank0: dict, rank1: dict, start: dict, what: str) -> None:
    assert rank0, f"{what}: no rule parameters recorded"
    for name, p in rank0.items():
        assert torch.equal(p, rank1[name]), f"{what} {name}: the ranks' copies differ"
    assert any(not torch.equal(p, start[name]) for name, p in rank0.items()), f"{what}: the rule did not move"


@pytest.mark.parametrize("layout", ["tp", "sp"], ids=["tensor-parallel", "sequence-parallel"])
def test_tensor_and_sequence_parallel_equal_the_hand_written_recipe(runs, layout):
    """The strategy (plan given, the stream's layout read from it, each block checkpointed) and the hand-written
    recipe: the same parameters after two steps, both equal to one process's, both ranks holding one rule."""
    for method in strategy_script.RULES:
        want = runs["single"][method]
        for r in (0, 1):
            got, hand = (runs[f"tp{r}"][layout, method, kind] for kind in ("strategy", "hand"))
            assert_close(got["after"], hand["after"], f"{method} {layout} strategy vs hand-written")
            assert_close(got["after"], want["after"], f"{method} {layout} strategy vs one process")
        said = runs["tp0"][layout, method, "strategy"]["applied"]
        layout_said = "sequence parallel" if layout == "sp" else "tensor parallel"
        assert f"{method} patch (callback) · {layout_said} (read from the plan), rule parameters on the mesh" in said
        assert "2 blocks (Block), 2 checkpointed" in said
        if method != "rescontroller":  # rescontroller has no parameters
            rank0, rank1 = (runs[f"tp{r}"][layout, method, "strategy"]["rule_local"] for r in (0, 1))
            assert_rule_moved_and_ranks_agree(rank0, rank1, want["start"], f"{method} {layout}")


def test_every_rule_sequence_parallel_under_the_strategy_equals_one_process(runs):
    """Every rule, sequence parallel through the strategy: one process's parameters after two steps, both ranks
    holding one copy of a rule's parameters (a chain's, or a per-merge rule's: laurel, ddl)."""
    for method in strategy_script.EVERY_RULE:
        want = runs["single"][method]
        for r in (0, 1):
            assert_close(runs[f"tp{r}"]["sp", method, "strategy"]["after"], want["after"], f"{method} sp")
        if any("_resctl" in name for name in want["start"]):
            rank0, rank1 = (runs[f"tp{r}"]["sp", method, "strategy"]["rule_local"] for r in (0, 1))
            assert_rule_moved_and_ranks_agree(rank0, rank1, want["start"], f"{method} sp")


def test_the_callbacks_diagnostics_under_sequence_parallel_equal_one_process(runs, one_rank, tmp_path):
    """ResidualControlCallback's depth profile of the sequence-parallel run (both ranks) equals a plain Trainer's
    in one process: ``param_grad_rms`` too, whose branch parameters have sharded (Colwise / Rowwise) and ``Partial``
    (SequenceParallel norms) gradients — the RMS of the reduced gradient, not of each rank's part."""
    callback = ResidualControlCallback(method=strategy_script.OBSERVED, **strategy_script.OBSERVING,
                                       dirpath=str(tmp_path))
    fit_here(Built(), None, [callback])
    want = callback.depth_profile
    for r in (0, 1):
        got = runs[f"tp{r}"]["diagnostics"]
        assert got.keys() == want.keys()
        for family, values in want.items():
            assert torch.allclose(torch.tensor(got[family]), torch.tensor(values), rtol=1e-10, atol=0,
                                  equal_nan=True), (family, got[family], values)


def test_data_parallel_equals_one_process(runs):
    """data_parallel_size=2 (FSDP2 per block and the root, each rank half the batch, each block checkpointed; hc's
    blocks compiled too), the rule from the strategy's own method=: one process's parameters after two steps."""
    for method in strategy_script.RULES:
        for r in (0, 1):
            assert_close(runs[f"dp{r}"][method]["after"], runs["single"][method]["after"], f"{method} data parallel")
        said = runs["dp0"][method]["applied"]
        assert f"{method} patch (strategy)" in said and "FSDP2 over 2 ranks" in said, said
        assert ("compiled one by one" in said) == (method in strategy_script.COMPILED), said


def test_the_2x2_mesh_equals_one_process(runs):
    """4 processes: FSDP2 over the data-parallel pairs x sequence parallel, each block checkpointed: every rank
    holds one process's parameters after two steps."""
    method = strategy_script.MESH_RULE
    for r in range(RANKS["mesh"]):
        assert_close(runs[f"mesh{r}"][method]["after"], runs["single"][method]["after"], f"{method} rank {r}")
    said = runs["mesh0"][method]["applied"]
    assert "sequence parallel (read from the plan)" in said and "FSDP2 over 2 ranks" in said, said


def test_a_checkpoint_saved_under_the_strategy_resumes_to_the_uninterrupted_run(runs):
    """Stopped after one step, saved by the Trainer (a distributed checkpoint, and one full file), resumed by a
    new Trainer and strategy for the second step: the uninterrupted run's parameters (the momentum buffers
    restored too)."""
    want = runs["dp0"][strategy_script.RESUMED]["after"]
    for kind in ("sharded", "full"):
        for r in (0, 1):
            assert_close(runs[f"dp{r}"]["resumed", kind]["after"], want, f"resumed from the {kind} checkpoint")
    assert (runs["out"] / "sharded.ckpt").is_dir() and (runs["out"] / "full.ckpt").is_file()


def test_the_full_checkpoint_loads_into_a_single_process_patched_model(runs):
    """The strategy's one-file checkpoint (after one step, FSDP2 and checkpoint_wrapper on the way) loads into an
    unpatched model of this process with patch_from_state_dict: the rule, and one process's step."""
    from lightning_resctl import patch_from_state_dict

    checkpoint = torch.load(runs["out"] / "full.ckpt", weights_only=False)
    module = Built()
    patch_from_state_dict(module, checkpoint["state_dict"])
    assert {s.method for s in merge_sites(module)} == {strategy_script.RESUMED}
    got = {n.removeprefix("model."): p for n, p in module.named_parameters()}
    assert_close(got, reference(strategy_script.RESUMED, steps=1)["after"], "loaded in one process")


# ---------------------------------------------------------------------------------------------- in this process
@pytest.fixture(scope="module")
def one_rank():
    """The Trainers of this module run in this process on a one-rank gloo group, destroyed at the end, with the
    environment put back (Lightning sets MASTER_PORT and the like there: a later test's subprocess would inherit a
    port this process took)."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


class Built(strategy_script.GPT):
    """The model built in ``__init__`` (no ``configure_model``)."""

    def __init__(self):
        super().__init__()
        self.model = script.base_model()


def fit_here(module, strategy=None, callbacks=(), max_steps=strategy_script.STEPS):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy or "auto", max_steps=max_steps,
                        callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return {n.replace(strategy_script.WRAPPED, "").removeprefix("model."): script._full(p).detach().clone()
            for n, p in module.named_parameters()}


def test_one_process_whole_recipe_equals_a_plain_trainer(one_rank):
    """One process, the model built in __init__: the strategy with the sequence-parallel plan (a one-rank mesh),
    each block checkpointed and compiled (dynamo only: the data-parallel run compiles with aot_eager), trains hc to
    the parameters of a plain Trainer with ResidualControlCallback, and of the patched model trained by hand."""
    torch._dynamo.reset()
    strategy = ResidualParallelStrategy(plan=strategy_script.model_plan("sp"), activation_checkpointing="blocks",
                                        compile={"backend": "eager"})
    got = fit_here(Built(), strategy, [ResidualControlCallback(method="hc")])
    plain = fit_here(Built(), None, [ResidualControlCallback(method="hc")])
    assert_close(got, plain, "strategy vs plain Trainer")
    assert_close(got, reference("hc")["after"], "strategy vs by hand")
    assert strategy.applied.startswith("ResidualParallelStrategy: hc patch (callback) · sequence parallel (read "
                                       "from the plan)"), strategy.applied
    torch._dynamo.reset()


def test_fullgraph_blocks_with_the_checkpoint_inside_equal_a_plain_trainer(one_rank):
    """compile={"fullgraph": True} with checkpointing: the checkpoint goes inside each compiled block (the only order
    where a chain rule compiles in one graph; around it, hc is refused when the block first compiles), and hc trains
    to the plain Trainer's parameters."""
    torch._dynamo.reset()
    strategy = ResidualParallelStrategy("hc", activation_checkpointing="blocks",
                                        compile={"backend": "eager", "fullgraph": True})
    module = Built()
    got = fit_here(module, strategy)
    assert_close(got, reference("hc")["after"], "fullgraph blocks vs by hand")
    assert all(type(b).__name__ == "CheckpointWrapper" and b._compiled_call_impl is not None for b in module.model.h)
    torch._dynamo.reset()


def test_which_blocks_are_checkpointed_and_the_precision_policy():
    from lightning_resctl.distributed.recipe import checkpointed, policy_for_precision

    blocks = [(f"h.{i}", nn.Linear(2, 2)) for i in range(5)]
    assert checkpointed(blocks, None) == [False] * 5 and checkpointed(blocks, "blocks") == [True] * 5
    assert checkpointed(blocks, 2) == [True, False, True, False, True]
    assert checkpointed(blocks, lambda name, block: name.endswith("3")) == [False, False, False, True, False]
    bf16 = policy_for_precision("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert policy_for_precision("32-true").param_dtype is None and policy_for_precision("bf16-true").param_dtype is None


def test_an_observing_callback_leaves_the_patch_to_the_strategy(one_rank, tmp_path):
    """ResidualControlCallback() (method=None: observe) with ResidualParallelStrategy("mgr-competitive"): the
    strategy's rule is patched (the observer would otherwise patch "add" first, to find the merges)."""
    module = Built()
    fit_here(module, ResidualParallelStrategy("mgr-competitive", backend="torch-eager"),
             [ResidualControlCallback(dirpath=str(tmp_path), log_every_n_steps=1)], max_steps=1)
    assert {s.method for s in merge_sites(module)} == {"mgr-competitive"}


def test_compare_runs_under_the_strategy_from_the_yaml(one_rank, tmp_path, caplog):
    """``lightning-resctl compare`` with ``trainer.strategy`` in its YAML (class_path / init_args): every run of the
    job trains under ResidualParallelStrategy, the compare job's callback giving the method."""
    import yaml

    from lightning_resctl.compare import cli

    config = {"model": {"class_path": "compare_toy.ToyLM", "init_args": {"dim": 16, "depth": 2}},
              "data": {"class_path": "compare_toy.ToyData", "init_args": {"train_size": 16}},
              "trainer": {"max_steps": 2, "val_check_interval": 2, "check_val_every_n_epoch": None,
                          "log_every_n_steps": 1, "accelerator": "cpu", "devices": 1,
                          "strategy": {"class_path": "lightning_resctl.ResidualParallelStrategy",
                                       "init_args": {"activation_checkpointing": "blocks",
                                                     "block_cls": "torch.nn.Sequential"}}},
              "compare": {"methods": ["plain", "mgr-competitive"], "seeds": 1, "cost_rounds": 1, "cost_warmup": 1,
                          "threads": 1, "depth_images": False, "progress_bar": False, "checkpoint_every_min": 0}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with caplog.at_level("INFO", logger="lightning_resctl"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_RESCTL_COMPILE", "0")
        assert cli.main(["--config", str(path), "--out", str(tmp_path / "out")]) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ResidualParallelStrategy:")]
    assert any(line.startswith("ResidualParallelStrategy: mgr-competitive patch (callback)") for line in said), said
    assert all("2 blocks (Sequential), 2 checkpointed" in line for line in said) and len(said) >= 2, said
    assert (tmp_path / "out" / "summary.json").is_file()



def _compiling_compare_job(tmp_path, depth: int) -> list:
    """``compare`` (plain and mgr-competitive) with ``trainer.strategy`` compiling and checkpointing each block (the
    YAML of issue 54: a causal MLP-mixer of ``depth`` blocks), validation every 3 steps, the diagnostics every 2, the
    final ablation; dynamo's recompile limit raises. :class:`compare_toy.GraphsPerRun`'s counts, per run."""
    import yaml

    from compare_toy import GraphsPerRun
    from lightning_resctl.compare import cli

    config = {"model": {"class_path": "compare_toy.MixerLM", "init_args": {"dim": 16, "depth": depth}},
              "data": {"class_path": "compare_toy.ToyData", "init_args": {"train_size": 48}},
              "trainer": {"max_steps": 6, "val_check_interval": 3, "check_val_every_n_epoch": None,
                          "limit_val_batches": 1, "accelerator": "cpu", "devices": 1,
                          "callbacks": [{"class_path": "compare_toy.GraphsPerRun"}],
                          "strategy": {"class_path": "lightning_resctl.ResidualParallelStrategy",
                                       "init_args": {"activation_checkpointing": "blocks",
                                                     "compile": {"backend": "resctl_counting"}}}},
              "compare": {"methods": ["plain", "mgr-competitive"], "seeds": 1, "cost_rounds": 1, "cost_warmup": 1,
                          "diagnostics_every_n_steps": 2, "threads": 1, "depth_images": False,
                          "progress_bar": False, "checkpoint_every_min": 0}}
    path = tmp_path / f"job{depth}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    GraphsPerRun.runs.clear()
    with pytest.MonkeyPatch.context() as mp, torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        mp.setenv("LIGHTNING_RESCTL_COMPILE", "0")
        assert cli.main(["--config", str(path), "--out", str(tmp_path / f"out{depth}")]) == 0
    assert len(GraphsPerRun.runs) == 2, GraphsPerRun.runs
    return [dict(run) for run in GraphsPerRun.runs]


def test_a_compare_job_under_the_compiling_strategy_compiles_its_graphs_once(one_rank, tmp_path):
    """No run of the job reaches dynamo's recompile limit (it raises here: the issue's run did, at the block's
    forward), every graph is compiled by the first validation — the steps after it (logging steps, whose diagnostics
    observe the merges; the next validation; the final ablation) reuse the graphs or run eagerly — and a run compiles
    the same number of graphs at 4 blocks and at 6 (a constant per kind of block, not one per block)."""
    at = {depth: _compiling_compare_job(tmp_path, depth) for depth in (4, 6)}
    for depth, runs in at.items():
        for method, run in zip(("plain", "mgr-competitive"), runs):
            assert 0 < run["validation at 3"] == run["end"], (depth, method, run)
    assert [run["end"] for run in at[4]] == [run["end"] for run in at[6]], at

class ParallelizesItself(strategy_script.GPT):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


REFUSED_AT_SETUP = {
    "plan names no module": (
        lambda: ResidualParallelStrategy("hc", plan={"model.h.*.nope": _colwise()}),
        None, ValueError, r"plan\['model\.h\.\*\.nope'\] names no module of GPT"),
    "block predicate matches nothing": (
        lambda: ResidualParallelStrategy("hc", block_cls=lambda name, module: name == "nowhere"),
        None, ValueError, r"block_cls=<function .*> matches no module of GPT"),
    "mesh larger than the world": (
        lambda: ResidualParallelStrategy("hc", plan={"model.h.*.mlp.c_fc": _colwise()}, tensor_parallel_size=2),
        None, ValueError, r"data_parallel_size=1 x tensor_parallel_size=2 needs 2 processes, more than the world's 1"),
    "model parallelized already": (
        lambda: ResidualParallelStrategy("hc"), ParallelizesItself, RuntimeError,
        r"parallel already .*fully_shard was applied to 'model'.*configure_model only builds the model"),
    "strategy and callback disagree": (
        lambda: ResidualParallelStrategy("hc"), "mgr-competitive", ValueError,
        r"ResidualParallelStrategy\(method='hc'.*ResidualControlCallback\(method='mgr-competitive'.*disagree"),
    "sequence parallel cannot be told": (
        lambda: ResidualParallelStrategy("hc", plan={"model.h.0": _prepare(0)}), None, ValueError,
        r"cannot tell from plan= whether the residual stream .* pass sequence_parallel=True"),
}


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def _prepare(dim):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_layouts=(Shard(dim),), desired_input_layouts=(Replicate(),))


@pytest.mark.parametrize("case", list(REFUSED_AT_SETUP))
def test_wrong_inputs_are_refused_naming_the_argument(one_rank, case):
    make, extra, error, message = REFUSED_AT_SETUP[case]
    module = (extra or strategy_script.GPT)() if not isinstance(extra, str) else strategy_script.GPT()
    callbacks = [ResidualControlCallback(method=extra)] if isinstance(extra, str) else []
    with pytest.raises(error, match=message):
        fit_here(module, make(), callbacks, max_steps=1)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(plan=[1]), TypeError, "plan must be a dict"),
    (dict(plan={"h.0": "colwise"}), TypeError, r"plan\['h.0'\] must be a ParallelStyle"),
    (dict(activation_checkpointing="all"), ValueError, "activation_checkpointing must be None, 'blocks'"),
    (dict(activation_checkpointing=0), ValueError, "activation_checkpointing must be"),
    (dict(compile="yes"), TypeError, "compile must be True, False or a dict"),
    (dict(block_cls=3), TypeError, "block_cls must be an nn.Module class"),
    (dict(block_cls="torch.nn.Nope"), TypeError, "block_cls='torch.nn.Nope' names no importable class"),
    (dict(tensor_parallel_size=2), ValueError, "tensor_parallel_size=2 without a plan"),
    (dict(sequence_parallel=True), ValueError, "sequence_parallel=True without a plan"),
    (dict(method="nope"), ValueError, "registered merge rule"),
    (dict(method="mgr", streams=-1), ValueError, "streams"),
], ids=["plan-type", "plan-style", "ckpt-name", "ckpt-zero", "compile", "block-cls", "block-path", "tp-no-plan",
        "sp-no-plan", "method", "option"])
def test_arguments_are_checked_on_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ResidualParallelStrategy(**kwargs)


def test_a_typed_config_is_the_method_with_its_options():
    from lightning_resctl.rules.mgr.config import MGRConfig

    strategy = ResidualParallelStrategy(MGRConfig(streams=2))
    assert strategy.method == "mgr" and strategy.patcher.options["streams"] == 2


# ---------------------------------------------------------------------------------------------- the parts
def test_the_stream_layout_is_read_from_the_plan():
    """Sequence parallel where a style shards the sequence (dim 1); tensor parallel where only known styles shard
    other dims; unknown (None) otherwise."""
    model = script.base_model()
    assert sequence_parallel_of(script.plan(model, "sp")) is True
    assert sequence_parallel_of(script.plan(model, "tp")) is False
    assert sequence_parallel_of({"h.0": _prepare(0)}) is None

    class Custom(type(_colwise()).__mro__[1]):  # a ParallelStyle of the user's own
        def _apply(self, module, mesh):
            return module

    assert sequence_parallel_of({"h.0.mlp.c_fc": _colwise(), "h.0": Custom()}) is None


class TwoLists(nn.Module):
    """A ModuleList of 3 heads (no merge) beside the 2 blocks that hold the merges."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.blocks = nn.ModuleList(PreNormBlock(8) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return sum(h(x) for h in self.heads)


def test_blocks_are_the_repeated_children_holding_the_merges():
    model = TwoLists()
    assert [n for n, _ in find_blocks(model)] == ["heads.0", "heads.1", "heads.2"]  # unpatched: the largest list
    patch_residuals(model, method="rescontroller", example_input=torch.randn(2, 8))
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in find_blocks(model, nn.Linear)] == ["heads.0", "heads.1", "heads.2", "blocks.0.f1",
                                                             "blocks.0.f2.0", "blocks.0.f2.2", "blocks.1.f1",
                                                             "blocks.1.f2.0", "blocks.1.f2.2"]
    with pytest.raises(ValueError, match="found no repeated blocks .* block_cls="):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


class _EncoderStack(nn.Module):
    """Blocks whose class is torch.nn's (``nn.TransformerEncoderLayer``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                     for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("method", [None, "hc"], ids=["plain", "hc"])
def test_blocks_of_a_torch_nn_class_are_compiled(method):
    """``Module.compile()`` of a block whose forward is torch.nn's (``nn.TransformerEncoderLayer``) compiles nothing
    (dynamo starts no frame in torch.nn; ``torch.compile(module)`` wraps one around it): the strategy's blocks are
    compiled all the same — a graph holds the block's feed-forward — and train as the eager model does."""
    import copy

    import torch._dynamo.testing

    from lightning_resctl.distributed.recipe import wrap_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _EncoderStack().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    if method is not None:
        patch_residuals(model, method=method, example_input=(x,))
    ref = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    wrap_blocks(model, find_blocks(model), None, {"backend": counter})
    got, want = model(x), ref(x)
    got.square().mean().backward()
    want.square().mean().backward()
    ops = [{getattr(n.target, "__name__", str(n.target)) for n in g.graph.nodes} for g in counter.graphs]
    assert any({"relu", "multi_head_attention_forward"} <= names for names in ops), ops  # the block, not a merge
    assert torch.equal(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    torch._dynamo.reset()
