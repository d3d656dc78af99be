"""The combination matrix (issue 36): rules x compile mode x activation checkpointing x precision x in-place merges.

Every case trains one step of a tiny patched model and compares its logits and gradients with the same model run
eagerly, without checkpointing (the reference): a combination that breaks shows at once. Compile modes: ``eager``,
``whole`` (``torch.compile(model)``, aot_eager), ``per-block`` (each block compiled on its own, aot_eager, the
checkpoint around the compiled block) and ``fullgraph`` (the whole model, ``fullgraph=True``); checkpointing: none,
each block in non-reentrant ``torch.utils.checkpoint``, switched on before the patch (``ckpt-first``) or after it
(``patch-first``), or ResidualParallelStrategy's ``wrap_blocks`` (``strategy``: ``checkpoint_wrapper`` with
``checkpoint_block``, which keeps a chain's state at the block, around each block, compiled first per block);
precision fp32 or bf16 autocast; the blocks' second merge written out of place or in place (``y += x``). The cases
are a pairwise cover (every pair of levels of any two factors in some case, every rule with every compile mode), not
the full product. Tensor and sequence parallelism have their own file."""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import warnings

import pytest
import torch
import torch._dynamo.testing
from torch.utils.checkpoint import checkpoint

from lightning_resctl import get_merge_rule, merge_rules, patch_residuals
from lightning_resctl.distributed.recipe import wrap_blocks
from lightning_resctl.runtime.backends import cpu_compile_available
from models import PreNormBlock, PreNormInplaceBlock, PreNormNet

C, LAYERS = 16, 2
RULES = [m for m in merge_rules() if m not in ("mgr",)]  # "mgr" is mgr-competitive under its short name
CHAIN = [m for m in RULES if get_merge_rule(m).kind == "chain"]
# one chain rule per runtime (MGR's chain, the hyper-connection frame, AttnRes's sources, DWA's block history,
# LAuReL-PA's previous streams): compiled per block under every checkpointing
FAMILIES = ("mgr-competitive", "hc", "attnres-block", "dwa", "laurel-pa")
COMPILE = ("eager", "whole", "per-block", "fullgraph")
CKPT = ("none", "ckpt-first", "patch-first", "strategy")
PRECISION = ("fp32", "bf16")
INPLACE = (False, True)
# relative error (per logits / per parameter's gradient) against the eager, non-checkpointed patched model, keyed by
# (precision, compiled): fp32 eager 1e-6 (measured: 0); fp32 compiled 2e-6 (measured: up to 4e-7 for attnres per
# block, 3e-7 with inductor, 1.1e-6 for kromhc per block under checkpoints: the frame rules' plain path traced there,
# the recomputing Function in the reference, on kromhc_alpha's 3-element gradient; the same case in fp64: 1.6e-15);
# bf16 compiled: bf16's rounding (2^-8), should a decomposition round its operands apart from the eager kernel
# (measured: 0)
TOL = {("fp32", False): 1e-6, ("fp32", True): 2e-6, ("bf16", False): 1e-6, ("bf16", True): 1e-2}


def _x(seed=1):
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed))


def exact_options(method):
    """MGR without its inversion (the checkpointed and compiled runs keep the streams, so the exact reference saves
    them too), the eager torch path of a rule with a ``backend`` (no background compile landing between runs) and
    mHC's Sinkhorn in 3 steps (the mechanisms under test do not depend on its length; 20 unrolled steps made mHC's
    cases the slowest of the matrix)."""
    names = get_merge_rule(method).option_names()
    return {**({"invert": False} if "invert" in names else {}),
            **({"backend": "torch-eager"} if "backend" in names else {}),
            **({"sinkhorn_iters": 3} if "sinkhorn_iters" in names else {})}


def patched_pair(method, ckpt="none", inplace=False, layers=LAYERS):
    """(model to test, its eager non-checkpointed twin with the same parameters); the rule's parameters moved off
    their init (zero-init queries would hide wrong gradients)."""
    torch.manual_seed(0)
    model = PreNormNet(layers, C, PreNormInplaceBlock if inplace else PreNormBlock)
    model.ckpt = ckpt == "ckpt-first"
    report = patch_residuals(model, method=method, example_input=(_x(0),), **exact_options(method))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    ref = copy.deepcopy(model)
    model.ckpt, ref.ckpt = ckpt in ("ckpt-first", "patch-first"), False
    return model, ref


def compiled(model, mode, backend="aot_eager", ckpt=None):
    """``model`` as ``mode`` runs it: the callable, and the compile counter (None when eager); ``ckpt="strategy"``:
    its blocks wrapped (and compiled, per block) by the strategy's ``wrap_blocks``."""
    counter = None if mode == "eager" else torch._dynamo.testing.CompileCounterWithBackend(backend)
    if ckpt == "strategy":
        blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        wrap_blocks(model, blocks, "blocks", {"backend": counter} if mode == "per-block" else None)
        if mode in ("eager", "per-block"):
            return model, counter
    if mode == "eager":
        return model, None
    if mode == "per-block":
        for b in model.blocks:
            b.compile(backend=counter)
        return model, counter
    return torch.compile(model, backend=counter, fullgraph=mode == "fullgraph"), counter


def step(run, model, x, precision):
    """Logits and the parameters' gradients of one step (loss: mean square of the logits)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
        logits = run(x)
    logits.float().square().mean().backward()
    grads = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for k, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().float(), grads


def assert_close(got, want, rel, what):
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"
    return err


def assert_same_step(got, want, rel):
    (logits, grads), (ref_logits, ref_grads) = got, want
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    errs = [assert_close(logits, ref_logits, rel, "logits")]
    errs += [assert_close(grads[k], g, rel, f"gradient of {k}") for k, g in ref_grads.items()]
    return max(errs)


def pairwise_cover():
    """Cases (rule, compile, ckpt, precision, inplace): every rule with every compile mode, one chain rule of each
    runtime (``FAMILIES``) compiled per block under each checkpointing (finding 1: both orders of the flag; the
    strategy's) and every other chain rule under one, and the remaining factors chosen greedily until every pair of
    levels of any two factors occurs in some case."""
    factors = (RULES, COMPILE, CKPT, PRECISION, INPLACE)
    uncovered = {((i, a), (j, b)) for i, j in itertools.combinations(range(5), 2)
                 for a in factors[i] for b in factors[j]}
    rows = []

    def add(row):
        rows.append(row)
        uncovered.difference_update(((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(5), 2))

    def gain(row):
        return sum(((i, row[i]), (j, row[j])) in uncovered for i, j in itertools.combinations(range(5), 2))

    for rule, mode in itertools.product(RULES, COMPILE):
        ckpts = CKPT[1:] if mode == "per-block" and rule in CHAIN else CKPT
        for ckpt in ckpts if mode == "per-block" and rule in FAMILIES else (None,):
            options = [(rule, mode, c, p, i) for c in ((ckpt,) if ckpt else ckpts) for p in PRECISION for i in INPLACE]
            add(max(options, key=gain))
    while uncovered:
        add(max(itertools.product(*factors), key=gain))
    return rows


CASES = pairwise_cover()


def test_the_cases_are_a_pairwise_cover():
    factors = (RULES, COMPILE, CKPT, PRECISION, INPLACE)
    for i, j in itertools.combinations(range(5), 2):
        assert {(r[i], r[j]) for r in CASES} == set(itertools.product(factors[i], factors[j])), (i, j)
    assert {(r[0], r[2]) for r in CASES if r[1] == "per-block"} >= set(itertools.product(FAMILIES, CKPT[1:]))
    assert {r[0] for r in CASES if r[1] == "per-block" and r[2] != "none"} >= set(CHAIN)


def _case_id(case):
    rule, mode, ckpt, precision, inplace = case
    return f"{rule}-{mode}-{ckpt}-{precision}{'-inplace' if inplace else ''}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_combination_gives_the_eager_non_checkpointed_step(case):
    rule, mode, ckpt, precision, inplace = case
    torch._dynamo.reset()
    model, ref = patched_pair(rule, ckpt, inplace)
    run, counter = compiled(model, mode, ckpt=ckpt)
    x = _x()
    want = step(ref, ref, x, precision)
    # fullgraph with checkpointing inside the graph: dynamo traces the checkpoint only when the forward's side
    # effects (the chain's bookkeeping, kept once) are not replayed in backward; it refuses without this switch
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=mode == "fullgraph"):
        got = step(run, model, x, precision)
    assert_same_step(got, want, TOL[(precision, mode != "eager")])
    if counter is not None and (mode != "whole" or ckpt == "none" or rule not in CHAIN):
        # compiled, not an eager fallback (the whole model with checkpointed blocks: dynamo runs a chain rule's
        # checkpoints eagerly, their side effects untraced, and may run the whole forward so; a per-merge rule's
        # merge check keeps no side effect there, so the model compiles)
        assert counter.frame_count >= 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- finding 2
GRAD_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


# the matrix has fullgraph x in-place x checkpointing for the others
@pytest.mark.parametrize("method", ["mgr-competitive"])
def test_fullgraph_with_in_place_merges_in_every_grad_mode_with_and_without_checkpointing(method):
    """``torch.compile(model, fullgraph=True)`` of in-place merges (``y += x``): the model compiles in one graph in
    grad / no_grad / inference_mode, with and without checkpointed blocks, and gives the eager model's logits (and
    its gradients where grad is on). One compiled model serves all six (dynamo recompiles on the grad mode)."""
    torch._dynamo.reset()
    model, ref = patched_pair(method, "none", inplace=True)
    run = torch.compile(model, backend="eager", fullgraph=True)
    x = _x()
    for ckpt, (name, grad_mode) in itertools.product((False, True), GRAD_MODES.items()):
        model.ckpt = ckpt
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True), grad_mode():
            out = run(x)
            want = ref(x)
        assert_close(out.detach(), want.detach(), 1e-6, f"logits ({name}, checkpointing={ckpt})")
        if name == "grad":
            got_grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
            want_grads = torch.autograd.grad(want.square().mean(), list(ref.parameters()))
            for (k, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
                assert_close(g, w, 1e-6, f"gradient of {k} (checkpointing={ckpt})")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- finding 1
def test_per_block_fullgraph_under_outer_checkpointing_is_refused_at_the_first_forward():
    """A block compiled on its own with ``fullgraph=True`` and checkpointed from outside: the chain's state for the
    recomputation is kept at a graph break, which fullgraph forbids: refused when the first forward compiles the
    block, naming what to do instead (not from inside backward)."""
    torch._dynamo.reset()
    model, _ = patched_pair("mgr", "patch-first")
    for b in model.blocks:
        b.compile(backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"(?s)checkpointed from outside.*fullgraph.*checkpoint_wrapper before "
                                        r"torch.compile"):
        model(_x())
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["mhc"])
def test_per_block_fullgraph_with_the_checkpoint_inside_the_compiled_block(method):
    """torchtitan's order: ``checkpoint_wrapper`` first, then each wrapped block compiled with ``fullgraph=True``;
    dynamo traces the checkpoint with the chain's bookkeeping kept once (its switch for forward side effects)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch._dynamo.reset()
    model, ref = patched_pair(method)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(checkpoint_wrapper(b), backend=counter, fullgraph=True)
    x = _x()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        logits, grads = step(model, model, x, "fp32")
    grads = {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): g for k, g in grads.items()}
    assert_same_step((logits, grads), step(ref, ref, x, "fp32"), TOL[("fp32", True)])
    assert counter.frame_count == LAYERS
    torch._dynamo.reset()


def test_per_block_compiled_checkpointed_blocks_train_two_steps_and_keep_nothing():
    """A second step (fresh forward) is as exact as the first, and no chain state outlives its backward."""
    torch._dynamo.reset()
    model, ref = patched_pair("hc", "patch-first", inplace=True)
    run, _ = compiled(model, "per-block")
    for seed in (1, 2):
        assert_same_step(step(run, model, _x(seed), "fp32"), step(ref, ref, _x(seed), "fp32"), TOL[("fp32", True)])
    runs = {id(s._run): s._run for s in model.modules() if getattr(s, "_run", None) is not None}
    assert runs and all(len(r.entries) == 0 for r in runs.values())
    torch._dynamo.reset()


def test_a_logging_step_of_the_strategys_compiled_checkpointed_blocks_observes_and_trains_as_eager():
    """ResidualMonitor over the strategy's blocks (each compiled, ``checkpoint_block`` around it): a logging step
    (observers set) runs the blocks eagerly, forward and recomputation alike — compiled, the observers' graphs let
    the recomputation run other graphs than the forward (a CheckpointError) — and its metrics, like every step's
    logits and gradients, are the eager model's."""
    from lightning_resctl import ResidualMonitor

    torch._dynamo.reset()
    model, ref = patched_pair("mgr-competitive", layers=4)  # (2 blocks compile too few graphs to go wrong)
    run, counter = compiled(model, "per-block", ckpt="strategy")
    monitor, ref_monitor = ResidualMonitor(model, log_every_n_steps=2), ResidualMonitor(ref, log_every_n_steps=2)
    for seed in range(3):
        with monitor.step(seed):
            got = step(run, model, _x(seed), "fp32")
        with ref_monitor.step(seed):
            want = step(ref, ref, _x(seed), "fp32")
        assert_same_step(got, want, TOL[("fp32", True)])
        metrics, ref_metrics = monitor.metrics(), ref_monitor.metrics()
        assert metrics.keys() == ref_metrics.keys() and (seed == 1) == bool(ref_metrics)
        for k, v in ref_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert counter.frame_count >= 1
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["rescontroller", "add"])
def test_a_per_merge_rule_compiles_a_whole_model_with_checkpointed_blocks(method):
    """The per-call merge check (a side effect) is not kept inside a checkpoint traced into a compiled model:
    there dynamo refuses side effects and would give up the whole forward (run it eagerly, 0 graphs)."""
    torch._dynamo.reset()
    model, ref = patched_pair(method, "ckpt-first")
    run, counter = compiled(model, "whole")
    assert_same_step(step(run, model, _x(), "fp32"), step(ref, ref, _x(), "fp32"), TOL[("fp32", True)])
    assert counter.frame_count == 1 and counter.op_count >= 1
    torch._dynamo.reset()


def _checkpointing(forward):
    """``forward`` checkpointed while training, as transformers' ``GradientCheckpointingLayer`` (5.x) wraps a layer's
    ``forward`` (``functools.wraps``): the module's hooks stay outside the checkpoint, its merges run inside it."""

    @functools.wraps(forward)
    def forward_with_checkpointing(self, x):
        if self.training:
            return checkpoint(forward, self, x, use_reentrant=False)
        return forward(self, x)
    return forward_with_checkpointing


class ForwardCheckpointedBlock(PreNormBlock):
    forward = _checkpointing(PreNormBlock.forward)


@pytest.mark.parametrize("method,side_effects", [("rescontroller", False), ("rescontroller", True), ("hc", True)],
                         ids=["rescontroller", "rescontroller-side-effects", "hc-side-effects"])
def test_blocks_compiled_on_their_own_that_checkpoint_their_forward_train_as_eager(method, side_effects):
    """Compiled per block, such a checkpoint is traced into the block's graph while the module's hooks are not:
    its merges mark their module's tally there, a side effect, so dynamo runs the checkpoint eagerly, or compiles
    it with torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint (as the docs advise); either way the
    step is the eager one, not refused as if the merges had not run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PreNormNet(LAYERS, C, ForwardCheckpointedBlock)
    patch_residuals(model, method=method, example_input=(_x(0),), **exact_options(method))
    ref = copy.deepcopy(model)
    run, counter = compiled(model, "per-block")
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=side_effects):
        got = step(run, model, _x(), "fp32")
    assert_same_step(got, step(ref, ref, _x(), "fp32"), TOL[("fp32", True)])
    assert counter.frame_count >= 1 or not side_effects
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["mgr-competitive", "attnres-block", "hc"])
def test_a_checkpointed_blocks_recomputation_runs_the_graphs_its_forward_ran(method):
    """Backward recomputes each compiled, checkpointed block with the graphs its forward compiled: a graph of its
    own for the recomputation (a guard on the checkpoint phase) is one that inductor may partition otherwise, and
    torch.utils.checkpoint then finds other saved tensors (CheckpointError at C=256, pytorch#166926's symptom)."""
    torch._dynamo.reset()
    model, ref = patched_pair(method, "ckpt-first")
    run, counter = compiled(model, "per-block")
    model.zero_grad(set_to_none=True)
    logits = run(_x())
    compiled_in_forward = counter.frame_count
    logits.square().mean().backward()
    assert counter.frame_count == compiled_in_forward, "the recomputation compiled graphs of its own"
    assert_same_step(step(run, model, _x(), "fp32"), step(ref, ref, _x(), "fp32"), TOL[("fp32", True)])
    torch._dynamo.reset()


def test_a_recompile_limit_below_the_chains_merges_is_named_with_the_value_to_set():
    """A rule whose merges run by their positions (attnres) compiles a graph per merge position in a checkpointed
    block compiled on its own: a recompile limit below the chain's merges runs the blocks past it eagerly, which the
    user learns from a warning naming the setting and a value. A rule whose merges share their graphs (hc) warns
    nothing under the same limit, nor does attnres-block (its stacked state: one structure at any depth)."""
    torch._dynamo.reset()
    model, ref = patched_pair("attnres", "ckpt-first")
    run, _ = compiled(model, "per-block")
    with pytest.warns(UserWarning, match=r"has 4 merges.*'attnres'.*recompile_limit is 3.*recompile_limit = 8"):
        with torch._dynamo.config.patch(recompile_limit=3):
            got = step(run, model, _x(), "fp32")
    assert_same_step(got, step(ref, ref, _x(), "fp32"), TOL[("fp32", True)])
    torch._dynamo.reset()
    for method in ("hc", "attnres-block"):
        model, _ = patched_pair(method, "ckpt-first")
        run, _ = compiled(model, "per-block")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*recompile_limit")
            with torch._dynamo.config.patch(recompile_limit=3):
                step(run, model, _x(), "fp32")
        torch._dynamo.reset()


@pytest.mark.skipif(not cpu_compile_available(), reason="no C++ compiler for inductor")
def test_per_block_inductor_under_checkpointing():
    """The one inductor case: blocks compiled by inductor, checkpointed, patched after the checkpointing is on."""
    torch._dynamo.reset()
    model, ref = patched_pair("mgr-competitive", "ckpt-first")
    run, counter = compiled(model, "per-block", backend="inductor")
    assert_same_step(step(run, model, _x(), "fp32"), step(ref, ref, _x(), "fp32"), TOL[("fp32", True)])
    assert counter.frame_count >= 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- FSDP2
@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("method,precision", [("mgr-competitive", "bf16")])
def test_fsdp2_per_block_compile_and_checkpointing(method, precision, one_process_group):
    """The recipe in one process (gloo): the patch, each block compiled (aot_eager) and checkpointed, ``fully_shard``
    per block and on the root, bf16 ``MixedPrecisionPolicy`` (fp32 reduction) or none. Compared with the same
    model sharded with the same policy, eager and not checkpointed (fp32: with the plain eager patched model)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    model, ref = patched_pair(method, "patch-first")
    run, counter = compiled(model, "per-block")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for m in (model, ref) if precision == "bf16" else (model,):
        for b in m.blocks:
            fully_shard(b, mp_policy=policy)
        fully_shard(m, mp_policy=policy)
    x = _x()

    def full(step_result):
        logits, grads = step_result
        return logits, {k: getattr(g, "full_tensor", lambda: g)() for k, g in grads.items()}

    assert_same_step(full(step(run, model, x, "fp32")), full(step(ref, ref, x, "fp32")),
                     TOL[(precision, True)])
    assert counter.frame_count >= 1
    torch._dynamo.reset()


def test_mgr_with_its_default_inversion_is_within_the_inversions_rounding():
    """MGR's default options (``invert="auto"``): the eager reference inverts its merges in backward, the compiled
    checkpointed blocks keep the streams; the two differ by the inversion's rounding only."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PreNormNet(LAYERS, C)
    patch_residuals(model, method="mgr-competitive", example_input=(_x(0),))
    ref = copy.deepcopy(model)
    model.ckpt = True
    run, _ = compiled(model, "per-block")
    assert_same_step(step(run, model, _x(), "fp32"), step(ref, ref, _x(), "fp32"), 1e-5)
    torch._dynamo.reset()
