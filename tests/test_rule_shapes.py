"""Rule parameters have one shape everywhere, and that shape is shardable (issue 27 item 2).

FSDP2's ``fully_shard`` refuses 0-d parameters. Every rule's parameters are >= 1-d as built, so a plain
``patch_residuals`` then ``fully_shard`` works and the plain and the Lightning path
(``patch_in_configure_model``) write state dicts that load into each other. Checkpoints written when competitive
MGR's ``forget_bias`` was 0-d still load (``MGRMerge`` reshapes it on load) and resume with their optimizer state
(``adapt_optimizer_state``: the callback and ``PatchOnLoadMixin`` run it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_resctl import patch_in_configure_model
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


# ---------------------------------------------------------------------------------------------- Lightning
def _lit_classes():
    import lightning as L  # noqa: F401  (lightning is a dependency; imported lazily to keep collection light)

    from lightning_resctl import PatchOnLoadMixin
    from lit_models import LitToy

    class AdamGPT(PatchOnLoadMixin, LitToy):
        """Adam: per-element optimizer state (exp_avg, exp_avg_sq) for every parameter."""

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return AdamGPT


def _fit(module, steps, root, ckpt_path=None, callback=True):
    import lightning as L

    from lightning_resctl import ResidualControlCallback
    from lit_models import toy_loader

    cb = ResidualControlCallback(method="mgr-competitive", options={"streams": 2, "backend": "torch-eager"},
                                 depth_images=False, log_every_n_steps=100)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb] if callback else [], default_root_dir=root)
    trainer.fit(module, toy_loader(), ckpt_path=ckpt_path)
    return trainer


def _make_old(ckpt: dict, module) -> dict:
    """The checkpoint as written before issue 27: forget_bias 0-d in the state dict and in Adam's state."""
    old = dict(ckpt, state_dict={k: (v.reshape(()) if k.endswith("forget_bias") else v)
                                 for k, v in ckpt["state_dict"].items()})
    index = [i for i, (n, _) in enumerate(module.named_parameters()) if n.endswith("forget_bias")]
    assert index
    opt = ckpt["optimizer_states"][0]
    state = {i: ({k: (v.reshape(()) if i in index and k != "step" else v) for k, v in s.items()})
             for i, s in opt["state"].items()}
    assert all(state[i]["exp_avg"].dim() == 0 for i in index)
    old["optimizer_states"] = [dict(opt, state=state)]
    return old


def test_old_lightning_checkpoint_loads_and_resumes(tmp_path):
    """A training checkpoint written with a 0-d forget_bias (model and Adam state): load_from_checkpoint gives
    the same network, and a resume (with the callback, or patched by PatchOnLoadMixin alone) trains on to the
    same weights as a resume from the same checkpoint in today's shape."""
    AdamGPT = _lit_classes()
    module = AdamGPT()
    trainer = _fit(module, 2, tmp_path)
    new_path, old_path = tmp_path / "new.ckpt", tmp_path / "old.ckpt"
    trainer.save_checkpoint(new_path)
    torch.save(_make_old(torch.load(new_path, weights_only=False), module), old_path)
    x = module.example_input_array
    loaded = AdamGPT.load_from_checkpoint(old_path)
    module.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x), module(x), rtol=0, atol=0)
    runs = {}
    for name, path, callback in (("new", new_path, True), ("old", old_path, True), ("old-mixin", old_path, False)):
        resumed = AdamGPT()
        _fit(resumed, 4, tmp_path / name, ckpt_path=str(path), callback=callback)
        runs[name] = {k: v.detach().clone() for k, v in resumed.state_dict().items() if isinstance(v, torch.Tensor)}
    assert runs["old"].keys() == runs["new"].keys() == runs["old-mixin"].keys()
    moved = 0
    for k in runs["new"]:
        torch.testing.assert_close(runs["old"][k], runs["new"][k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(runs["old-mixin"][k], runs["new"][k], rtol=0, atol=0, msg=k)
        moved += k.endswith("forget_bias") and not torch.equal(runs["new"][k], module.state_dict()[k])
    assert moved  # the resumed steps trained forget_bias with the restored Adam state
