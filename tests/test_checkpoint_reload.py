"""Checkpoints of patched models, the Lightning way: ``MyModule.load_from_checkpoint(path)`` of a module that
opts in (:class:`lightning_resctl.PatchOnLoadMixin`) rebuilds the trained, patched network; a resume without the
patching callback works too; the backend is recorded but never blocks a load or a resume."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_resctl import (
    PatchOnLoadMixin,
    ResidualControlCallback,
    get_patch_report,
    merge_sites,
    patch_from_state_dict,
    patch_residuals,
)
from lit_models import LitToy, toy_loader as _loader

# trained with the eager torch path (no compile time in the suite); the other backends are loaded into
OPTIONS = {"rescontroller": {"backend": "torch-eager"}, "mgr": {"streams": 2, "backend": "torch-eager"}}


class LitGPT(LitToy):
    """A LightningModule that does not opt in."""


class OptInGPT(PatchOnLoadMixin, LitGPT):
    """The same module, opted in: one base class."""


def _trainer(tmp_path, steps, callbacks=()):
    return L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=list(callbacks), default_root_dir=tmp_path)


def _control(method, **options):
    return ResidualControlCallback(method=method, options={**OPTIONS[method], **options}, depth_images=False,
                                   log_every_n_steps=100)


def _out(module):
    module.eval()
    with torch.no_grad():
        return module(module.example_input_array)


@pytest.fixture(scope="module", params=["rescontroller", "mgr"])
def trained(request, tmp_path_factory):
    """(method, checkpoint path, the trained module) — two steps with the patching callback."""
    method = request.param
    tmp_path = tmp_path_factory.mktemp(method)
    module = OptInGPT()
    trainer = _trainer(tmp_path, 2, [_control(method)])
    trainer.fit(module, _loader())
    path = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(path)
    return method, path, module


def test_load_from_checkpoint_reapplies_the_recorded_patch(trained):
    method, path, module = trained
    loaded = OptInGPT.load_from_checkpoint(path)
    assert {s.method for s in merge_sites(loaded)} == {method}
    assert torch.equal(_out(loaded), _out(module))
    report = get_patch_report(loaded)
    assert report.options == get_patch_report(module).options


def test_load_from_checkpoint_of_a_module_that_did_not_opt_in_fails_loudly(trained):
    """Nothing of lightning_resctl runs in its load_from_checkpoint: torch's strict load names the site keys."""
    _, path, _ = trained
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*_resctl_site0\._extra_state"):
        LitGPT.load_from_checkpoint(path)


def test_resume_without_the_callback_repatches_before_the_optimizer(trained, tmp_path):
    """fit(ckpt_path=...) without the patching callback: the mixin patches in on_load_checkpoint, before the
    optimizer is built, so the rule's parameters (MGR) keep training."""
    method, path, module = trained
    resumed = OptInGPT()
    _trainer(tmp_path, 3).fit(resumed, _loader(), ckpt_path=str(path))
    assert {s.method for s in merge_sites(resumed)} == {method}
    new = get_patch_report(resumed).new_parameters
    assert bool(new) == (method == "mgr")
    trained_params = dict(module.named_parameters())
    for name in new:  # one more SGD step moved every rule parameter that has a gradient
        p = resumed.get_parameter(name)
        if p.grad is not None and p.grad.abs().sum() > 0:
            assert not torch.equal(p, trained_params[name]), name


def test_resume_and_load_with_another_backend(trained, tmp_path):
    """The backend changes how the math runs, not what it computes: a resume with the callback set to another
    backend, and a load of the checkpoint into a twin patched with another backend, both go through."""
    method, path, module = trained
    resumed = OptInGPT()
    trainer = _trainer(tmp_path, 2, [_control(method, backend="reference")])
    trainer.fit(resumed, _loader(), ckpt_path=str(path))  # max_steps reached: restores and stops
    assert {s.rule.config.backend for s in merge_sites(resumed)} == {"reference"}
    torch.testing.assert_close(_out(resumed), _out(module), rtol=1e-5, atol=1e-6)
    twin = LitGPT()
    patch_residuals(twin, method=method, **{**OPTIONS[method], "backend": "reference"})
    twin.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    torch.testing.assert_close(_out(twin), _out(module), rtol=1e-5, atol=1e-6)


def test_a_recorded_triton_backend_that_cannot_run_here_loads_with_auto(trained, monkeypatch):
    """A checkpoint trained with backend="triton" on a GPU, loaded where Triton cannot run: the patch is
    re-applied with backend="auto" (with a warning naming both), not refused."""
    monkeypatch.setenv("LIGHTNING_RESCTL_COMPILE", "0")  # "auto" runs the eager torch path (no compile time)
    method, path, module = trained
    state = torch.load(path, weights_only=True)["state_dict"]
    twin = LitGPT()
    patch_residuals(twin, method=method, **{**OPTIONS[method], "backend": "triton"})
    twin.load_state_dict(state)
    triton_state = twin.state_dict()  # records say backend="triton"
    monkeypatch.setattr("lightning_resctl.runtime.triton.triton_available", lambda: False)  # the rule asks it
    fresh = LitGPT()
    with pytest.warns(UserWarning, match="backend='triton'.*backend='auto'"):
        patch_from_state_dict(fresh, triton_state)
    assert {s.rule.config.backend for s in merge_sites(fresh)} == {"auto"}
    torch.testing.assert_close(_out(fresh), _out(module), rtol=1e-5, atol=1e-6)


def test_patch_from_state_dict_reproduces_an_include_restricted_patch():
    """The records say which modules were patched: a patch limited with ``include`` is re-applied to the same
    modules only (a patch of the whole model would not match the checkpoint's keys)."""
    torch.manual_seed(0)
    model = LitGPT(n_layer=3)
    patch_residuals(model, method="rescontroller", include="model.h.1", backend="torch-eager")
    saved = model.state_dict()
    fresh = LitGPT(n_layer=3)
    patch_from_state_dict(fresh, saved)
    assert sorted(s.path for s in merge_sites(fresh)) == sorted(s.path for s in merge_sites(model)) \
        == ["model.h.1", "model.h.1"]
    assert torch.equal(_out(fresh), _out(model))


def test_patch_from_state_dict_patches_the_submodule_that_was_patched():
    """A checkpoint of a LightningModule whose ``self.model`` was patched: the same submodule is patched again
    (the records' paths are relative to it)."""
    model = LitGPT()
    patch_residuals(model.model, method="mgr", streams=2, include="h.0", backend="torch-eager")
    fresh = LitGPT()
    patch_from_state_dict(fresh, model.state_dict())
    assert "_resctl_patch" not in vars(fresh) and get_patch_report(fresh.model).method == "mgr"
    assert torch.equal(_out(fresh), _out(model))
