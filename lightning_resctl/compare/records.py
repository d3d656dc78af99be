"""The job's output folder: its manifest (``job.json``), one record per (method, seed) run (``runs/*.json``),
the cost measurement (``cost.json``), and reading them back from one or several folders (resume, shards,
``lightning-resctl summarize``).

A folder's manifest holds the job's *identity* — model, data, Trainer settings and the options that define the
results — and its fingerprint (SHA-256 of the identity). A resumed job and every shard of a job must have the same
fingerprint; records of different jobs are never merged.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["JobFolder", "OutputExistsError", "JobMismatchError", "fingerprint", "load_job", "RESULT_FILES",
           "RESULT_DIRS", "merge_folders"]

#: what a job leaves in its folder (and what ``overwrite`` removes before a new job)
RESULT_FILES = ("job.json", "summary.md", "summary.json", "cost.json", "val_metric.png", "stream_rms_depth.png",
                "update_ratio_depth.png", "ablation_depth.png")
RESULT_DIRS = ("runs", "tb")


class OutputExistsError(FileExistsError):
    """``out`` already holds the results of an earlier job and neither ``overwrite`` nor ``resume`` was given."""


class JobMismatchError(ValueError):
    """Records of different jobs (different fingerprints) were to be resumed or merged."""


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def fingerprint(identity: dict[str, Any]) -> str:
    """SHA-256 (hex, first 16 digits) of the canonical JSON of ``identity``."""
    text = json.dumps(_canonical(identity), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if a == b else [f"{prefix}: {a!r} vs {b!r}"]


def _json_safe(value: Any) -> Any:
    """NaN / inf as None (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class JobFolder:
    """One job's output folder (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ------------------------------------------------------------------ layout
    def record_path(self, method: str, seed: int) -> Path:
        return self.path / "runs" / f"{method}_seed{seed}.json"

    def run_dir(self, method: str, seed: int) -> Path:
        """Working files of a run in progress (its checkpoint)."""
        return self.path / "runs" / f"{method}_seed{seed}"

    def checkpoint(self, method: str, seed: int) -> Path:
        return self.run_dir(method, seed) / "last.ckpt"

    def tensorboard_dir(self) -> Path:
        return self.path / "tb"

    def existing_results(self) -> list[str]:
        return sorted(name for name in (*RESULT_FILES, *RESULT_DIRS) if (self.path / name).exists())

    # ------------------------------------------------------------------ manifest
    def manifest(self) -> dict[str, Any] | None:
        path = self.path / "job.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def prepare(self, identity: dict[str, Any], shard: str | None, *, overwrite: bool, resume: bool,
                write: bool = True) -> None:
        """Make the folder ready for this job: refuse to mix it into an earlier job's results unless ``overwrite``
        (which removes them) or ``resume`` (which needs the same job: same fingerprint); then write the manifest."""
        found = self.existing_results()
        if found and resume:
            old = self.manifest()
            if old is None:
                raise JobMismatchError(f"resume: {self.path} holds results ({', '.join(found)}) but no job.json, so "
                                       "they cannot be matched to this job; use another out folder or overwrite")
            if old["fingerprint"] != fingerprint(identity):
                diff = _differences(old["identity"], _canonical(identity))
                raise JobMismatchError(
                    f"resume: {self.path} holds a different job (fingerprint {old['fingerprint']} vs "
                    f"{fingerprint(identity)}); what differs: {'; '.join(diff[:8])}")
        elif found and not overwrite:
            raise OutputExistsError(
                f"{self.path} already holds the results of an earlier job ({', '.join(found)}). Pass --overwrite to "
                f"replace them, --resume to continue that job, or choose another folder with --out.")
        elif found and write:
            for name in found:
                path = self.path / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if write:
            (self.path / "runs").mkdir(parents=True, exist_ok=True)
            manifest = {"fingerprint": fingerprint(identity), "identity": _canonical(identity), "shard": shard}
            (self.path / "job.json").write_text(json.dumps(_json_safe(manifest), indent=1))

    # ------------------------------------------------------------------ records
    def write_record(self, record: dict[str, Any]) -> Path:
        path = self.record_path(record["method"], record["seed"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_json_safe(record), indent=1, default=str))
        tmp.replace(path)  # a job killed while writing leaves no half record
        shutil.rmtree(self.run_dir(record["method"], record["seed"]), ignore_errors=True)
        return path

    def read_record(self, method: str, seed: int) -> dict[str, Any] | None:
        path = self.record_path(method, seed)
        return json.loads(path.read_text()) if path.is_file() else None

    def records(self) -> list[dict[str, Any]]:
        runs = self.path / "runs"
        return [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))] if runs.is_dir() else []

    def write_cost(self, cost: dict[str, Any]) -> None:
        (self.path / "cost.json").write_text(json.dumps(_json_safe(cost), indent=1))

    def cost(self) -> dict[str, Any] | None:
        path = self.path / "cost.json"
        return json.loads(path.read_text()) if path.is_file() else None


def load_job(folder: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """``(manifest, records, cost)`` of one folder; FileNotFoundError when it holds no job."""
    job = JobFolder(folder)
    manifest = job.manifest()
    if manifest is None:
        raise FileNotFoundError(f"{job.path} holds no compare job (no job.json)")
    return manifest, job.records(), job.cost()


def merge_folders(folders: Sequence[str | Path]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """The records of several folders of one job (e.g. its shards) as one: ``(manifest, records, cost)``.

    JobMismatchError when the folders hold different jobs, or the same (method, seed) with different results; the
    cost measurement is the one folder's that has it (the first shard measures it)."""
    if not folders:
        raise ValueError("give at least one output folder")
    manifest, records, cost = load_job(folders[0])
    by_key = {(r["method"], r["seed"]): r for r in records}
    for folder in folders[1:]:
        other, more, more_cost = load_job(folder)
        if other["fingerprint"] != manifest["fingerprint"]:
            diff = _differences(manifest["identity"], other["identity"])
            raise JobMismatchError(f"{folders[0]} and {folder} hold different jobs; "
                                   f"what differs: {'; '.join(diff[:8])}")
        for r in more:
            key = (r["method"], r["seed"])
            if key in by_key and by_key[key].get("final") != r.get("final"):
                raise JobMismatchError(f"run {key[0]}, seed {key[1]} is in two folders with different results")
            by_key.setdefault(key, r)
        cost = cost or more_cost
    return manifest, list(by_key.values()), cost


def planned_runs(methods: Iterable[str], seeds: Iterable[int], shard: tuple[int, int] | None) -> list[tuple[str, int]]:
    """The (method, seed) runs of a job in their order (seed by seed), or of one shard ``(I, N)`` of it: every
    N-th run starting at the I-th."""
    runs = [(m, s) for s in seeds for m in methods]
    if shard is None:
        return runs
    i, n = shard
    return runs[i - 1::n]


__all__ += ["planned_runs"]
