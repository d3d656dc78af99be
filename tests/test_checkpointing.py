"""Activation checkpointing of patched models (issue 28): every chain rule trains under non-reentrant
checkpointing with the gradients of the non-checkpointed patched model, whichever order checkpointing and the
patch are applied in; reentrant checkpointing is refused at the first training forward, naming the alternative."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from _resctl_ckpt_dist_script import randomize_rule  # the rule's parameters moved away from their init
from lightning_resctl import get_merge_rule, merge_rules, patch_residuals
from models import PreNormBlock, PreNormInplaceBlock

CHAIN = [m for m in merge_rules() if get_merge_rule(m).kind == "chain"]
C = 16


class ParallelBlock(PreNormBlock):
    """A parallel block written as two additions: one merge of the input with both branches."""

    def forward(self, x):
        a = self.f1(torch.tanh(self.ln1(x)))
        m = self.f2(self.ln2(x))
        x = a + x
        return m + x


class Net(nn.Module):
    """A small GPT-like net; ``ckpt``: None (plain), "block" (each block in torch.utils.checkpoint, ``reentrant``
    chooses the variant), "offload" (the same inside offloading saved-tensor hooks) or "sequential"
    (checkpoint_sequential in 2 segments: blocks 0-1 in one region, 2-3 not checkpointed)."""

    def __init__(self, layers=4, ckpt=None, reentrant=False, block=PreNormBlock):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.Sequential(*(block(C) for _ in range(layers)))
        self.head = nn.Linear(C, 3)
        self.ckpt, self.reentrant = ckpt, reentrant

    def forward(self, x):
        x = self.emb(x)
        if self.ckpt == "block":
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=self.reentrant)
        elif self.ckpt == "offload":
            # a stand-in for HF's offload=True (save_on_cpu around the checkpoint) on a GPU: the block's saved input
            # comes back from backward as a copy, a new tensor with its own storage
            for b in self.blocks:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                    x = checkpoint(b, x, use_reentrant=False)
        elif self.ckpt == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=self.reentrant)
        else:
            for b in self.blocks:
                x = b(x)
        return self.head(x)


def _x(seed=0):
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed))


def grads_of(model, loss_fn) -> dict:
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, rel=1e-6):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k, g in want.items():
        err = float((got[k] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= rel, f"{k}: relative gradient error {err:.3g}"


def _loss(x):
    return lambda m: m(x).square().mean()


def exact_options(method, **options):
    """``options``, with ``invert=False`` for a rule that has the option (MGR): without checkpointing MGR's backward
    reconstructs the streams by inverting its merges (rounding ~1e-7..1e-6 relative); inside a checkpointed
    region it keeps them (saved-tensor hooks decide what is kept), so the exact reference saves them too. And the
    eager torch path for a rule with a ``backend``: the default one compiles in the background and switches to the
    compiled math when it lands, possibly between the two runs compared (a rounding-level difference, flaky at 1e-6).
    """
    names = get_merge_rule(method).option_names()
    if "invert" in names:
        options.setdefault("invert", False)
    if "backend" in names:
        options.setdefault("backend", "torch-eager")
    return options


def _patched_pair(method, ckpt, order, reentrant=False, block=PreNormBlock, **options):
    """(checkpointed patched model, non-checkpointed patched twin with the same parameters)."""
    torch.manual_seed(0)
    model = Net(ckpt=ckpt if order == "ckpt-first" else None, reentrant=reentrant, block=block)
    report = patch_residuals(model, method=method, example_input=(_x(),), **exact_options(method, **options))
    randomize_rule(model, report)
    ref = copy.deepcopy(model)
    model.ckpt = ckpt
    ref.ckpt = None
    return model, ref


@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
@pytest.mark.parametrize("method", CHAIN)
def test_non_reentrant_checkpoint_gives_the_gradients_of_the_plain_patched_model(method, order):
    model, ref = _patched_pair(method, "block", order)
    x = _x(1)
    want = grads_of(ref, _loss(x))
    got = grads_of(model, _loss(x))
    assert_same_grads(got, want)
    assert any("_resctl" in k for k in got)  # the rule's own parameters are among them
    # a second step (fresh forward, the entries of the first are gone) is as exact
    assert_same_grads(grads_of(model, _loss(_x(2))), grads_of(ref, _loss(_x(2))))
    assert len(next(iter(s._run for s in model.modules() if getattr(s, "_run", None) is not None)).entries) == 0


def test_mgr_default_inversion_is_within_its_rounding_of_the_checkpointed_gradients():
    """With the default ``invert="auto"`` the non-checkpointed reference inverts (the checkpointed run keeps the
    streams and equals the non-inverting run exactly, above): the two differ by the inversion's rounding only."""
    model, ref = _patched_pair("mgr", "block", "patch-first", invert="auto")
    x = _x(2)
    assert_same_grads(grads_of(model, _loss(x)), grads_of(ref, _loss(x)), rel=1e-5)


@pytest.mark.parametrize("method", ["mgr", "attnres-block", "mhc"])
def test_checkpoint_sequential_gives_the_gradients_of_the_plain_patched_model(method):
    model, ref = _patched_pair(method, "sequential", "patch-first")
    x = _x(1)
    assert_same_grads(grads_of(model, _loss(x)), grads_of(ref, _loss(x)))


@pytest.mark.parametrize("ckpt", ["block", "sequential"])  # sequential: 2 blocks in one region
@pytest.mark.parametrize("block", [PreNormInplaceBlock, ParallelBlock], ids=["in-place", "parallel"])
@pytest.mark.parametrize("method", ["mgr", "attnres-block", "hc"])
def test_in_place_and_parallel_merges_under_checkpointing(method, block, ckpt):
    model, ref = _patched_pair(method, ckpt, "patch-first", block=block)
    report_sites = [s for s in model.modules() if type(s).__name__ == "MergeSite"]
    assert len(report_sites) == (8 if block is PreNormInplaceBlock else 4)
    assert all(s.inplace == "update" for s in report_sites[1::2]) if block is PreNormInplaceBlock else True
    x = _x(1)
    assert_same_grads(grads_of(model, _loss(x)), grads_of(ref, _loss(x)))


class Body(nn.Module):
    """The whole chain in one module (its owner), checkpointed as one region by :class:`Whole`."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(PreNormBlock(C) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Whole(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Linear(C, C), Body(), nn.Linear(C, 3)
        self.ckpt = False

    def forward(self, x):
        x = self.emb(x)
        x = checkpoint(self.body, x, use_reentrant=False) if self.ckpt else self.body(x)
        return self.head(x)


@pytest.mark.parametrize("method", ["mgr", "attnres", "hc"])
def test_the_whole_chain_and_its_owner_in_one_checkpointed_region(method):
    """The recomputation re-runs the chain's owner (its reset and end hooks) and all of the chain's merges."""
    torch.manual_seed(0)
    model = Whole()
    randomize_rule(model, patch_residuals(model, method=method, example_input=(_x(),), **exact_options(method)))
    ref = copy.deepcopy(model)
    model.ckpt = True
    assert_same_grads(grads_of(model, _loss(_x(1))), grads_of(ref, _loss(_x(1))))


@pytest.mark.parametrize("method", ["mgr", "attnres", "mhc-lite"])
def test_offloaded_block_inputs_give_the_gradients_of_the_plain_patched_model(method):
    """The block's input comes back from backward as another tensor: the recomputation finds the chain state
    kept with its checkpointed region."""
    model, ref = _patched_pair(method, "offload", "patch-first")
    x = _x(1)
    assert_same_grads(grads_of(model, _loss(x)), grads_of(ref, _loss(x)))


@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
@pytest.mark.parametrize("ckpt", ["block", "sequential"])
def test_reentrant_checkpoint_is_refused_at_the_first_training_forward(ckpt, order):
    model, _ = _patched_pair("mgr", ckpt, order, reentrant=True)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False"):
        model(_x(1))
    # inference through the same checkpointed model is fine (nothing to differentiate)
    with torch.no_grad():
        model.eval()
        out = model(_x(1))
        model.ckpt = None
        torch.testing.assert_close(model(_x(1)), out)


# ---------------------------------------------------------------------------------------------- HF transformers
def _hf(name):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _lm_loss(model):
    return model(IDS, labels=IDS).loss


def _hf_pair(name, method, order, **kwargs):
    torch.manual_seed(0)
    model = _hf(name).train()
    if order == "ckpt-first":
        model.gradient_checkpointing_enable(**kwargs)
    report = patch_residuals(model, method=method, example_input=IDS, **exact_options(method))
    randomize_rule(model, report)
    ref = copy.deepcopy(model)
    if order == "patch-first":  # HF Trainer's order: the model is patched, then the Trainer enables checkpointing
        model.gradient_checkpointing_enable(**kwargs)
    else:
        ref.gradient_checkpointing_disable()
    assert model.is_gradient_checkpointing and not ref.is_gradient_checkpointing
    return model, ref


@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
@pytest.mark.parametrize("name,method", [("gpt2", m) for m in CHAIN] + [("llama", "mgr"), ("llama", "attnres"),
                                                                         ("llama", "mhc-lite")])
def test_hf_gradient_checkpointing_gives_the_gradients_of_the_plain_patched_model(name, method, order):
    model, ref = _hf_pair(name, method, order)
    got = grads_of(model, _lm_loss)
    assert_same_grads(got, grads_of(ref, _lm_loss))
    assert any("_resctl" in k for k in got)


class _CopyingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """Stand-in for ``save_on_cpu(pin_memory=True)`` on a GPU (a CPU cannot pin memory): what is saved comes back
    from backward as a copy."""

    def __init__(self, pin_memory=False, device_type="cpu"):
        super().__init__(lambda t: t.clone(), lambda t: t)


def test_hf_offloaded_activation_checkpointing(monkeypatch):
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", _CopyingSaveOnCpu)
    model, ref = _hf_pair("gpt2", "mgr", "patch-first")
    model.gradient_checkpointing_disable()
    model.activation_checkpointing_enable(offload=True)
    assert_same_grads(grads_of(model, _lm_loss), grads_of(ref, _lm_loss))


def test_hf_reentrant_gradient_checkpointing_is_refused_at_the_first_forward():
    model, _ = _hf_pair("gpt2", "hc", "patch-first", gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()  # what HF does for reentrant checkpointing of adapters (PEFT)
    with pytest.raises(RuntimeError, match=r"gradient_checkpointing_kwargs=\{'use_reentrant': False\}"):
        _lm_loss(model)


# ---------------------------------------------------------------------------------------------- wrappers, FSDP2
@pytest.mark.parametrize("order", ["ckpt-first", "patch-first"])
def test_checkpoint_wrapper_in_either_order(order):
    """torch.distributed's ``checkpoint_wrapper`` (what FSDP recipes apply per block) replaces the blocks by
    wrappers: applied before the patch (the patch finds the merges through it) or after."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(m):
        for i, b in enumerate(m.blocks):
            m.blocks[i] = checkpoint_wrapper(b)

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    if order == "ckpt-first":
        wrap(model)
    for m in (model, ref):
        randomize_rule(m, patch_residuals(m, method="mhc", example_input=(_x(),)))
    if order == "patch-first":
        wrap(model)
    assert type(model.blocks[0]).__name__ == "CheckpointWrapper"
    got = {k.replace("_checkpoint_wrapped_module.", ""): g for k, g in grads_of(model, _loss(_x(1))).items()}
    assert_same_grads(got, grads_of(ref, _loss(_x(1))))


FSDP2_METHODS = ("mgr", "attnres-block", "dwa", "ddl")


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    """One launch of the two ModelParallelStrategy processes, training each of ``FSDP2_METHODS`` in turn."""
    import os
    import subprocess
    import sys

    import _resctl_ckpt_dist_script as script

    out = tmp_path_factory.mktemp("fsdp2")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, script.__file__, ",".join(FSDP2_METHODS), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("method", FSDP2_METHODS)
def test_fsdp2_model_parallel_strategy_with_checkpointed_blocks(method, fsdp2_runs):
    """Lightning's ModelParallelStrategy (2 CPU processes, gloo), blocks in checkpoint_wrapper, fully_shard:
    the full gradients of one step equal the single-process, non-checkpointed patched model's on the union of
    the ranks' batches."""
    import _resctl_ckpt_dist_script as script
    from models import NanoGPT

    tmp_path = fsdp2_runs / method
    dist = torch.load(tmp_path / "grads.pt")
    ref = NanoGPT(**script.CFG)
    patch_residuals(ref, method=method, example_input=torch.zeros(2, script.CFG["block_size"], dtype=torch.long),
                    **exact_options(method))
    start = torch.load(tmp_path / "start.pt")
    weights = {k: v.reshape(ref.state_dict()[k].shape) for k, v in start.items() if not k.endswith("_extra_state")}
    result = ref.load_state_dict(weights, strict=False)  # the site records differ in ``invert`` only
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    x, y = script.data().tensors
    want = grads_of(ref, lambda m: script.loss_of(m, x, y))
    assert any("_resctl" in k for k in want)
    assert_same_grads({k: g.reshape(want[k].shape) for k, g in dist.items()}, want)


# ---------------------------------------------------------------------------------------------- compile, autocast
@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "side-effects-skipped"])
@pytest.mark.parametrize("method", ["mgr", "attnres-block", "hc"])
def test_compiled_checkpointed_patched_model(method, fullgraph):
    """torch.compile (aot_eager) of a patched model with checkpointed blocks. By default dynamo does not trace a
    checkpoint whose body mutates state outside it (the chain's bookkeeping) and runs that part eagerly, where the
    recomputation replays; with ``skip_fwd_side_effects_in_bwd_under_checkpoint`` it compiles the whole forward
    into one graph (``fullgraph=True``) and its partitioner recomputes the tensors. Exact gradients either way."""
    import torch._dynamo

    model, ref = _patched_pair(method, "block", "patch-first")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=fullgraph):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        for seed in (1, 2):
            got = {k.replace("_orig_mod.", ""): g for k, g in grads_of(compiled, _loss(_x(seed))).items()}
            assert_same_grads(got, grads_of(ref, _loss(_x(seed))))
    torch._dynamo.reset()


@pytest.mark.parametrize("method", CHAIN)
def test_bf16_autocast_checkpointed_equals_bf16_autocast_plain(method):
    model, ref = _patched_pair(method, "block", "patch-first")
    x = _x(1)

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().square().mean()

    assert_same_grads(grads_of(model, loss), grads_of(ref, loss))
