"""The scripts some tests run in processes of their own (2-4 gloo ranks standing in for GPUs): started beside the
test process, which computes its single-process references meanwhile, then waited for."""
from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["start_runs", "wait_for_runs"]


def start_runs(script, runs: dict, **env) -> dict:
    """Start ``python script *args`` for each ``{name: args}`` of ``runs`` (interpreted Triton, warnings off, no
    inherited ``LOCAL_RANK`` nor Lightning's global seed, which a compare job run in the test process leaves in its
    environment and Lightning's launch would seed each rank with; ``env`` adds variables); returns
    ``{name: Popen}`` with stdout and stderr together."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", **env)
    for inherited in ("LOCAL_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(inherited, None)
    return {name: subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
            for name, args in runs.items()}


def wait_for_runs(procs: dict, timeout: float) -> dict:
    """Each run's output, once all have ended (one past ``timeout`` seconds is killed); AssertionError naming the
    first run that failed, with the end of its output."""
    logs = {}
    for name, p in procs.items():
        try:
            logs[name], _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            logs[name], _ = p.communicate()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    return logs
