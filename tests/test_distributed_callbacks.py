"""ResidualControlCallback(method="mgr") under DDP and FSDP2 (CPU, gloo, 2 processes).

The distributed runs are standalone scripts (strategy="ddp" relaunches sys.argv) started with
subprocess, both at once; the single-process reference runs in this process on the union of the data.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tbparse import SummaryReader

import _resctl_dist_script as script
from processes import start_runs, wait_for_runs

SCRIPT = Path(__file__).resolve().parent / "_resctl_dist_script.py"
FORWARD = ("stream_rms", "update_rms", "update_ratio", "growth", "max_abs", "max_over_median",
           "mgr_gate_mean_s0", "mgr_gate_mean_s1", "mgr_gate_std_s0", "mgr_pool_entropy",
           "mgr_stream_rms_s0", "mgr_stream_rms_s1", "mgr_angle")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    procs = start_runs(SCRIPT, {mode: (mode, out) for mode in ("ddp", "fsdp")})
    # single-process references on the union of the ranks' data, meanwhile
    script.main("single", out, "competitive", name="single")
    wait_for_runs(procs, timeout=240)
    return out


def _scalars(logdir):
    df = SummaryReader(str(logdir), pivot=False).scalars
    return {(r.tag, int(r.step)): float(r.value) for r in df.itertuples()}


def _histograms(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    acc.Reload()
    return {t: [(e.step, e.histogram_value.num, list(e.histogram_value.bucket)) for e in acc.Histograms(t)]
            for t in acc.Tags()["histograms"]}


def _checks(out, name, rank):
    return json.loads((out / f"{name}_checks_rank{rank}.json").read_text())


def _compare_metrics(dist, single, families, rel=1e-5):
    n = 0
    for (tag, step), v in single.items():
        fam = tag.split("/")[1] if tag.startswith("resctl/") else None
        if fam in families:
            assert (tag, step) in dist, tag
            assert dist[(tag, step)] == pytest.approx(v, rel=rel, abs=1e-9), (tag, step)
            n += 1
    return n


def test_ddp_identical_params_and_union_metrics(runs):
    p0 = torch.load(runs / "ddp_params_rank0.pt")
    p1 = torch.load(runs / "ddp_params_rank1.pt")
    single = torch.load(runs / "single_params_rank0.pt")
    c0, c1 = _checks(runs, "ddp", 0), _checks(runs, "ddp", 1)
    assert c0["world_size"] == 2 and c0["methods"] == ["mgr"] and c0["num_sites"] == 4
    assert c0["new_params"] and all(c0["new_params_in_optimizer"]) and c0["finite"]
    assert sum(c0["new_params_changed"]) >= len(c0["new_params"]) - 1  # merge 0's pool sees one stream: no grad
    assert list(p0) == list(p1) == list(single)
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k  # identical on both ranks
        torch.testing.assert_close(p0[k], single[k], rtol=1e-5, atol=1e-6)  # = one process on the union
    assert c0["depth_profile"]["stream_rms"] == c1["depth_profile"]["stream_rms"]  # reduced the same on both
    # ablation: losses averaged over ranks == one process on the union of the validation batches
    cs = _checks(runs, "single", 0)
    assert len(cs["loss_increase"]) == 4 and c0["loss_increase"] == c1["loss_increase"]
    assert c0["base_loss"] == pytest.approx(cs["base_loss"], rel=1e-6)
    assert c0["loss_increase"] == pytest.approx(cs["loss_increase"], rel=1e-4, abs=5e-6)  # fp32 loss ~3.5

    dist = _scalars(runs / "ddp" / "version_0")
    ref = _scalars(runs / "single" / "version_0")
    assert {s for (t, s) in ref if t.startswith("resctl/")} == {0, 1}
    assert _compare_metrics(dist, ref, FORWARD + ("mgr_forget_mean", "param_grad_rms")) >= 2 * 40
    # gate histograms: counts reduced over ranks (num = all tokens of the union batch), equal to one process
    hd, hs = (_histograms(runs / n / "version_0") for n in ("ddp", "single"))
    assert set(hd) == set(hs) and "resctl/mgr_gate_hist_s0/01" in hd
    for tag in hs:
        for (sd, nd, bd), (ss, ns, bs) in zip(hd[tag], hs[tag]):
            assert sd == ss and nd == ns == 4 * script.CFG["block_size"] and bd == pytest.approx(bs), tag
    # d loss / d stream: each rank's loss is the mean over its own half of the batch -> exactly 2x
    for d in range(4):
        for step in (0, 1):
            tag = f"resctl/stream_grad_rms/{d:02d}"
            assert dist[(tag, step)] == pytest.approx(2 * ref[(tag, step)], rel=1e-5)


def test_fsdp2_mgr_params_sharded_trained_and_metrics(runs):
    for rank in (0, 1):
        c = _checks(runs, "fsdp", rank)
        assert c["world_size"] == 2 and c["methods"] == ["mgr"] and c["num_sites"] == 4
        assert c["all_params_dtensor"], "fully_shard did not cover every parameter"
        assert c["new_params"] and all(c["new_params_dtensor"]) and all(c["new_params_in_optimizer"])
        assert sum(c["new_params_changed"]) >= len(c["new_params"]) - 1
        assert c["finite"]
        cs = _checks(runs, "single", 0)
        assert c["loss_increase"] == pytest.approx(cs["loss_increase"], rel=1e-4, abs=5e-6)  # fp32 loss ~3.5
    full0 = torch.load(runs / "fsdp_params_rank0.pt")
    single = torch.load(runs / "single_params_rank0.pt")
    assert list(full0) == list(single)
    for k in full0:
        torch.testing.assert_close(full0[k], single[k], rtol=1e-4, atol=1e-6)  # same shapes: one path or the other
    dist = _scalars(runs / "fsdp" / "version_0")
    ref = _scalars(runs / "single" / "version_0")
    fams = tuple(f for f in FORWARD) + ("param_grad_rms",)
    assert _compare_metrics(dist, ref, fams, rel=1e-4) >= 2 * 40
    assert all(math.isfinite(v) for (t, s), v in dist.items() if t.startswith("resctl/"))
