"""ResController: the oracle against the spec, every execution path against the oracle.

Paths: "torch" (the lean autograd.Function) and "triton" (fused kernels; on CPU under
TRITON_INTERPRET=1, set in conftest.py). Kernel tests use tiny odd shapes.
"""
from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch

import lightning_resctl
from benchmarks.models import wire_merges
from lightning_resctl.rules.rescontroller import (
    ControllerScales,
    ResController,
    rescontroller,
    rescontroller_reference,
    rescontroller_scales,
)
from lightning_resctl.runtime.memory import saved_tensor_bytes
from models import NanoGPT

BACKENDS = ["torch", "triton"]
DEFAULTS = dict(update_ratio=0.18, stream_ratio=1.08, update_softness=8.0, stream_softness=8.0, eps=1e-12)


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def _check_path_vs_reference(backend, r, u, *, atol, rtol, **opts):
    """Forward and (r, u) gradients of ``backend`` against plain autograd of the oracle."""
    r = r.detach().requires_grad_()
    u = u.detach().requires_grad_()
    ref = rescontroller_reference(r, u, **opts)
    out = rescontroller(r, u, **opts, backend=backend)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    g = torch.randn_like(ref)
    for got, want in zip(_grads(out, (r, u), g), _grads(ref, (r, u), g)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------
# the oracle is the spec
# ------------------------------------------------------------------------------------------
def _spec_by_hand(r, u, update_ratio, stream_ratio, update_softness, stream_softness, eps):
    """The spec, one row, Python floats; C from the materialised candidate stream."""
    d = len(r)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    R = math.sqrt(sum(x * x for x in r) / d + eps)
    U = math.sqrt(sum(x * x for x in u) / d + eps)
    A_u = update_ratio * R
    hard_u = min(A_u / (U + eps), 1.0)
    p_u = U / (A_u + eps)
    s_u = 1.0 - sig(update_softness * (p_u - 1.0)) * (1.0 - hard_u)
    C = math.sqrt(sum((a + s_u * b) ** 2 for a, b in zip(r, u)) / d + eps)
    A_s = stream_ratio * R
    hard_s = min(A_s / (C + eps), 1.0)
    p_s = C / (A_s + eps)
    s_s = 1.0 - sig(stream_softness * (p_s - 1.0)) * (1.0 - hard_s)
    return [a + s_u * s_s * b for a, b in zip(r, u)], s_u, s_s, p_u > 1.0, p_s > 1.0


@pytest.mark.parametrize("u_scale", [0.01, 0.2, 0.5, 3.0])
@pytest.mark.parametrize("opts", [DEFAULTS, dict(DEFAULTS, stream_ratio=0.3, update_softness=3.0, eps=1e-6)])
def test_reference_is_the_spec(u_scale, opts):
    r = torch.randn(3, 11, dtype=torch.float64)
    u = u_scale * torch.randn(3, 11, dtype=torch.float64) + 0.5 * u_scale * r  # partly aligned
    out = rescontroller_reference(r, u, **opts)
    scales = rescontroller_scales(r, u, **opts)
    for i in range(3):
        want, s_u, s_s, cap_u, cap_s = _spec_by_hand(r[i].tolist(), u[i].tolist(), **opts)
        torch.testing.assert_close(out[i], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert scales.alpha[i].item() == pytest.approx(s_u, rel=1e-6)
        assert scales.beta[i].item() == pytest.approx(s_s, rel=1e-6)
        assert bool(scales.update_cap_active[i]) == cap_u and bool(scales.stream_cap_active[i]) == cap_s


def test_scales_shapes_and_dtypes():
    r, u = torch.randn(2, 5, 7, dtype=torch.float64), torch.randn(2, 5, 7, dtype=torch.float64)
    s = rescontroller_scales(r, u, dim=1)
    assert isinstance(s, ControllerScales)
    assert s.alpha.shape == s.beta.shape == s.update_cap_active.shape == (2, 7)
    assert s.alpha.dtype == s.beta.dtype == torch.float32 and s.stream_cap_active.dtype == torch.bool


# ------------------------------------------------------------------------------------------
# cap regimes: idle / soft / fully active, for each cap
# ------------------------------------------------------------------------------------------
def _regime_rows(regime, rows=3, C=33, dtype=torch.float64):
    """(r, u, options) whose rows all put the named cap in the named regime."""
    r = torch.randn(rows, C, dtype=dtype)
    noise = torch.randn(rows, C, dtype=dtype)
    rms = lambda t: t.pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731
    unit = lambda t: t / rms(t)  # noqa: E731
    if regime == "update_idle":  # U = 0.05 R  -> p_u ~ 0.28
        return r, 0.05 * rms(r) * unit(noise), DEFAULTS
    if regime == "update_soft":  # U = 0.2 R  -> p_u ~ 1.1
        return r, 0.2 * rms(r) * unit(noise), DEFAULTS
    if regime == "update_active":  # U = 50 R  -> p_u ~ 280
        return r, 50.0 * rms(r) * unit(noise), DEFAULTS
    if regime == "stream_idle":  # tiny update: C ~ R < 1.08 R
        return r, 0.01 * rms(r) * unit(noise), DEFAULTS
    if regime == "stream_soft":  # update aligned with r: C ~ 1.18 R -> p_s ~ 1.09
        return r, 0.5 * r + 0.01 * rms(r) * unit(noise), DEFAULTS
    if regime == "stream_active":  # allowed stream 0.3 R, C ~ R -> p_s ~ 3.3
        return r, 0.05 * rms(r) * unit(noise), dict(DEFAULTS, stream_ratio=0.3)
    raise ValueError(regime)


REGIMES = ["update_idle", "update_soft", "update_active", "stream_idle", "stream_soft", "stream_active"]


@pytest.mark.parametrize("regime", REGIMES)
def test_regimes_are_what_they_claim(regime):
    r, u, opts = _regime_rows(regime)
    s = rescontroller_scales(r, u, **opts)
    cap, state = regime.split("_")
    scale = s.alpha if cap == "update" else s.beta
    active = s.update_cap_active if cap == "update" else s.stream_cap_active
    # the hard cap of this stage, recomputed from the spec's quantities
    R = r.pow(2).mean(-1).add(opts["eps"]).sqrt()
    if cap == "update":
        X = u.pow(2).mean(-1).add(opts["eps"]).sqrt()
        A = opts["update_ratio"] * R
    else:
        X = (r + s.alpha.double()[:, None] * u).pow(2).mean(-1).add(opts["eps"]).sqrt()
        A = opts["stream_ratio"] * R
    hard = (A / (X + opts["eps"])).clamp(max=1.0).float()
    if state == "idle":
        assert not active.any() and torch.all(scale == 1.0)
    elif state == "soft":
        assert active.all() and torch.all(scale > hard + 0.02) and torch.all(scale < 0.99)
    else:
        assert active.all()
        torch.testing.assert_close(scale, hard, rtol=1e-3, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regime", REGIMES)
def test_paths_match_reference_in_every_regime(backend, regime):
    r, u, opts = _regime_rows(regime, dtype=torch.float32)
    _check_path_vs_reference(backend, r, u, atol=1e-5, rtol=1e-5, **opts)


# ------------------------------------------------------------------------------------------
# every path vs the reference: fp32, fp64 gradcheck, low precision, odd rows, dim=1
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(37, 96), (5, 777), (2, 3, 33), (4, 1)])
def test_fp32_matches_reference(backend, shape):
    r = torch.randn(shape)
    u = torch.randn(shape) * torch.logspace(-2, 1, shape[-1])  # mixed update sizes
    _check_path_vs_reference(backend, r, u, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regime", ["update_soft", "update_active", "stream_soft", "stream_active"])
def test_fp64_gradcheck(backend, regime):
    r, u, opts = _regime_rows(regime, rows=2, C=6)
    r.requires_grad_()
    u.requires_grad_()
    fn = lambda r, u: rescontroller(r, u, **opts, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (r, u), eps=1e-6, atol=1e-5, rtol=1e-4)
    # fp64 math inside: matches the fp64 oracle far below fp32 precision (the kernels receive
    # the float options as fp32 scalars, hence 1e-6 rather than 1e-12 there)
    tol = 1e-12 if backend == "torch" else 1e-6
    torch.testing.assert_close(fn(r, u), rescontroller_reference(r, u, **opts), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype):
    r = torch.randn(7, 96).to(dtype)
    u = (0.3 * torch.randn(7, 96)).to(dtype)
    r.requires_grad_()
    u.requires_grad_()
    out = rescontroller(r, u, backend=backend)
    assert out.dtype == dtype
    # the math is fp32: same as the fp32 oracle on the upcast inputs, rounded once to dtype
    want = rescontroller_reference(r.float(), u.float())
    ulp = torch.finfo(dtype).eps * want.abs().clamp(min=1.0)
    assert torch.all((out.float() - want).abs() <= ulp)
    g = torch.randn(7, 96).to(dtype)
    gr, gu = _grads(out, (r, u), g)
    assert gr.dtype == gu.dtype == dtype
    r32, u32 = r.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    wr, wu = _grads(rescontroller_reference(r32, u32), (r32, u32), g.float())
    torch.testing.assert_close(gr.float(), wr, atol=2 * torch.finfo(dtype).eps, rtol=2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(gu.float(), wu, atol=2 * torch.finfo(dtype).eps, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_promote_like_add(backend):
    r = torch.randn(3, 40)
    u = torch.randn(3, 40).bfloat16()
    out = rescontroller(r, u, backend=backend)
    assert out.dtype == (r + u).dtype == torch.float32
    torch.testing.assert_close(out, rescontroller_reference(r, u.float()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_autocast(backend):
    """Under autocast the update comes in bf16 and the stream stays fp32: fp32 out, like r + u."""
    r = torch.randn(4, 64, requires_grad=True)
    lin = torch.nn.Linear(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u = lin(r)
        out = rescontroller(r, u, backend=backend)
    assert u.dtype == torch.bfloat16 and out.dtype == torch.float32
    torch.testing.assert_close(out, rescontroller_reference(r, u))
    out.sum().backward()
    assert torch.isfinite(r.grad).all() and torch.isfinite(lin.weight.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_channels_first_dim1(backend):
    r = torch.randn(2, 24, 3, 5)
    u = 0.4 * torch.randn(2, 24, 3, 5)
    # the oracle along dim=1 is the oracle on channels-last rows
    want = rescontroller_reference(r.movedim(1, -1), u.movedim(1, -1)).movedim(-1, 1)
    torch.testing.assert_close(rescontroller_reference(r, u, dim=1), want, rtol=0, atol=0)
    _check_path_vs_reference(backend, r, u, dim=1, atol=1e-5, rtol=1e-5)
    m = ResController(dim=1, backend=backend)
    torch.testing.assert_close(m(r, u), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    r = torch.randn(40, 6).t()  # (6, 40), rows strided
    u = torch.randn(6, 80)[:, ::2]
    _check_path_vs_reference(backend, r, u, atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Launch plans made with a shrunk launch table (``monkeypatch``) are forgotten before and after each test."""
    tiles = lightning_resctl.runtime.triton.load_kernels("tiles")
    tiles.clear_launch_plans()
    yield
    tiles.clear_launch_plans()


def small_tiles(monkeypatch, single_elems, loop_block, tile_bytes=64):
    """Shrink the ResController launch table so that small shapes reach the loop paths the GPU runs on long
    rows (``single_elems``: longest row read once; ``loop_block``: column block of longer rows;
    ``tile_bytes``: bytes of one tensor per program for short rows)."""
    tiles = lightning_resctl.runtime.triton.load_kernels("tiles")
    tiles.clear_launch_plans()
    for entry in tiles.RESCONTROLLER.values():
        for key, value in (("single_elems", single_elems), ("loop_block", loop_block), ("tile_bytes", tile_bytes)):
            assert key in entry
            monkeypatch.setitem(entry, key, value)


def test_triton_column_block_loop(monkeypatch):
    """Rows longer than the table's single_elems take the two-pass column loop (forward and backward), with
    a column block that does not divide the row."""
    small_tiles(monkeypatch, single_elems=64, loop_block=128)
    r = torch.randn(3, 777)
    u = torch.randn(3, 777) * torch.linspace(0.01, 3.0, 777)
    _check_path_vs_reference("triton", r, u, atol=2e-5, rtol=1e-5)
    small_tiles(monkeypatch, single_elems=4, loop_block=8)
    r64, u64 = torch.randn(1, 11, dtype=torch.float64, requires_grad=True), torch.randn(1, 11, dtype=torch.float64)
    u64.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rescontroller(a, b, backend="triton"), (r64, u64))


@pytest.mark.parametrize("tile_bytes", [512, 16384])
def test_triton_several_rows_per_program(monkeypatch, tile_bytes):
    """Short rows go several to a program (the last program's rows partly past the end); with 512 bytes a
    program holds 2 fp32 rows of 33 (block 64), with 16384 bytes all 37 rows (64 rows, 27 past the end)."""
    small_tiles(monkeypatch, single_elems=4096, loop_block=64, tile_bytes=tile_bytes)
    r = torch.randn(37, 33)
    u = torch.randn(37, 33) * torch.linspace(0.01, 3.0, 33)
    _check_path_vs_reference("triton", r, u, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("single_elems", [4096, 16])
def test_triton_strided_rows_need_no_copy(monkeypatch, single_elems):
    """Column slices and channels-first tensors are read through their strides (one and two row levels),
    in both the one-read and the column-loop path; the output keeps the residual's layout."""
    small_tiles(monkeypatch, single_elems=single_elems, loop_block=16, tile_bytes=256)
    r = torch.randn(2, 40, 3, 5).movedim(1, -1)  # channels-first moved last: (2, 3, 5, 40), two row levels
    u = torch.randn(2, 3, 5, 80)[..., ::2]  # column slice: feature stride 2
    _check_path_vs_reference("triton", r, u, atol=2e-5, rtol=1e-5)
    out = rescontroller(r, u, backend="triton")
    assert out.stride() == r.stride()
    r3 = torch.randn(4, 7, 5, 21)[::2, ::2, ::2]  # three row levels: copied, still right
    _check_path_vs_reference("triton", r3, torch.randn(r3.shape), atol=2e-5, rtol=1e-5)


def test_row_grid_levels():
    """How tensors map to strided rows: one level, two levels, or None (the caller copies)."""
    row_grid = lightning_resctl.runtime.triton.load_kernels("rows").row_grid
    x = torch.empty(6, 5, 8)
    assert row_grid(x) == (1, 30, ((0, 8, 1),))
    cf = torch.empty(2, 8, 3, 4).movedim(1, -1)  # (2, 3, 4, 8): batch stride 96, pixel stride 1, feature 12
    assert row_grid(cf, x.new_empty(2, 3, 4, 8)) == (2, 12, ((96, 1, 12), (96, 8, 1)))
    assert row_grid(torch.empty(4, 7, 5, 3)[::2, ::2, ::2]) is None
    assert row_grid(torch.empty(70000, 1, 3, 2).movedim(1, -1)[:, ::2]) is None  # batch past the grid limit
    assert row_grid(torch.empty(5)) == (1, 1, ((0, 0, 1),))


def test_triton_ops_registration():
    """Schema, fake (meta) implementations and the autograd formula of the custom ops."""
    kernels = lightning_resctl.runtime.triton.load_kernels("rescontroller")
    r = torch.randn(3, 20, requires_grad=True)
    u = torch.randn(3, 20, requires_grad=True)
    args = (0.18, 1.08, 8.0, 8.0, 1e-12)
    torch.library.opcheck(kernels.rescontroller_fwd, (r, u, *args))
    g = torch.randn(3, 20)
    torch.library.opcheck(kernels.rescontroller_bwd, (g, r.detach(), u.detach(), *args))


# ------------------------------------------------------------------------------------------
# degenerate rows and the spec's properties
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zero", ["residual", "update", "both"])
def test_zero_rows_stay_finite(backend, zero):
    r = torch.randn(3, 17)
    u = torch.randn(3, 17)
    if zero in ("residual", "both"):
        r[1] = 0.0
    if zero in ("update", "both"):
        u[1] = 0.0
    r.requires_grad_()
    u.requires_grad_()
    out = rescontroller(r, u, backend=backend)
    grads = _grads(out, (r, u), torch.ones_like(out))
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)
    _check_path_vs_reference(backend, r, u, atol=1e-5, rtol=1e-5)
    if zero == "update":
        assert torch.equal(out[1], r[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the Triton interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_propagate_per_row(backend):
    r = torch.randn(4, 9)
    u = torch.randn(4, 9)
    r[1, 3] = float("nan")
    u[2, 0] = float("inf")
    out = rescontroller(r, u, backend=backend)
    assert not torch.isfinite(out[1]).all() and not torch.isfinite(out[2]).all()
    assert torch.isfinite(out[[0, 3]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_update_passes_through(backend):
    r = torch.randn(5, 64)
    u = 1e-3 * torch.randn(5, 64)
    out = rescontroller(r, u, backend=backend)
    torch.testing.assert_close(out, r + u, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_oversized_update_is_pulled_to_the_cap(backend):
    r = torch.randn(5, 64, dtype=torch.float64)
    rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731
    for size in (1e2, 1e4):
        u = size * torch.randn(5, 64, dtype=torch.float64)
        alpha = rescontroller_scales(r, u).alpha.double()
        torch.testing.assert_close(rms(alpha[:, None] * u), 0.18 * rms(r), rtol=1e-3, atol=0)
        # the output's update part is s_u s_s u: parallel to u, never larger than the capped update
        out = rescontroller(r, u, backend=backend)
        coef = ((out - r) * u).sum(-1) / (u * u).sum(-1)
        torch.testing.assert_close(out - r, coef[:, None] * u, rtol=1e-6, atol=1e-9)
        assert torch.all(rms(out - r) <= 0.18 * rms(r) * (1 + 1e-3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_are_independent(backend):
    r = torch.randn(6, 50)
    u = torch.randn(6, 50)
    out = rescontroller(r, u, backend=backend)
    r2, u2 = r.clone(), u.clone()
    r2[2] *= 100.0
    u2[4] = torch.randn(50) * 1e3
    out2 = rescontroller(r2, u2, backend=backend)
    keep = [0, 1, 3, 5]
    assert torch.equal(out[keep], out2[keep])
    assert not torch.allclose(out[[2, 4]], out2[[2, 4]])
    # batch of rows == rows one by one
    one_by_one = torch.cat([rescontroller(r[i : i + 1], u[i : i + 1], backend=backend) for i in range(6)])
    torch.testing.assert_close(out, one_by_one, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# API: module, backends, bad input
# ------------------------------------------------------------------------------------------
def test_module_api():
    m = ResController(update_ratio=0.2, stream_ratio=1.1, dim=1)
    assert m.update_ratio == 0.2 and m.stream_ratio == 1.1 and m.dim == 1 and m.backend == "auto"
    assert m.options() == dict(DEFAULTS, update_ratio=0.2, stream_ratio=1.1, dim=1)
    assert list(m.parameters()) == [] and "update_ratio=0.2" in repr(m)
    x = torch.randn(2, 8, 3)
    assert m.resolved_backend(x) == "torch"  # auto on a CPU tensor: the torch path
    assert m.set_backend("native") is m and m.backend == "triton" and m.resolved_backend(x) == "triton"
    m.set_backend("torch")
    assert m.resolved_backend() == m.resolved_backend(x) == "torch"
    torch.testing.assert_close(m(x, x), rescontroller_reference(x, x, update_ratio=0.2, stream_ratio=1.1, dim=1))


def test_public_exports():
    """``lightning_resctl.rescontroller`` is the function (not the submodule of the same name)."""
    assert lightning_resctl.ResController is ResController
    assert lightning_resctl.rescontroller_reference is rescontroller_reference
    assert lightning_resctl.rescontroller is rescontroller
    assert isinstance(lightning_resctl.triton_available(), bool)


def test_triton_backend_needs_a_device_it_runs_on(monkeypatch):
    triton = importlib.import_module("lightning_resctl.runtime.triton")
    monkeypatch.setattr(triton, "interpreter_mode", lambda: False)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="backend='triton'"):
        rescontroller(x, x, backend="triton")
    assert ResController().resolved_backend(x) == "torch"


BAD_CALLS = [
    (lambda r: dict(residual=r, update=torch.randn(4, 9)), ValueError, "same shape"),
    (lambda r: dict(residual=r, update=torch.randn(1, 8)), ValueError, "same shape"),
    (lambda r: dict(residual=r, update=torch.ones(4, 8, dtype=torch.int64)), TypeError, "update"),
    (lambda r: dict(residual=r.bool(), update=r), TypeError, "residual"),
    (lambda r: dict(residual=r.tolist(), update=r), TypeError, "residual"),
    (lambda r: dict(residual=r, update=r.to("meta")), ValueError, "device"),
    (lambda r: dict(residual=r[:, :0], update=r[:, :0]), ValueError, "feature dim"),
    (lambda r: dict(residual=r, update=r, dim=2), ValueError, "dim=2"),
    (lambda r: dict(residual=r, update=r, dim=1.0), TypeError, "dim"),
    (lambda r: dict(residual=r, update=r, update_ratio=0.0), ValueError, "update_ratio"),
    (lambda r: dict(residual=r, update=r, stream_ratio=-1.0), ValueError, "stream_ratio"),
    (lambda r: dict(residual=r, update=r, update_softness=float("nan")), ValueError, "update_softness"),
    (lambda r: dict(residual=r, update=r, stream_softness=float("inf")), ValueError, "stream_softness"),
    (lambda r: dict(residual=r, update=r, eps=0), ValueError, "eps"),
    (lambda r: dict(residual=r, update=r, eps="1e-12"), TypeError, "eps"),
    (lambda r: dict(residual=r, update=r, update_ratio=True), TypeError, "update_ratio"),
]


@pytest.mark.parametrize("fn", [rescontroller, rescontroller_reference, rescontroller_scales])
@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_input(fn, case):
    make, err, match = BAD_CALLS[case]
    kwargs = make(torch.randn(4, 8))
    with pytest.raises(err, match=match):
        fn(**kwargs)


def test_bad_backend_and_module_options():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="backend.*'cuda'"):
        rescontroller(x, x, backend="cuda")
    with pytest.raises(TypeError, match="backend"):
        ResController(backend=None)
    with pytest.raises(ValueError, match="update_ratio"):
        ResController(update_ratio=-0.1)
    with pytest.raises(TypeError, match="dim"):
        ResController(dim="last")
    with pytest.raises(ValueError, match="backend"):
        ResController().set_backend("gpu")
    with pytest.raises(ValueError, match="dim=3"):
        ResController(dim=3)(x, x)
    with pytest.raises(ValueError, match="0-d"):
        rescontroller(torch.tensor(1.0), torch.tensor(1.0))


# ------------------------------------------------------------------------------------------
# torch.compile: no graph break on either path
# ------------------------------------------------------------------------------------------
class _TinyNet(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.lin = torch.nn.Linear(24, 24)
        self.merge = ResController(backend=backend)

    def forward(self, x):
        x = self.merge(x, self.lin(x))
        return self.merge(x, torch.tanh(self.lin(x)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    net = _TinyNet(backend)
    x = torch.randn(2, 5, 24, requires_grad=True)
    explained = torch._dynamo.explain(net)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    if backend == "triton":  # one opaque op per merge, not traced kernels
        assert code.count("lightning_resctl.rescontroller_fwd") == 2
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    eager = net(x)
    (ex,) = torch.autograd.grad(eager.square().sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gx, ex)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------
# the lean torch path in a 12-layer GPT: saved bytes and gradients
# ------------------------------------------------------------------------------------------
def _saved_activation_bytes(model, idx):
    """Bytes saved for backward by one forward, each storage counted once, parameters excluded."""
    nbytes, loss = saved_tensor_bytes(
        lambda: torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()),
        exclude=model.parameters(),
    )
    loss.backward()
    return nbytes


def test_gpt_saved_bytes_and_gradients():
    cfg = dict(n_layer=12, n_head=4, n_embd=256, vocab_size=128, block_size=64)
    plain = NanoGPT(**cfg)
    lean = wire_merges(copy.deepcopy(plain), ResController(backend="torch"))
    oracle = wire_merges(copy.deepcopy(plain), rescontroller_reference)
    idx = torch.randint(0, 128, (1, 64))
    plain_bytes = _saved_activation_bytes(plain, idx)
    lean_bytes = _saved_activation_bytes(lean, idx)
    oracle_bytes = _saved_activation_bytes(oracle, idx)
    assert lean_bytes <= 1.2 * plain_bytes, (lean_bytes, plain_bytes)
    assert lean_bytes < oracle_bytes  # plain autograd of the oracle keeps more
    # the lean Function's gradients are those of plain autograd through the oracle
    for p_lean, p_oracle in zip(lean.parameters(), oracle.parameters()):
        torch.testing.assert_close(p_lean.grad, p_oracle.grad, rtol=1e-4, atol=1e-6)


def _huge_rows(shape, dtype, scale=1e20, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(shape, generator=g, dtype=torch.float64) * scale)
    u = (torch.randn(shape, generator=g, dtype=torch.float64) * scale * torch.linspace(0.01, 3.0, shape[-1],
                                                                                        dtype=torch.float64))
    r[0] /= scale  # one ordinary row beside the huge ones: rows stay independent
    u[0] /= scale
    return r.to(dtype), u.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["reference", "torch", "triton", "triton-blocked"])
@pytest.mark.parametrize("shape", [(3, 37), (4, 129)])
def test_huge_rows_stay_finite_and_match_fp64(path, dtype, shape, monkeypatch):
    """Rows of magnitude ~1e20 (whose squares overflow fp32) give the fp64 result, forward and backward."""
    if path == "triton-blocked":
        small_tiles(monkeypatch, single_elems=16, loop_block=16)
    r, u = _huge_rows(shape, dtype)
    r.requires_grad_()
    u.requires_grad_()
    assert torch.isfinite(r.detach() + u.detach()).all()
    fn = rescontroller_reference if path == "reference" else (
        lambda a, b: rescontroller(a, b, backend=path.split("-")[0]))
    out = fn(r, u)
    r64, u64 = r.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = rescontroller_reference(r64, u64)
    assert torch.isfinite(out).all()
    tol = dict(rtol=2e-2, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=0)
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), **tol)
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for got, want in ((r.grad, r64.grad), (u.grad, u64.grad)):
        assert torch.isfinite(got).all()
        scale = want.abs().amax(-1, keepdim=True)
        err = ((got.double() - want) / scale).abs().max().item()
        assert err < (3e-2 if dtype == torch.bfloat16 else 1e-4), err


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_near_the_scaling_threshold(backend):
    """Rows just below / above 2^32 (where the moments start being scaled by a power of two) agree."""
    r = torch.randn(6, 64) * torch.tensor([1e9, 4e9, 5e9, 1e12, 1.0, 1e-3]).unsqueeze(1)
    u = torch.randn(6, 64) * r.abs().amax(-1, keepdim=True) * 0.3
    out = rescontroller(r, u, backend=backend)
    torch.testing.assert_close(out.double(), rescontroller_reference(r.double(), u.double()), rtol=1e-5, atol=1e-5)


def test_torch_path_modes_and_switch(monkeypatch):
    from lightning_resctl.runtime import backends

    x = torch.randn(2, 4)
    assert backends.torch_mode("torch-eager", x) == "eager"
    assert backends.torch_mode("torch-compiled", x) == "compiled"
    monkeypatch.setenv(backends.COMPILE_ENV, "0")
    assert backends.torch_mode("torch", x) == "eager"
    monkeypatch.setenv(backends.COMPILE_ENV, "1")
    assert backends.torch_mode("torch", x) == ("background" if backends.cpu_compile_available() else "eager")
    for name in ("torch-eager", "torch-compiled"):
        assert ResController(backend=name).resolved_backend(x) == name


@pytest.mark.skipif(not __import__("lightning_resctl.runtime.backends").runtime.backends.cpu_compile_available(),
                    reason="no C++ compiler for inductor")
@pytest.mark.parametrize("regime", REGIMES)
def test_compiled_region_matches_eager_and_reference(regime):
    r, u, opts = _regime_rows(regime, rows=5, C=67, dtype=torch.float32)
    outs, grads = {}, {}
    for backend in ("torch-eager", "torch-compiled", "reference"):
        a, b = r.clone().requires_grad_(), u.clone().requires_grad_()
        fn = (lambda x, y: rescontroller_reference(x, y, **opts)) if backend == "reference" else (
            lambda x, y: rescontroller(x, y, **opts, backend=backend))
        out = fn(a, b)
        (out * torch.cos(torch.arange(out.numel()).reshape(out.shape))).sum().backward()
        outs[backend], grads[backend] = out.detach(), (a.grad, b.grad)
    torch.testing.assert_close(outs["torch-compiled"], outs["torch-eager"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs["torch-compiled"], outs["reference"], rtol=1e-5, atol=1e-5)
    for i in range(2):
        torch.testing.assert_close(grads["torch-compiled"][i], grads["torch-eager"][i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads["torch-compiled"][i], grads["reference"][i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch-eager"])
def test_double_backward_is_refused_not_silently_wrong(backend):
    """The closed-form backward is not itself differentiable (its per-row scalars are saved without a graph):
    a second derivative must raise, not return a wrong number. (``torch-compiled`` runs the same autograd.Function,
    its backend choosing only the math after the refusal; compiling fp64 regions for it cost CI 27 s.)"""
    r = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    u = (3 * torch.randn(3, 8, dtype=torch.float64)).requires_grad_()
    out = rescontroller(r, u, backend=backend)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(out.pow(2).sum(), r, create_graph=True)
    g, = torch.autograd.grad(out.pow(2).sum(), r)  # a plain backward is unaffected
    torch.testing.assert_close(g, torch.autograd.grad(rescontroller_reference(r, u).pow(2).sum(), r)[0])


def test_module_takes_its_options_as_a_config():
    """``ResController(config=ResControllerConfig(...))`` is the module the keywords build (what the rule passes:
    its own config); keywords and a config together are refused; the config is checked like the keywords."""
    from lightning_resctl.rules import get_merge_rule
    from lightning_resctl.rules.rescontroller import ResControllerConfig

    options = dict(update_ratio=0.3, stream_ratio=1.2, update_softness=4.0, stream_softness=6.0, eps=1e-9,
                   backend="torch-eager")
    by_keywords = ResController(**options, dim=1)
    by_config = ResController(config=ResControllerConfig(**options), dim=1)
    assert by_config.options() == by_keywords.options() and by_config.backend == by_keywords.backend
    r, u = torch.randn(2, 6, 3), torch.randn(2, 6, 3)
    torch.testing.assert_close(by_config(r, u), rescontroller_reference(r, u, **by_keywords.options()))
    with pytest.raises(TypeError, match="config="):
        ResController(0.3, config=ResControllerConfig(update_ratio=0.3))
    with pytest.raises(ValueError, match="update_ratio"):
        ResController(config=ResControllerConfig(update_ratio=0.0))
    rule = get_merge_rule("rescontroller").rule_class("rescontroller", ResControllerConfig(**options))
    assert rule.build_merge(6).options() == {**by_keywords.options(), "dim": 6}
