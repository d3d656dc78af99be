"""The command line: help, version, the LightningCLI configuration (model / data / trainer / compare), flags and their
errors, existing results, summarize, the progress line, and ``lightning_resctl.compare`` as a function."""
from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_resctl
from lightning_resctl import __main__ as entry
from lightning_resctl.compare import cli, job
from lightning_resctl.compare.progress import JobProgress, format_duration

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(autouse=True)
def _toy_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _parse(*args: str) -> cli.CompareCLI:
    return cli.CompareCLI(list(args))


def test_bare_command_prints_help_and_starts_no_job(monkeypatch, capsys):
    monkeypatch.setattr(job, "run_job", lambda *a: pytest.fail("a job was started"))
    assert entry.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: lightning-resctl" in out and "compare" in out and "summarize" in out


def test_bare_module_in_a_fresh_interpreter_prints_help():
    proc = subprocess.run([sys.executable, "-m", "lightning_resctl"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "[resctl]" not in proc.stdout + proc.stderr
    assert "usage: python -m lightning_resctl " in proc.stdout  # named as it was run


def test_version_names_the_installed_stack_beside_the_versions_the_suite_runs_against(capsys):
    """As ``lightning`` / ``transformers env`` do: the package's version, then torch, lightning, transformers and
    triton as installed (read from the distributions' metadata here) and as tested."""
    from importlib.metadata import version

    from lightning_resctl.__main__ import TESTED_WITH

    assert entry.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"lightning_resctl {lightning_resctl.__version__}"
    assert set(TESTED_WITH) == {"torch", "lightning", "transformers", "triton"}
    for dist, tested in TESTED_WITH.items():
        line = next((line for line in lines[1:] if line.split()[:1] == [dist]), None)
        assert line is not None, (dist, lines)
        assert version(dist) in line.split() and f"(tested: {tested})" in line, line
    assert entry.main(["bogus"]) == 2


def test_compare_is_the_function_and_the_submodules_still_import():
    assert callable(lightning_resctl.compare) and lightning_resctl.compare.__name__ == "compare"
    assert "compare" in lightning_resctl.__all__
    from lightning_resctl.compare import summary

    assert importlib.import_module("lightning_resctl.compare.job") is job and hasattr(summary, "write_summary")
    assert lightning_resctl.compare is importlib.import_module("lightning_resctl.compare").compare


def test_print_config_in_a_fresh_interpreter_shows_the_builtin_default_and_the_compare_section():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "lightning_resctl", "compare", "--print_config", "--methods",
                           "plain,add", "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["class_path"].endswith("CharGPT") and config["data"]["class_path"].endswith("CharDataModule")
    assert config["model"]["init_args"]["n_layer"] == 16 and config["trainer"]["max_steps"] == 100
    assert config["compare"]["methods"] in ("plain,add", ["plain", "add"]) and config["compare"]["resume"] is True
    assert config["compare"]["seeds"] == 2 and "seed_everything" not in config


def test_help_lists_every_compare_option_with_its_default_and_the_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--help")
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    from lightning_resctl.compare.options import HELP, CompareOptions

    for name, default in vars(CompareOptions()).items():
        assert f"--compare.{name}" in text and f"--{name}" in text, name
        assert f"default: {'null' if default is None else default}" in text, (name, default)
        assert " ".join(HELP[name].split())[:40] in text, name
    assert "--model my_pkg.MyModule --data my_pkg.MyDataModule" in text and "lightning-resctl summarize" in text


def test_help_starts_with_what_a_compare_user_needs(capsys):
    """A short usage line, then what the job does, the examples and the method names, then the compare options,
    and only after them the Trainer's, the model's and the data's (hundreds of lines)."""
    with pytest.raises(SystemExit):
        _parse("--help")
    lines = capsys.readouterr().out.splitlines()
    first_trainer = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--trainer."))
    head = "\n".join(lines[:first_trainer])
    assert lines[0].startswith("usage: lightning-resctl compare ") and not lines[1].startswith(" " * 10), lines[:3]
    assert "examples:" in head and "method names: plain," in head and "--compare.methods" in head
    assert head.index("examples:") < head.index("--compare.methods") and first_trainer < 120


def test_help_names_the_program_as_it_was_run(monkeypatch, capsys):
    """``python -m lightning_resctl`` runs ``lightning_resctl/__main__.py`` as ``sys.argv[0]``."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "lightning_resctl" / "__main__.py"), "compare", "--help"])
    with pytest.raises(SystemExit):
        _parse("--help")
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lightning_resctl compare ")
    assert "  python -m lightning_resctl compare --config my.yaml" in out
    assert entry.main([]) == 0 and "usage: python -m lightning_resctl [-h]" in capsys.readouterr().out


def test_a_user_model_from_yaml_keeps_its_own_init_arguments(tmp_path):
    """Choosing a model class must not hand it the built-in model's init arguments that it happens to accept too
    (jsonargparse keeps those when a default class_path is replaced)."""
    config = tmp_path / "my.yaml"
    config.write_text("model:\n  class_path: compare_toy.ToyLM\n  init_args: {dim: 8}\n"
                      "data:\n  class_path: compare_toy.ToyData\ntrainer:\n  max_steps: 7\ncompare:\n  seeds: 3\n")
    parsed = _parse("--config", str(config)).config
    assert parsed.model.class_path == "compare_toy.ToyLM"
    assert dict(parsed.model.init_args) == {"vocab": 24, "dim": 8, "depth": 3, "dropout": 0.1, "lr": 0.01, "seq": 12}
    assert dict(parsed.data.init_args)["batch_size"] == 8 and parsed.trainer.max_steps == 7
    assert parsed.compare.seeds == 3
    # the same by flags; a model without a data class brings its own dataloaders
    parsed = _parse("--model", "compare_toy.ToyLM", "--model.dim", "8", "--seeds", "3").config
    assert dict(parsed.model.init_args)["lr"] == 0.01 and parsed.data is None
    # without a model the built-in one and its data are used, and flags reach them
    parsed = _parse("--model.n_layer", "3", "--data.block_size", "16").config
    assert parsed.model.class_path.endswith("CharGPT") and parsed.model.init_args.n_layer == 3
    assert parsed.data.init_args.block_size == 16


def test_compare_flags_and_their_yaml_section_are_one_option(tmp_path):
    a = _parse("--methods", "plain,mgr-competitive", "--shard", "2/3", "--resume").compare_options()
    b = _parse("--compare.methods", "[plain, mgr-competitive]", "--compare.shard", "2/3",
               "--compare.resume", "true").compare_options()
    config = tmp_path / "c.yaml"
    config.write_text("compare:\n  methods: plain,mgr-competitive\n  shard: 2/3\n  resume: true\n")
    c = _parse("--config", str(config)).compare_options()
    assert a == b == c and a.method_list() == ["plain", "mgr-competitive"] and a.shard_pair() == (2, 3) and a.resume
    assert _parse("--preset", "paper").compare_options().method_list() == list(cli.PRESETS["paper"])
    assert _parse("--preset", "paper", "--methods", "plain").compare_options().method_list() == ["plain"]
    options = _parse("--methods", "plain,mgr-competitive", "--options", "{mgr-competitive: {streams: 8}}")
    assert options.compare_options().options == {"mgr-competitive": {"streams": 8}}


@pytest.mark.parametrize("args", [
    ["--methods", "plain,mgr-competitive", "--seeds", "3", "--out", "runs/a b"],
    ["--methods", "plain,mgr-competitive", "--overwrite", "--seeds", "3", "--out", "runs/a b"],
    ["--overwrite", "true", "--methods", "plain,mgr-competitive", "--seeds", "3", "--out", "runs/a b"],
    ["--compare.overwrite=true", "--methods", "plain,mgr-competitive", "--seeds", "3", "--out", "runs/a b"],
    ["--config", "{config}", "--out", "runs/a b"],  # overwrite: true in the config file
])
def test_the_resume_command_a_stopped_job_prints_parses_to_the_same_job_with_resume(args, tmp_path):
    import shlex

    config = tmp_path / "c.yaml"
    config.write_text("compare:\n  methods: plain,mgr-competitive\n  seeds: 3\n  overwrite: true\n")
    args = [a.replace("{config}", str(config)) for a in args]
    parsed = _parse(*args)
    command = shlex.split(cli.resume_command(args, parsed.compare_options()))
    assert command[:2] == ["lightning-resctl", "compare"]  # how this process was started (pytest): the script
    again = _parse(*command[2:])
    original, resumed = parsed.compare_options(), again.compare_options()
    assert resumed.resume and not resumed.overwrite
    assert resumed.identity() == original.identity() and resumed.out == original.out == "runs/a b"
    assert cli.resume_command(command[2:], resumed) == shlex.join(command)  # resuming again: the same command


@pytest.mark.parametrize("args, message", [
    (["--methods", "plain,resnet"], "unknown method(s) ['resnet']"),
    (["--shard", "3/2"], "shard must be 'I/N' with integers 1 <= I <= N, got '3/2'"),
    (["--methods", "plain", "--options", "{mgr: {streams: 8}}"], "options names method 'mgr'"),
    (["--methods", "plain,mgr", "--options", "{mgr: {streamz: 8}}"], "unknown option(s) for method='mgr': ['streamz']"),
    (["--seeds", "0"], "seeds must be an int >= 1, got 0"),
    (["--resume", "--overwrite"], "give at most one of overwrite and resume"),
])
def test_bad_values_stop_before_anything_runs_and_say_which(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*args).compare_options()
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err
    if "unknown method" in message:
        assert all(name in err for name in cli.available_methods())


def test_methods_are_plain_plus_the_registered_rules_and_an_outside_rule_works_by_name(monkeypatch):
    from lightning_resctl.rules import MergeRule, base

    assert cli.available_methods() == ("plain", *lightning_resctl.merge_rules())

    class Outside(MergeRule):
        def merge(self, module, stream, update, inplace):
            return stream + update

    monkeypatch.setitem(base._REGISTRY, "outside", base.RuleEntry("outside", Outside, (), "an outside rule"))
    assert _parse("--methods", "plain,outside").compare_options().method_list() == ["plain", "outside"]


def test_existing_results_are_kept_unless_overwrite_or_resume(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    assert entry.main(["compare", "--out", str(out), "--trainer.max_steps", "2", "--methods", "plain"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" in err and str(out) in err and "summary.json" in err
    assert (out / "summary.json").read_text() == "{}"
    assert entry.main(["compare", "--out", str(out), "--methods", "plain", "--resume"]) == 2
    assert "no job.json" in capsys.readouterr().err


def test_overwrite_removes_only_the_earlier_job(tmp_path):
    from lightning_resctl.compare.records import JobFolder

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "plain_seed0.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("keep me")
    JobFolder(tmp_path).prepare({"compare": {}}, None, overwrite=True, resume=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me" and list((tmp_path / "runs").iterdir()) == []


def test_summarize_refuses_a_folder_without_a_job(tmp_path, capsys):
    assert entry.main(["summarize", str(tmp_path)]) == 2
    assert "holds no compare job" in capsys.readouterr().err


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
    assert "run 2/4: plain, seed 0" in line and "total 25%" in line and "ETA 30s" in line  # 10 s for 10 of 40 steps
    clock["t"] = 15.0
    p.update(5, loss=2.0)
    assert "step 5/10" in stream.getvalue().splitlines()[-1]
    assert format_duration(75) == "1m15s" and format_duration(3700) == "1h01m"
    unknown = JobProgress(2, 0, stream=io.StringIO(), interval_s=0.0, clock=lambda: 0.0)
    unknown.start()
    unknown.start_run(2, "plain", 1)
    assert "step 0 |" in unknown.line() and "total 50%" in unknown.line() and "ETA --" in unknown.line()


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
