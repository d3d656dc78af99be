"""ResidualMonitor in plain PyTorch loops, ablate(), and the destinations a loop writes to (a SummaryWriter,
Lightning logger objects). Every test reads what was written back (event files, CSV, PNG files)."""
from __future__ import annotations

import copy
import csv
import logging

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from lightning_resctl import ResidualControlCallback, ResidualMonitor, ablate
from lightning_resctl.surgery import get_patch_report, merge_sites, patch_residuals
from models import NanoGPT
from test_callbacks import CFG, LitGPT, _acc, _loader, _reference_stats, _scalars, _trainer
from test_callbacks_ux import _Grab, _manual_increase

EXAMPLE = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]), generator=torch.Generator().manual_seed(0))


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _batches(n=16, batch=4, seed=123):
    return list(_loader(n, batch, seed))


def test_plain_loop_with_summarywriter_equals_independent_hooks(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(**CFG)
    reference = copy.deepcopy(model)  # never patched: the values come from forward hooks on it
    monitor = ResidualMonitor(model, log_every_n_steps=2, per_depth="all", example_input=EXAMPLE)
    assert get_patch_report(model).method == "add"  # observe: plain additions, outputs bitwise unchanged
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    probed = []
    model.register_forward_pre_hook(lambda m, a: probed.append(any(s.observer is not None for s in merge_sites(m))))
    writer = SummaryWriter(str(tmp_path / "tb"))
    expected = {}
    for step, batch in enumerate(_batches()):
        with monitor.step(step) as logging_step:
            _loss(model, batch).backward()
        assert logging_step == (step % 2 == 1)
        if logging_step:
            expected[step] = _reference_stats(reference, batch)  # forward + backward with hooks
        else:
            _loss(reference, batch).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert bool(monitor.metrics()) == logging_step  # {} on steps that do not log
        monitor.log_to(writer)
    written = monitor.log_figures(writer)
    writer.close()

    assert probed == [False, True, False, True]  # no probe at all on steps that do not log
    sc = _scalars(tmp_path / "tb")
    assert {s for (t, s) in sc} == {1, 3}
    for step, (stream, update, sgrad, pgrad) in expected.items():
        for d in range(4):
            assert sc[(f"resctl/stream_rms/{d:02d}", step)] == pytest.approx(stream[d], rel=1e-5)
            assert sc[(f"resctl/update_rms/{d:02d}", step)] == pytest.approx(update[d], rel=1e-5)
            assert sc[(f"resctl/growth/{d:02d}", step)] == pytest.approx(stream[d] / stream[0], rel=1e-5)
            assert sc[(f"resctl/stream_grad_rms/{d:02d}", step)] == pytest.approx(sgrad[d], rel=1e-4)
            assert sc[(f"resctl/param_grad_rms/{d:02d}", step)] == pytest.approx(pgrad[d], rel=1e-4)
        growth = [stream[d] / stream[0] for d in range(4)]
        assert sc[("resctl/summary/growth_last", step)] == pytest.approx(growth[-1], rel=1e-5)
    assert monitor.depth_profile["stream_rms"] == pytest.approx([expected[3][0][d] for d in range(4)], rel=1e-5)
    assert [s for s, _ in monitor.history] == [1, 3]

    acc = _acc(tmp_path / "tb")
    for tag in ("resctl/depth_profile/rms", "resctl/depth_profile/ratio", "resctl/depth_heatmap/stream_rms",
                "resctl/depth_heatmap/update_ratio", "resctl/depth_heatmap/growth"):
        assert tag in acc.Tags()["images"] and tag in written, tag
        (img,) = acc.Images(tag)
        assert img.step == 3 and img.width > 100
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    (about,) = [t for t in acc.Tags()["tensors"] if t.startswith("resctl/about")]
    assert "plain additions, observed" in acc.Tensors(about)[0].tensor_proto.string_val[0].decode()

    monitor.close()  # removes the "add" patch it applied
    assert get_patch_report(model) is None and not merge_sites(model)
    x = EXAMPLE
    assert torch.equal(model(x), reference(x))  # trained identically, bitwise


def test_plain_loop_records_what_the_trainer_callback_records(tmp_path):
    """Same model, weights and batches: a Trainer with the callback and a plain loop with the monitor write the
    same tags at the same steps with the same values (MGR: gate families and histograms included)."""
    module = LitGPT()
    plain = copy.deepcopy(module.model)  # unpatched, same weights (MGR's own parameters start deterministic)
    cb = ResidualControlCallback(method="mgr", options={"streams": 2}, per_depth="all", log_every_n_steps=1,
                                 depth_images=False)
    _trainer(tmp_path, [cb], name="trainer", max_steps=2).fit(module, _loader())

    monitor = ResidualMonitor(plain, log_every_n_steps=1, method="mgr", options={"streams": 2}, per_depth="all",
                              example_input=module.example_input_array)
    opt = torch.optim.SGD(plain.parameters(), lr=module.lr)
    writer = SummaryWriter(str(tmp_path / "plain"))
    for step, batch in enumerate(_batches(n=8)):
        with monitor.step(step):
            _loss(plain, batch).backward()
        opt.step()
        opt.zero_grad()
        monitor.log_to(writer)
    writer.close()

    by_trainer = {k: v for k, v in _scalars(tmp_path / "trainer" / "version_0").items() if k[0].startswith("resctl/")}
    by_loop = _scalars(tmp_path / "plain")
    assert set(by_loop) == set(by_trainer)
    assert len(by_trainer) > 2 * 60 and any(t.startswith("resctl/mgr_gate_mean_s1/") for t, _ in by_trainer)
    for key, value in by_trainer.items():
        assert by_loop[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    hist_trainer = _acc(tmp_path / "trainer" / "version_0")
    hist_loop = _acc(tmp_path / "plain")
    tags = hist_trainer.Tags()["histograms"]
    assert tags and sorted(tags) == sorted(hist_loop.Tags()["histograms"])
    for tag in tags:
        for a, b in zip(hist_trainer.Histograms(tag), hist_loop.Histograms(tag)):
            assert a.step == b.step and list(a.histogram_value.bucket) == list(b.histogram_value.bucket), tag
    assert monitor.depth_profile.keys() == cb.depth_profile.keys()


def test_accumulated_micro_batches_and_records_written_later(tmp_path):
    """Two `with monitor.step(0)` blocks add up to the union batch; log_to called late writes every record."""
    torch.manual_seed(0)
    model = NanoGPT(**CFG)
    reference = copy.deepcopy(model)
    monitor = ResidualMonitor(model, log_every_n_steps=1, per_depth="all", example_input=EXAMPLE)
    b0, b1, b2 = _batches(n=12)
    union = (torch.cat([b0[0], b1[0]]), torch.cat([b0[1], b1[1]]))
    stream, update, _, pgrad = _reference_stats(reference, union)
    for micro in (b0, b1):
        with monitor.step(0):
            (_loss(model, micro) / 2).backward()  # mean over the union
    assert monitor.metrics() != {}
    model.zero_grad()
    with monitor.step(1):
        _loss(model, b2).backward()
    writer = SummaryWriter(str(tmp_path / "tb"))
    monitor.log_to(writer)  # steps 0 and 1, both
    writer.close()
    sc = _scalars(tmp_path / "tb")
    assert {s for (t, s) in sc} == {0, 1}
    for d in range(4):
        assert sc[(f"resctl/stream_rms/{d:02d}", 0)] == pytest.approx(stream[d], rel=1e-5)
        assert sc[(f"resctl/update_rms/{d:02d}", 0)] == pytest.approx(update[d], rel=1e-5)
        assert sc[(f"resctl/param_grad_rms/{d:02d}", 0)] == pytest.approx(pgrad[d], rel=1e-4)


def test_lightning_logger_objects_get_scalars_and_figures(tmp_path):
    """A CSVLogger (no images): scalars through log_metrics, figures as PNG files next to it, said once;
    a TensorBoardLogger object: scalars and images in its event file."""
    torch.manual_seed(0)
    model = NanoGPT(**CFG)
    monitor = ResidualMonitor(model, log_every_n_steps=1, example_input=EXAMPLE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    csv_logger = CSVLogger(str(tmp_path), name="csv", version=0)
    tb_logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    grab = _Grab()
    logging.getLogger("lightning_resctl").addHandler(grab)
    profiles = []
    try:
        for step, batch in enumerate(_batches(n=12)):
            with monitor.step(step):
                _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            monitor.log_to(csv_logger, tb_logger)
            monitor.log_figures(csv_logger)
            profiles.append(list(monitor.depth_profile["stream_rms"]))
        monitor.log_figures(tb_logger)
    finally:
        logging.getLogger("lightning_resctl").removeHandler(grab)
    csv_logger.save()
    tb_logger.experiment.flush()

    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = {int(r["step"]): float(r["resctl/stream_rms/03"]) for r in rows if r.get("resctl/stream_rms/03")}
    assert logged == pytest.approx({s: p[3] for s, p in enumerate(profiles)}, rel=1e-6)
    figures = tmp_path / "csv" / "version_0" / "resctl_figures"
    names = sorted(p.name for p in figures.iterdir())
    for step in range(3):
        assert f"depth_profile_rms_step{step:06d}.png" in names and f"depth_heatmap_growth_step{step:06d}.png" in names
    assert "about.md" in names and "| depth |" in (figures / "about.md").read_text()
    said = [line for line in grab.lines if "cannot show images" in line]
    assert len(said) == 1 and "CSVLogger" in said[0] and str(figures) in said[0]

    sc = _scalars(tmp_path / "tb" / "version_0")
    assert sc[("resctl/stream_rms/03", 2)] == pytest.approx(profiles[2][3], rel=1e-6)
    assert "resctl/depth_heatmap/stream_rms" in _acc(tmp_path / "tb" / "version_0").Tags()["images"]


def test_backward_outside_the_block_is_said(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(**CFG)
    monitor = ResidualMonitor(model, log_every_n_steps=1, example_input=EXAMPLE)
    batch = _batches()[0]
    with pytest.warns(UserWarning, match="run the backward inside"):
        with monitor.step(0):
            loss = _loss(model, batch)
    loss.backward()
    out = monitor.metrics()
    assert "resctl/stream_rms/00" in out and "resctl/stream_grad_rms/00" in out  # tensor hooks still fire
    assert not any(t.startswith("resctl/param_grad_rms/") for t in out)  # not read before the backward


def test_close_records_the_last_step_first(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(**CFG)
    monitor = ResidualMonitor(model, log_every_n_steps=1, example_input=EXAMPLE)
    with monitor.step(0):
        _loss(model, _batches()[0]).backward()
    monitor.close()  # before any metrics() / log_to(): the step is recorded, not dropped
    assert [s for s, _ in monitor.history] == [0] and not merge_sites(model)
    writer = SummaryWriter(str(tmp_path / "tb"))
    monitor.log_to(writer)
    writer.close()
    assert ("resctl/stream_rms/00", 0) in _scalars(tmp_path / "tb")


def test_ablate_equals_skipping_each_merge_by_hand(tmp_path):
    torch.manual_seed(0)
    module = LitGPT()
    patch_residuals(module, method="add")
    batches = _batches(n=8)
    module.train()
    result = ablate(module, batches, lambda m, b: m.loss(b))
    assert module.training  # mode restored
    base, expected = _manual_increase(module, batches)
    assert result.base_loss == pytest.approx(base, rel=1e-9)
    assert result.loss_increase == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert len(set(round(v, 6) for v in expected)) > 1

    writer = SummaryWriter(str(tmp_path / "tb"))
    result.log_to(writer, step=7)
    writer.close()
    sc = _scalars(tmp_path / "tb")
    assert [sc[(f"resctl/ablation_loss_increase/{d:02d}", 7)] for d in range(4)] == pytest.approx(expected, rel=1e-6)
    assert sc[("resctl/ablation_base_loss", 7)] == pytest.approx(base, rel=1e-6)
    assert "resctl/ablation/loss_increase" in _acc(tmp_path / "tb").Tags()["images"]


def test_arguments_and_destinations_are_checked():
    model = NanoGPT(**CFG)
    with pytest.raises(ValueError, match="log_every_n_steps"):
        ResidualMonitor(model, log_every_n_steps=0)
    with pytest.raises(ValueError, match="per_depth"):
        ResidualMonitor(model, per_depth="some")
    with pytest.raises(ValueError, match="registered merge rule"):
        ResidualMonitor(model, method="mgx")
    with pytest.raises(ValueError, match="alert_growth"):
        ResidualMonitor(model, alert_growth=-1)
    assert get_patch_report(model) is None  # nothing patched by a refused monitor
    monitor = ResidualMonitor(model, log_every_n_steps=1, example_input=EXAMPLE)
    with monitor.step(0):
        _loss(model, _batches()[0]).backward()
    with pytest.raises(TypeError, match="cannot write to a dict"):
        monitor.log_to({"not": "a logger"})
    from lightning.fabric import Fabric

    with pytest.warns(UserWarning, match="nothing to write to"):
        monitor.log_to(Fabric(accelerator="cpu", devices=1))  # a Fabric without loggers: the record would be lost
    with pytest.raises(ValueError, match="batches is empty"):
        ablate(model, [], _loss)
    with pytest.raises(TypeError, match="scalar Tensor"):
        ablate(model, _batches()[:1], lambda m, b: m(b[0]))
    monitor.close()
    with pytest.raises(ValueError, match="no merge sites"):
        ablate(model, _batches()[:1], _loss)
    with pytest.raises(RuntimeError, match="found no residual merge"):
        ResidualMonitor(torch.nn.Linear(4, 4), example_input=torch.randn(2, 4))
