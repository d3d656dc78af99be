"""The compare job end to end on a user's own LightningModule + DataModule (``tests/compare_toy.py``, not the
built-in GPT): by the command line with a LightningCLI-style YAML, by the Python API, killed and resumed, sharded
and merged; and the built-in GPT against the init check."""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import lightning_resctl
from lightning_resctl.compare import cli

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
METHODS = ["plain", "mgr-competitive", "rescontroller"]
TRAINER = {"max_steps": 12, "val_check_interval": 4, "check_val_every_n_epoch": None, "log_every_n_steps": 2,
           "accelerator": "cpu", "gradient_clip_val": 1.0}
COMPARE = {"methods": METHODS, "seeds": 2, "cost_rounds": 3, "cost_warmup": 1, "threads": 1, "depth_images": False,
           "progress_bar": False, "checkpoint_every_min": 0}


def _yaml(path: Path, *, callbacks=(), **compare) -> Path:
    """A LightningCLI-style config of the toy job: model:, data:, trainer: with class_path / init_args, compare:."""
    config = {
        "model": {"class_path": "compare_toy.ToyLM", "init_args": {"dim": 16, "depth": 3}},
        "data": {"class_path": "compare_toy.ToyData", "init_args": {"train_size": 80}},
        "trainer": {**TRAINER, "callbacks": list(callbacks)},
        "compare": {**COMPARE, **compare},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _runs(out: Path) -> dict[tuple[str, int], dict]:
    return {(r["method"], r["seed"]): r for r in (json.loads(p.read_text()) for p in (out / "runs").glob("*.json"))}


@pytest.fixture(scope="module", autouse=True)
def _eager_cpu_merges():
    """The merges' torch path runs eagerly here (compiling its CPU regions takes longer than these tiny runs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_RESCTL_COMPILE", "0")
        mp.syspath_prepend(str(TESTS))
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The toy job run straight through by the command line, with a log of every run's batches."""
    tmp = tmp_path_factory.mktemp("straight")
    log = tmp / "batches.txt"
    config = _yaml(tmp / "job.yaml", callbacks=[{"class_path": "compare_toy.BatchLog",
                                                 "init_args": {"path": str(log)}}])
    import compare_toy

    compare_toy.BatchLog.fits = 0
    assert cli.main(["--config", str(config), "--out", str(tmp / "out")]) == 0
    return tmp / "out", log


def test_command_line_job_on_a_user_model_compares_matched_runs(straight):
    out, log = straight
    summary = json.loads((out / "summary.json").read_text())
    runs = _runs(out)
    assert set(runs) == {(m, s) for m in METHODS for s in (0, 1)}
    # the user's model with the user's init arguments (not the built-in model's lr or dropout)
    assert summary["identity"]["model"]["class_path"] == "compare_toy.ToyLM"
    assert "ToyLM(vocab=24, dim=16, depth=3, dropout=0.1, lr=0.01, seq=12)" in summary["about"]["model"]
    # matched per seed: the same initial weights and the same batches in the same order for every method
    by_fit: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        fit, step, digest = line.split()
        by_fit.setdefault(int(fit), []).append(digest)
    order = [(m, s) for s in (0, 1) for m in METHODS]  # the job's run order
    batches = {run: by_fit[i + 1] for i, run in enumerate(order)}
    for s in (0, 1):
        assert all(batches[(m, s)] == batches[("plain", s)] for m in METHODS)
        assert len(batches[("plain", s)]) == TRAINER["max_steps"]
        assert len({runs[(m, s)]["init_fingerprint"] for m in METHODS}) == 1
    assert batches[("plain", 0)] != batches[("plain", 1)]
    assert runs[("plain", 0)]["init_fingerprint"] != runs[("plain", 1)]["init_fingerprint"]
    # the monitored metric: the logged val_loss at every validation, the last one compared
    for r in runs.values():
        assert r["status"] == "done" and r["monitor"] == "val_loss" and r["steps"] == 12
        assert [step for step, _ in r["curve"]] == [4, 8, 12] and r["final"] == r["curve"][-1][1]
    assert runs[("mgr-competitive", 0)]["params_added"] > 0 == runs[("rescontroller", 0)]["params_added"]
    assert runs[("mgr-competitive", 0)]["curve"] != runs[("plain", 0)]["curve"]  # the method was applied
    # paired statistics over the per-seed differences
    pair = summary["methods"]["mgr-competitive"]["paired"]
    diffs = [runs[("mgr-competitive", s)]["final"] - runs[("plain", s)]["final"] for s in (0, 1)]
    assert pair["diffs"] == pytest.approx(diffs) and pair["n"] == 2 and pair["ci"] is None
    assert pair["better"] == sum(d < 0 for d in diffs)
    md = (out / "summary.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method | val_loss"))
    assert "vs plain, paired by seed" in header and "start vs plain" in header and "cost vs plain" in header
    line = next(line for line in md.splitlines() if line.startswith("- **mgr-competitive**"))
    assert f"in {pair['better']} of 2 seeds" in line and "fewer than 3 seeds, no interval" in line
    # the init check and the cost column, per method
    assert runs[("plain", 0)]["init_difference"]["output"] == 0.0
    assert runs[("mgr-competitive", 0)]["init_difference"]["output"] > 0
    cost = json.loads((out / "cost.json").read_text())
    assert set(cost["ratio"]) == set(METHODS) and cost["rounds"] == 3 and cost["ratio"]["plain"] == 1.0
    for name in ("val_metric.png", "stream_rms_depth.png", "ablation_depth.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tb" / "mgr-competitive" / "seed1").glob("events.out.tfevents.*"))
    assert not [p for p in (out / "runs").iterdir() if p.is_dir()]  # checkpoints are removed when a run ends


def test_python_api_runs_the_same_job_and_reports_refusals_and_false_identity(straight, tmp_path, monkeypatch):
    """The API on the same model, data and Trainer settings gives the command line's runs bit for bit; a rule the
    surgery refuses gets its line and the others run; a rule that claims identity at init but is not is flagged."""
    from compare_toy import ToyData, ToyLM
    from lightning_resctl.rules import MergeRule, base

    class Halved(MergeRule):
        description = "stream + update / 2 (claims identity at init: it is not)"
        identity_at_init = True

        def merge(self, module, stream, update, inplace):
            return stream + 0.5 * update

    class Refuser(MergeRule):
        description = "refuses every model"

        def refuse(self, model):
            return "this rule refuses every model"

        def merge(self, module, stream, update, inplace):
            return stream + update

    monkeypatch.setitem(base._REGISTRY, "halved", base.RuleEntry("halved", Halved, (), Halved.description))
    monkeypatch.setitem(base._REGISTRY, "refuser", base.RuleEntry("refuser", Refuser, (), Refuser.description))
    trainer = {**TRAINER, "devices": 1}  # the API chooses num_sanity_val_steps=0, enable_model_summary=False
    table = lightning_resctl.compare(
        model=lambda: ToyLM(dim=16, depth=3), datamodule=ToyData(train_size=80),
        methods=["plain", "mgr-competitive", "halved", "refuser"], seeds=1, trainer=trainer, out=tmp_path / "api",
        cost_rounds=0, threads=1, depth_images=False, progress_bar=False)
    cli_runs, api_runs = _runs(straight[0]), _runs(tmp_path / "api")
    for method in ("plain", "mgr-competitive"):
        assert api_runs[(method, 0)]["curve"] == cli_runs[(method, 0)]["curve"]
        assert api_runs[(method, 0)]["train_curve"] == cli_runs[(method, 0)]["train_curve"]
        assert table[method]["final"] == cli_runs[(method, 0)]["final"]
    assert [row["method"] for row in table] == ["plain", "mgr-competitive", "halved", "refuser"]
    assert table["refuser"]["status"].startswith("refused") and "refuses every model" in table["refuser"]["status"]
    assert ("refuser", 0) in api_runs and api_runs[("refuser", 0)]["status"] == "refused"
    assert table["halved"]["init_flagged"] is True and table["halved"]["init_output_diff"] > 1e-3
    assert table["mgr-competitive"]["init_flagged"] is False  # MGR does not claim identity at init
    md = (tmp_path / "api" / "summary.md").read_text()
    assert "method refuser refused" in md and "this rule refuses every model" in md
    assert "⚠ **halved** starts" in md and "identity at init" in md
    assert list(table.to_pandas().index) == ["plain", "mgr-competitive", "halved", "refuser"]
    about = json.loads((tmp_path / "api" / "job.json").read_text())["about"]
    assert about["trainer_chosen"] == {"num_sanity_val_steps": 0, "enable_model_summary": False}
    assert "the job chose, as you did not set them: num_sanity_val_steps=0, enable_model_summary=False" in md


def test_the_job_says_which_trainer_settings_it_chose_and_set(tmp_path, capsys):
    """The Trainer settings the command line chooses when the user's do not set them (here gradient_clip_val,
    num_sanity_val_steps, ...) and those the job sets for every run (its logger, callbacks, ...) are printed before
    the first run and written to job.json and summary.md; the user's own values are not listed as chosen."""
    config = _yaml(tmp_path / "job.yaml", methods=["plain"], seeds=1, cost_rounds=0, ablation=False)
    raw = yaml.safe_load(config.read_text())
    del raw["trainer"]["gradient_clip_val"]
    raw["trainer"]["max_steps"] = 2
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    capsys.readouterr()
    assert cli.main(["--config", str(config), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    before_runs = said.split("[resctl] run 1/1", 1)[0]
    chosen = {"gradient_clip_val": 1.0, "devices": 1, "num_sanity_val_steps": 0, "enable_model_summary": False}
    about = json.loads((out / "job.json").read_text())["about"]
    assert about["trainer_chosen"] == chosen
    assert set(about["trainer_set"]) == {"logger", "callbacks", "enable_progress_bar", "default_root_dir",
                                         "enable_checkpointing"}
    line = ("the job chose, as you did not set them: gradient_clip_val=1.0, devices=1, num_sanity_val_steps=0, "
            "enable_model_summary=False")
    assert line in before_runs and line in (out / "summary.md").read_text()
    for key in about["trainer_set"]:
        assert f"{key}: " in before_runs and f"{key}: " in (out / "summary.md").read_text()
    assert "max_steps=2" not in line and "val_check_interval" not in line  # the user's own settings


def test_a_method_list_without_plain_is_refused_naming_the_fix(tmp_path, capsys):
    """Every figure compares a method with plain of the same seed: a list without plain is refused before anything
    runs, by the command line (exit 2), its --help and the Python API, naming the list to give instead."""
    config = _yaml(tmp_path / "job.yaml", methods=["mgr-competitive", "rescontroller"])
    with pytest.raises(SystemExit) as stop:
        cli.main(["--config", str(config), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "methods must include plain" in err and "plain,mgr-competitive,rescontroller" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"methods must include plain.*\['plain', 'mgr-competitive'\]"):
        lightning_resctl.compare(model=lambda: None, methods=["mgr-competitive"], out=tmp_path / "api")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "must include plain" in " ".join(capsys.readouterr().out.split())


def test_a_killed_job_resumes_to_the_numbers_of_a_straight_job(straight, tmp_path):
    """SIGKILL in the middle of the second run (a patched model, mid-epoch), then --resume: finished runs are kept,
    the run in progress continues from its checkpoint, and every number equals the uninterrupted job's."""
    marker = tmp_path / "killed"
    config = _yaml(tmp_path / "job.yaml", callbacks=[{"class_path": "compare_toy.KillOnce",
                                                      "init_args": {"step": 7, "marker": str(marker), "run": 2}}])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "LIGHTNING_RESCTL_COMPILE": "0"}
    proc = subprocess.run([sys.executable, "-m", "lightning_resctl", "compare", "--config", str(config), "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert marker.exists() and set(_runs(out)) == {("plain", 0)}
    assert (out / "runs" / "mgr-competitive_seed0" / "last.ckpt").is_file()  # saved at the validation of step 4
    assert cli.main(["--config", str(config), "--out", str(out), "--resume"]) == 0
    _assert_same_record(out, straight[0])  # the killed fit's events after its checkpoint (steps 5-7) are dropped
    assert {key for key, run in _runs(out).items() if run["resumed"]} == {("mgr-competitive", 0)}
    assert not (out / "runs" / "mgr-competitive_seed0").exists()
    md = (out / "summary.md").read_text()
    assert "| mgr-competitive | 0 |" in md and "| yes |" in md


@pytest.mark.parametrize("where, step", [("train", 6), ("validation", 8), ("epoch_end", 10), ("setup", 0)])
def test_a_sigterm_job_saves_its_run_says_how_to_resume_and_exits_143(straight, tmp_path, where, step):
    """SIGTERM (a cluster's notice before pre-empting) during a training step, mid-way through a validation, or at
    the end of an epoch (10 batches) of the second run, long before its next periodic checkpoint: the run saves its
    checkpoint at once (at that step's end, at that validation's end, at the epoch's end), the job prints one line
    with the command that resumes it and exits 143 (a scheduler reads 0 as success); that command, run as printed,
    ends with every number of the uninterrupted job. In the fit's setup (before Lightning handles SIGTERM) there is
    nothing to save: the job stops at once and the run starts over."""
    marker = tmp_path / "terminated"
    config = _yaml(tmp_path / "job.yaml", checkpoint_every_min=60,
                   callbacks=[{"class_path": "compare_toy.TermOnce",
                               "init_args": {"step": step, "marker": str(marker), "run": 2, "where": where}}])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "LIGHTNING_RESCTL_COMPILE": "0"}
    proc = subprocess.run([sys.executable, "-m", "lightning_resctl", "compare", "--config", str(config), "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert marker.exists() and set(_runs(out)) == {("plain", 0)}
    saved = out / "runs" / "mgr-competitive_seed0" / "last.ckpt"
    if where == "setup":
        assert not saved.exists()
    else:  # saved on the signal, not by the periodic checkpoint (60 min)
        assert torch.load(saved, weights_only=False)["global_step"] == step
    hints = [line for line in (proc.stdout + proc.stderr).splitlines() if "--resume" in line]
    assert len(hints) == 1, proc.stdout[-3000:]
    command = shlex.split(hints[0].split("resume with: ", 1)[1])
    assert command[:3] == ["python", "-m", "lightning_resctl"] and command[3] == "compare"
    assert cli.main(command[4:]) == 0
    resumed, reference = _runs(out), _runs(straight[0])
    assert set(resumed) == set(reference)
    for key, run in resumed.items():
        for field in ("final", "curve", "train_curve", "ablation_loss_increase", "init_fingerprint"):
            assert run[field] == reference[key][field], (key, field)
        assert run["resumed"] == (key == ("mgr-competitive", 0) and where != "setup")


#: what a resumed job may legitimately record differently from a straight one: wall-clock figures (the run's and the
#: job's times, the timed step count, which leaves out the interval across the stop) and whether the run was resumed
TIMING_FIELDS = ("wall_s", "train_time_s", "steps_timed", "resumed")


def _tensorboard(out: Path) -> dict[str, list[tuple]]:
    """Every event the job logged to TensorBoard: ``{"method/seedN": sorted [(kind, tag, step, value), ...]}``."""
    from tbparse import SummaryReader

    record = {}
    for run in sorted(p for p in (out / "tb").glob("*/seed*") if p.is_dir()):
        reader = SummaryReader(str(run))
        events = []
        for kind in ("scalars", "histograms", "text", "tensors"):
            frame = getattr(reader, kind)
            for row in frame.to_dict("records"):
                tag, step = row.pop("tag"), int(row.pop("step"))
                events.append((kind, tag, step, repr(sorted((k, repr(v)) for k, v in row.items()))))
        record[f"{run.parent.name}/{run.name}"] = sorted(events)
    return record


def _assert_same_record(out: Path, reference: Path) -> None:
    """``out`` holds the record of the job in ``reference``: every TensorBoard event (tag, step, value), every field
    of every run record, the summary's figures, except :data:`TIMING_FIELDS` and the cost column (a timing)."""
    got, want = _tensorboard(out), _tensorboard(reference)
    assert set(got) == set(want)
    for run in want:
        assert got[run] == want[run], (run, sorted(set(got[run]) ^ set(want[run]))[:6])
    runs, reference_runs = _runs(out), _runs(reference)
    assert set(runs) == set(reference_runs)
    for key, run in runs.items():
        for field in set(run) | set(reference_runs[key]):
            if field not in TIMING_FIELDS:
                assert run.get(field) == reference_runs[key].get(field), (key, field)
    summary, reference_summary = (json.loads((d / "summary.json").read_text()) for d in (out, reference))
    for m, figures in reference_summary["methods"].items():
        assert {k: v for k, v in summary["methods"][m].items() if k != "cost"} == {
            k: v for k, v in figures.items() if k != "cost"}, m


def _term_on_call(monkeypatch, owner, name: str, call: int) -> None:
    """SIGTERM this process just before the ``call``-th call of ``owner.name`` (once)."""
    original, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("where", ["train", "validation", "between runs", "summary"])
def test_a_resumed_job_records_what_the_straight_job_records(straight, tmp_path, monkeypatch, where):
    """SIGTERM during a training step or a validation of the second run (a patched model, mid-epoch), between two
    runs, or while the summary is written; then --resume. The folder ends with the straight job's record: the same
    TensorBoard events (every tag, step and value), run records, diagnostics and summary figures."""
    import compare_toy
    from lightning_resctl.compare import plots, records

    marker, out = tmp_path / "terminated", tmp_path / "out"
    callbacks = []
    if where in ("train", "validation"):
        compare_toy.TermOnce.fits = 0
        callbacks = [{"class_path": "compare_toy.TermOnce",
                      "init_args": {"step": 6 if where == "train" else 8, "marker": str(marker), "run": 2,
                                    "where": where}}]
    config = _yaml(tmp_path / "job.yaml", checkpoint_every_min=60, callbacks=callbacks)
    with monkeypatch.context() as patch:
        if where == "between runs":
            _term_on_call(patch, records.JobFolder, "write_record", 3)  # after the third run, before its record
        elif where == "summary":
            _term_on_call(patch, plots, "band_figure", 2)
        assert cli.main(["--config", str(config), "--out", str(out)]) == 143
    assert cli.main(["--config", str(config), "--out", str(out), "--resume"]) == 0
    _assert_same_record(out, straight[0])
    wall = sum(r["wall_s"] for r in _runs(out).values()) + json.loads((out / "cost.json").read_text())["wall_s"]
    assert _total_wall_s(out) == round(wall)  # the runs' own times, a stopped fit's included


def _total_wall_s(out: Path) -> float:
    md = (out / "summary.md").read_text()
    line = next(line for line in md.splitlines() if line.startswith("Total wall time:"))
    return float(line.split(":", 1)[1].split(" s", 1)[0])


def test_every_output_is_reproduced_from_the_folder_and_resuming_a_finished_job_changes_nothing(straight, tmp_path,
                                                                                                  capsys):
    """The total wall time is the sum of the runs' own times (and the cost measurement's), so the summary is a
    function of the folder: --resume of a finished job rewrites every file byte for byte, says the job is finished,
    and trains nothing."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    runs = _runs(out)
    cost = json.loads((out / "cost.json").read_text())
    assert _total_wall_s(out) == round(sum(r["wall_s"] for r in runs.values()) + cost["wall_s"])
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert cli.main(["--config", str(straight[0].parent / "job.yaml"), "--out", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert sorted(after) == sorted(before)
    assert [name for name in before if after[name] != before[name]] == []
    assert "all 6 runs of this job are finished" in said and "run 1/" not in said and "cost vs plain:" not in said


_API_SCRIPT = """
import os, signal, sys
import lightning_resctl
from compare_toy import ToyData, ToyLM

marker, out, resume, trainer = sys.argv[1], sys.argv[2], sys.argv[3] == "resume", eval(sys.argv[4])
built = []


def model():  # called once per seed, outside any fit: the second call comes between seed 0's and seed 1's runs
    built.append(1)
    if len(built) == 2 and not os.path.exists(marker):
        open(marker, "w").write("terminated")
        os.kill(os.getpid(), signal.SIGTERM)
    return ToyLM(dim=16, depth=3)


lightning_resctl.compare(model=model, datamodule=ToyData(train_size=80), methods=["plain", "mgr-competitive"],
                         seeds=2, trainer=trainer, out=out, resume=resume, cost_rounds=0, threads=1,
                         depth_images=False, progress_bar=False)
"""


def test_a_sigterm_between_runs_stops_an_api_job_with_143_and_resume_finishes_it(straight, tmp_path):
    """SIGTERM outside a fit (between runs, where Lightning's handler is not installed) of a job started by the
    Python API: the job says how to resume and the process exits 143 (not killed by the signal, not 0); the same call
    with resume=True keeps the finished runs and ends with the numbers of the uninterrupted job."""
    script, marker, out = tmp_path / "job.py", tmp_path / "terminated", tmp_path / "out"
    script.write_text(_API_SCRIPT)
    trainer = repr({**TRAINER, "devices": 1, "num_sanity_val_steps": 0, "enable_model_summary": False})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "LIGHTNING_RESCTL_COMPILE": "0"}
    proc = subprocess.run([sys.executable, str(script), str(marker), str(out), "new", trainer], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert marker.exists() and set(_runs(out)) == {("plain", 0), ("mgr-competitive", 0)}
    hints = [line for line in proc.stdout.splitlines() if "resume with" in line]
    assert len(hints) == 1 and "resume=True" in hints[0], proc.stdout[-3000:]
    assert "SIGTERM" in proc.stdout and "2 of 4 runs finished" in proc.stdout
    proc = subprocess.run([sys.executable, str(script), str(marker), str(out), "resume", trainer], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = _runs(out), _runs(straight[0])
    assert set(resumed) == {(m, s) for m in ("plain", "mgr-competitive") for s in (0, 1)}
    for key, run in resumed.items():
        for field in ("final", "curve", "train_curve", "init_fingerprint"):
            assert run[field] == reference[key][field], (key, field)


def test_two_shards_merged_equal_one_job(straight, tmp_path):
    config = _yaml(tmp_path / "job.yaml")
    for i in (1, 2):
        assert cli.main(["--config", str(config), "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2"]) == 0
    ran = [set(_runs(tmp_path / f"s{i}")) for i in (1, 2)]
    assert ran[0].isdisjoint(ran[1]) and ran[0] | ran[1] == set(_runs(straight[0]))
    assert (tmp_path / "s1" / "cost.json").is_file() and not (tmp_path / "s2" / "cost.json").exists()
    assert cli.summarize_main([str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "summary.json").read_text())
    whole = json.loads((straight[0] / "summary.json").read_text())
    assert merged["missing"] == [] and set(merged["methods"]) == set(METHODS)
    for m in METHODS:
        assert merged["methods"][m]["final"] == whole["methods"][m]["final"]
        assert merged["methods"][m]["paired"] == whole["methods"][m]["paired"]
    # a shard alone says what is missing; folders of another job are refused
    assert "not run yet" in (tmp_path / "s2" / "summary.md").read_text()
    other = _yaml(tmp_path / "other.yaml", seeds=1)
    assert cli.main(["--config", str(other), "--out", str(tmp_path / "o"), "--methods", "plain"]) == 0
    assert cli.summarize_main([str(tmp_path / "s1"), str(tmp_path / "o")]) == 2


# --- the built-in GPT and the init check ------------------------------------------------------------------------

@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_builtin_gpt_starts_every_identity_rule_as_plain_and_the_check_catches_the_default_eps(one_thread):
    """With its norm eps, every rule that claims identity at init starts within 1e-3 of plain on the built-in GPT;
    with torch's default LayerNorm eps (1e-5) Attention Residuals starts far away and the check flags it."""
    from lightning_resctl.compare.data import CharDataModule
    from lightning_resctl.compare.fairness import IDENTITY_TOLERANCE, InitProbe, init_difference
    from lightning_resctl.compare.gpt import CharGPT
    from lightning_resctl.compare.methods import available_methods, claims_identity_at_init

    dm = CharDataModule(max_train_chars=20_000, max_val_chars=5_000, block_size=16, batch_size=4, val_batches=1)
    dm.setup("fit")
    probe = InitProbe(next(iter(dm.val_dataloader())), torch.device("cpu"))
    claimed = [(m, None) for m in available_methods()[1:] if claims_identity_at_init(m)]
    claimed += [(m, {"init": "residual"}) for m in available_methods()[1:]
                if not claims_identity_at_init(m) and claims_identity_at_init(m, {"init": "residual"})]
    assert {"add", "attnres", "attnres-block", "hc", "dwa", "laurel", "laurel-pa", "kromhc"} <= {m for m, _ in claimed}
    torch.manual_seed(0)
    gpt = CharGPT(n_layer=4, n_embd=32, n_head=2, block_size=16)
    for method, options in claimed:
        result = init_difference(gpt, method, options, probe)
        assert result["identity_claimed"] and not result["flagged"], (method, result)
        assert max(result["output"], result["grad_norm"]) <= IDENTITY_TOLERANCE
    torch.manual_seed(0)
    default_eps = CharGPT(n_layer=4, n_embd=32, n_head=2, block_size=16, norm_eps=1e-5)
    result = init_difference(default_eps, "attnres", None, probe)
    assert result["flagged"] and result["output"] > 0.05
    mgr = init_difference(gpt, "mgr-competitive", None, probe)
    assert not mgr["identity_claimed"] and not mgr["flagged"] and mgr["output"] > IDENTITY_TOLERANCE


def test_init_check_measures_outputs_and_gradients_and_reports_refusals(one_thread):
    from compare_toy import ToyData, ToyLM
    from lightning_resctl.compare.fairness import InitProbe, RefusedError, init_difference

    dm = ToyData()
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    torch.manual_seed(0)
    model = ToyLM()
    probe = InitProbe(batch, torch.device("cpu"))
    assert init_difference(model, "add", None, probe) == {"output": 0.0, "grad_norm": 0.0, "identity_claimed": True,
                                                         "flagged": False}
    # an independent measurement: the method's logits and gradient norm against plain's, by hand
    import copy

    from lightning_resctl import patch_residuals

    patched = copy.deepcopy(model)
    patch_residuals(patched, method="rescontroller")
    x, y = batch
    for m in (model, patched):
        m.eval()
    with torch.no_grad():
        expected = float((patched(x) - model(x)).norm() / model(x).norm())
    result = init_difference(model, "rescontroller", None, probe)
    assert result["output"] == pytest.approx(expected, rel=1e-6) and result["output"] > 0
    grads = []
    for m in (copy.deepcopy(model), patched):
        m.train()
        m.zero_grad()
        torch.manual_seed(0)
        m._loss(batch).backward()
        grads.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None)))
    assert result["grad_norm"] == pytest.approx(abs(grads[1] - grads[0]) / grads[0], rel=1e-6)
    with pytest.raises(RefusedError, match="streams must be <= 6"):  # a surgery that refuses is reported
        init_difference(model, "mhc-lite", {"streams": 7}, probe)


def test_builtin_default_job_by_the_command_line(tmp_path, capfd, caplog):
    """The built-in GPT and data through the command line at a tiny size: the corpus is named without machine paths,
    Lightning's banner prints once, one progress line follows the runs."""
    import logging

    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    text = tmp_path / "corpus.txt"
    text.write_text((Path(__import__("sysconfig").get_paths()["stdlib"]) / "textwrap.py").read_text()[:6000])
    argv = ["compare", "--data.text", str(text), "--model.n_layer", "1", "--model.n_embd", "8", "--model.n_head", "2",
            "--model.block_size", "8", "--data.block_size", "8", "--data.batch_size", "2", "--data.val_batches", "1",
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.accelerator", "cpu",
            "--seeds", "1", "--methods", "plain,add,rescontroller", "--ablation", "false", "--threads", "1",
            "--out", str(tmp_path / "out"), "--depth_images", "false", "--cost_rounds", "1", "--cost_warmup", "0"]
    from lightning_resctl import __main__ as entry

    assert entry.main(argv) == 0
    captured = capfd.readouterr()
    text_out = captured.out + captured.err
    banner = [r.getMessage() for r in caplog.records if "GPU available" in r.getMessage()]
    assert len(banner) == 1, banner
    for i, m in enumerate(["plain", "add", "rescontroller"], 1):
        assert f"run {i}/3: {m}, seed 0 | step" in text_out, m
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "Data: text file corpus.txt:" in md and str(tmp_path) not in md.split("TensorBoard")[0]
    runs = _runs(tmp_path / "out")
    assert runs[("add", 0)]["curve"] == runs[("plain", 0)]["curve"]  # add is bitwise plain: a matched start
    assert runs[("add", 0)]["init_difference"]["output"] == 0.0


def test_rule_identity_claims_are_read_from_the_registry(monkeypatch):
    from dataclasses import dataclass

    from lightning_resctl.compare.methods import claims_identity_at_init
    from lightning_resctl.rules import MergeRule, base

    @dataclass
    class Cfg:
        init: str = "paper"

    class Conditional(MergeRule):
        Config = Cfg
        identity_at_init = {"init": "residual"}

        def merge(self, module, stream, update, inplace):
            return stream + update

    monkeypatch.setitem(base._REGISTRY, "cond", base.RuleEntry("cond", Conditional, (), ""))
    monkeypatch.setitem(base._REGISTRY, "cond-res",
                        base.RuleEntry("cond-res", Conditional, (("init", "residual"),), ""))
    assert not claims_identity_at_init("cond") and claims_identity_at_init("cond", {"init": "residual"})
    assert claims_identity_at_init("cond-res")
    assert claims_identity_at_init("attnres") and claims_identity_at_init("attnres-block")
    assert not claims_identity_at_init("mgr-competitive") and not claims_identity_at_init("rescontroller")
    assert not claims_identity_at_init("mhc-lite") and claims_identity_at_init("mhc-lite", {"init": "residual"})
    assert claims_identity_at_init("dwa") and claims_identity_at_init("laurel") and claims_identity_at_init("laurel-pa")
    assert not claims_identity_at_init("laurel", {"rw_norm": "softmax"}) and not claims_identity_at_init("ddl")
    assert not claims_identity_at_init("kromhc") and claims_identity_at_init("kromhc", {"init": "residual"})


# --- statistics -----------------------------------------------------------------------------------------------

def test_paired_statistics_and_t_interval():
    from lightning_resctl.compare.stats import describe, paired, t_quantile_975, verdict

    plain = {0: 2.0, 1: 2.5, 2: 3.0}
    method = {0: 0.1, 1: 0.5, 2: 0.9}  # per-seed differences -1.9, -2, -2.1: mean -2, sample sd 0.1
    pair = paired(method, plain, "min")
    assert pair["diffs"] == pytest.approx([-1.9, -2.0, -2.1]) and pair["better"] == 3 and pair["n"] == 3
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, 2) = 4.303 (statistical tables)
    assert pair["ci"] == pytest.approx([-2 - half, -2 + half], abs=1e-3)
    wide = paired({0: 1.0, 1: 0.5, 2: 0.0}, plain)  # differences -1, -2, -3: sd 1, the interval holds 0
    assert wide["ci"] == pytest.approx([-2 - 4.303 / math.sqrt(3), -2 + 4.303 / math.sqrt(3)], abs=1e-3)
    assert t_quantile_975(10) == pytest.approx(2.228, abs=1e-3) and t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert paired(method, plain, "max")["better"] == 0
    text = verdict(describe(method.values()), describe(plain.values()), pair, "val_loss", "min")
    assert "lower than plain by 2.0000" in text and "beyond the seed spread" in text
    assert "lower than plain in 3 of 3 seeds" in text and "excludes 0" in text
    noisy = paired({0: 1.0, 1: 3.1, 2: 2.0}, plain, "min")  # differences -1, +0.6, -1.0
    text = verdict(describe([1.0, 3.1, 2.0]), describe(plain.values()), noisy, "val_loss", "min")
    assert "within the seed spread" in text and "in 2 of 3 seeds" in text and "(includes 0)" in text
    one = paired({0: 1.0}, {0: 2.0})
    assert "no claim" in verdict(describe([1.0]), describe([2.0]), one, "val_loss")


def test_shards_partition_the_runs_deterministically():
    from lightning_resctl.compare.records import planned_runs

    runs = planned_runs(["plain", "a", "b"], [0, 1, 2], None)
    assert runs[:3] == [("plain", 0), ("a", 0), ("b", 0)]
    shards = [planned_runs(["plain", "a", "b"], [0, 1, 2], (i, 4)) for i in (1, 2, 3, 4)]
    assert sorted(r for s in shards for r in s) == sorted(runs) and sum(map(len, shards)) == len(runs)
    assert shards == [planned_runs(["plain", "a", "b"], [0, 1, 2], (i, 4)) for i in (1, 2, 3, 4)]


def test_a_folder_is_resumed_or_merged_only_with_the_same_job(tmp_path):
    from lightning_resctl.compare.records import JobFolder, JobMismatchError, OutputExistsError

    job = {"model": {"class_path": "m.A", "init_args": {"x": 1}}, "compare": {"seeds": 2}}
    folder = JobFolder(tmp_path)
    folder.prepare(job, None, overwrite=False, resume=False)
    with pytest.raises(OutputExistsError, match="--overwrite.*--resume"):
        folder.prepare(job, None, overwrite=False, resume=False)
    folder.prepare(job, None, overwrite=False, resume=True)  # same job: fine
    changed = {**job, "model": {"class_path": "m.A", "init_args": {"x": 2}}}
    with pytest.raises(JobMismatchError, match=r"model\.init_args\.x: 1 vs 2"):
        folder.prepare(changed, None, overwrite=False, resume=True)


# --- cost vs plain: warm-up per batch shape, interleaving, spread -------------------------------------------------

class _FakeStep(torch.nn.Module):
    """Advances a fake clock by its method's step time (noisy when ``noise``); logs (method, batch shape, timed?)."""

    def __init__(self, log, clock, times):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.log, self.clock, self.times, self.name = log, clock, times, "plain"

    def __deepcopy__(self, memo):  # every method's copy shares the log and the clock
        return _FakeStep(self.log, self.clock, self.times)

    def training_step(self, batch, i):
        step = self.times[self.name]
        self.clock["t"] += step(i) if callable(step) else step
        self.log.append((self.name, tuple(batch[0].shape)))
        return (self.w * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}


def test_cost_warms_every_shape_up_interleaves_and_flags_a_wide_spread(monkeypatch):
    from lightning_resctl.compare import cost

    log, clock = [], {"t": 0.0}
    monkeypatch.setattr(cost.time, "process_time", lambda: clock["t"])
    monkeypatch.setattr(cost, "apply_method", lambda model, name, options=None: setattr(model, "name", name))
    times = {"plain": 1.0, "slow": 2.0, "noisy": lambda i: 1.0 if i % 2 else 3.0}
    batches = [(torch.ones(2, 3),), (torch.ones(2, 3),), (torch.ones(1, 3),), (torch.ones(2, 3),)] * 2
    res = cost.measure_cost(["slow", "noisy"], _FakeStep(log, clock, times), batches, warmup=1)
    # warm-up: one untimed round per distinct batch shape (2 here), before any timed round
    assert res["warmup_rounds"] == 2 and res["rounds"] == 8
    warm = log[:2 * 3]
    assert {shape for _, shape in warm} == {(2, 3), (1, 3)}
    rounds = [log[i:i + 3] for i in range(0, len(log), 3)]
    assert all(sorted(n for n, _ in r) == ["noisy", "plain", "slow"] for r in rounds)
    assert len({tuple(n for n, _ in r) for r in rounds}) == 3  # the order rotates
    assert res["ratio"]["slow"] == 2.0 and res["reliable"]["slow"] and res["iqr"]["slow"] == [2.0, 2.0]
    assert res["ratio"]["plain"] == 1.0 and res["reliable"]["plain"]
    assert not res["reliable"]["noisy"] and res["range"]["noisy"] == [1.0, 3.0]


def test_cost_times_the_compiled_code_not_the_eager_steps_before_it(monkeypatch):
    """The rules' CPU regions compile in a background process and run eagerly until ready: the timed rounds
    start only after every pending compile is in (else the ratio measures the eager fallback)."""
    from lightning_resctl.compare import cost

    log, clock = [], {"t": 0.0}
    monkeypatch.setattr(cost.time, "process_time", lambda: clock["t"])
    monkeypatch.setattr(cost, "apply_method", lambda model, name, options=None: setattr(model, "name", name))
    monkeypatch.setattr(cost, "wait_for_compiles", lambda *a, **k: log.append(("waited", None)) or True)
    batches = [(torch.ones(2, 3),)] * 3
    cost.measure_cost(["slow"], _FakeStep(log, clock, {"plain": 1.0, "slow": 2.0}), batches, warmup=2)
    assert [name for name, _ in log].index("waited") == 2 * 2  # after the 2 untimed rounds of 2 methods
    assert [name for name, _ in log].count("waited") == 1


def test_summary_says_when_a_cost_ratio_is_unreliable(tmp_path):
    from lightning_resctl.compare.summary import write_summary

    manifest = {"fingerprint": "x", "identity": {"compare": {"methods": ["plain", "a"], "first_seed": 0, "seeds": 1,
                                                              "mode": "min", "monitor": None}}}
    rec = {"status": "done", "seed": 0, "monitor": "val_loss", "final": 1.0, "curve": [[1, 1.0]],
           "final_train_loss": 1.0, "steps": 1, "params_added": 0, "sites": 0,
           "init_difference": {"output": 0.0, "grad_norm": 0.0}}
    cost = {"ratio": {"plain": 1.0, "a": 1.4}, "iqr": {"plain": [1, 1], "a": [0.9, 2.5]}, "range": {"plain": [1, 1],
            "a": [0.5, 4.0]}, "reliable": {"plain": True, "a": False}, "step_s": {"plain": 1, "a": 1.4}, "rounds": 10,
            "warmup_rounds": 2, "device": "cpu", "clock": "process CPU time", "max_relative_iqr": 0.1}
    write_summary(manifest, [{**rec, "method": "plain"}, {**rec, "method": "a", "final": 0.9}], cost, tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "| a | 0.9000 |" in md and "1.40x (0.90-2.50) unreliable" in md
    assert "cost ratios of a are unreliable" in md and "one seed only" in md


#: matplotlib marker codes in words (matplotlib's own names, not the package's)
MARKER_WORDS = {"o": "circle", "s": "square", "^": "triangle", "D": "diamond", ".": "dot", "v": "triangle"}


@pytest.mark.parametrize("branches", [["mlp", "mlp", "mlp"], ["attn", "mlp", "attn", "mlp"], None])
def test_the_summary_names_the_markers_the_depth_plots_draw(tmp_path, monkeypatch, branches):
    """The sentence of summary.md about the depth plots' markers names the markers the figures draw (read from the
    figure objects), and no other: MLP-only models get squares, attention and MLP circles and squares, a model
    whose merges' sub-layers are unknown dots."""
    from lightning_resctl.compare import plots
    from lightning_resctl.compare.summary import write_summary

    figures = []
    original = plots.band_figure

    def capture(*args, **kwargs):
        fig = original(*args, **kwargs)
        figures.append((kwargs["title"], fig))
        return fig

    monkeypatch.setattr(plots, "band_figure", capture)
    depth = len(branches) if branches else 3
    manifest = {"fingerprint": "x", "identity": {"compare": {"methods": ["plain", "a"], "first_seed": 0, "seeds": 1,
                                                              "mode": "min", "monitor": None}}}
    rec = {"status": "done", "seed": 0, "monitor": "val_loss", "final": 1.0, "curve": [[1, 1.0]],
           "final_train_loss": 1.0, "steps": 1, "params_added": 0, "sites": depth, "branches": branches,
           "depth_profile": {"stream_rms": [1.0 + d for d in range(depth)]},
           "init_difference": {"output": 0.0, "grad_norm": 0.0}}
    write_summary(manifest, [{**rec, "method": "plain"}, {**rec, "method": "a", "final": 0.9}], None, tmp_path)
    fig = next(fig for title, fig in figures if title.startswith("stream RMS vs depth"))
    drawn = {line.get_marker() for line in fig.axes[0].lines if line.get_linestyle() == "None"}
    words = {MARKER_WORDS[m] for m in drawn}
    assert words == ({"square"} if branches == ["mlp"] * 3 else {"circle", "square"} if branches else {"dot"})
    sentence = next(line for line in (tmp_path / "summary.md").read_text().splitlines() if "Depth plots" in line)
    for word in set(MARKER_WORDS.values()):
        assert (word in sentence) == (word in words), (word, sentence)


# --- data ----------------------------------------------------------------------------------------------------

def test_corpus_split_by_file_named_without_machine_paths(tmp_path):
    from lightning_resctl.compare.data import decode, stdlib_corpus

    for i in range(12):
        (tmp_path / f"f{i:02d}.py").write_text(f"# file {i} é\n" + "x = 1\n" * (i + 1))
    a = stdlib_corpus(stdlib_dir=tmp_path, max_train_chars=None, max_val_chars=None, val_every=4)
    b = stdlib_corpus(stdlib_dir=tmp_path, max_train_chars=None, max_val_chars=None, val_every=4)
    assert a.val_files == ["f03.py", "f07.py", "f11.py"] and not set(a.val_files) & set(a.train_files)
    assert torch.equal(a.train, b.train) and "# file 3 é\n" in decode(a.val) and "# file 3 é" not in decode(a.train)
    assert str(tmp_path) not in a.describe() and "9 + 3 files" in a.describe()
    real = stdlib_corpus(max_train_chars=50_000, max_val_chars=10_000)
    import platform

    assert real.describe().startswith(f"Python {platform.python_version()} standard library, ")
    assert "/" not in real.describe().split(":")[0]


def test_builtin_data_order_follows_the_global_seed_and_validation_is_fixed(tmp_path):
    import lightning as L

    from lightning_resctl.compare.data import CharDataModule

    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(5000)))
    dm = CharDataModule(text=str(text), block_size=16, batch_size=4)
    dm.setup("fit")

    def first(seed):
        L.seed_everything(seed, verbose=False)
        return [x for x, _ in list(dm.train_dataloader())[:5]]

    a, b, c = first(7), first(7), first(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not all(torch.equal(x, y) for x, y in zip(a, c))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    L.seed_everything(1, verbose=False)
    v1 = [x for x, _ in dm.val_dataloader()]
    L.seed_everything(2, verbose=False)
    assert all(torch.equal(p, q) for p, q in zip(v1, [x for x, _ in dm.val_dataloader()]))


def test_hf_dataset_loads_text_and_says_what_is_missing(monkeypatch):
    import types

    from lightning_resctl.compare.data import decode, hf_corpus

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_corpus("some/dataset")
    rows = {"train": [{"text": f"line {i} of the training split\n"} for i in range(50)],
            "validation": [{"text": "a validation line\n"} for _ in range(5)]}

    def load_dataset(name, config=None, split="train", streaming=False):
        if split not in rows:
            raise ValueError(f"unknown split {split}")
        return iter(rows[split])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = hf_corpus("me/corpus", max_train_chars=400, max_val_chars=None)
    assert decode(corpus.train).startswith("line 0 of the training split") and len(corpus.train) == 400
    assert "a validation line" in decode(corpus.val) and corpus.describe().startswith("Hugging Face dataset me/corpus")

    def offline(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="could not load the Hugging Face dataset 'me/corpus'.*network"):
        hf_corpus("me/corpus")


def test_monitor_is_found_like_the_ablation_callback_finds_the_loss():
    from lightning_resctl.compare.recorder import MonitorNotFoundError, find_monitor

    assert find_monitor({"val/loss": 1, "val/acc": 2}, None) == "val/loss"
    assert find_monitor({"val_loss": 1, "val/loss": 2}, None) == "val_loss"
    assert find_monitor({"val/ce_loss": 1, "train_loss": 2, "val/acc": 3}, None) == "val/ce_loss"
    assert find_monitor({"val/acc": 1}, "val/acc") == "val/acc"
    with pytest.raises(MonitorNotFoundError, match=r"monitor='val/f1' is not logged.*\['val/acc'\]"):
        find_monitor({"val/acc": 1}, "val/f1")
    with pytest.raises(MonitorNotFoundError, match="pass monitor=NAME"):
        find_monitor({"val/acc": 1, "val/a_loss": 2, "val/b_loss": 3}, None)


def test_depth_plot_has_seed_band_integer_ticks_and_branch_markers():
    from matplotlib.collections import PolyCollection

    from lightning_resctl.compare.plots import SeedCurves, band_figure

    curves = {"plain": SeedCurves.from_profiles([[1, 2, 4, 8], [1, 3, 5, 9]]),
              "mgr": SeedCurves.from_profiles([[1, 1.5, 2, 2], [1, 1.4, 2.2, 2.5]])}
    assert curves["plain"].lo.tolist() == [1, 2, 4, 8] and curves["plain"].hi.tolist() == [1, 3, 5, 9]
    fig = band_figure(curves, xlabel="depth", ylabel="rms", title="t", logy=True, depth_axis=True,
                      branches=["attn", "mlp", "attn", "mlp"])
    ax = fig.axes[0]
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 2
    ticks = [t for t in ax.get_xticks() if -0.5 <= t <= 3.5]
    assert ticks and all(float(t).is_integer() for t in ticks)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"attention merge", "MLP merge", "range over 2 seeds"} <= set(labels)
    assert np.isfinite(curves["mgr"].mean).all()
