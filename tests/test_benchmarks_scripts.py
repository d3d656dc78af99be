"""benchmarks/gpu_check.sh (dry run and the no-CUDA path) and the benchmarks' independence from tests/."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["kernel-tests", "kernels-aot", "bench-rescontroller", "bench-mgr", "bench-peers", "bench-compiled",
         "bench-cudagraphs", "bench-recipe"]
#: issue 54's figures: one device call of at most 8 minutes
COMPILED_STEPS = ["bench-compiled", "bench-cudagraphs", "bench-recipe"]
COMPILED_RULES = ["rescontroller", "mgr n=4 competitive", "attnres-block (lightning_resctl)", "hc (lightning_resctl)",
                  "mhc-lite (lightning_resctl)"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_dry_run_lists_the_steps_in_order():
    res = run("--dry-run")
    assert res.returncode == 0, res.stderr
    listed = re.findall(r"^(\d+)\. (\S+) \(limit (\d+) s\): (.+)$", res.stdout, flags=re.M)
    assert [name for _, name, _, _ in listed] == STEPS
    assert [int(i) for i, _, _, _ in listed] == list(range(1, len(STEPS) + 1))
    limits = {name: int(limit) for _, name, limit, _ in listed}
    # the whole check in two device calls of at most 8 minutes each: the kernels' steps (issue 55), the compiled
    # steps (issue 54)
    assert sum(limits[n] for n in COMPILED_STEPS) <= 480
    assert sum(limits[n] for n in STEPS if n not in COMPILED_STEPS) <= 480
    cmds = {name: cmd for _, name, _, cmd in listed}
    assert "TRITON_INTERPRET=0" in cmds["kernel-tests"] and "-k device_" in cmds["kernel-tests"]
    assert "--dtype bf16" in cmds["bench-peers"] and "--T 1024" in cmds["bench-peers"]
    for step, mode in (("bench-compiled", "default"), ("bench-cudagraphs", "reduce-overhead")):
        assert "--T 1024" in cmds[step] and f"--compile {mode}" in cmds[step]
        assert re.search(r"--only '([^']*)'", cmds[step]).group(1).split(",") == COMPILED_RULES
    assert "--layers 12 24" in cmds["bench-recipe"] and "--device cuda" in cmds["bench-recipe"]
    assert "mgr-competitive,attnres-block,hc,mhc-lite" in cmds["bench-recipe"]
    assert "--arch device" in cmds["kernels-aot"]  # the prediction for the architecture the benchmarks measure
    assert "nothing executed" in res.stdout


def test_the_compiled_steps_name_variants_bench_peers_has():
    # a label --only does not know runs nothing for it, silently (the table only lists what ran)
    import torch

    from benchmarks.bench_peers import variants

    labels = {label for label, _, _ in variants(torch.zeros(2, 8, dtype=torch.long))}
    assert set(COMPILED_RULES) <= labels, set(COMPILED_RULES) - labels


def test_dry_run_commands_name_existing_files_and_flags():
    listed = re.findall(r"^\d+\. \S+ \(limit \d+ s\): (.+)$", run("--dry-run").stdout, flags=re.M)
    scripts = set()
    for cmd in listed:
        for path in re.findall(r"(?:benchmarks|tests)/\S+\.py", cmd):
            assert (ROOT / path).exists(), path
            scripts.add(path)
    assert any("bench_peers.py" in c for c in listed)
    helps = {}
    for path in sorted(p for p in scripts if p.startswith("benchmarks/")):  # a step's script at least parses --help
        res = subprocess.run([sys.executable, str(ROOT / path), "--help"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert res.returncode == 0, (path, res.stderr[-2000:])
        helps[path] = res.stdout
    for cmd in listed:  # every flag a step passes is one its script takes
        path = re.search(r"benchmarks/\S+\.py", cmd)
        if path is not None:
            for flag in re.findall(r"\s(--[a-z][a-z-]*)", cmd):
                assert flag in helps[path.group(0)], (path.group(0), flag)
    for flag in ("--device", "--dtype", "--threads", "--layers", "--C", "--heads", "--T", "--batch", "--reps"):
        assert flag in helps["benchmarks/bench_peers.py"]


def test_the_device_tests_it_selects_exist_and_run_in_the_normal_suite():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_mgr_kernels.py", "-k", "device_"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    names = [line for line in res.stdout.splitlines() if "::test_device_" in line]
    assert any("rescontroller" in n for n in names) and any("mgr" in n for n in names)


def test_named_steps_run_alone_in_the_script_order():
    # a device call runs at most 10 minutes and the whole check is budgeted 12.5: it runs in two calls
    res = run("--dry-run", "bench-recipe", "kernel-tests")
    assert res.returncode == 0, res.stderr
    assert re.findall(r"^\d+\. (\S+) \(", res.stdout, flags=re.M) == ["kernel-tests", "bench-recipe"]
    bad = run("--dry-run", "bench-recipes")
    assert bad.returncode == 2 and "bench-recipes" in bad.stderr and "bench-recipe" in bad.stderr


def test_without_cuda_it_says_so_and_exits_zero(tmp_path):
    # hide every GPU from torch: the script must not start any step
    res = run(env={"CUDA_VISIBLE_DEVICES": "", "REPORT": str(tmp_path / "r.md")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no CUDA device" in res.stdout
    assert not (tmp_path / "r.md").exists()


def test_benchmarks_import_nothing_from_tests():
    # benchmarks/models.py and benchmarks/timm_import.py are the helpers shared with the tests (the tests import
    # them from there); a benchmark never imports a test module
    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+tests\b", text, flags=re.M), path
        assert '/ "tests"' not in text, path


def test_each_compile_mode_compiles_the_eager_models():
    # gpu_check's bench-compiled asks for two modes; the second once compiled the first's compiled models again
    # (torch.compile of a compiled module is a function: the step benchmark then failed on .parameters())
    import torch

    from benchmarks.step_bench import compiled_rows

    rows = [{"label": "plain", "model": torch.nn.Linear(2, 2), "opt": None, "note": None}]
    for mode in ("default", "reduce-overhead"):
        rows += compiled_rows(rows, mode)
    assert [(r["label"], r.get("mode")) for r in rows] == [("plain", None), ("plain", "default"),
                                                           ("plain", "reduce-overhead")]
    assert all(r["model"]._orig_mod is rows[0]["model"] for r in rows[1:])
