"""patch_residuals on Hugging Face transformers v5 models (random init from small configs, nothing downloaded)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetModel,
)
from transformers.models.resnet.modeling_resnet import ResNetBasicLayer  # noqa: E402

from lightning_resctl import merge_rules  # noqa: E402
from lightning_resctl.rules import get_merge_rule  # noqa: E402
from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals, unpatch_residuals  # noqa: E402

# every registered rule (name variants that only preset options, e.g. mgr-competitive, are covered by their base)
METHODS = [m for m in merge_rules() if not get_merge_rule(m).preset]
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _gpt2(n_layer=2):
    cfg = GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _llama(n_layer=2):
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _bert(n_layer=2):
    cfg = BertConfig(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertModel(cfg)


def _resnet():
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], layer_type="basic")
    return ResNetModel(cfg)


def _images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def _train_losses(model, loss_fn, steps=5, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _lm_loss(model):
    return model(IDS, labels=IDS).loss


# ---------------------------------------------------------------------------------------------- decoders
@pytest.mark.parametrize("make,file", [(_gpt2, "modeling_gpt2.py"), (_llama, "modeling_llama.py")],
                         ids=["gpt2", "llama"])
def test_decoders_have_exactly_2n_sites(make, file):
    model = make(n_layer=3)
    report = patch_residuals(model, method="add", example_input=IDS)
    assert len(report.sites) == 6
    assert len(report.chains) == 1 and [s.position for s in report.sites] == list(range(6))
    assert all(file in s.location and s.stream_shape == (2, 8, 32) for s in report.sites)
    assert all("residual" in s.source_line for s in report.sites)
    # masks, positions and RoPE are seen and rejected, never patched
    assert report.skipped and all("residual" not in s.source_line for s in report.skipped)


def test_gpt2_operand_order_is_recognised():
    report = patch_residuals(_gpt2(), method="add", example_input=IDS)
    attn, mlp = report.sites[:2]
    assert attn.source_line == "hidden_states = attn_output + residual" and attn.stream_operand == "right"
    assert mlp.source_line == "hidden_states = residual + feed_forward_hidden_states" and mlp.stream_operand == "left"


@pytest.mark.parametrize("make", [_gpt2, _llama, _bert], ids=["gpt2", "llama", "bert"])
def test_add_is_bitwise_equal_and_unpatch_restores(make):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    kwargs = {"labels": IDS} if make is not _bert else {}

    def loss_of(m):
        out = m(IDS, **kwargs)
        return out.loss if make is not _bert else out.last_hidden_state.pow(2).mean()

    before = loss_of(model).detach()
    patch_residuals(model, method="add", example_input=IDS)
    loss_of(ref).backward()
    loss = loss_of(model)
    loss.backward()
    assert torch.equal(loss.detach(), before)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or grads[name].grad is not None:
            assert torch.equal(p.grad, grads[name].grad), name
    unpatch_residuals(model)
    assert torch.equal(loss_of(model).detach(), before)


@pytest.mark.parametrize("method", METHODS)
def test_gpt2_trains_and_hidden_states_keep_their_form(method):
    torch.manual_seed(0)
    model = _gpt2()
    ref_hidden = [h.shape for h in model(IDS, output_hidden_states=True).hidden_states]
    patch_residuals(model, method=method, example_input=IDS)
    out = model(IDS, output_hidden_states=True)
    assert [h.shape for h in out.hidden_states] == ref_hidden == [torch.Size([2, 8, 32])] * 3
    losses = _train_losses(model, _lm_loss)
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("method", [m for m in METHODS if m != "add"])
def test_llama_trains(method):
    torch.manual_seed(0)
    model = _llama()
    report = patch_residuals(model, method=method, example_input=IDS)
    assert len(report.sites) == 4
    losses = _train_losses(model, _lm_loss)
    assert losses[-1] < losses[0] - 0.05, losses


# ---------------------------------------------------------------------------------------------- BERT (post-norm)
@pytest.mark.parametrize("method", METHODS)
def test_bert_post_norm_merges_inside_layernorm(method):
    torch.manual_seed(0)
    model = _bert()
    report = patch_residuals(model, method=method, example_input=IDS)
    assert len(report.sites) == 4
    assert all(s.source_line.startswith("hidden_states = self.LayerNorm(hidden_states + input_tensor)")
               for s in report.sites)
    # the LayerNorm sits between merges: each merge is its own chain
    assert [(s.chain, s.position) for s in report.sites] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    target = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    losses = _train_losses(model, lambda m: (m(IDS).last_hidden_state - target).pow(2).mean())
    assert losses[-1] < losses[0], losses


# ---------------------------------------------------------------------------------------------- ResNet (channels-first)
def test_resnet_channels_first_and_projection_shortcut_skipped():
    torch.manual_seed(0)
    ref = _resnet()
    model = copy.deepcopy(ref)
    x = _images()
    report = patch_residuals(model, method="add", example_input=x)
    assert [s.path for s in report.sites] == ["encoder.stages.0.layers.0", "encoder.stages.1.layers.1"]
    assert all(s.dim == 1 and s.source_line == "hidden_state += residual" for s in report.sites)
    assert report.sites[1].stream_shape == (2, 16, 4, 4)
    (skip,) = report.skipped
    assert skip.path == "encoder.stages.1.layers.0" and skip.reason.startswith("projection shortcut")
    assert isinstance(model.encoder.stages[0].layers[0], ResNetBasicLayer)
    assert torch.equal(model(x).pooler_output, ref(x).pooler_output)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "add"])
def test_resnet_trains(method):
    torch.manual_seed(0)
    model = _resnet()
    x = _images()
    report = patch_residuals(model, method=method, example_input=x)
    if get_merge_rule(method).kind != "chain":  # a per-merge rule's module works on the channels (dim 1)
        assert all(s.module.dim == 1 for s in report.sites)
    else:
        assert all(c.module.dim == 16 or c.module.dim == 8 for c in report.chains)
        seen = []
        merge_sites(model)[1].observer = lambda site, s, u, streams: seen.append(
            None if streams is None else tuple(streams.shape))
        model(x)
        merge_sites(model)[1].observer = None
        if method == "mgr":
            assert seen == [(2, 4, 4, 1, 16)]  # features last; one stream entering a chain's first merge
        elif seen != [None]:  # the rule's streams: (N, H, W, m, C), features last
            (shape,) = seen
            assert shape[:3] == (2, 4, 4) and shape[-1] == 16, shape
    target = torch.randn(2, 16, 1, 1, generator=torch.Generator().manual_seed(4))
    losses = _train_losses(model, lambda m: (m(x).pooler_output - target).pow(2).mean(), lr=1e-2)
    assert losses[-1] < losses[0], losses


def test_gradient_checkpointing_rescontroller_recomputes():
    """(Chain rules under HF checkpointing: tests/test_checkpointing.py.)"""
    torch.manual_seed(0)
    model = _gpt2()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    ref = copy.deepcopy(model)
    getattr(ref, "activation_checkpointing_disable", ref.gradient_checkpointing_disable)()
    patch_residuals(model, method="rescontroller", example_input=IDS)
    patch_residuals(ref, method="rescontroller", example_input=IDS)
    _lm_loss(model).backward()
    _lm_loss(ref).backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


def _opt():
    cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2,
                                 vocab_size=64, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0)
    return transformers.OPTForCausalLM(cfg), IDS, "logits"


def _t5():
    cfg = transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64,
                                dropout_rate=0.0)
    return transformers.T5Model(cfg), {"input_ids": IDS, "decoder_input_ids": IDS}, "last_hidden_state"


def _convnext():
    cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2)
    return transformers.ConvNextModel(cfg), _images(), "last_hidden_state"


@pytest.mark.parametrize("make,chains,dims", [(_opt, [4], -1), (_t5, [4, 6], -1), (_convnext, [1, 2], 1)],
                         ids=["opt-reshaped-stream", "t5-encoder-decoder", "convnext-channels-first"])
def test_more_architectures(make, chains, dims):
    """OPT re-views its stream as (B*T, C) between merges (still one chain); T5 has an encoder and a
    decoder chain; ConvNeXt's blocks are channels-first although their MLP is channels-last."""
    torch.manual_seed(0)
    model, x, field = make()

    def run(m):
        out = m(**x) if isinstance(x, dict) else m(x)
        return getattr(out, field)

    before = run(model)
    report = patch_residuals(model, method="add", example_input=x)
    assert [c.length for c in report.chains] == chains and {s.dim for s in report.sites} == {dims}
    assert torch.equal(run(model), before)
    unpatch_residuals(model)
    patch_residuals(model, method="mgr", example_input=x)
    out = run(model)
    assert out.shape == before.shape
    out.pow(2).mean().backward()
    assert all(c.module.merges[0].pool_query.grad is not None for c in get_patch_report(model).chains)
