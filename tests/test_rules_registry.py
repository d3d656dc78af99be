"""The merge-rule registry: one name space, options checked once, rules defined outside the package."""
from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import pytest
import torch

import lightning_resctl
from lightning_resctl import (
    ResidualAblationCallback,
    ResidualControlCallback,
    merge_rules,
    patch_residuals,
    register_merge_rule,
    unpatch_residuals,
)
from lightning_resctl.rules import ChainRule, MergeRule, get_merge_rule, make_rule
from lightning_resctl.rules.base import _REGISTRY
from lightning_resctl.surgery import merge_sites
from lit_models import LitToy, tiny_gpt, toy_loader as _loader


@dataclass
class HalfConfig:
    scale: float = 0.5


class Half(MergeRule):
    """A toy per-merge rule defined outside the package: ``stream + scale * update``."""

    Config = HalfConfig
    description = "stream + scale * update"

    def validate(self, config):
        if not config.scale > 0:
            raise ValueError(f"scale must be > 0, got {config.scale!r}")

    def merge(self, module, stream, update, inplace):
        return stream + self.config.scale * update


@pytest.fixture
def half():
    register_merge_rule("toy-half", Half)
    yield "toy-half"
    _REGISTRY.pop("toy-half", None)


_gpt = tiny_gpt


def test_builtin_names_and_variants():
    names = merge_rules()
    for name in ("add", "rescontroller", "mgr", "mgr-competitive", "mgr-independent"):
        assert name in names
    assert lightning_resctl.merge_rules() == names
    assert make_rule("mgr-independent").config.gating == "independent"
    assert make_rule("mgr-competitive").config.gating == "competitive"
    assert get_merge_rule("mgr").kind == "chain" and get_merge_rule("rescontroller").kind == "merge"


def test_variant_names_work_in_patch_residuals_as_in_the_cli():
    model = _gpt()
    report = patch_residuals(model, method="mgr-independent", streams=2)
    assert report.method == "mgr-independent" and report.options["gating"] == "independent"
    assert all(s.chain_module.gating == "independent" for s in merge_sites(model))
    with pytest.raises(ValueError, match="fixes gating='independent'"):
        patch_residuals(_gpt(), method="mgr-independent", gating="competitive")


@pytest.mark.parametrize("bad, match", [
    (dict(method="nope"), "registered merge rules"),
    (dict(method="rescontroller", update_rate=0.1), "update_rate"),
    (dict(method="rescontroller", update_ratio=-1.0), "update_ratio must be > 0"),
    (dict(method="mgr", streams=1), "streams must be an int >= 2"),
    (dict(method="mgr", eps=0.0), "eps must be > 0"),
    (dict(method="mgr", b_base=float("nan")), "b_base must be a finite number"),
    (dict(method="mgr", gating="soft"), "gating must be one of"),
])
def test_bad_options_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        patch_residuals(_gpt(), **bad)
    method = bad.pop("method")
    with pytest.raises(ValueError, match=match):  # at construction, not inside fit
        ResidualControlCallback(method=method, **bad)


def test_register_refuses_bad_entries(half):
    with pytest.raises(ValueError, match="registered already"):
        register_merge_rule("toy-half", Half)
    with pytest.raises(TypeError, match="MergeRule"):
        register_merge_rule("x", object)
    with pytest.raises(ValueError, match="not options"):
        register_merge_rule("x", Half, sharpness=2)
    with pytest.raises(ValueError, match="plain"):
        register_merge_rule("plain", Half)


def test_outside_rule_works_by_name_in_patch_residuals(half):
    assert half in merge_rules()
    model = _gpt()
    x = model.example_input_array
    ref = model(x)
    report = patch_residuals(model, method=half, scale=0.25)
    assert len(report.sites) == 4 and report.options == {"scale": 0.25}
    # the result is what the toy rule computes: zero scale would make every block a no-op
    with torch.no_grad():
        for s in merge_sites(model):
            s.rule.config.scale = 1.0
        assert torch.allclose(model(x), ref, atol=1e-6)
    unpatch_residuals(model)
    assert torch.equal(model(x), ref)
    with pytest.raises(ValueError, match="scale must be > 0"):
        patch_residuals(_gpt(), method=half, scale=0.0)


def test_outside_rule_works_in_the_callbacks(half, tmp_path):
    module = LitToy()
    control = ResidualControlCallback(method=half, scale=0.5, log_every_n_steps=1, depth_images=False,
                                      dirpath=str(tmp_path))  # logger=False: somewhere to write, or no probes
    ablation = ResidualAblationCallback(max_batches=1, depth_images=False)
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[control, ablation],
                        default_root_dir=tmp_path)
    trainer.fit(module, _loader(), _loader())
    sites = merge_sites(module)
    assert sites and all(s.method == half for s in sites)
    assert len(control.depth_profile["stream_rms"]) == 4
    assert len(ablation.loss_increase) == 4


def test_a_chain_rule_must_build_a_chain():
    class Broken(ChainRule):
        pass

    register_merge_rule("toy-broken", Broken)
    try:
        with pytest.raises(NotImplementedError):
            patch_residuals(_gpt(), method="toy-broken")
    finally:
        _REGISTRY.pop("toy-broken", None)


_STREAM_FAMILIES = {"stream_rms", "update_rms", "update_ratio", "growth", "max_abs", "max_over_median",
                    "stream_grad_rms", "param_grad_rms"}


@pytest.mark.parametrize("method", merge_rules())
def test_every_rule_logs_its_own_diagnostics_through_the_one_callback(method, tmp_path):
    module = LitToy()
    cb = ResidualControlCallback(method=method, log_every_n_steps=1, depth_images=False,
                                 dirpath=str(tmp_path))  # logger=False: somewhere to write, or no probes
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], default_root_dir=tmp_path)
    trainer.fit(module, _loader())
    prof = cb.depth_profile
    assert len(prof["stream_rms"]) == 4 and all(v == v and v > 0 for v in prof["stream_rms"])
    own = {k: v for k, v in prof.items() if k not in _STREAM_FAMILIES}
    if method == "add":
        assert own == {}
    else:  # the rule's own families, finite where observed (gated families start after MGR's accumulation)
        assert own, f"{method} logged no family of its own"
        assert any(v == v for vals in own.values() for v in vals)
        assert all(v != float("inf") for vals in own.values() for v in vals)


@pytest.mark.parametrize("method", merge_rules())
def test_every_rule_trains_validates_checkpoints_resumes_and_reloads(method, tmp_path):
    """A stranger's loop: fit with validation (train/eval switches), save, resume from the checkpoint,
    then rebuild the trained network in a fresh module from the checkpoint alone."""
    from lightning_resctl import patch_from_state_dict

    def trainer(steps, name):
        cb = ResidualControlCallback(method=method, log_every_n_steps=1, depth_images=False, dirpath=str(tmp_path))
        return L.Trainer(max_steps=steps, limit_val_batches=1, val_check_interval=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb], default_root_dir=tmp_path / name)

    module = LitToy()
    t = trainer(2, "a")
    t.fit(module, _loader(), _loader())
    ckpt = tmp_path / "a.ckpt"
    t.save_checkpoint(str(ckpt))
    x = module.example_input_array
    module.eval()
    with torch.no_grad():
        ref = module(x)
    saved = torch.load(ckpt, weights_only=True)["state_dict"]

    resumed = LitToy()
    t2 = trainer(2, "b")  # max_steps already reached: fit restores the checkpoint and stops
    t2.fit(resumed, _loader(), _loader(), ckpt_path=str(ckpt))
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(resumed(x), ref)

    fresh = LitToy()
    with pytest.raises(RuntimeError, match="_resctl_site"):
        LitToy().load_state_dict(saved)
    report = patch_from_state_dict(fresh, saved)
    assert report.method == method
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), ref)


def test_outside_rule_works_by_name_in_the_compare_job(half, tmp_path):
    import json
    import sysconfig
    from pathlib import Path

    import lightning_resctl
    from lightning_resctl.compare.data import CharDataModule
    from lightning_resctl.compare.gpt import CharGPT

    text = tmp_path / "corpus.txt"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[:8000])
    out = tmp_path / "out"
    lightning_resctl.compare(
        model=lambda: CharGPT(n_layer=2, n_embd=16, n_head=2, block_size=16),
        datamodule=CharDataModule(text=str(text), block_size=16, batch_size=4, val_batches=1),
        methods=["plain", half], seeds=1, out=out, ablation=False, progress_bar=False, threads=1,
        depth_images=False, cost_rounds=1, cost_warmup=0,
        trainer={"max_steps": 3, "val_check_interval": 3, "check_val_every_n_epoch": None, "accelerator": "cpu"})
    summary = json.loads((out / "summary.json").read_text())
    text_md = (out / "summary.md").read_text()
    assert half in text_md and "stream + scale * update" in text_md
    runs = {r["method"]: r for r in summary["runs"]}
    assert runs[half]["sites"] == 4 and runs[half]["patch_options"] == {"scale": 0.5}
    assert math.isfinite(runs[half]["final"])