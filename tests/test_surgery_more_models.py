"""patch_residuals on more third-party architectures (HF transformers v5, random init from tiny configs, nothing
downloaded) and on hand-written models probing what is and is not a residual merge.

For each model: ``method="add"`` is bitwise equal (outputs and gradients), the sites are exactly the true merges
(read from the model's source), nothing else is patched, ``unpatch_residuals`` is bitwise, and "rescontroller" and
"mgr" run forward and backward with finite values.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_resctl.surgery import merge_sites, patch_residuals, unpatch_residuals
from surgery_checks import one_thread  # noqa: F401 (module fixture)

C = 16
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
IMG = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
SEQ = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3))


def _run(model, x):
    torch.manual_seed(0)  # same dropout / drop-path draws for the reference and the patched model
    if isinstance(x, dict):
        return model(**x)
    return model(x)


def _out(model, x, field):
    out = _run(model, x)
    return out if field is None else getattr(out, field)


def _check(make, x, field=None, methods=("rescontroller", "mgr")):
    """Patch with "add" (bitwise outputs + grads, bitwise unpatch), then each method (finite forward+backward).
    Returns the "add" report."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    before = _out(model, x, field).detach()
    report = patch_residuals(model, method="add", example_input=x)
    _out(ref, x, field).float().pow(2).mean().backward()
    out = _out(model, x, field)
    out.float().pow(2).mean().backward()
    assert torch.equal(out.detach(), before)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = grads[name].grad
        assert (p.grad is None) == (g is None), name
        assert p.grad is None or torch.equal(p.grad, g), name
    unpatch_residuals(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert torch.equal(_out(model, x, field).detach(), before)
    for method in methods:
        m = copy.deepcopy(ref)
        patched = patch_residuals(m, method=method, example_input=x, backend="torch")  # no Triton interpreter
        assert len(patched.sites) == len(report.sites)
        out = _out(m, x, field)
        out.float().pow(2).mean().backward()
        assert out.shape == before.shape and torch.isfinite(out).all()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    return report


# ---------------------------------------------------------------------------------------------- HF transformers
transformers = pytest.importorskip("transformers")
T = transformers
_LM = dict(vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_LLAMA_LIKE = dict(_LM, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32)


def _mistral():
    return T.MistralForCausalLM(T.MistralConfig(**_LLAMA_LIKE, head_dim=16))


def _cohere():
    return T.CohereForCausalLM(T.CohereConfig(**_LLAMA_LIKE))


def _neox(parallel):
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**dict(_LLAMA_LIKE, num_key_value_heads=2),
                                                use_parallel_residual=parallel, hidden_dropout=0.0))


def _gemma2():
    return T.Gemma2ForCausalLM(T.Gemma2Config(**_LLAMA_LIKE, head_dim=16))


def _granite():
    return T.GraniteForCausalLM(T.GraniteConfig(**_LLAMA_LIKE, residual_multiplier=0.5))


def _stablelm():
    return T.StableLmForCausalLM(T.StableLmConfig(**_LLAMA_LIKE))


def _mixtral():
    return T.MixtralForCausalLM(T.MixtralConfig(**_LLAMA_LIKE, num_local_experts=2, num_experts_per_tok=1))


def _phi():
    return T.PhiForCausalLM(T.PhiConfig(**_LLAMA_LIKE, resid_pdrop=0.0))


def _gptj():
    return T.GPTJForCausalLM(T.GPTJConfig(**_LM, n_layer=2, n_embd=32, n_head=2, rotary_dim=8, n_positions=32))


def _mpt():
    return T.MptForCausalLM(T.MptConfig(**_LM, n_layers=2, d_model=32, n_heads=2, max_seq_len=32))


def _distilbert():
    return T.DistilBertModel(T.DistilBertConfig(vocab_size=64, n_layers=2, dim=32, n_heads=2, hidden_dim=64,
                                                max_position_embeddings=32, pad_token_id=0))


def _vit():
    return T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32,
                                  intermediate_size=64, num_attention_heads=2))


def _beit():
    return T.BeitModel(T.BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, layer_scale_init_value=0.1,
                                    use_relative_position_bias=True, drop_path_rate=0.1))


def _poolformer():
    return T.PoolFormerModel(T.PoolFormerConfig(hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2,
                                                patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1], mlp_ratio=2.0))


def _levit():
    return T.LevitModel(T.LevitConfig(image_size=32, hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                      depths=[1, 1], key_dim=[8, 8], drop_path_rate=0, mlp_ratio=[2, 2],
                                      attention_ratio=[2, 2], down_ops=[["Subsample", 8, 1, 2, 2, 2]]))


def _efficientnet():
    return T.EfficientNetModel(T.EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.3,
                                                    hidden_dim=320))


def _mobilevit():
    return T.MobileViTModel(T.MobileViTConfig(image_size=32, hidden_sizes=[16, 24, 32],
                                              neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]))


def _bart():
    return T.BartModel(T.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
                                    eos_token_id=2, decoder_start_token_id=2))


def _swin():
    return T.SwinModel(T.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                    window_size=4, drop_path_rate=0.1))


def _mobilenet():
    return T.MobileNetV2Model(T.MobileNetV2Config(image_size=32, depth_multiplier=0.25))


_S2S = {"input_ids": IDS, "decoder_input_ids": IDS}
# (model, input, output field, chain lengths, source lines of the merges)
HF_CASES = {
    "mistral": (_mistral, IDS, "logits", [4], {"hidden_states = residual + hidden_states"}),
    # parallel block written stream first (residual + attn + mlp): one merge of the branches' sum per layer
    "cohere-parallel": (_cohere, IDS, "logits", [2],
                        {"hidden_states = residual + hidden_states_attention + hidden_states_mlp"}),
    "gemma2-mask-skipped": (_gemma2, IDS, "logits", [4], {"hidden_states = residual + hidden_states"}),
    "granite-multiplier": (_granite, IDS, "logits", [4],
                           {"hidden_states = residual + hidden_states * self.residual_multiplier"}),
    "stablelm-renamed-stream": (_stablelm, IDS, "logits", [4],
                                {"residual = residual + self_attn_output", "hidden_states = residual + mlp_output"}),
    "mixtral-moe": (_mixtral, IDS, "logits", [4], {"hidden_states = residual + hidden_states"}),
    # MPT's MLP merge sits inside the ffn module: the chain crosses module boundaries
    "mpt": (_mpt, IDS, "logits", [4],
            {"hidden_states = self.resid_attn_dropout(attn_outputs) + residual", "output = output + residual"}),
    # parallel residual written branches first: mlp + attn (two branches, skipped) + residual (one merge)
    "neox-parallel": (lambda: _neox(True), IDS, "logits", [2],
                      {"hidden_states = mlp_output + attn_output + hidden_states"}),
    "phi-parallel": (_phi, IDS, "logits", [2],
                     {"hidden_states = attn_outputs + feed_forward_hidden_states + residual"}),
    "gptj-parallel": (_gptj, IDS, "logits", [2], {"return attn_output + feed_forward_hidden_states + residual"}),
    "neox-sequential": (lambda: _neox(False), IDS, "logits", [4],
                        {"attn_output = attn_output + hidden_states", "hidden_states = mlp_output + attn_output"}),
    # post-norm: a LayerNorm between merges, each merge its own chain
    "distilbert-post-norm": (_distilbert, IDS, "last_hidden_state", [1, 1, 1, 1],
                             {"attention_output = self.sa_layer_norm(attention_output + hidden_states)",
                              "ffn_output = self.output_layer_norm(ffn_output + attention_output)"}),
    "vit": (_vit, IMG, "last_hidden_state", [4], {"hidden_states = hidden_states + residual"}),
    # layer scale (lambda_1 * x) and drop path are part of the update
    "beit-layer-scale": (_beit, IMG, "last_hidden_state", [4],
                         {"hidden_states = self.drop_path(hidden_states) + residual"}),
    # the token mixer is a parameter-free pooling, scaled by a learned layer scale
    "poolformer": (_poolformer, IMG, "last_hidden_state", [2, 2],
                   {"hidden_states = hidden_states + self.drop_path(scaled_op)",
                    "output = hidden_states + self.drop_path(scaled_op)"}),
    # attention biases are skipped; the subsampling blocks have no merge and split the chain
    "levit": (_levit, IMG, "last_hidden_state", [2, 3],
              {"hidden_state = hidden_state + self.module(hidden_state)"}),
    # encoder-decoder, post-norm: 2 merges per encoder layer, 3 per decoder layer (cross-attention)
    "bart": (_bart, _S2S, "last_hidden_state", [1] * 10, {"hidden_states = residual + hidden_states"}),
    "swin-drop-path": (_swin, IMG, "last_hidden_state", [4, 4],
                       {"hidden_states = shortcut + self.drop_path(attention_windows)",
                        "hidden_states = self.dropout(hidden_states) + residual"}),
    # inverted residuals: only blocks with stride 1 and in == out channels have a merge; channels-first
    "mobilenet_v2": (_mobilenet, IMG, "last_hidden_state", [1, 2, 3, 2, 2],
                     {"return residual + features if self.use_residual else features"}),
    # squeeze-excitation multiplies (not a merge); one block with stride 1 and in == out has a merge
    "efficientnet": (_efficientnet, IMG, "last_hidden_state", [1], {"hidden_states = hidden_states + embeddings"}),
    # conv inverted residuals (channels-first) then transformer blocks (channels-last) in one model
    "mobilevit": (_mobilevit, IMG, "last_hidden_state", [1, 2, 4, 8, 6],
                  {"return residual + features if self.use_residual else features",
                   "hidden_states = attention_output + hidden_states", "hidden_states = hidden_states + input_tensor"}),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_architecture(name):
    make, x, field, chains, lines = HF_CASES[name]
    report = _check(make, x, field)
    assert [c.length for c in report.chains] == chains
    assert {s.source_line for s in report.sites} == lines
    # nothing else is patched, and what is skipped is skipped for being no merge (masks, positions, rotary
    # embeddings, two-branch sums, activations), never for a failure to rewrite
    known = ("broadcast", "independent", "two branches", "without learned parameters", "not floating point")
    for skip in report.skipped:
        assert any(k in skip.reason for k in known), (skip.source_line, skip.reason)
    if name in ("mobilenet_v2", "efficientnet"):
        assert {s.dim for s in report.sites} == {1}
    if name == "mobilevit":
        assert [s.dim for s in report.sites if s.chain < 2] == [1, 1, 1]
        assert {s.dim for s in report.sites if s.chain >= 2} == {-1}


def test_whisper_encoder_and_decoder_chains():
    def make():
        return T.WhisperModel(T.WhisperConfig(
            vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, max_source_positions=8,
            max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0))

    feats = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    report = _check(make, {"input_features": feats, "decoder_input_ids": IDS}, "last_hidden_state")
    # pre-norm: one encoder chain (self-attn, mlp) and one decoder chain (self-attn, cross-attn, mlp)
    assert [c.length for c in report.chains] == [4, 6]
    assert [s.path for s in report.sites if s.chain == 1] == ["decoder.layers.0"] * 3 + ["decoder.layers.1"] * 3
    assert any("embed_positions" in s.source_line for s in report.skipped)


def test_albert_shared_layer_rescontroller_and_mgr_refusal():
    def make():
        return T.AlbertModel(T.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                            pad_token_id=0))

    report = _check(make, IDS, "last_hidden_state", methods=("rescontroller",))
    # one weight-shared layer applied 3 times, post-norm: 6 merges from 2 expressions, each its own chain
    assert len(report.sites) == 6 and [c.length for c in report.chains] == [1] * 6
    model = make()
    patch_residuals(model, method="add", example_input=IDS)
    assert len(merge_sites(model)) == 2  # one site per expression, shared by the 3 applications
    with pytest.raises(RuntimeError, match="several chains"):
        patch_residuals(make(), method="mgr", example_input=IDS)


def test_falcon_merge_in_a_free_function_is_patched():
    """Falcon merges in ``dropout_add`` (a free function): patched per call site (tests/test_surgery_functions.py
    has the details); its default parallel block sums the two branches first (skipped), then one merge."""
    def make():
        return T.FalconForCausalLM(T.FalconConfig(**_LM, num_hidden_layers=2, hidden_size=32, num_attention_heads=2))

    report = _check(make, IDS, "logits")
    assert [c.length for c in report.chains] == [2]
    assert {(s.source_line, s.function) for s in report.sites} == {("out = residual + out", "dropout_add")}
    reasons = {s.source_line: s.reason for s in report.skipped}
    assert "two branches" in reasons["mlp_output += attention_output"]


# ---------------------------------------------------------------------------------------------- hand-written models
class _Mlp(nn.Sequential):
    def __init__(self, c=C):
        super().__init__(nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))


class _ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class _UNet(nn.Module):
    """U-Net: concatenated skips (not merges)."""

    def __init__(self):
        super().__init__()
        self.e1, self.e2, self.mid = _ConvBNReLU(3, 8), _ConvBNReLU(8, 16), _ConvBNReLU(16, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.d1, self.out = _ConvBNReLU(16, 8), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.e1(x)
        b = self.mid(self.e2(F.max_pool2d(a, 2)))
        return self.out(self.d1(torch.cat([self.up(b), a], 1)))


class _DenseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(_ConvBNReLU(8 + 4 * i, 4) for i in range(3))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return x


class _Highway(nn.Module):
    """(1 - t) * x + t * f(x): a convex combination of two branches, no identity stream."""

    def __init__(self):
        super().__init__()
        self.f, self.t = _Mlp(), nn.Linear(C, C)

    def forward(self, x):
        t = torch.sigmoid(self.t(x))
        return (1 - t) * x + t * self.f(x)


@pytest.mark.parametrize("make,x", [(_UNet, IMG[:, :, :8, :8]), (_DenseNet, IMG[:, :, :8, :8]), (_Highway, SEQ)],
                         ids=["unet-concat", "densenet-concat", "highway"])
def test_no_residual_merge_nothing_patched(make, x):
    with pytest.raises(RuntimeError, match="no residual merge"):
        patch_residuals(make(), method="add", example_input=x)


class _SE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class _SEBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.bn, self.se = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), _SE(c)

    def forward(self, x):
        out = self.se(F.relu(self.bn(self.conv(x))))
        out += x
        return F.relu(out)


class _SEResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(_SEBlock(8), _SEBlock(8))

    def forward(self, x):
        return self.blocks(self.stem(x))


def test_squeeze_excitation_resnet():
    report = _check(_SEResNet, IMG[:, :, :8, :8])
    assert [s.source_line for s in report.sites] == ["out += x"] * 2
    assert {s.dim for s in report.sites} == {1} and report.skipped == []


class _Gated(nn.Module):
    """x + sigmoid(g(x)) * f(x) and ReZero's x + alpha * f(x): the gate/scale is part of the update."""

    def __init__(self):
        super().__init__()
        self.f, self.f2, self.g = _Mlp(), _Mlp(), nn.Linear(C, C)
        self.alpha = nn.Parameter(torch.full((), 0.5))

    def forward(self, x):
        x = x + torch.sigmoid(self.g(x)) * self.f(x)
        x = x + self.alpha * self.f2(x)
        return x


def test_gated_and_rezero_residuals():
    report = _check(_Gated, SEQ)
    assert [s.source_line for s in report.sites] == ["x = x + torch.sigmoid(self.g(x)) * self.f(x)",
                                                     "x = x + self.alpha * self.f2(x)"]
    assert [c.length for c in report.chains] == [2]


class _DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * mask / (1 - self.p)


class _DropPathBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1, self.f2, self.drop_path = _Mlp(), _Mlp(), _DropPath(0.5)

    def forward(self, x):
        x = x + self.drop_path(self.f1(x))
        x = x + self.drop_path(self.f2(x))
        return x


class _DropPathNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(_DropPathBlock(), _DropPathBlock())

    def forward(self, x):
        return self.blocks(x)


def test_drop_path_residual_in_training_mode():
    report = _check(_DropPathNet, torch.randn(8, 5, C))
    assert [c.length for c in report.chains] == [4]
    assert report.sites[0].source_line == "x = x + self.drop_path(self.f1(x))"


class _PreBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = _Mlp()

    def forward(self, x):
        return x + self.f(x)


class _SharedTwice(nn.Module):
    """One weight-tied block applied three times: one site, three positions of one chain."""

    def __init__(self):
        super().__init__()
        self.block, self.head = _PreBlock(), nn.Linear(C, C)

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return self.head(x)


class _Siamese(nn.Module):
    """One block applied to two inputs: two chains through one expression."""

    def __init__(self):
        super().__init__()
        self.block = _PreBlock()

    def forward(self, x):
        return self.block(x) * self.block(x.flip(0))


def test_weight_tied_block_applied_three_times():
    report = _check(_SharedTwice, SEQ)
    assert [c.length for c in report.chains] == [3]
    model = _SharedTwice()
    patch_residuals(model, method="mgr", example_input=SEQ)
    (site,) = merge_sites(model)
    assert site.positions == (0, 1, 2) and len(site.chain_module.merges) == 3


def test_one_block_in_two_chains():
    report = _check(_Siamese, SEQ, methods=("rescontroller",))
    assert [c.length for c in report.chains] == [1, 1]
    with pytest.raises(RuntimeError, match="several chains"):
        patch_residuals(_Siamese(), method="mgr", example_input=SEQ)


# ---------------------------------------------------------------------------------------------- fixed bugs
class _ExpandedPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.pos = nn.Parameter(torch.randn(1, 5, C))
        self.mlp = _Mlp()

    def forward(self, x):
        x = self.fc(x)
        x = x + self.pos.expand_as(x)  # a positional embedding: x only gives the shape
        return x + self.mlp(x)


def test_positional_embedding_expanded_like_the_stream_is_not_a_merge():
    """``pos.expand_as(x)`` reads only x's shape: it is not an update computed from x."""
    report = _check(_ExpandedPosition, SEQ)
    assert [s.source_line for s in report.sites] == ["return x + self.mlp(x)"]
    reasons = {s.source_line.split("#")[0].strip(): s.reason for s in report.skipped}
    assert "independent" in reasons["x = x + self.pos.expand_as(x)"]


class _DerivedWeights(nn.Module):
    """Branches whose weights reach the matmul through ops: ``W.t()``, ``weight.to(dtype)``, weight_norm."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(C, C) / 4)
        self.lin = nn.Linear(C, C, bias=False)
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(C, C, bias=False))

    def forward(self, x):
        x = x + F.gelu(x @ self.w.t())
        x = x + F.linear(x, self.lin.weight.to(x.dtype))
        x = x + self.wn(x)
        return x


def test_branch_with_weights_computed_from_parameters_is_a_merge():
    report = _check(_DerivedWeights, SEQ)
    assert [s.source_line for s in report.sites] == ["x = x + F.gelu(x @ self.w.t())",
                                                     "x = x + F.linear(x, self.lin.weight.to(x.dtype))",
                                                     "x = x + self.wn(x)"]
    assert [c.length for c in report.chains] == [3] and report.skipped == []


class _ParallelStreamFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g, self.h = _Mlp(), _Mlp(), _Mlp()

    def forward(self, x):
        x = x + self.f(x) + self.g(x)
        x = self.h(x) + x
        return x


def test_parallel_block_written_stream_first_is_one_merge():
    """``x + f(x) + g(x)``: g(x) is a branch of the stream added to the first merge's result, not a sum of
    two unrelated branches: one merge of x and f(x) + g(x) (a parallel block, docs/surgery.md)."""
    report = _check(_ParallelStreamFirst, SEQ)
    assert [(s.chain, s.position) for s in report.sites] == [(0, 0), (0, 1)]
    assert [s.stream_operand for s in report.sites] == ["left", "right"]
    assert [len(s.parallel_parts) for s in report.sites] == [1, 0]
    assert report.skipped == []


class _ResidualSequential(nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


def test_model_that_is_a_sequential():
    """A root nn.Sequential must not get MGR's chain as a child (it would run it as a layer); an addition in a
    Sequential subclass's forward is skipped (a site registered there would be iterated as a layer)."""
    report = _check(lambda: nn.Sequential(_PreBlock(), _PreBlock()), SEQ)
    assert [c.length for c in report.chains] == [2]
    model = nn.Sequential(_PreBlock(), _PreBlock())
    report = patch_residuals(model, method="mgr", example_input=SEQ)
    assert report.chains[0].owner == "0._resctl_mgr0"
    model(SEQ).sum().backward()
    report = _check(lambda: nn.Sequential(_ResidualSequential(nn.LayerNorm(C), nn.Linear(C, C)), _PreBlock()), SEQ)
    assert [s.path for s in report.sites] == ["1"]
    (skip,) = report.skipped
    assert skip.path == "0" and "container module" in skip.reason
