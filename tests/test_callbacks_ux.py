"""What a user sees of the callbacks: one patch owner, options, the patch line, ablation with a module that only
logs, summary scalars, alerts, few depths, PNG figures for loggers without images, no logger."""
from __future__ import annotations

import logging
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_resctl.callbacks import ResidualAblationCallback, ResidualControlCallback
from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals
from lightning_resctl.surgery.patcher import ResidualPatcher
from test_callbacks import LitGPT, _acc, _loader, _ObserverProbe, _scalars, _trainer


# ------------------------------------------------------------------------------------------ one patch owner
def test_both_callbacks_share_one_patch_owner_whatever_the_order(tmp_path):
    abl = ResidualAblationCallback(max_batches=1)  # observing: defers to the callback that has a method
    ctrl = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1, depth_images=False)
    assert isinstance(abl.patcher, ResidualPatcher) and isinstance(ctrl.patcher, ResidualPatcher)
    module = LitGPT()
    _trainer(tmp_path, [abl, ctrl], max_epochs=1, max_steps=-1, limit_train_batches=2, limit_val_batches=1).fit(
        module, _loader(), _loader(n=4))
    report = get_patch_report(module)
    assert report is not None and report.method == "mgr" and report.options["streams"] == 2
    assert len(abl.loss_increase) == 4 and all(math.isfinite(v) for v in abl.loss_increase)
    assert not abl.patcher.owns_patch and not ctrl.patcher.owns_patch


def test_ablation_alone_patches_for_observation_and_removes_it(tmp_path):
    abl = ResidualAblationCallback(max_batches=1)
    module = LitGPT()
    _trainer(tmp_path, [abl], max_epochs=1, max_steps=-1, limit_train_batches=1, limit_val_batches=1).fit(
        module, _loader(), _loader(n=4))
    assert len(abl.loss_increase) == 4
    assert get_patch_report(module) is None and not merge_sites(module)


# ------------------------------------------------------------------------------------------ options
def test_options_argument_and_keywords_and_typos():
    cb = ResidualControlCallback(method="mgr", options={"streams": 3})
    assert cb.patcher.options == {"streams": 3}
    assert ResidualControlCallback(method="mgr", streams=3).patcher.options == {"streams": 3}
    with pytest.raises(ValueError, match="stream"):
        ResidualControlCallback(method="mgr", options={"stream": 3})
    with pytest.raises(ValueError, match="both"):
        ResidualControlCallback(method="mgr", options={"streams": 3}, streams=2)
    with pytest.raises(ValueError, match="registered merge rule"):
        ResidualAblationCallback(method="mgx")
    with pytest.raises(ValueError, match="streams"):
        ResidualAblationCallback(method="mgr", options={"streams": 1})


# ------------------------------------------------------------------------------------------ the patch line
class _Grab(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_patch_line_once_with_counts(tmp_path):
    grab = _Grab()
    logging.getLogger("lightning_resctl").addHandler(grab)
    try:
        cb = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1, depth_images=False)
        module = LitGPT()
        base = sum(p.numel() for p in module.parameters())
        _trainer(tmp_path, [cb], max_steps=1).fit(module, _loader())
    finally:
        logging.getLogger("lightning_resctl").removeHandler(grab)
    report = get_patch_report(module)
    params = dict(module.named_parameters())
    added = sum(params[n].numel() for n in report.new_parameters)
    assert added > 0
    lines = [l for l in grab.lines if l.startswith("patched ")]
    assert len(lines) == 1, grab.lines
    line = lines[0]
    assert line.startswith("patched 4 residual merges (mgr, n=2)"), line
    assert f"added {added:,} parameters ({100 * added / base:.2g}% of" in line
    assert "get_patch_report" in line


def test_observing_prints_no_patch_line(tmp_path):
    grab = _Grab()
    logging.getLogger("lightning_resctl").addHandler(grab)
    try:
        _trainer(tmp_path, [ResidualControlCallback(log_every_n_steps=1, depth_images=False)], max_steps=1).fit(
            LitGPT(), _loader())
    finally:
        logging.getLogger("lightning_resctl").removeHandler(grab)
    assert not [l for l in grab.lines if l.startswith("patched ")]


# ------------------------------------------------------------------------------------------ ablation loss
class LogOnly(LitGPT):
    """The idiomatic module: validation_step logs and returns nothing."""

    def __init__(self, name="val_loss"):
        super().__init__()
        self.name = name

    def validation_step(self, batch, batch_idx):
        self.log(self.name, self.loss(batch))
        self.log("val_acc", torch.tensor(0.5))


def _manual_increase(module, batches):
    def mean_loss():
        with torch.no_grad():
            return sum(module.loss(b).double().item() for b in batches) / len(batches)

    module.eval()
    base = mean_loss()
    out = []
    for site in merge_sites(module):
        site.skip_update = True
        out.append(mean_loss() - base)
        site.skip_update = False
    return base, out


@pytest.mark.parametrize("name, monitor", [("val_loss", None), ("val/ce", "val/ce")])
def test_ablation_reads_the_logged_loss(tmp_path, name, monitor):
    ctrl = ResidualControlCallback(method="add", log_every_n_steps=1, depth_images=False)
    abl = ResidualAblationCallback(max_batches=2, monitor=monitor)
    module = LogOnly(name)
    val = _loader(n=8, batch=4, seed=5)
    _trainer(tmp_path, [ctrl, abl], max_epochs=1, max_steps=-1, limit_train_batches=1, limit_val_batches=2).fit(
        module, _loader(), val)
    base, expected = _manual_increase(module, list(val)[:2])
    assert abl.base_loss == pytest.approx(base, rel=1e-6)
    assert abl.loss_increase == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert abl.loss_source == f"logged {name!r}"


class NoLoss(LitGPT):
    """Manual optimisation, validation_step logs only an accuracy: nothing the ablation can use."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.train_steps = 0

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", torch.tensor(0.5))


def test_ablation_without_a_loss_refuses_before_training(tmp_path):
    abl = ResidualAblationCallback(max_batches=1)
    module = NoLoss()
    with pytest.raises(MisconfigurationException, match="loss_fn"):
        _trainer(tmp_path, [abl], max_epochs=1, max_steps=-1, limit_train_batches=2, limit_val_batches=1).fit(
            module, _loader(), _loader(n=4))
    assert module.train_steps == 0


class TrainLossOnly(LitGPT):
    def validation_step(self, batch, batch_idx):
        self.log("val_acc", torch.tensor(0.5))


def test_ablation_falls_back_to_training_step_loss(tmp_path):
    abl = ResidualAblationCallback(max_batches=2)
    module = TrainLossOnly()
    val = _loader(n=8, batch=4, seed=5)
    with pytest.warns(UserWarning, match="training_step"):
        _trainer(tmp_path, [ResidualControlCallback(method="add", depth_images=False), abl], max_epochs=1,
                 max_steps=-1, limit_train_batches=1, limit_val_batches=2).fit(module, _loader(), val)
    base, expected = _manual_increase(module, list(val)[:2])
    assert abl.loss_increase == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert abl.loss_source == "training_step"


# ------------------------------------------------------------------------------------------ summary, alerts, few depths
def test_summary_scalars_and_few_depths(tmp_path):
    cb = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1, depth_images=False,
                                 per_depth="all", alert_growth=None, alert_max_over_median=None)
    _trainer(tmp_path, [cb], max_steps=2).fit(LitGPT(), _loader())
    sc = _scalars(tmp_path / "run" / "version_0")
    D = 4
    for step in (0, 1):
        growth = [sc[(f"resctl/growth/{d:02d}", step)] for d in range(D)]
        ratio = [sc[(f"resctl/update_ratio/{d:02d}", step)] for d in range(D)]
        mom = [sc[(f"resctl/max_over_median/{d:02d}", step)] for d in range(D)]
        assert sc[("resctl/summary/growth_last", step)] == pytest.approx(growth[-1], rel=1e-6)
        assert sc[("resctl/summary/update_ratio_max", step)] == pytest.approx(max(ratio), rel=1e-6)
        assert sc[("resctl/summary/max_over_median_max", step)] == pytest.approx(max(mom), rel=1e-6)
        sat = sc[("resctl/summary/gate_saturation", step)]
        assert 0.0 <= sat <= 1.0

    few = ResidualControlCallback(log_every_n_steps=1, depth_images=False)  # default per_depth="few"
    _trainer(tmp_path, [few], name="few", max_steps=1).fit(LitGPT(), _loader())
    logdir = tmp_path / "few" / "version_0"
    sc = _scalars(logdir)
    depths = sorted({t.rsplit("/", 1)[1] for (t, s) in sc if t.startswith("resctl/stream_rms/")})
    assert depths == ["00", "02", "03"]  # first, middle, last
    assert ("resctl/summary/growth_last", 0) in sc and not any(k[0] == "resctl/summary/gate_saturation" for k in sc)
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = _acc(logdir)
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["stream_rms @ depth 00, 02, 03"] == [r"^resctl/stream_rms/00$", r"^resctl/stream_rms/02$",
                                                       r"^resctl/stream_rms/03$"]
    assert any(t.startswith("^resctl/summary/growth_last") for c in charts.values() for t in c)

    chosen = ResidualControlCallback(log_every_n_steps=1, depth_images=False, per_depth=[1])
    _trainer(tmp_path, [chosen], name="chosen", max_steps=1).fit(LitGPT(), _loader())
    sc = _scalars(tmp_path / "chosen" / "version_0")
    assert sorted({t.rsplit("/", 1)[1] for (t, s) in sc if t.startswith("resctl/stream_rms/")}) == ["01"]
    with pytest.raises(ValueError, match="per_depth"):
        ResidualControlCallback(per_depth="some")


def test_alerts_once_per_run(tmp_path):
    cb = ResidualControlCallback(log_every_n_steps=1, depth_images=False, alert_growth=1e-6,
                                 alert_max_over_median=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _trainer(tmp_path, [cb], max_steps=3).fit(LitGPT(), _loader(n=12))
    alerts = [w for w in rec if "alert_growth" in str(w.message)]
    assert len(alerts) == 1, [str(w.message) for w in rec]
    quiet = ResidualControlCallback(log_every_n_steps=1, depth_images=False, alert_growth=None,
                                    alert_max_over_median=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _trainer(tmp_path, [quiet], name="quiet", max_steps=2).fit(LitGPT(), _loader())
    assert not [w for w in rec if "alert_" in str(w.message)]


def test_about_text_names_depths_branches_and_rule_notes(tmp_path):
    module = LitGPT()
    patch_residuals(module.model, method="mgr", streams=2, example_input=module.example_input_array)
    for s in merge_sites(module):
        s.branch = "attn" if "attn" in s.source_line else "mlp"
    cb = ResidualControlCallback(log_every_n_steps=1, depth_images=False)
    _trainer(tmp_path, [cb], max_steps=1).fit(module, _loader())
    assert cb.depth_labels == ["00 attn", "01 mlp", "02 attn", "03 mlp"]
    acc = _acc(tmp_path / "run" / "version_0")
    tags = acc.Tags()["tensors"]
    (tag,) = [t for t in tags if t.startswith("resctl/about")]
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "attn" in text and "mlp" in text and "accumulat" in text  # MGR's note on gates before depth n-1


# ------------------------------------------------------------------------------------------ where figures go
def test_csv_logger_gets_png_figures(tmp_path):
    cb = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1)
    abl = ResidualAblationCallback(max_batches=1)
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    _trainer(tmp_path, [cb, abl], logger=logger, max_epochs=1, max_steps=-1, limit_train_batches=2,
             limit_val_batches=1).fit(LitGPT(), _loader(), _loader(n=4))
    pngs = sorted(p.name for p in (tmp_path / "csv" / "version_0" / "resctl_figures").glob("*.png"))
    for stem in ("depth_profile_rms", "depth_profile_ratio", "depth_heatmap_stream_rms",
                 "depth_histogram_mgr_gate_hist", "ablation_loss_increase"):
        assert any(n.startswith(stem) for n in pngs), (stem, pngs)
    from PIL import Image

    for n in pngs:
        with Image.open(tmp_path / "csv" / "version_0" / "resctl_figures" / n) as im:
            assert im.size[0] > 100 and im.size[1] > 100


def test_dirpath_puts_figures_there(tmp_path):
    cb = ResidualControlCallback(log_every_n_steps=1, dirpath=str(tmp_path / "figs"))
    _trainer(tmp_path, [cb], max_epochs=1, max_steps=-1, limit_train_batches=1, limit_val_batches=1).fit(
        LitGPT(), _loader(), _loader(n=4))
    assert any((tmp_path / "figs").glob("depth_profile_rms*.png"))


def test_no_logger_warns_and_never_observes(tmp_path):
    cb = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1)
    probe = _ObserverProbe()
    with pytest.warns(UserWarning, match="no logger"):
        L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, callbacks=[cb, probe],
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=str(tmp_path)).fit(LitGPT(), _loader())
    assert probe.set_at == [False, False]
    assert cb.depth_profile == {} and cb.history == []
