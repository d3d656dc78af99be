"""The parallelism axis of the combination matrix: tensor and sequence parallel (2 CPU processes, gloo, fp64) and
the whole recipe on a 2 x 2 mesh (4 processes).

Three process groups run at once (tests/_resctl_tp_script.py), each checking its cases in one go: the raw DTensor API
(every rule, the residual stream replicated or sharded on the sequence), Lightning's ModelParallelStrategy with
ResidualControlCallback, and the recipe (FSDP2 x sequence parallel, checkpointing around each compiled block, bf16).
Every fp64 run is compared with the single-process eager patched model (computed here, from the same weights and
batch): logits, gradients, and the parameters after one SGD step; the ranks' copies of a rule's parameters must be
equal after the step. And the refusals: patching after ``parallelize_module`` (every rule, both layouts, both APIs),
a tensor-parallel forward whose rule parameters were not put on the mesh.
"""
from __future__ import annotations

import pytest
import torch

import _resctl_tp_script as script
from lightning_resctl import parallelize_residuals
from processes import start_runs, wait_for_runs

# fp64: the parallel runs sum the same products in another order (measured <= 1e-12, and 2.6e-12 for the gradient of
# laurel's two RW logits per merge: one sum over every token's terms, which cancel)
REL = 1e-11
BF16_VS_PLAIN = 3.0  # the recipe (bf16 compute): a rule's gradients may differ from fp32 at most 3x the plain model's


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    procs = start_runs(script.__file__, {mode: (mode, out) for mode in ("raw", "lightning", "recipe")},
                       LIGHTNING_RESCTL_COMPILE="0")
    references = {method: single_process(method) for method in script.RULES}  # meanwhile
    recipe_references = {case: fp32_gradients(case) for case in script.RECIPE_CASES}
    wait_for_runs(procs, timeout=300)
    loaded = {name: torch.load(out / f"{name}.pt", weights_only=False)
              for name in ("raw_rank0", "raw_rank1", "lightning_rank0", "lightning_rank1", "recipe_rank0")}
    return {**loaded, "single": references, "recipe_single": recipe_references}


def single_process(method: str) -> dict:
    """The reference: the eager patched model in this process, one step on the same batch (and its parameters
    before the step)."""
    model = script.build(method)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = script.batch()
    logits = model(x)
    script.loss_of(logits, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=script.LR).step()
    return {"logits": logits.detach(), "grads": grads, "start": start,
            "after": {n: p.detach().clone() for n, p in model.named_parameters()}}


def fp32_gradients(case: str) -> dict:
    """The recipe's reference: the fp32 eager model (``plain``: unpatched) in this process, the whole batch."""
    model = (script.base_model() if case == "plain" else script.build(case)).float()
    x, y = script.batch()
    script.loss_of(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def has_parameters(single: dict) -> bool:
    """Whether the rule of a :func:`single_process` run added parameters (every chain rule, ``laurel``, ``ddl``)."""
    return any("_resctl" in name for name in single["start"])


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for name, w in want.items():
        err = float((got[name] - w).abs().max() / w.abs().max().clamp_min(1e-300))
        assert err <= REL, f"{what} {name}: relative difference {err:.3g}"


def assert_ranks_hold_one_rule(rank0: dict, rank1: dict, start: dict) -> None:
    """Each rank's own copy of the rule's parameters after the step: equal, and moved by the step."""
    assert rank0, "no rule parameters recorded"
    for name, p in rank0.items():
        assert torch.equal(p, rank1[name]), f"{name}: the ranks' copies differ after one step"
    assert any(not torch.equal(p, start[name]) for name, p in rank0.items()), "the step did not move the rule"


@pytest.mark.parametrize("layout", ["tp", "sp"], ids=["tensor-parallel", "sequence-parallel"])
def test_every_rule_trains_as_one_process(runs, layout):
    """parallelize_module (Colwise / Rowwise MLPs; ``sp``: SequenceParallel norms too, the stream sharded on the
    sequence between blocks) then parallelize_residuals: fp64 logits, gradients and the step equal one process's."""
    for method in script.RULES:
        want = runs["single"][method]
        rank0, rank1 = (runs[f"raw_rank{r}"]["runs"][layout, method] for r in (0, 1))
        for rank in (rank0, rank1):
            assert_close({"logits": rank["logits"]}, {"logits": want["logits"]}, f"{method} {layout}")
            assert_close(rank["grads"], want["grads"], f"{method} {layout} gradient")
            assert_close(rank["after"], want["after"], f"{method} {layout} after the step")
        if has_parameters(want):
            assert_ranks_hold_one_rule(rank0["rule_local"], rank1["rule_local"], want["start"])


def test_patching_a_tensor_parallel_model_is_refused_naming_the_order(runs):
    """Every rule, both layouts, raw API and the Lightning callback (which patches after configure_model, where the
    module parallelized itself): refused at patch time, before any forward, with the order that works. (Before, the
    sequence-parallel model was refused as having no merge, and the tensor-parallel one got only its attention
    merges patched, silently: the MLP merges' branch ends in RowwiseParallel's DTensor redistribution.)"""
    messages = dict(runs["raw_rank0"]["patch_after"])
    assert {layout for layout, _ in messages} == {"tp", "sp"}
    messages.update({f"callback {m}": msg for m, msg in runs["lightning_rank0"]["refused"].items()})
    assert set(runs["lightning_rank0"]["refused"]) == {"add", script.LIGHTNING_RULE}
    for case, message in messages.items():
        assert message.startswith("RuntimeError: patching method="), (case, message)
        for words in ("tensor parallel", "DTensor", "patch before parallelize_module", "patch_in_configure_model",
                      "parallelize_residuals"):
            assert words.lower() in message.lower(), (case, words, message)


def test_rule_parameters_left_off_the_mesh_are_refused_at_the_first_forward(runs):
    """Patched, then parallelize_module, without parallelize_residuals: a rule with parameters would train one copy
    per rank; its first forward raises, naming parallelize_residuals. Rules without parameters run (exact above)."""
    for method, message in runs["raw_rank0"]["not_parallelized"].items():
        if has_parameters(runs["single"][method]):
            assert "parallelize_residuals(model, tp_mesh, sequence_parallel=" in message, (method, message)
            assert "tensor parallel" in message, (method, message)
        else:
            assert message == "no error", (method, message)


def test_lightning_model_parallel_strategy_with_the_callback(runs):
    """ModelParallelStrategy(tensor_parallel_size=2): configure_model patches (patch_in_configure_model), makes the
    model sequence parallel, calls parallelize_residuals; one Trainer step equals one process's step."""
    want = runs["single"][script.LIGHTNING_RULE]
    rank0, rank1 = runs["lightning_rank0"], runs["lightning_rank1"]
    for rank in (rank0, rank1):
        assert_close(rank["after"], want["after"], "Trainer step")
    assert_ranks_hold_one_rule(rank0["rule_local"], rank1["rule_local"], want["start"])


def test_the_whole_recipe_on_a_2x2_mesh(runs):
    """4 processes: FSDP2 over the data-parallel mesh x sequence parallel, each block compiled (aot_eager) inside
    activation checkpointing, bf16 MixedPrecisionPolicy. bf16 compute cannot match fp32 exactly: each case's
    gradients are compared with its fp32 single-process run, and a rule may differ by at most
    :data:`BF16_VS_PLAIN` times what bf16 does to the unpatched model (a gradient left unreduced differs by ~1)."""
    got, want = runs["recipe_rank0"], runs["recipe_single"]
    errors = {}
    for case in script.RECIPE_CASES:
        assert not isinstance(got[case], str), f"{case}: {got[case]}"
        assert got[case].keys() == want[case].keys(), case
        errors[case] = max(float((got[case][n] - w).norm() / w.norm().clamp_min(1e-30)) for n, w in want[case].items())
    assert errors["plain"] <= 5e-2, errors
    for case, err in errors.items():
        assert err <= BF16_VS_PLAIN * errors["plain"], errors


def test_the_stream_layout_must_be_said():
    """The stream is a plain tensor whether replicated or sharded: ``sequence_parallel`` has no default, and
    anything but a bool is refused before the model is touched."""
    model = script.build("hc")
    with pytest.raises(TypeError, match="sequence_parallel"):
        parallelize_residuals(model, None)
    with pytest.raises(TypeError, match="sequence_parallel must be True or False"):
        parallelize_residuals(model, None, sequence_parallel="yes")
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
