"""The background compiler of :meth:`lightning_resctl.runtime.regions.CompiledRegion.background`: one child process per
Python process that traces and compiles region signatures while the parent runs their math eagerly.

Why a process and not a thread: tracing and inductor keep process-wide state (torch.fx's "is tracing" flag — while
it is set every ``torch.compile``-d function of the process refuses to run —, inductor's config patches), and a
compiling thread would hold the GIL against the training loop. The child shares nothing but the inductor cache
directory with the parent; it runs at a lower CPU priority, one compile at a time.

Protocol (pickle over the child's stdin / stdout; the child starts with the parent's ``sys.path``): jobs
``(job_id, job)`` with ``job`` = ``{module, qualname, template, ambient, default_dtype, num_threads, path}``
(``template``: the call's arguments with each tensor replaced by a :class:`TensorSpec`; ``num_threads``: the
parent's ``torch.get_num_threads()``, which inductor's CPU code generation writes into the kernels, so the child
compiles with it although it runs its own few ops single-threaded); the child answers ``(job_id, result)`` with
``{path, guard, spec}`` (a saved ``torch._inductor.CompiledArtifact``, the trace's size guard as text, the output
spec of :func:`~lightning_resctl.runtime.tracer.trace_region` with its tree as JSON) or ``{error}``. Its stderr goes to
``worker.log`` in the job directory.

Imports :mod:`lightning_resctl.runtime.tracer` only (regions import this module, not the other way round).
"""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from typing import NamedTuple, Optional

import torch

from .tracer import ambient, compiling, flatten_signature, rebuild_args, set_ambient, trace_region

__all__ = ["TensorSpec", "BackgroundCompiler", "compiler_for", "main"]

#: CPU priority of the child (``os.nice`` increment; ours): the training loop keeps ~90 % of a core it shares with
#: the child, and the compiles still finish within a minute on 2 cores (``benchmarks/bench_first_step.py``).
NICE = 10


class TensorSpec(NamedTuple):
    """What the child needs of a tensor argument: a contiguous tensor of this dtype and shape on this device."""
    dtype: torch.dtype
    device: str
    shape: tuple


def _importable(fn) -> bool:
    """``fn`` is what its module's attribute path ``__qualname__`` names (so the child can import it)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or fn.__module__ == "__main__" or "<" in fn.__qualname__:
        return False
    obj = module
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _template(args):
    return tuple(TensorSpec(a.dtype, a.device.type, tuple(a.shape)) if isinstance(a, torch.Tensor)
                 else type(a)(_template(a)) if isinstance(a, (tuple, list)) else a for a in args)


def _warm_up() -> None:
    """What loading a compiled artifact in this process costs the first time, done off the training thread: the
    inductor imports and the probe of the CPU's vector ISA (compiler subprocesses). No tracing, no config change."""
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()


class BackgroundCompiler:
    """Parent side: starts the child on the first job, sends jobs, and resolves each job's ``Future`` from a
    reader thread, which also runs :func:`_warm_up` when the first answer arrives (after the first steps, before
    the training thread loads that answer). :meth:`close` (also at exit) stops the child."""

    def __init__(self):
        self.pid = os.getpid()
        self.dir = tempfile.mkdtemp(prefix="lightning_resctl_regions_")
        self.log_path = os.path.join(self.dir, "worker.log")
        self._ids = itertools.count()
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._dead: Optional[str] = None
        atexit.register(self.close)

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # one compile at a time, no compile-worker pool
        # the priority is lowered before anything is imported: importing torch takes seconds of CPU that would
        # otherwise compete with the first training steps
        code = (f"import os\nif hasattr(os, 'nice'): os.nice({NICE})\n"
                f"import sys; sys.path[:0] = {sys.path!r}\n"
                "from lightning_resctl.runtime.background import main; main()")
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", code],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                    close_fds=True)
        threading.Thread(target=self._read, args=(proc,), name="lightning_resctl-compile-reader", daemon=True).start()
        return proc

    def submit(self, fn, args, ambient) -> Future:
        """Queue the compile of ``fn(*args)``'s signature under the autocast state ``ambient``; the Future's
        result is the child's answer (see the module docstring)."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                future.set_result({"error": self._dead})
                return future
            job_id = next(self._ids)
            job = {"module": fn.__module__, "qualname": fn.__qualname__, "template": _template(args),
                   "ambient": ambient, "default_dtype": torch.get_default_dtype(),
                   "num_threads": torch.get_num_threads(),
                   "path": os.path.join(self.dir, f"{job_id}.bin")}
            self._jobs[job_id] = future
            try:
                if self._proc is None:
                    self._proc = self._start()
                pickle.dump((job_id, job), self._proc.stdin)
                self._proc.stdin.flush()
            except (OSError, ValueError) as err:
                self._jobs.pop(job_id, None)
                future.set_result({"error": f"the background compiler cannot be reached ({err})"})
        return future

    def _read(self, proc: subprocess.Popen) -> None:
        warm = False
        while True:
            try:
                job_id, result = pickle.load(proc.stdout)
            except Exception:  # noqa: BLE001 - EOF or a broken pipe: the child is gone
                break
            if not warm and "error" not in result:
                warm = True
                try:
                    _warm_up()
                except Exception:  # noqa: BLE001 - loading the artifact reports what is wrong
                    pass
            with self._lock:
                future = self._jobs.pop(job_id, None)
            if future is not None:
                future.set_result(result)
        code = proc.wait()
        with self._lock:
            self._dead = f"the background compiler exited (code {code}; its log: {self.log_path})"
            jobs, self._jobs = self._jobs, {}
        for future in jobs.values():
            future.set_result({"error": self._dead})

    def close(self) -> None:
        """Stop the child (a compile in progress is abandoned) and remove the job directory."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._dead = self._dead or "the background compiler was closed"
        if proc is not None and os.getpid() == self.pid:
            try:
                proc.stdin.close()
            except OSError:
                pass
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if os.getpid() == self.pid:
            shutil.rmtree(self.dir, ignore_errors=True)


_COMPILER: dict = {}
#: this torch can save what inductor compiled and load it in another process (torch >= 2.8)
_CAN_SAVE = importlib.util.find_spec("torch._inductor.standalone_compile") is not None


def compiler_for(fn) -> Optional[BackgroundCompiler]:
    """This process's :class:`BackgroundCompiler` (a forked child gets its own) when ``fn`` can be compiled in
    the background (importable by name; this torch can save compiled artifacts), else None."""
    if not _importable(fn) or not _CAN_SAVE:
        return None
    compiler = _COMPILER.get("it")
    if compiler is None or compiler.pid != os.getpid():
        compiler = _COMPILER["it"] = BackgroundCompiler()
    return compiler


# ----------------------------------------------------------------------------------------------
# child side
# ----------------------------------------------------------------------------------------------
def _compile(job: dict) -> dict:
    import torch._inductor
    from torch.utils._pytree import treespec_dumps

    module = importlib.import_module(job["module"])
    fn = module
    for part in job["qualname"].split("."):
        fn = getattr(fn, part)
    args = rebuild_args(job["template"], (torch.empty(s.shape, dtype=s.dtype, device=s.device)  # untouched pages
                                          for s in _specs(job["template"])), slot=TensorSpec)
    tensors: list = []
    flatten_signature(args, tensors)
    torch.set_default_dtype(job["default_dtype"])
    saved = ambient()
    try:
        set_ambient(job["ambient"])
        # the kernels are written for the thread count the parent runs them with (a child at 1 thread wrote
        # single-threaded kernels, which the parent then ran at every step)
        torch.set_num_threads(job["num_threads"])
        with compiling():
            graph, examples, guard, spec = trace_region(fn, args, tensors)
            artifact = torch._inductor.standalone_compile(graph, examples)
    finally:
        torch.set_num_threads(1)
        set_ambient(saved)
    artifact.save(path=job["path"], format="binary")
    tree, kinds, constants = spec
    return {"path": job["path"], "guard": guard, "spec": (treespec_dumps(tree), kinds, constants)}


def _specs(template):
    for a in template:
        if isinstance(a, TensorSpec):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _specs(a)


def main() -> None:
    """Child entry point: answer jobs from stdin until it closes."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the answers
    torch.set_num_threads(1)
    while True:
        try:
            job_id, job = pickle.load(inp)
        except EOFError:
            return
        try:
            result = _compile(job)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which runs that signature eagerly
            text = str(err).splitlines()[0] if str(err) else ""
            result = {"error": f"{type(err).__name__}: {text}"}
        pickle.dump((job_id, result), out)
        out.flush()
