"""ResidualMonitor under Lightning Fabric: a LitGPT ``GPT`` trained a few steps with Fabric on CPU, in one and in
two processes (DDP, gloo), writes the diagnostics, and the numbers equal the Trainer callback's on the same model,
weights and batches (tests/_resctl_fabric_script.py runs them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import _resctl_fabric_script as script
from processes import start_runs, wait_for_runs

SCRIPT = Path(__file__).resolve().parent / "_resctl_fabric_script.py"
FIGURES = ("depth_profile/rms", "depth_profile/ratio", "depth_heatmap/stream_rms", "depth_heatmap/growth",
           "depth_histogram/mgr_gate_hist", "ablation/loss_increase")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    two = start_runs(SCRIPT, {"two-process Fabric": ("fabric", out, 2, "fabric2")})
    script.main("trainer", out)                    # the references, in this process, meanwhile
    script.main("fabric", out, 1, "fabric1")
    wait_for_runs(two, timeout=300)
    return out


def _scalars(logdir):
    df = SummaryReader(str(logdir), pivot=False).scalars
    return {(r.tag, int(r.step)): float(r.value) for r in df.itertuples() if r.tag.startswith("resctl/")}


def _events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _json(out, name, rank=0):
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def _params(out, name, rank=0):
    return {k: v for k, v in torch.load(out / f"{name}_params_rank{rank}.pt").items() if not k.endswith("_extra_state")}


def test_fabric_one_process_writes_what_the_trainer_callback_writes(runs):
    by_trainer, by_fabric = _scalars(runs / "trainer" / "version_0"), _scalars(runs / "fabric1" / "version_0")
    assert set(by_fabric) == set(by_trainer)
    assert {s for (_, s) in by_trainer} == {0, 1}
    assert len(by_trainer) > 2 * 60 and ("resctl/mgr_gate_mean_s1/03", 1) in by_trainer
    for key, value in by_trainer.items():
        assert by_fabric[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    trainer_ev, fabric_ev = _events(runs / "trainer" / "version_0"), _events(runs / "fabric1" / "version_0")
    hists = trainer_ev.Tags()["histograms"]
    assert hists and sorted(hists) == sorted(fabric_ev.Tags()["histograms"])
    for tag in hists:
        for a, b in zip(trainer_ev.Histograms(tag), fabric_ev.Histograms(tag)):
            assert a.step == b.step and list(a.histogram_value.bucket) == list(b.histogram_value.bucket), tag
    images = fabric_ev.Tags()["images"]
    assert {f"resctl/{f}" for f in FIGURES} <= set(images), images
    assert "custom_scalars__config__" in fabric_ev.Tags()["tensors"]

    t, f = _json(runs, "trainer"), _json(runs, "fabric1")
    assert f["depth_profile"].keys() == t["depth_profile"].keys()
    assert f["loss_increase"] == pytest.approx(t["loss_increase"], rel=1e-6, abs=1e-9)
    assert f["base_loss"] == pytest.approx(t["base_loss"], rel=1e-9)
    pt, pf = _params(runs, "trainer"), _params(runs, "fabric1")
    assert sorted(pt) == sorted(pf) and any("_resctl_mgr" in k for k in pt)  # MGR's parameters were trained too
    for k in pt:
        torch.testing.assert_close(pf[k], pt[k], rtol=0, atol=0)


def test_fabric_two_processes_equal_one_process_on_the_union(runs):
    by_trainer, by_ddp = _scalars(runs / "trainer" / "version_0"), _scalars(runs / "fabric2" / "version_0")
    assert set(by_ddp) == set(by_trainer)  # logged once, by rank zero
    assert len(list((runs / "fabric2" / "version_0").glob("events.out.tfevents.*"))) == 1
    for (tag, step), value in by_trainer.items():
        if tag.startswith("resctl/stream_grad_rms/"):
            # d(loss)/d(stream) of each rank's own mean loss over half the batch: exactly twice the union's
            assert by_ddp[(tag, step)] == pytest.approx(2 * value, rel=1e-5), tag
        else:
            assert by_ddp[(tag, step)] == pytest.approx(value, rel=1e-5, abs=1e-6), (tag, step)
    trainer_ev, ddp_ev = _events(runs / "trainer" / "version_0"), _events(runs / "fabric2" / "version_0")
    for tag in trainer_ev.Tags()["histograms"]:  # gate counts summed over ranks: all tokens of the union batch
        for a, b in zip(trainer_ev.Histograms(tag), ddp_ev.Histograms(tag)):
            assert a.histogram_value.num == b.histogram_value.num == 4 * script.CONFIG["block_size"]
            assert list(a.histogram_value.bucket) == list(b.histogram_value.bucket), tag
    assert {f"resctl/{f}" for f in FIGURES} <= set(ddp_ev.Tags()["images"])

    r0, r1, t = _json(runs, "fabric2", 0), _json(runs, "fabric2", 1), _json(runs, "trainer")
    assert r0["world"] == r1["world"] == 2
    assert r0["depth_profile"] == r1["depth_profile"]  # reduced the same on both ranks
    assert r1["figures"] == [] and r0["figures"]  # figures by rank zero only
    assert r0["loss_increase"] == r1["loss_increase"]
    assert r0["loss_increase"] == pytest.approx(t["loss_increase"], rel=1e-4, abs=5e-6)  # fp32 loss ~3.6
    p0, p1, pt = _params(runs, "fabric2", 0), _params(runs, "fabric2", 1), _params(runs, "trainer")
    for k in pt:
        assert torch.equal(p0[k], p1[k]), k
        torch.testing.assert_close(p0[k], pt[k], rtol=1e-5, atol=1e-6)
