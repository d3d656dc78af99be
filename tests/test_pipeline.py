"""Pipeline parallel in ResidualParallelStrategy (issue 56): the blocks split into stages, each rule's chain state
carried across the boundaries as the rule packs it (``ChainRule.stage_state``).

Three groups of gloo processes run at once (tests/_resctl_pipeline_script.py): 2 stages on 2 ranks (every rule; 4
stages interleaved on the 2 ranks; a model whose blocks are an ``nn.ModuleDict``), 4 stages on 4 ranks (every rule;
each rule under GPipe at one of the two sizes and 1F1B at the other), and a pipeline 2 x data 2 mesh (FSDP2, each
block checkpointed and compiled) with a distributed checkpoint saved after one step and resumed. Every fp64 run is
compared with the patched model trained in this process by hand (meanwhile): the parameters after two SGD steps
(momentum), every key of one process's state dict held by some stage, the copies that several stages hold equal;
each step's loss; what each stage sends per microbatch against the rule's state at that boundary in one process. In
this process (a one-rank gloo group, two stages on it): a rule a user registers, and the refusals, each naming the
argument.
"""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn

import _resctl_pipeline_script as script
from lightning_resctl import ResidualParallelStrategy, merge_sites, patch_residuals
from lightning_resctl.distributed.blocks import find_blocks
from lightning_resctl.rules import base
from lightning_resctl.rules.base import ChainRule
from lightning_resctl.rules.mgr.rule import MGRRule
from processes import start_runs, wait_for_runs

REL = 1e-12  # fp64: the stages sum the same products, the shared parameters' gradients in another order
RANKS = {"pp2": 2, "pp4": 4, "mesh": 4}
ROW_BYTES = script.CFG["block_size"] * script.CFG["n_embd"] * 8  # one row of the stream, fp64


def reference(method: str, kind: str = "gpt", steps: int = script.STEPS) -> dict:
    """The patched model trained in this process by hand: the state dict after ``steps`` SGD steps, each step's loss;
    and the chain's state after each block for a one-row microbatch (what a stage boundary there carries)."""
    model = script.base_model(kind)
    patch_residuals(model, method=method, example_input=script.batch()[0][:2], **script.options(method))
    states = boundary_states(model)
    chains = [site.chain_module for site in merge_sites(model) if site.rule.kind == "chain"]
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    losses = []
    for _ in range(steps):
        loss = script.loss_of(model(script.batch()[0]), script.batch()[1])
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        val_loss = float(script.loss_of(model.eval()(script.batch()[0]), script.batch()[1]))
    return {"state": {n: t.detach().clone() for n, t in model.state_dict().items()}, "losses": losses,
            "boundaries": states, "chain": chains[0] if chains else None, "val_loss": val_loss}


def boundary_states(model: nn.Module) -> list:
    """The chain's state after each block (None without a chain rule), one forward on a one-row microbatch."""
    chain = [s for s in merge_sites(model) if s.rule.kind == "chain"]
    out = []
    hooks = [block.register_forward_hook(lambda *_: out.append(chain[0].__dict__["_run"].state if chain else None))
             for _, block in find_blocks(model)]
    with torch.no_grad():
        model(script.batch()[0][:1])
    for h in hooks:
        h.remove()
    return out


def state_bytes(state, chain) -> int:
    """What of a chain state a later stage reads, in bytes (the rules' definitions): MGR's streams; the frame's
    streams and the next merge's res / post; AttnRes's completed blocks and partial block (its key logits and queries
    are computed again from them), and its layout (t, whether a partial, each block's first site); DWA's stream and
    the completed blocks' outputs an average after a later block reads; LAuReL-PA's previous streams."""
    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    if state is None:
        return 0
    if isinstance(state, torch.Tensor):
        return size([state])
    kind = type(state).__name__
    if kind == "FrameState":
        return size([state.streams, state.res, state.post])
    if kind == "DWAState":
        done = len(state.history) - 1
        k = chain.dilation  # the average after block i reads the outputs (i mod k) + m k, m = 0 .. i // k
        later = {j for i in map(int, chain.averages) if i > done for j in range(i % k, i + 1, k)}
        return size([state.stream, *(t for j, t in enumerate(state.history) if j in later)])
    if kind == "LaurelState":
        return size(state.streams)
    assert kind == "AttnResState", kind
    sources = state.sources()
    return size(sources) + 8 * (2 + len(state.blocks))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    procs = start_runs(script.__file__, {mode: (mode, out) for mode in RANKS}, LIGHTNING_RESCTL_COMPILE="0")
    references = {method: reference(method) for method in script.EVERY_RULE}  # meanwhile
    references["moduledict"] = reference(script.MODULEDICT_RULE, "moduledict")
    wait_for_runs(procs, timeout=900)
    loaded = {f"{mode}{r}": torch.load(out / f"{mode}_rank{r}.pt", weights_only=False)
              for mode, ranks in RANKS.items() for r in range(ranks)}
    return {**loaded, "single": references, "out": out}


def merged(runs: dict, mode: str, case) -> dict:
    """The state dict the ranks of ``mode`` hold together; a key held by several ranks must be equal on each."""
    out: dict = {}
    for r in range(RANKS[mode]):
        for name, t in runs[f"{mode}{r}"][case]["state"].items():
            if name in out:
                assert torch.equal(out[name], t), f"{case} {name}: the ranks' copies differ"
            out[name] = t
    return out


def max_difference(got: dict, want: dict, what: str) -> float:
    """The largest relative difference of a parameter (state-dict entry) from one process's; every key present."""
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    worst = 0.0
    for name, w in want.items():
        if not w.is_floating_point():  # a merge site's record: where its patch ran differs (module paths)
            continue
        err = float((got[name] - w).abs().max() / w.abs().max().clamp_min(1e-300))
        assert err <= REL, f"{what} {name}: relative difference {err:.3g}"
        worst = max(worst, err)
    return worst


def assert_losses(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert abs(g - w) <= REL * abs(w), f"{what}: loss {g!r} != one process's {w!r}"


def assert_case(runs: dict, mode: str, case, reference_key, data_parallel: int = 1) -> float:
    """The ranks' parameters after two steps against one process's; each step's loss (the mean over the
    ``data_parallel`` ranks of a stage, each of which saw its share of the rows) and the logged one."""
    want = runs["single"][reference_key]
    worst = max_difference(merged(runs, mode, case), want["state"], f"{mode} {case}")
    for first in range(0, RANKS[mode], data_parallel):
        ranks = [runs[f"{mode}{r}"][case] for r in range(first, first + data_parallel)]
        losses = [sum(steps) / data_parallel for steps in zip(*(r["losses"] for r in ranks))]
        assert_losses(losses, want["losses"], f"{mode} {case} ranks {first}+")
        logged = sum(r["logged"]["train_loss"] for r in ranks) / data_parallel
        assert logged == pytest.approx(want["losses"][-1], rel=REL)
    return worst


@pytest.mark.parametrize("stages", [2, 4])
def test_every_rule_equals_one_process(runs, stages):
    """2 stages on 2 ranks and 4 on 4, 4 microbatches of one row, GPipe and 1F1B alternating over the rules (each
    rule runs the other one at 4 stages than at 2): every rule's parameters after two steps and both losses equal
    one process's; the stage line names the split and the rule's state; the middle stages hold neither the
    embedding nor the head."""
    mode = f"pp{stages}"
    for method in script.EVERY_RULE:
        assert_case(runs, mode, (method, script.schedule_of(method, stages), stages), method)
    case = ("hc", script.schedule_of("hc", stages), stages)
    if stages == 2:
        assert (f"pipeline over 2 ranks ({case[1]}, 4 microbatches): stage 0: blocks 0-1 + wte, wpe, lm_head; stage 1: "
                "blocks 2-3 + wte, ln_f, lm_head, hc state across the boundaries") in runs["pp20"][case]["applied"]
    else:
        for r in (1, 2):
            assert not any(n.startswith(("wte", "wpe", "lm_head", "ln_f")) for n in runs[f"pp4{r}"][case]["state"])


def test_four_stages_interleaved_on_two_ranks_equal_one_process(runs):
    """``schedule="interleaved-1f1b"``: 4 stages, 2 per rank (each a view of the rank's model with a chain run of its
    own), equal to one process."""
    for method in script.INTERLEAVED:
        assert_case(runs, "pp2", (method, "interleaved-1f1b", 4), method)


def test_each_stage_sends_the_stream_and_the_rules_state(runs):
    """What each stage sends per microbatch (the strategy's record, printed on rank zero): the stream (one row) and
    what a later stage reads of the rule's state at that boundary, as one process's chain holds it there."""
    for mode, stages in (("pp2", 2), ("pp4", 4)):
        for method in script.EVERY_RULE:
            sent = runs[f"{mode}0"][method, script.schedule_of(method, stages), stages]["sent"]
            per_stage = script.CFG["n_layer"] // stages
            assert sorted(sent) == list(range(stages - 1)), (mode, method, sent)
            for s, items in sent.items():
                state = runs["single"][method]["boundaries"][(s + 1) * per_stage - 1]
                assert items[0][0] == "stream" and items[0][3] == ROW_BYTES, (mode, method, items)
                want = state_bytes(state, runs["single"][method]["chain"])
                assert sum(b for *_, b in items[1:]) == want, (mode, method, s, items)


def test_blocks_in_a_module_dict_are_found_and_pipelined(runs):
    """torchtitan's layout (``layers`` an ``nn.ModuleDict``): found without ``block_cls``, 2 stages keep the layers'
    names, equal to one process; its validation step runs through the pipeline (forward only, eval mode), its loss,
    logged with ``sync_dist`` on every rank, one process's."""
    model = script.base_model("moduledict")
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert_case(runs, "pp2", "moduledict", "moduledict")
    for r in (0, 1):
        assert runs[f"pp2{r}"]["moduledict"]["logged"]["val_loss"] == pytest.approx(
            runs["single"]["moduledict"]["val_loss"], rel=REL)
    assert {n.split(".")[1] for n in runs["pp21"]["moduledict"]["state"] if n.startswith("layers.")} == {"2", "3"}


def test_pipeline_by_data_mesh_with_checkpointing_and_compile_equals_one_process(runs):
    """Pipeline 2 x data 2: FSDP2 per block and per stage, each block checkpointed around its compiled self, 2
    microbatches of one row per data-parallel rank: one process's parameters and losses."""
    assert_case(runs, "mesh", "whole", script.MESH_RULE, data_parallel=2)
    said = runs["mesh0"]["whole"]["applied"]
    assert "2 blocks (Block), 2 checkpointed, compiled one by one" in said and "FSDP2 over 2 ranks" in said


def test_resumed_equals_uninterrupted_and_loads_into_one_process(runs):
    """Stopped after one step, saved (distributed checkpoint), resumed by a new Trainer: the uninterrupted run's
    parameters and second loss; the checkpoint, made one file, loads into the patched model in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole, resumed = merged(runs, "mesh", "whole"), merged(runs, "mesh", "resumed")
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name
    for r in range(4):
        assert runs[f"mesh{r}"]["resumed"]["losses"] == runs[f"mesh{r}"]["whole"]["losses"][1:]
    one_file = runs["out"] / "resumed.pt"
    dcp_to_torch_save(runs["out"] / "resumed.ckpt", one_file)
    module = script.GPT()
    patch_residuals(module.model, method=script.MESH_RULE, example_input=script.batch()[0][:2],
                    **script.options(script.MESH_RULE))
    module.load_state_dict(torch.load(one_file, weights_only=False)["state_dict"])
    max_difference({n.removeprefix("model."): t for n, t in module.state_dict().items()},
                   runs["single"][script.MESH_RULE]["state"], "loaded into one process")


# ---------------------------------------------------------------------------------------------- in this process
@pytest.fixture
def one_rank():
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def fit_here(strategy, module=None, steps: int = script.STEPS):
    """The state dict after ``steps`` (Lightning's model summary on: it runs no forward of the split model)."""
    module = module or script.GPT()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module)
    fit_here.module = module
    return {n.removeprefix("model."): t.detach().clone() for n, t in module.state_dict().items()}


class UserChainRule(MGRRule):
    """A rule registered outside the package, with a stage state of its own (the streams in a tuple as they are)."""

    def stage_state(self, chain, state=None, *, packed=None):
        if packed is None:
            return (state * 1.0,)
        chain.start(packed[0][..., 0, :])
        return packed[0]


class TwoBatches(script.GPT):
    """Two different batches of 4 rows per epoch."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        tok = torch.randint(0, script.CFG["vocab_size"], (8, script.CFG["block_size"] + 1), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tok[:, :-1], tok[:, 1:]), batch_size=4)


def test_gradient_accumulation_through_the_pipeline(one_rank):
    """``accumulate_grad_batches=2``: each batch's gradients (from the schedule) are added after Lightning's
    ``zero_grad`` of the window, scaled by the window: the parameters of one process accumulating the two batches."""
    module = TwoBatches()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, logger=False,
                        strategy=ResidualParallelStrategy("mgr-competitive", backend="torch-eager",
                                                          schedule="interleaved-1f1b", microbatches=2),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    model = script.base_model()
    patch_residuals(model, method="mgr-competitive", example_input=script.batch()[0][:2], backend="torch-eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    for x, y in TwoBatches().train_dataloader():
        (script.loss_of(model(x), y) / 2).backward()
    optimizer.step()
    max_difference({n.removeprefix("model."): t for n, t in module.state_dict().items()},
                   dict(model.state_dict()), "accumulated")


class NoStageState(MGRRule):
    stage_state = ChainRule.stage_state


def test_a_rule_registered_by_a_user_crosses_the_stages(one_rank, monkeypatch):
    """Two stages on one rank (interleaved): a rule registered outside the package, through its own
    ``stage_state``, trains to one process's parameters."""
    monkeypatch.setitem(base._REGISTRY, "user-chain", base.RuleEntry("user-chain", UserChainRule, (), ""))
    got = fit_here(ResidualParallelStrategy("user-chain", backend="torch-eager", schedule="interleaved-1f1b",
                                            microbatches=2))
    want = reference("user-chain")
    max_difference(got, want["state"], "user-chain")
    module = fit_here.module
    assert torch.equal(module.example_input_array, script.batch()[0][:2])  # set aside during fit, back at teardown
    with pytest.raises(RuntimeError, match="split into pipeline stages .* through the Trainer's steps"):
        module.model(script.batch()[0])


def test_refusals_name_the_argument(one_rank, monkeypatch):
    """On construction: the pipeline's arguments; on setup (two stages on one rank): more stages than blocks, blocks
    that are not one chain of one class, a rule that declares no stage state; at a step: a batch that does not split
    into equal microbatches."""
    for kwargs, match in [(dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive int"),
                          (dict(schedule="zigzag"), "schedule must be one of"),
                          (dict(pipeline_parallel_size=4, microbatches=2), "needs microbatches >= pipeline_parallel"),
                          (dict(pipeline_parallel_size=2, stages=[1, 1, 2]), "stages has 3 entries"),
                          (dict(pipeline_parallel_size=2, plan=lambda module, mesh: {}),
                           "plan= .* pipeline_parallel_size"),
                          (dict(pipeline_parallel_size=2, save_distributed_checkpoint=False),
                           "save_distributed_checkpoint=False under pipeline parallel")]:
        with pytest.raises((ValueError, TypeError), match=match):
            ResidualParallelStrategy("hc", **kwargs)
    interleaved = dict(schedule="interleaved-1f1b", microbatches=2)
    with pytest.raises(ValueError, match="stages_per_rank=8 makes 8 stages, more than the model's 4 blocks"):
        fit_here(ResidualParallelStrategy("hc", stages_per_rank=8, **interleaved))
    with pytest.raises(ValueError, match="one chain of one class; block_cls= found"):
        fit_here(ResidualParallelStrategy("hc", block_cls=lambda name, m: name.startswith("model.h.")
                                          and name.count(".") == 3, **interleaved))
    with pytest.raises(ValueError, match="a batch of 4 rows does not split into microbatches=3 of equal size"):
        fit_here(ResidualParallelStrategy("hc", schedule="interleaved-1f1b", microbatches=3))
    monkeypatch.setitem(base._REGISTRY, "no-stage-state", base.RuleEntry("no-stage-state", NoStageState, (), ""))
    with pytest.raises(ValueError, match="method='no-stage-state' .NoStageState. declares no stage state"):
        fit_here(ResidualParallelStrategy("no-stage-state", backend="torch-eager", **interleaved))
