"""Compiled regions must not break the process: concurrent first calls, tracers (torch.jit.trace, torch.export,
ONNX export) and failures scoped to the signature that failed (issue 21, items 3-5)."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.fx._symbolic_trace as fx_trace

from lightning_resctl.runtime import backends
from lightning_resctl.runtime.regions import CompiledRegion

needs_compiler = pytest.mark.skipif(not backends.cpu_compile_available(), reason="no C++ compiler for inductor")


def _math(a, b):
    """A row reduction and an elementwise epilogue (the shape of the merge rules' math)."""
    return torch.addcmul(a, torch.sigmoid((a * b).sum(-1, keepdim=True)), b)


def _process_is_clean():
    """No global tracing state left behind: fx's "is tracing" flag is off and torch.compile of an unrelated function
    works (it refuses to run while that flag is set)."""
    assert not fx_trace.is_fx_symbolic_tracing()
    x = torch.randn(5)
    torch.testing.assert_close(torch.compile(lambda t: t.cos() * 3, backend="eager")(x), x.cos() * 3)


@needs_compiler
def test_concurrent_first_calls_from_threads_compile_one_at_a_time():
    """Four threads, four shapes, released together: every call is right, none falls back, and the process is
    clean afterwards (the traces used to collide and leave torch.fx's tracing flag set)."""
    region = CompiledRegion(_math)
    shapes = [(3, 5), (1, 7), (4, 1), (1, 1)]  # four size patterns (sizes 1 are specialized): four graphs
    inputs = [(torch.randn(s), torch.randn(s)) for s in shapes]
    barrier = threading.Barrier(len(shapes))
    results, errors = [None] * len(shapes), []

    def work(i):
        try:
            barrier.wait()
            results[i] = region(*inputs[i])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shapes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert not [w for w in caught if "lightning_resctl" in str(w.message)], [str(w.message) for w in caught]
    for (a, b), got in zip(inputs, results):
        torch.testing.assert_close(got, _math(a, b))
    assert region.num_graphs == len(shapes) and not region.failed
    _process_is_clean()


@needs_compiler
@pytest.mark.parametrize("phase", ["trace", "compile"])
def test_a_compile_in_another_thread_is_not_a_tracer_here(phase, monkeypatch):
    """torch.fx's "is tracing" flag is process-wide: ``make_fx`` sets it while a region's math is traced, and
    inductor's own passes while it compiles. A region called from another thread meanwhile must still compile (it
    read the flag as a user's tracer and ran eagerly: the thread test above counted three graphs for four shapes,
    about one run in 25)."""
    from torch._inductor import compile_fx as inductor

    from lightning_resctl.runtime.regions import _under_a_tracer

    inside, release = threading.Event(), threading.Event()

    def wait_here():
        inside.set()
        release.wait(30)

    def slow_math(a):
        if phase == "trace":
            wait_here()
        return a * 2

    def compile_fx_tracing_a_pattern(graph, examples):  # as inductor's pattern passes do: an fx trace inside
        def pattern(x):
            wait_here()
            return x

        fx_trace.symbolic_trace(pattern)
        return real_compile_fx(graph, examples)

    real_compile_fx = inductor.compile_fx
    if phase == "compile":
        monkeypatch.setattr(inductor, "compile_fx", compile_fx_tracing_a_pattern)
    region = CompiledRegion(slow_math)
    other = threading.Thread(target=region, args=(torch.randn(3, 4),))
    other.start()
    try:
        assert inside.wait(30), f"the other thread never reached its {phase}"
        flag_set, seen_here = fx_trace.is_fx_symbolic_tracing(), _under_a_tracer()
    finally:
        release.set()
        other.join()
    assert flag_set, "the other thread's trace did not set torch.fx's flag: this test no longer tests anything"
    assert not seen_here
    assert region.num_graphs == 1 and not region.failed
    _process_is_clean()


def test_a_failure_inside_the_trace_leaves_the_process_clean():
    def broken(a):
        raise ValueError("the math refuses")

    region = CompiledRegion(broken)
    with pytest.raises(ValueError, match="the math refuses"):  # the eager call raises the genuine error
        with pytest.warns(RuntimeWarning, match="broken"):
            region(torch.randn(3))
    _process_is_clean()


def _patched_gpt(method):
    from benchmarks.models import NanoGPT
    from lightning_resctl.surgery import patch_residuals

    model = NanoGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    patch_residuals(model, method=method)  # default backend: the compiled regions on CPU
    return model


@needs_compiler
@pytest.mark.parametrize("method", ["mgr", "rescontroller"])
def test_torch_jit_trace_records_the_eager_math(method):
    """``torch.jit.trace`` (also what the TorchScript ONNX exporter runs) must record the merge math as ops: a call
    into compiled code inside the trace crashed (MGR: ``unordered_map::at``) or would be frozen into the trace as
    constants. The traced model must give the eager model's output on another input."""
    model = _patched_gpt(method)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (torch.randint(0, 32, (2, 8)),), check_trace=False)
    assert not [w for w in caught if "lightning_resctl" in str(w.message)]  # no failed compile inside the trace
    other = torch.randint(0, 32, (3, 8))
    torch.testing.assert_close(traced(other), model(other))
    _process_is_clean()


@needs_compiler
@pytest.mark.parametrize("method", ["mgr", "rescontroller"])
def test_torch_export_records_the_eager_math(method):
    """An exported program holds the merge math as plain aten ops (it must run without this package: no compiled
    code, none of the ops the rules use under torch.compile) and gives the eager model's output."""
    model = _patched_gpt(method).eval()
    with torch.no_grad():
        program = torch.export.export(model, (torch.randint(0, 32, (2, 8)),))
        assert not any("lightning_resctl" in str(n.target) for n in program.graph.nodes)
        other = torch.randint(0, 32, (2, 8))
        torch.testing.assert_close(program.module()(other), model(other))
    _process_is_clean()
