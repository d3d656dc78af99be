"""Rule parameters have one shape everywhere, and that shape is shardable (issue 27 item 2).

FSDP2's ``fully_shard`` refuses 0-d parameters. Every rule's parameters are >= 1-d as built, so a plain
``patch_residuals`` then ``fully_shard`` works and the plain and the Lightning path
(``patch_in_configure_model``) write state dicts that load into each other. Checkpoints written when competitive
MGR's ``forget_bias`` was 0-d still load (``MGRMerge`` reshapes it on load)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_resctl.callbacks import patch_in_configure_model
from lightning_resctl.rules import merge_rules
from lightning_resctl.surgery import patch_from_state_dict, patch_residuals
from models import NanoGPT

SCRIPT = Path(__file__).resolve().parent / "_fsdp_plain_patch_script.py"


def _gpt(seed=0):
    torch.manual_seed(seed)
    return NanoGPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _randomize(model, report, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in report.new_parameters:
            p = model.get_parameter(name)
            p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("method", merge_rules())
def test_no_rule_parameter_is_0d(method):
    model = _gpt()
    report = patch_residuals(model, method=method)
    scalars = [n for n in report.new_parameters if model.get_parameter(n).dim() == 0]
    assert not scalars, f"{method}: 0-d parameters {scalars} (FSDP2's fully_shard refuses them)"


def test_fsdp2_fully_shard_after_plain_patch_every_rule(tmp_path):
    """One gloo process per run of the script; each rule: patch, shard, same logits and gradients flow."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "store"), *merge_rules()], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in merge_rules())
    assert set(lines) == set(merge_rules()), out.stdout
    bad = {m: r for m, r in lines.items() if r != "ok"}
    assert not bad, bad


@pytest.mark.parametrize("method", ["mgr-competitive", "mgr-independent", "attnres-block", "hc", "mhc-lite"])
def test_plain_and_lightning_path_state_dicts_load_into_each_other(method):
    plain = _gpt()
    _randomize(plain, patch_residuals(plain, method=method))
    lit = _gpt(seed=1)
    patch_in_configure_model(lit, lit, method=method)
    x = torch.randint(0, 64, (2, 8))
    shapes = {k: v.shape for k, v in plain.state_dict().items() if isinstance(v, torch.Tensor)}
    assert shapes == {k: v.shape for k, v in lit.state_dict().items() if isinstance(v, torch.Tensor)}
    lit.load_state_dict(plain.state_dict())  # strict
    torch.testing.assert_close(lit(x), plain(x), rtol=0, atol=0)
    back = _gpt(seed=2)
    patch_residuals(back, method=method)
    back.load_state_dict(lit.state_dict())
    torch.testing.assert_close(back(x), plain(x), rtol=0, atol=0)


def _old_state_dict(model):
    """The state dict as the code before issue 27 wrote it: competitive MGR's forget_bias 0-d."""
    sd = model.state_dict()
    old = {k: (v.reshape(()) if k.endswith("forget_bias") else v) for k, v in sd.items()}
    assert any(k.endswith("forget_bias") and v.dim() == 0 for k, v in old.items())
    return old


def test_old_0d_forget_bias_checkpoint_loads_with_equal_outputs():
    model = _gpt()
    _randomize(model, patch_residuals(model, method="mgr-competitive"))
    x = torch.randint(0, 64, (2, 8))
    want = model(x)
    old = _old_state_dict(model)
    fresh = _gpt(seed=1)
    patch_residuals(fresh, method="mgr-competitive")
    fresh.load_state_dict(old)  # strict
    torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)
    assert all(p.dim() == 1 for n, p in fresh.named_parameters() if n.endswith("forget_bias"))
    # an unpatched model re-patched from the old state dict (patch_from_state_dict) too
    again = _gpt(seed=2)
    patch_from_state_dict(again, old)
    torch.testing.assert_close(again(x), want, rtol=0, atol=0)


def test_wrong_forget_bias_shape_still_refused():
    model = _gpt()
    patch_residuals(model, method="mgr-competitive")
    sd = model.state_dict()
    key = next(k for k in sd if k.endswith("forget_bias"))
    sd[key] = torch.zeros(2)
    with pytest.raises(RuntimeError, match="size mismatch for .*forget_bias"):
        model.load_state_dict(sd)
