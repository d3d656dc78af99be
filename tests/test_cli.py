"""The command line: help, version, presets and registered method names, --overwrite, progress."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import lightning_resctl
from lightning_resctl import __main__ as cli
from lightning_resctl import compare
from lightning_resctl.compare import methods as methods_mod
from lightning_resctl.compare.cli import build_parser, parse_config
from lightning_resctl.compare.progress import JobProgress, format_duration


def test_bare_command_prints_help_and_starts_no_job(monkeypatch, capsys):
    monkeypatch.setattr(compare, "run_comparison", lambda cfg: pytest.fail("a job was started"))
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m lightning_resctl" in out and "compare" in out and "--help" in out


def test_bare_module_in_a_fresh_interpreter_prints_help():
    proc = subprocess.run([sys.executable, "-m", "lightning_resctl"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "[resctl]" not in proc.stdout + proc.stderr


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lightning_resctl {lightning_resctl.__version__}"
    with pytest.raises(SystemExit) as exc:
        parse_config(["--version"])
    assert exc.value.code == 0
    assert lightning_resctl.__version__ in capsys.readouterr().out


def test_help_shows_every_default():
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        default = action.default
        if action.dest == "methods":
            default = ",".join(compare.DEFAULT_METHODS)
        elif isinstance(default, (list, tuple)):
            default = ",".join(map(str, default))
        shown = " ".join(f"(default: {default})".split())
        # argparse may wrap a long default across lines: compare without whitespace
        assert shown.replace(" ", "") in text.replace(" ", ""), (action.dest, shown)


def test_methods_are_plain_plus_the_registered_rules(monkeypatch):
    assert compare.available_methods()[0] == "plain"
    if hasattr(lightning_resctl, "merge_rules"):
        assert compare.available_methods() == ("plain", *lightning_resctl.merge_rules())
    for name in compare.available_methods():
        assert parse_config(["--methods", name]).methods == [name]


def test_a_registered_rule_is_run_by_its_name_with_streams_when_it_has_that_option(monkeypatch):
    """No per-method branching: a newly registered name works, and only rules with a `streams`
    option get --streams."""
    import lightning_resctl.surgery as surgery

    class Entry:
        def __init__(self, options):
            self.description, self._options = "a test rule", options

        def option_names(self):
            return self._options

    entries = {"add": Entry([]), "brand-new": Entry(["streams", "other"])}
    monkeypatch.setattr(lightning_resctl, "merge_rules", lambda: tuple(entries), raising=False)
    monkeypatch.setattr(lightning_resctl, "get_merge_rule", lambda name: entries[name], raising=False)
    calls = []
    monkeypatch.setattr(surgery, "patch_residuals", lambda model, method, **kw: calls.append((method, kw)))
    assert compare.available_methods() == ("plain", "add", "brand-new")
    assert parse_config(["--methods", "plain,brand-new", "--streams", "3"]).methods == ["plain", "brand-new"]
    model = object()
    assert methods_mod.apply_method(model, "plain", 3) is None
    methods_mod.apply_method(model, "brand-new", 3)
    methods_mod.apply_method(model, "add", 3)
    assert calls == [("brand-new", {"streams": 3}), ("add", {})]
    assert methods_mod.describe_method("brand-new") == "a test rule"


def test_paper_preset_runs_its_methods_or_names_the_registered_ones(capsys):
    paper = compare.PRESETS["paper"]
    assert paper == ("plain", "mhc-lite", "attnres-block", "attnres", "mgr-independent", "mgr-competitive",
                     "rescontroller")
    missing = [m for m in paper if m not in compare.available_methods()]
    if not missing:
        assert parse_config(["--preset", "paper"]).methods == list(paper)
        return
    with pytest.raises(SystemExit) as exc:
        parse_config(["--preset", "paper"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(m in err for m in missing) and "Registered:" in err
    for name in compare.available_methods():
        assert name in err
    # --methods given alongside a preset wins
    assert parse_config(["--preset", "paper", "--methods", "plain"]).methods == ["plain"]


def test_existing_results_are_not_overwritten_without_the_flag(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "my_notes.txt").write_text("keep me")
    from lightning_resctl.compare import runs

    monkeypatch.setattr(runs, "load_corpus", lambda **kw: pytest.fail("the job started"))
    assert cli.main(["compare", "--out", str(out), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and str(out) in err and "summary.json" in err
    assert (out / "summary.json").read_text() == "{}"

    seen = {}
    monkeypatch.setattr(runs, "_run_comparison", lambda cfg, corpus: seen.setdefault("files", sorted(
        p.name for p in out.iterdir())))
    assert cli.main(["compare", "--out", str(out), "--steps", "2", "--overwrite"]) == 0
    assert seen["files"] == ["my_notes.txt"]  # the old results are gone, other files are kept


def test_progress_line_names_run_method_seed_and_eta():
    clock = {"t": 0.0}
    stream = io.StringIO()
    p = JobProgress(4, 10, stream=stream, interval_s=0.0, clock=lambda: clock["t"])
    p.start()
    p.start_run(1, "mgr-competitive", 0)
    assert "ETA --" in stream.getvalue()
    clock["t"] = 10.0
    p.update(10, loss=2.5)
    p.end_run()
    p.start_run(2, "plain", 0)
    line = stream.getvalue().strip().splitlines()[-1]
    assert "run 2/4: plain, seed 0" in line and "total 25%" in line
    assert "ETA 30s" in line  # 10 s for 10 of 40 steps
    clock["t"] = 15.0
    p.update(5, loss=2.0)
    assert "step 5/10" in stream.getvalue().splitlines()[-1]
    assert format_duration(75) == "1m15s" and format_duration(3700) == "1h01m"


def test_progress_on_a_terminal_rewrites_one_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    p = JobProgress(2, 5, stream=stream, clock=lambda: 0.0)
    p.start()
    p.start_run(1, "plain", 3)
    p.update(2, loss=1.0)
    p.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.startswith("\r") and "plain, seed 3" in text


def test_a_small_job_prints_lightning_banner_once_and_one_progress_line(tmp_path, capfd, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    (tmp_path / "t.txt").write_text(src.read_text(encoding="utf-8")[:6000])
    argv = ["compare", "--text", str(tmp_path / "t.txt"), "--n-layer", "1", "--n-embd", "8", "--n-head", "2",
            "--block-size", "8", "--batch-size", "2", "--steps", "3", "--eval-every", "3", "--val-batches", "1",
            "--seeds", "1", "--methods", "plain,add,rescontroller", "--ablation", "false", "--threads", "1",
            "--accelerator", "cpu", "--out", str(tmp_path / "out"), "--depth-images", "false",
            "--cost-steps", "1", "--cost-warmup", "0"]
    assert cli.main(argv) == 0
    captured = capfd.readouterr()
    text = captured.out + captured.err
    banner = [r.getMessage() for r in caplog.records if "GPU available" in r.getMessage()]
    tips = [r.getMessage() for r in caplog.records if "Tip:" in r.getMessage()]
    assert len(banner) == 1 and len(tips) <= 1, (banner, tips)
    assert text.count("LeafSpec") <= 1
    assert "v_num" not in text
    for i, m in enumerate(["plain", "add", "rescontroller"], 1):
        assert re.search(rf"run {i}/3: {m}, seed 0 \| step \d+/3 .*ETA", text), m
    assert "cost vs plain" in text
