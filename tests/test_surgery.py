"""patch_residuals on the hand-written models of tests/models.py."""
from __future__ import annotations

import copy
import functools
import inspect
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_resctl.surgery import (
    MergeSite,
    PatchReport,
    get_patch_report,
    load_unpatched_state_dict,
    merge_sites,
    patch_residuals,
    unpatch_residuals,
)
from models import Block, BranchyNet, NanoGPT, TinyViT, ViTBlock

METHODS = ["add", "rescontroller", "mgr"]


def _gpt(n_layer=2):
    return NanoGPT(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)


def _lm_loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def _loss(model, x):
    if isinstance(model, NanoGPT):
        return _lm_loss(model, x)
    return model(x).float().pow(2).mean()


# ---------------------------------------------------------------------------------------------- finding merges
def test_nanogpt_sites_are_exactly_the_true_merges():
    model = _gpt(n_layer=3)
    report = patch_residuals(model, method="add")
    assert isinstance(report, PatchReport)
    assert len(report.sites) == 6
    assert [(s.chain, s.position) for s in report.sites] == [(0, k) for k in range(6)]
    assert [s.path for s in report.sites] == ["h.0", "h.0", "h.1", "h.1", "h.2", "h.2"]
    assert report.sites[0].source_line == "x = x + self.attn(self.ln_1(x))"
    assert report.sites[1].source_line == "x = x + self.mlp(self.ln_2(x))"
    lines, first = inspect.getsourcelines(Block.forward)
    attn_line = first + next(i for i, t in enumerate(lines) if "x = x + self.attn" in t)
    assert report.sites[0].location.endswith(f"compare/nanogpt.py:{attn_line}")
    assert all(s.stream_shape == (2, 16, 32) and s.method == "add" and s.module is None for s in report.sites)
    assert all(s.stream_operand == "left" for s in report.sites)
    # the positional embedding is not a merge, and says why
    (skip,) = report.skipped
    assert "self.wpe(pos)" in skip.source_line and "broadcast" in skip.reason
    assert len(report.chains) == 1 and report.chains[0].length == 6
    text = str(report)
    assert "h.2" in text and "x = x + self.mlp" in text and "skipped" in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["method"] == "add" and len(d["sites"]) == 6 and d["sites"][3]["position"] == 3


def test_branching_model_every_spelling_and_no_false_merges():
    model = BranchyNet(dim=16, depth=6)
    report = patch_residuals(model, method="add")
    lines = [s.source_line for s in report.sites]
    assert lines == ["x = x + layer(x)", "x = layer(x) + x", "x = torch.add(x, layer(x))",
                     "h += x  # in place, on the update", "x = x + layer(x)", "x = layer(x) + x"]
    assert [s.stream_operand for s in report.sites[:4]] == ["left", "right", "left", "right"]
    assert [s.position for s in report.sites] == list(range(6))
    # one expression in a Python loop runs two merges: one MergeSite, two positions
    sites = merge_sites(model)
    assert len(sites) == 4 and sites[0].positions == (0, 4) and sites[1].positions == (1, 5)
    reasons = {s.source_line.split("#")[0].strip(): s.reason for s in report.skipped}
    assert "broadcast" in reasons["x = self.inp(x) + self.extra_bias"]
    assert "two branches" in reasons["both = self.left(x) + self.right(x)"]


def test_vit_block_with_layer_scale():
    model = TinyViT(depth=3)
    report = patch_residuals(model, method="rescontroller")
    assert len(report.sites) == 6
    assert {s.path for s in report.sites} == {"blocks.0", "blocks.1", "blocks.2"}
    assert report.sites[0].source_line == "x = x + self.gamma_1 * attn_out"
    assert any("self.pos_embed" in s.source_line for s in report.skipped)


def test_elementwise_self_update_is_not_a_merge():
    class GeluTanh(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * torch.pow(x, 3.0))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = GeluTanh()

        def forward(self, x):
            return x + self.fc(self.act(x))

    model = Net()
    report = patch_residuals(model, method="add", example_input=torch.randn(3, 8))
    assert [s.path for s in report.sites] == [""]
    (skip,) = report.skipped
    assert skip.path == "act" and "without learned parameters" in skip.reason


def test_no_merge_raises_and_says_what_was_searched():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"no residual merge.*searched 4 modules of Sequential"):
        patch_residuals(model, method="add", example_input=torch.randn(2, 4))
    report = patch_residuals(model, method="add", example_input=torch.randn(2, 4), allow_empty=True)
    assert len(report.sites) == 0 and get_patch_report(model) is None
    with pytest.raises(ValueError, match="example_input"):
        patch_residuals(model, method="add")


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        patch_residuals(_gpt(), method="sum")
    with pytest.raises(ValueError, match="update_rate"):
        patch_residuals(_gpt(), method="rescontroller", update_rate=0.1)
    with pytest.raises(ValueError, match="num_merges"):
        patch_residuals(_gpt(), method="mgr", num_merges=3)
    with pytest.raises(ValueError, match="method='add' takes no options"):
        patch_residuals(_gpt(), method="add", streams=2)
    with pytest.raises(TypeError, match="wrapped"):
        patch_residuals(torch.compile(_gpt(), backend="eager"), method="add")


def test_include_exclude():
    model = _gpt(n_layer=3)
    report = patch_residuals(model, method="add", include=["h.1", "h.2"], exclude="h.2")
    assert [s.path for s in report.sites] == ["h.1", "h.1"]
    assert sorted(s.path for s in report.skipped if s.reason == "not matched by include") == ["h.0", "h.0"]
    assert sorted(s.path for s in report.skipped if s.reason == "matched by exclude") == ["h.2", "h.2"]


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("make", [_gpt, lambda: TinyViT(depth=2), lambda: BranchyNet(depth=6)],
                         ids=["nanogpt", "vit", "branchy"])
def test_add_is_bitwise_equal_outputs_and_gradients(make):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    x = ref.example_input_array
    patch_residuals(model, method="add")
    _loss(ref, x).backward()
    loss = _loss(model, x)
    loss.backward()
    assert torch.equal(loss, _loss(ref, x).detach())
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[name].grad), name


@pytest.mark.parametrize("method", METHODS)
def test_in_place_and_transparent(method):
    model = _gpt(n_layer=2)
    x = model.example_input_array
    names = [n for n, _ in model.named_parameters()]
    blocks = list(model.h)
    shapes_before = _block_output_shapes(model, x)
    report = patch_residuals(model, method=method)
    # same object, same parameter names (MGR only adds), classes are subclasses of the originals
    after = [n for n, _ in model.named_parameters()]
    assert [n for n in after if n in set(names)] == names
    assert all(isinstance(b, Block) and type(b).__name__ == "Block" and type(b) is not Block for b in blocks)
    assert list(model.h) == blocks
    new = [n for n, _ in model.named_parameters() if n not in names]
    assert sorted(new) == sorted(report.new_parameters)
    if method == "mgr":
        assert new and all(n.startswith("_resctl_mgr0.") for n in new)
        assert "_resctl_mgr0.merges.3.gate_bias" in new and "_resctl_mgr0.output_pool.pool_query" in new
    else:
        assert new == []
    # code between merges sees the original shapes (MGR's streams stay out of the model's code)
    assert _block_output_shapes(model, x) == shapes_before
    assert model(x).shape == (2, 16, 64)


def _block_output_shapes(model, x):
    shapes = []
    hooks = [b.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.shape))) for b in model.h]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return shapes


@pytest.mark.parametrize("method", METHODS)
def test_unpatch_restores_exactly(method):
    model = BranchyNet(depth=6)
    x = model.example_input_array
    before = model(x)
    keys = list(model.state_dict().keys())
    cls = type(model)
    patch_residuals(model, method=method)
    assert type(model) is not cls and merge_sites(model)
    with pytest.raises(RuntimeError, match="already patched"):
        patch_residuals(model, method="add")
    unpatch_residuals(model)
    assert type(model) is cls and merge_sites(model) == [] and get_patch_report(model) is None
    assert list(model.state_dict().keys()) == keys
    assert torch.equal(model(x), before)
    with pytest.raises(RuntimeError, match="not patched"):
        unpatch_residuals(model)
    patch_residuals(model, method="add")  # a fresh patch after unpatching is fine
    assert torch.equal(model(x), before)


def test_patching_a_submodule_of_a_patched_model_is_refused():
    model = _gpt()
    patch_residuals(model, method="add")
    with pytest.raises(RuntimeError, match="already patched"):
        patch_residuals(model.h[0], method="add", example_input=torch.randn(1, 4, 32))


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains(method):
    torch.manual_seed(0)
    model = _gpt(n_layer=2)
    x = torch.randint(0, 64, (4, 16))
    report = patch_residuals(model, method=method)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = _lm_loss(model, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    if method == "mgr":  # the new parameters are trained too
        gate_bias = report.sites[3].module.gate_bias
        assert gate_bias.grad is not None and gate_bias.grad.abs().sum() > 0


def test_rescontroller_options_reach_the_merge_modules():
    model = _gpt()
    report = patch_residuals(model, method="rescontroller", update_ratio=0.3, stream_ratio=1.2)
    mods = [s.module for s in report.sites]
    assert all(type(m).__name__ == "ResController" for m in mods)
    assert all(m.update_ratio == 0.3 and m.stream_ratio == 1.2 for m in mods)


def test_mgr_chain_layout_and_options():
    model = _gpt(n_layer=3)
    report = patch_residuals(model, method="mgr", streams=3, gating="independent")
    (chain,) = report.chains
    assert chain.module.streams == 3 and chain.module.gating == "independent" and chain.module.num_merges == 6
    assert chain.output_pool is chain.module.output_pool
    assert [s.module.index for s in report.sites] == list(range(6))
    assert [s.module.accumulating for s in report.sites] == [True, True, False, False, False, False]


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("method", METHODS)
def test_torch_compile_fullgraph(method):
    torch._dynamo.reset()
    model = _gpt(n_layer=2)
    x = model.example_input_array
    patch_residuals(model, method=method)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-6)  # chain state reset between calls


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_into_fresh_patched_twin():
    torch.manual_seed(0)
    model = _gpt()
    x = model.example_input_array
    patch_residuals(model, method="mgr")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _lm_loss(model, x).backward()
    opt.step()  # MGR parameters move away from their init
    twin = _gpt()
    patch_residuals(twin, method="mgr")
    assert not torch.equal(twin(x), model(x))
    twin.load_state_dict(model.state_dict())  # strict
    assert torch.equal(twin(x), model(x))


def test_unpatched_checkpoint_into_patched_model():
    ref = _gpt()
    x = ref.example_input_array
    ckpt = ref.state_dict()
    model = _gpt()
    report = patch_residuals(model, method="mgr")
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(ckpt)
    new_keys = load_unpatched_state_dict(model, ckpt)
    assert sorted(new_keys) == sorted(report.new_keys) and len(new_keys) > len(report.new_parameters) > 0
    assert set(report.new_parameters) < set(new_keys)
    assert all(k.endswith("._extra_state") for k in set(new_keys) - set(report.new_parameters))
    for name, p in ref.named_parameters():
        assert torch.equal(model.get_parameter(name), p)
    with pytest.raises(RuntimeError, match="unexpected keys"):
        load_unpatched_state_dict(model, {**ckpt, "bogus": torch.zeros(1)})
    # ResController adds no parameter, but its sites' records are new keys: a strict load says so
    rc = _gpt()
    rc_report = patch_residuals(rc, method="rescontroller")
    with pytest.raises(RuntimeError, match="_extra_state"):
        rc.load_state_dict(ckpt)
    assert rc_report.new_parameters == []
    assert sorted(load_unpatched_state_dict(rc, ckpt)) == sorted(rc_report.new_keys) and len(rc_report.new_keys) == 4
    assert torch.isfinite(model(x)).all()


def test_deepcopy_of_a_patched_model():
    model = _gpt()
    x = model.example_input_array
    patch_residuals(model, method="mgr")
    clone = copy.deepcopy(model)
    assert torch.equal(clone(x), model(x))
    assert len(merge_sites(clone)) == 4
    assert merge_sites(clone)[0].chain_module is clone._resctl_mgr0
    unpatch_residuals(clone)
    assert type(clone.h[0]) is Block and type(model.h[0]) is not Block


# ---------------------------------------------------------------------------------------------- runtime switches
@pytest.mark.parametrize("method", METHODS)
def test_observer_sees_the_real_tensors(method):
    model = _gpt(n_layer=2)
    x = model.example_input_array
    patch_residuals(model, method=method)
    seen = []
    sites = merge_sites(model)
    for site in sites:
        site.observer = lambda site, stream, update, streams: seen.append(
            (site.position, stream.shape, update.requires_grad, None if streams is None else tuple(streams.shape)))
    _lm_loss(model, x).backward()
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    assert all(s[1] == (2, 16, 32) and s[2] for s in seen)
    if method == "mgr":
        assert [s[3] for s in seen] == [(2, 16, k, 32) for k in (1, 2, 3, 4)]
    else:
        assert all(s[3] is None for s in seen)
    for site in sites:
        site.observer = None
    seen.clear()
    model(x)
    assert seen == []


def test_skip_update_removes_exactly_that_branch_with_add():
    torch.manual_seed(0)
    ref = _gpt(n_layer=2)
    model = copy.deepcopy(ref)
    x = ref.example_input_array
    patch_residuals(model, method="add")
    site = merge_sites(model)[3]
    assert (site.path, site.position) == ("h.1", 3)
    site.skip_update = True
    hook = ref.h[1].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
    assert torch.equal(model(x), ref(x))
    hook.remove()
    site.skip_update = False
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("method", ["rescontroller", "mgr"])
def test_skip_update_changes_only_the_skipped_merge(method):
    model = _gpt(n_layer=2)
    x = model.example_input_array
    patch_residuals(model, method=method)
    base = model(x)
    site = merge_sites(model)[2]
    captured = []
    site.observer = lambda s, stream, update, streams: captured.append(stream)
    site.skip_update = True
    block_out = []
    hook = model.h[1].register_forward_hook(lambda m, a, o: block_out.append(o))
    out = model(x)
    hook.remove()
    assert torch.isfinite(out).all() and not torch.equal(out, base)
    if method == "rescontroller":  # the skipped attention merge hands the stream straight to the MLP merge
        mlp = model.h[1].mlp(model.h[1].ln_2(captured[0]))
        torch.testing.assert_close(block_out[0], merge_sites(model)[3].module(captured[0], mlp))


# ---------------------------------------------------------------------------------------------- rewriting corner cases
def _twice(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


def _make_tricky(scale):
    class Base(nn.Module):
        def forward(self, x):
            return x * 1.0

    class Tricky(Base):
        """super(), a closure variable, a private (mangled) name, a decorator, a multi-line add, add_."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.fc2 = nn.Linear(8, 8)
            self.__gain = 0.5

        @_twice
        def forward(self, x):
            x = super().forward(x)
            h = (
                x
                + self.fc(x) * scale * self.__gain
            )
            h.add_(self.fc2(h))
            return h

    return Tricky()


def test_rewrite_keeps_super_closures_mangling_and_decorators():
    model = _make_tricky(scale=2.0)
    x = torch.randn(3, 8)
    before = model(x)
    report = patch_residuals(model, method="add", example_input=x)
    assert len(report.sites) == 2 and report.sites[1].source_line == "h.add_(self.fc2(h))"
    assert type(model).forward.__wrapped__ is not None
    assert torch.equal(model(x), before)
    report_rc = None
    unpatch_residuals(model)
    report_rc = patch_residuals(model, method="rescontroller", example_input=x)
    assert torch.isfinite(model(x)).all() and len(report_rc.sites) == 2


def test_two_identical_blocks_share_one_patched_class():
    model = TinyViT(depth=3)
    patch_residuals(model, method="add")
    classes = {type(b) for b in model.blocks}
    assert len(classes) == 1 and issubclass(classes.pop(), ViTBlock)
    assert all(isinstance(m, MergeSite) for m in (model.blocks[0]._resctl_site0, model.blocks[2]._resctl_site1))


@pytest.mark.parametrize("method", METHODS)
def test_pickle_round_trip_rebuilds_the_patched_classes(method):
    import pickle

    from lightning_resctl.surgery import rewrite

    model = _gpt()
    x = model.example_input_array
    patch_residuals(model, method=method)
    out = model(x)
    blob = pickle.dumps(model)
    rewrite._SUBCLASS_CACHE.clear()  # as in a fresh process: the classes are rebuilt from the source
    rewrite._METHOD_CACHE.clear()
    clone = pickle.loads(blob)
    assert isinstance(clone.h[0], Block) and type(clone.h[0]) is not Block
    assert torch.equal(clone(x), out)
    assert len(merge_sites(clone)) == 4 and get_patch_report(clone).method == method
    unpatch_residuals(clone)
    assert type(clone.h[1]) is Block


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_torch_transformer_encoder(norm_first):
    """torch's own nn.TransformerEncoderLayer: multi-line merges, post-norm merges inside norm calls."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ref = copy.deepcopy(enc)
    x = torch.randn(2, 5, 16)
    report = patch_residuals(enc, method="add", example_input=x)
    assert len(report.sites) == 4 and len(report.chains) == (1 if norm_first else 4)
    if norm_first:
        assert report.sites[0].source_line.startswith("x + self._sa_block( self.norm1(x),")
    else:
        assert report.sites[1].source_line == "x = self.norm2(x + self._ff_block(x))"
    assert torch.equal(enc(x), ref(x))


def test_unrewritable_additions_are_skipped_with_the_reason():
    helper_ns: dict = {}
    exec("def residual(x, f):\n    return x + f(x)\n", helper_ns)  # no source file: cannot be rewritten

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            x = helper_ns["residual"](x, self.a)   # a merge in a plain function without source
            return x + self.b(x)

    model = Net()
    report = patch_residuals(model, method="add", example_input=torch.randn(2, 8))
    assert [s.source_line for s in report.sites] == ["return x + self.b(x)"]
    (skip,) = report.skipped
    assert skip.path == "" and "cannot rewrite the function residual" in skip.reason
    assert "source of residual not available" in skip.reason


def test_module_without_source_is_skipped_with_the_reason():
    ns = {"nn": nn}
    exec("class Res(nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.f = nn.Linear(4, 4)\n"
         "    def forward(self, x):\n"
         "        return x + self.f(x)\n", ns)
    model = ns["Res"]()
    with pytest.raises(RuntimeError, match="cannot rewrite Res.forward: source of forward not available"):
        patch_residuals(model, method="add", example_input=torch.randn(2, 4))


def test_report_and_unpatch_through_a_wrapping_module():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = _gpt()

        def forward(self, idx):
            return self.model(idx)

    outer = Wrapper()
    x = outer.model.example_input_array
    before = outer(x)
    report = patch_residuals(outer.model, method="mgr")
    assert get_patch_report(outer) is report and len(merge_sites(outer)) == 4
    with pytest.raises(RuntimeError, match="already patched"):
        patch_residuals(outer, method="add", example_input=x)
    unpatch_residuals(outer)
    assert get_patch_report(outer.model) is None and merge_sites(outer) == []
    assert torch.equal(outer(x), before)
