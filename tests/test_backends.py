"""lightning_resctl.runtime.regions.CompiledRegion: one inductor compile per call signature, called without dynamo,
always the eager function's result."""
from __future__ import annotations

import warnings

import pytest
import torch

from lightning_resctl.runtime import backends
from lightning_resctl.runtime.regions import CompiledRegion

needs_compiler = pytest.mark.skipif(not backends.cpu_compile_available(), reason="no C++ compiler for inductor")


def _math(a, b, scale, dim):
    """A row reduction and an elementwise epilogue (the shape of the merge rules' math), two outputs."""
    m = (a * b).sum(dim, keepdim=True) * scale
    return torch.addcmul(a, torch.sigmoid(m), b), {"m": m}


@needs_compiler
def test_one_compile_serves_every_size_of_a_pattern_and_matches_eager():
    region = CompiledRegion(_math)
    for shape in [(5, 7, 9), (2, 3, 33), (8, 64, 17)]:
        a, b = torch.randn(shape), torch.randn(shape)
        out, extra = region(a, b, 0.5, -1)
        want, want_extra = _math(a, b, 0.5, -1)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(extra["m"], want_extra["m"])
    assert region.num_graphs == 1 and not region.failed and region.first_call_s > 0


@needs_compiler
def test_sizes_seen_equal_are_not_assumed_equal_later():
    """A trace on a square input may use that both sizes are equal; a later non-square call must not reuse it."""
    def fn(a):
        return a * a.sum(0, keepdim=True) + a.sum(1, keepdim=True)

    region = CompiledRegion(fn)
    for shape in [(6, 6), (6, 5), (5, 6), (1, 6), (6, 1), (3, 3)]:
        a = torch.randn(shape)
        torch.testing.assert_close(region(a), fn(a))
    assert region.num_graphs == 4  # square, non-square, a size 1 in either place


@needs_compiler
def test_constants_and_dtypes_are_part_of_the_signature():
    region = CompiledRegion(_math)
    a, b = torch.randn(4, 9), torch.randn(4, 9)
    for scale, dim in [(0.5, -1), (2.0, -1), (0.5, 0)]:
        torch.testing.assert_close(region(a, b, scale, dim)[0], _math(a, b, scale, dim)[0])
    a64, b64 = a.double(), b.double()
    out = region(a64, b64, 0.5, -1)[0]
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _math(a64, b64, 0.5, -1)[0])
    assert region.num_graphs == 4


@needs_compiler
def test_sizes_the_trace_fixed_or_bounded_are_checked_on_each_call():
    import math

    def fn(a):
        first, *rest = a.split(1, dim=-1)  # the number of pieces fixes the last size in the trace
        return first * len(rest) / math.sqrt(a.shape[0])  # math.sqrt fixes the first

    region = CompiledRegion(fn)
    for shape in [(3, 5), (4, 7), (3, 5), (4, 7), (3, 6)]:
        a = torch.randn(shape)
        torch.testing.assert_close(region(a), fn(a))
    assert region.num_graphs == 3

    def bounded(a):
        return a[:, :3] * 2 if a.shape[1] > 3 else a  # a branch on a size: a bound in the trace

    region = CompiledRegion(bounded)
    for shape in [(2, 5), (2, 3), (2, 9)]:
        a = torch.randn(shape)
        torch.testing.assert_close(region(a), bounded(a))
    assert region.num_graphs == 2


@needs_compiler
def test_strided_views_grad_inputs_and_the_signature_limit():
    region = CompiledRegion(_math, max_graphs=1)
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    ag = a.clone().requires_grad_()
    out = region(ag, b, 1.0, -1)[0]
    assert out.grad_fn is not None and region.num_graphs == 0  # grad mode: autograd through the eager math
    at, bt = a.t(), b.t()
    torch.testing.assert_close(region(at, bt, 1.0, -1)[0], _math(at, bt, 1.0, -1)[0])  # copied to contiguous
    assert region.num_graphs == 1
    torch.testing.assert_close(region(a, b, 1.0, -1)[0], _math(a, b, 1.0, -1)[0])
    with pytest.warns(RuntimeWarning, match="limit of 1 graphs"):
        torch.testing.assert_close(region(a, b, 3.0, -1)[0], _math(a, b, 3.0, -1)[0])  # past the limit: eager
    assert region.num_graphs == 1


@needs_compiler
def test_first_compile_under_inference_mode():
    region = CompiledRegion(_math)
    with torch.inference_mode():
        a, b = torch.randn(3, 11), torch.randn(3, 11)
        torch.testing.assert_close(region(a, b, 1.0, -1)[0], _math(a, b, 1.0, -1)[0])
    assert region.num_graphs == 1 and not region.failed


@needs_compiler
def test_a_failed_compile_is_scoped_to_its_signature_and_named_once(monkeypatch):
    """A compile that fails for one signature (here: fp64) leaves that signature eager, says once which one, and
    other signatures (fp32) still compile (one failure used to turn compiling off for the whole process)."""
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx

    def fails_for_fp64(graph, examples):
        if any(e.dtype == torch.float64 for e in examples):
            raise RuntimeError("no fp64 here")
        return real(graph, examples)

    monkeypatch.setattr(compile_fx_module, "compile_fx", fails_for_fp64)
    region = CompiledRegion(_math)
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"_math for the call signature \(float64 2-d cpu, float64 2-d cpu, "
                                            r"0.5, -1\) failed \(RuntimeError: no fp64 here\)"):
        torch.testing.assert_close(region(a, b, 0.5, -1)[0], _math(a, b, 0.5, -1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same signature, none for the others
        torch.testing.assert_close(region(a, b, 0.5, -1)[0], _math(a, b, 0.5, -1)[0])
        a32, b32 = a.float(), b.float()
        torch.testing.assert_close(region(a32, b32, 0.5, -1)[0], _math(a32, b32, 0.5, -1)[0])
    assert region.num_graphs == 1 and list(region.failed) == ["(float64 2-d cpu, float64 2-d cpu, 0.5, -1)"]


@needs_compiler
def test_compiled_code_that_fails_at_run_time_falls_back_for_that_signature():
    region = CompiledRegion(lambda a, b: a * b)
    x = torch.randn(3)
    region(x, x)
    (graphs,) = region.entries.values()
    compiled, spec, guard = graphs[0]

    def broken(*args):
        raise RuntimeError("bad kernel")

    graphs[0] = (broken, spec, guard)
    with pytest.warns(RuntimeWarning, match="RuntimeError: bad kernel"):
        assert torch.equal(region(x, x), x * x)
    assert list(region.failed) == ["(float32 1-d cpu, float32 1-d cpu)"]
    y = torch.randn(2, 3)
    assert torch.equal(region(y, y), y * y) and region.num_graphs == 2  # another signature still compiles


@needs_compiler
def test_eager_under_a_dispatch_mode_so_flop_counters_see_the_ops():
    """Lightning's ModelSummary counts FLOPs under a dispatch mode: the region must neither trace inside it
    (the trace would leak symbolic sizes into the counter) nor hide its ops from it."""
    from torch.utils.flop_counter import FlopCounterMode

    region = CompiledRegion(lambda a, b: a @ b)
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    with FlopCounterMode(display=False) as counter:
        out = region(a, b)
    torch.testing.assert_close(out, a @ b)
    assert counter.get_total_flops() == 2 * 4 * 6 * 3 and region.num_graphs == 0 and not region.failed
    region(a, b)
    with FlopCounterMode(display=False) as counter:  # an already compiled graph is not used inside a mode either
        region(a, b)
    assert counter.get_total_flops() == 2 * 4 * 6 * 3 and region.num_graphs == 1


@needs_compiler
def test_meta_tensors_run_eagerly():
    region = CompiledRegion(_math)
    a = torch.empty(3, 5, device="meta")
    out, extra = region(a, a, 1.0, -1)
    assert out.device.type == "meta" and out.shape == (3, 5) and region.num_graphs == 0 and not region.failed


@needs_compiler
def test_autocast_state_is_part_of_the_signature():
    """A graph traced under autocast computes in low precision: it must not serve a call outside autocast."""
    def fn(a, b):
        return (a @ b).float().sum(-1)

    region = CompiledRegion(fn)
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(region(a, b), fn(a, b))
        torch.testing.assert_close(region(a, b), fn(a, b))  # (the bf16 graph is off by ~1e-2)
    assert region.num_graphs == 2


def test_eager_inside_functorch_transforms():
    region = CompiledRegion(lambda a: a.sin() * 2)
    x = torch.randn(5)
    grad = torch.func.grad(lambda t: region(t).sum())(x)
    torch.testing.assert_close(grad, 2 * x.cos())
    assert region.num_graphs == 0


# ------------------------------------------------------------------------------------------
# backend names and the one resolver (lightning_resctl.runtime.backends)
# ------------------------------------------------------------------------------------------
def test_every_rule_resolves_a_backend_as_the_runtime_does(monkeypatch):
    """ResController and MGR answer "which backend runs on this tensor" with the runtime's one resolver: the same
    answer for every name, and the same refusal of "triton" on a device Triton cannot run on (MGR used to accept
    it and fail later, in the kernel)."""
    from lightning_resctl.rules.mgr import MGRChain
    from lightning_resctl.rules.rescontroller import ResController
    from lightning_resctl.runtime import triton as runtime_triton

    x = torch.randn(2, 3, 8)
    streams = torch.randn(2, 3, 2, 8)
    for name in backends.RULE_BACKENDS:
        canonical = backends.check_backend(name, backends.RULE_BACKENDS)
        ctrl, chain = ResController(backend=name), MGRChain(8, 2, streams=2, backend=name)
        want = "torch" if canonical == "auto" else canonical  # CPU tensors: "auto" runs the torch path
        assert ctrl.resolved_backend(x) == chain.resolved_backend(streams) == backends.resolve_backend(canonical, x) \
            == want, name
    monkeypatch.setattr(runtime_triton, "interpreter_mode", lambda: False)  # Triton no longer runs on CPU here
    assert backends.resolve_backend("auto", x) == "torch"
    for rule in (ResController(backend="triton"), MGRChain(8, 2, streams=2, backend="triton")):
        with pytest.raises(ValueError, match=r"backend='triton' cannot run on cpu tensors"):
            rule.resolved_backend(x)


def test_auto_traces_the_math_under_torch_compile_where_it_runs_the_kernels_eagerly(monkeypatch):
    """On a CUDA tensor where Triton runs, "auto" is the Triton kernels eagerly and the torch path while dynamo
    traces (a whole-model or per-block ``torch.compile``): the compiler sees the merge math as aten ops and fuses it
    with its neighbours, where the kernels' ``torch.library`` op would be opaque to it. "triton" asked by name stays
    the kernels. (A fake CUDA tensor: no GPU needed to read the decision.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    with FakeTensorMode():
        x = torch.empty(2, 8, device="cuda")
    assert backends.resolve_backend("auto", x) == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert backends.resolve_backend("auto", x) == "torch"
    assert backends.resolve_backend("auto", None) == "torch"
    assert backends.resolve_backend("triton", x) == "triton"

def test_rules_take_their_backend_names_from_the_runtime():
    """Written once: the rules' lists are the runtime's tuple, not copies of it."""
    import lightning_resctl.rules.mgr as mgr
    from lightning_resctl.rules.rescontroller import BACKENDS as rescontroller_backends

    assert mgr.BACKENDS is rescontroller_backends is backends.RULE_BACKENDS
    assert backends.RULE_BACKENDS == backends.BACKENDS + ("reference",)
