"""Figures in every logger: with a WandbLogger (offline: WANDB_MODE=offline, nothing is sent) or an MLFlowLogger
(a local file store), the callbacks' scalars, depth profiles, heat maps, gate figure and ablation figure arrive in
the run itself, read back here from what each library wrote to disk."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lightning_resctl import ResidualAblationCallback, ResidualControlCallback
from test_callbacks import LitGPT, _loader, _trainer

FIGURES = ("depth_profile/rms", "depth_profile/ratio", "depth_heatmap/stream_rms", "depth_heatmap/update_ratio",
           "depth_heatmap/growth", "depth_histogram/mgr_gate_hist", "ablation/loss_increase")


def _fit(tmp_path, logger):
    cb = ResidualControlCallback(method="mgr", options={"streams": 2}, log_every_n_steps=1, per_depth="all")
    abl = ResidualAblationCallback(max_batches=1)
    _trainer(tmp_path, [cb, abl], logger=logger, max_epochs=1, max_steps=-1, limit_train_batches=2,
             limit_val_batches=1).fit(LitGPT(), _loader(), _loader(n=4))
    return cb, abl


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run: its ``.wandb`` file is a LevelDB-style log (a 7-byte header,
    then 32 KiB blocks of chunks ``crc32 (4) | length (2) | type (1) | data``) of protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    chunks, pos, block, part = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 1:  # full
            chunks.append(chunk)
        elif kind == 2:  # first
            part = chunk
        elif kind == 3:  # middle
            part += chunk
        elif kind == 4:  # last
            chunks.append(part + chunk)
    rows = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline_run_gets_scalars_and_every_figure(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="resctl-test")
    cb, abl = _fit(tmp_path, logger)
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    import wandb

    wandb.teardown()  # waits until the run file is written (finish() returns before that)

    (run_file,) = run_dir.glob("run-*.wandb")
    rows = _wandb_history(run_file)
    per_step = [r for r in rows if "resctl/stream_rms/03" in r]
    assert [r["trainer/global_step"] for r in per_step] == [0, 1]  # Lightning's own logging steps
    assert per_step[-1]["resctl/stream_rms/03"] == pytest.approx(cb.depth_profile["stream_rms"][3], rel=1e-6)
    assert per_step[-1]["resctl/mgr_gate_mean_s1/03"] == pytest.approx(cb.depth_profile["mgr_gate_mean_s1"][3],
                                                                       rel=1e-6)
    (ablation,) = [r for r in rows if "resctl/ablation_loss_increase/00" in r]
    assert [ablation[f"resctl/ablation_loss_increase/{d:02d}"] for d in range(4)] == pytest.approx(abl.loss_increase)

    images = {}
    for r in rows:
        for key, value in r.items():
            if key.endswith("/_type") and value == "images/separated":
                tag = key[: -len("/_type")]
                images[tag] = r[f"{tag}/filenames"]
    assert {f"resctl/{f}" for f in FIGURES} <= set(images), sorted(images)
    for tag, files in images.items():
        for name in files:
            png = run_dir / "files" / name
            assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (tag, name)
    assert not list(tmp_path.rglob("resctl_figures"))  # W&B takes images: no PNG folder beside it


def test_mlflow_file_store_gets_scalars_and_every_figure(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the local file store behind this switch
    logger = MLFlowLogger(experiment_name="resctl", tracking_uri=(tmp_path / "mlruns").as_uri())
    cb, abl = _fit(tmp_path, logger)
    client, run_id = logger.experiment, logger.run_id

    history = client.get_metric_history(run_id, "resctl/stream_rms/03")
    assert sorted(m.step for m in history) == [0, 1]
    assert max(history, key=lambda m: m.step).value == pytest.approx(cb.depth_profile["stream_rms"][3], rel=1e-6)
    inc = [client.get_metric_history(run_id, f"resctl/ablation_loss_increase/{d:02d}")[0].value for d in range(4)]
    assert inc == pytest.approx(abl.loss_increase)

    # images logged with a key and a step: images/<key with '/' -> '~'>+step+<step>+...png
    images = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    keys = {Path(p).name.split("+")[0].replace("~", "/") for p in images}
    assert {f"resctl/{f}" for f in FIGURES} <= keys, sorted(keys)
    about = client.download_artifacts(run_id, "resctl/about.md", str(tmp_path / "dl"))
    text = Path(about).read_text()
    assert "| depth |" in text and "mgr" in text
    assert not list(tmp_path.rglob("resctl_figures"))
