"""The baseline chain rules (attnres, attnres-block, hc, mhc, mhc-lite, kromhc) on patched models: compile, training,
unpatching, checkpoints, meta-device init, options, diagnostics, ablation and mode-dependent merges.

The math of each rule is tested in tests/test_rule_attnres.py, test_rule_hc.py, test_rule_mhc_lite.py,
test_rule_kromhc.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_resctl.rules import make_rule, merge_rules
from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals, unpatch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from models import NanoGPT

RULES = ["attnres", "attnres-block", "hc", "mhc", "mhc-lite", "kromhc"]
# a variant of each option that changes the parameters or the math, to exercise them end to end
VARIANTS = [("attnres", {"key_norm_affine": False}), ("attnres-block", {"block_size": 3}),
            ("attnres-block", {"num_blocks": 2}), ("hc", {"dynamic": False, "reduce": "mean"}),
            ("mhc", {"sinkhorn": "dsv4", "sinkhorn_iters": 5, "streams": 3}), ("mhc", {"init": "residual"}),
            ("mhc-lite", {"streams": 3, "init": "residual", "reduce": "mean"}),
            ("kromhc", {"streams": 8, "init": "residual", "reduce": "mean"})]


def _gpt(n_layer=2, n_embd=32):
    return NanoGPT(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=n_embd)


def _lm_loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def randomize_new_parameters(model, report, std=0.3, seed=3):
    """Move the rule's parameters away from their init (so tests see a non-trivial rule)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g) * std)


def assert_runtime_matches_oracle(rule, chain, x, branches, oracle, params, apart=False):
    """Drive ``rule``'s runtime over ``branches`` from ``x`` and compare every h, the output and the gradients of
    ``[x] + params`` with ``oracle() -> (output, [h_0, ...])`` (fp64 tolerances); ``apart``: the state the rule
    starts when its merges are compiled apart from the chain's owner (``start_apart``)."""
    out_ref, hs_ref = oracle()
    grads_ref = torch.autograd.grad(out_ref.square().sum(), [x] + params)
    state, h, hs = (rule.start_apart if apart else rule.start)(chain, x), x, []
    for k, f in enumerate(branches):
        hs.append(h)
        state, h = rule.step(chain, k, state, f(h), k + 1)
    for a, b in zip(hs + [h], hs_ref + [out_ref]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(h.square().sum(), [x] + params)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    return grads


def test_registered():
    assert set(RULES) <= set(merge_rules())
    for name in RULES:
        assert make_rule(name).kind == "chain"


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("method,options", [(m, {}) for m in RULES] + VARIANTS,
                         ids=[m for m in RULES] + [f"{m}-{'-'.join(map(str, o.values()))}" for m, o in VARIANTS])
def test_patch_and_train(method, options):
    torch.manual_seed(0)
    model = _gpt(n_layer=2)
    x = torch.randint(0, 64, (4, 16))
    report = patch_residuals(model, method=method, **options)
    assert report.new_parameters and all(n.startswith(make_rule(method, options).chain_attr)
                                         for n in report.new_parameters)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = _lm_loss(model, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses
    grads = [model.get_parameter(n).grad for n in report.new_parameters]
    assert all(g is not None for g in grads)  # no unused parameter (DDP)
    assert sum(g.abs().sum() for g in grads) > 0


# ---------------------------------------------------------------------------------------------- unpatch, checkpoint
@pytest.mark.parametrize("method", RULES)
def test_unpatch_is_bitwise(method):
    model = _gpt()
    x = model.example_input_array
    before = model(x)
    keys = list(model.state_dict())
    report = patch_residuals(model, method=method)
    randomize_new_parameters(model, report)
    assert not torch.equal(model(x), before)
    unpatch_residuals(model)
    assert list(model.state_dict()) == keys
    assert torch.equal(model(x), before)


@pytest.mark.parametrize("method", RULES)
def test_checkpoint_round_trip_into_fresh_patched_twin(method):
    torch.manual_seed(0)
    model = _gpt()
    x = model.example_input_array
    patch_residuals(model, method=method, streams=3) if method in ("hc", "mhc", "mhc-lite") else \
        patch_residuals(model, method=method)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _lm_loss(model, x).backward()
    opt.step()
    twin = _gpt()
    opts = {"streams": 3} if method in ("hc", "mhc", "mhc-lite") else {}
    patch_residuals(twin, method=method, **opts)
    assert not torch.equal(twin(x), model(x))
    twin.load_state_dict(model.state_dict())  # strict
    assert torch.equal(twin(x), model(x))
    other = _gpt()
    patch_residuals(other, method=method, **({"streams": 2} if opts else {"eps": 1e-5}))
    with pytest.raises(RuntimeError):
        other.load_state_dict(model.state_dict())


# ---------------------------------------------------------------------------------------------- init
@pytest.mark.parametrize("method,options", [(m, {}) for m in RULES] + VARIANTS)
def test_meta_device_init_equals_normal_init(method, options):
    rule = make_rule(method, options)
    ref = rule.build_chain(8, 5)
    with torch.device("meta"):
        meta = rule.build_chain(8, 5)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    ref_state = dict(ref.named_parameters()) | dict(ref.named_buffers())
    for name, t in list(meta.named_parameters()) + list(meta.named_buffers()):
        assert torch.equal(t, ref_state[name]), name
    # reset_parameters after training restores the init exactly
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    ref.reset_parameters()
    for name, t in meta.named_parameters():
        assert torch.equal(t, ref_state[name]), name
    assert all(p.dim() >= 1 for p in ref.parameters())  # FSDP2 refuses 0-d parameters: none here


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("method,options,match", [
    ("attnres", {"eps": -1.0}, "eps must be >= 0, got -1.0"),
    ("attnres", {"key_norm_affine": 1}, "key_norm_affine must be True or False, got 1"),
    ("attnres", {"block_size": 2}, r"unknown option\(s\) for method='attnres': \['block_size'\]"),
    ("attnres-block", {"block_size": 0}, "block_size must be an int >= 1 or None, got 0"),
    ("attnres-block", {"num_blocks": 2.5}, "num_blocks must be an int >= 1 or None, got 2.5"),
    ("attnres-block", {"block_size": 2, "num_blocks": 2}, "block_size and num_blocks are exclusive"),
    ("hc", {"streams": 0}, "streams must be an int >= 1, got 0"),
    ("hc", {"reduce": "max"}, r"reduce must be one of \('sum', 'mean'\), got 'max'"),
    ("hc", {"dynamic": "yes"}, "dynamic must be True or False, got 'yes'"),
    ("mhc", {"sinkhorn": "fast"}, r"sinkhorn must be one of \('paper', 'dsv4'\), got 'fast'"),
    ("mhc", {"sinkhorn_iters": 0}, "sinkhorn_iters must be an int >= 1, got 0"),
    ("mhc", {"init": "zero"}, r"init must be one of \('paper', 'residual'\), got 'zero'"),
    ("mhc", {"hc_eps": float("nan")}, "hc_eps must be a finite number, got nan"),
    ("mhc-lite", {"streams": 7}, r"streams must be <= 6 for method='mhc-lite', got 7: res mixes all n! permutation "
                                 r"matrices \(5040 for n=7\)"),
    ("mhc-lite", {"init": "identity"}, r"init must be one of \('paper', 'residual'\), got 'identity'"),
    ("kromhc", {"streams": 6}, r"streams must be a power of 2 >= 2 for method='kromhc', got 6"),
])
def test_bad_options_name_option_and_value(method, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        patch_residuals(_gpt(), method=method, **options)


# ---------------------------------------------------------------------------------------------- diagnostics
@pytest.mark.parametrize("method", RULES)
def test_observer_streams_and_stats(method):
    model = _gpt(n_layer=2)
    x = model.example_input_array
    report = patch_residuals(model, method=method)
    randomize_new_parameters(model, report)
    rule = merge_sites(model)[0].rule
    stats = rule.make_stats(4, model)
    shapes = []
    for site in merge_sites(model):
        def obs(site, stream, update, streams):
            run = site._run
            shapes.append(tuple(streams.shape))
            rule.observe(stats, site.current_position, site, site.current_position, stream, update, run.state)
        site.observer = obs
    model(x)
    out = stats.compute()
    if method.startswith("attnres"):
        m = [1, 2, 3, 4] if method == "attnres" else [1, 2, 2, 3]  # sources entering merge k (block S=2 for K=4)
        assert shapes == [(2, 16, k, 32) for k in m]
        w = out["attnres_weight"]
        assert w.shape == (4, 5 if method == "attnres" else 3)
        rows = torch.nan_to_num(w).sum(-1)
        torch.testing.assert_close(rows, torch.ones(4, dtype=rows.dtype))
        assert torch.isnan(w[0, 2:]).all() and (out["attnres_entropy"] > 0).all()
    else:
        assert shapes == [(2, 16, 4, 32)] * 4
        prefix = {"hc": "hc", "mhc": "mhc", "mhc-lite": "mhcl", "kromhc": "kromhc"}[method]
        assert out[f"{prefix}_pre_mean"].shape == (4, 4) and out[f"{prefix}_post_mean"].shape == (4, 4)
        assert (out[f"{prefix}_res_identity_dist"] > 0).all()
        if method in ("mhc-lite", "kromhc"):
            assert out[f"{prefix}_ds_error"].max() < 1e-6
        if method == "mhc":
            assert 0 < out["mhc_ds_error"].max() < 0.05  # 20 Sinkhorn steps: approximate


# ---------------------------------------------------------------------------------------------- ablation, modes
@pytest.mark.parametrize("method", RULES)
def test_skip_update_changes_only_the_output_downstream(method):
    model = _gpt(n_layer=2)
    x = model.example_input_array
    report = patch_residuals(model, method=method)
    randomize_new_parameters(model, report)
    base = model(x)
    inputs = []
    hooks = [b.ln_1.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for b in model.h]
    sites = merge_sites(model)
    sites[2].skip_update = True  # the attention merge of block 1
    out = model(x)
    for h in hooks:
        h.remove()
    assert torch.isfinite(out).all() and not torch.equal(out, base)
    sites[2].skip_update = False
    assert torch.equal(model(x), base)


class _ModeNet(nn.Module):
    """Pre-norm residual layers; layer 1's merge runs only in training mode."""

    def __init__(self, dim=16, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.example_input_array = torch.randn(3, 5, dim)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 1:
                if self.training:
                    x = x + layer(x)
            else:
                x = x + layer(x)
        return self.norm(x)


@pytest.mark.parametrize("method", RULES)
def test_mode_dependent_merge_reads_for_the_next_one_that_runs(method):
    torch.manual_seed(0)
    model = _ModeNet()
    x = model.example_input_array
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 0.0
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 0.0
    opts = {"init": "residual"} if method in ("mhc", "mhc-lite", "kromhc") else {}
    patch_residuals(model, method=method, **opts)
    for mode in (True, False):
        model.train(mode)
        ref.train(mode)
        # at init every rule is the plain residual for this pre-norm net with scale-invariant norms
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    # with trained-looking parameters: eval (merge 1 absent) == training with merge 1's update dropped, i.e. the
    # merges that do not run leave the state as it is and the previous merge reads for the next one that runs
    report = get_patch_report(model)
    randomize_new_parameters(model, report)
    model.eval()
    absent = model(x)
    model.train()
    (site1,) = [s for s in merge_sites(model) if s.positions == (1,)]
    site1.skip_update = True
    torch.testing.assert_close(model(x), absent, rtol=1e-6, atol=1e-6)
    site1.skip_update = False
    assert not torch.allclose(model(x), absent)


# grad mode: tests/test_region_whole_model_compile.py compiles every rule with fullgraph=True and compares the
# gradients with eager's
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("method", merge_rules())
def test_torch_compile_fullgraph_every_rule_every_grad_mode(method, grad_mode):
    """Lightning validates under no_grad / inference_mode: every rule compiles with fullgraph=True there too
    (backend="eager" runs dynamo, where attnres's autograd Function failed under no_grad), outputs equal eager."""
    torch._dynamo.reset()
    model = _gpt(n_layer=2, n_embd=16)
    x = model.example_input_array
    report = patch_residuals(model, method=method)
    randomize_new_parameters(model, report)
    model.eval()
    with GRAD_MODES[grad_mode]():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        out = compiled(x)
        again = compiled(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, eager, rtol=1e-5, atol=1e-6)
    assert not out.requires_grad and not eager.requires_grad
