"""The fallback inversion inside the Triton kernels (TRITON_INTERPRET=1 on CPU) and its exact-row budget.

The forward kernel picks the rows a gated merge saves exactly (beta above the threshold, or the running error gain
past its limit; each program's share of ``ceil(top_p * rows)``, first come), writes them, their slots and the gain;
the backward kernel rebuilds the merge's inputs from its output and those rows, and hands them on. Checked against
the definitions here, and whole chains against the reference and against the chain without inversion.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_resctl.rules.mgr import MGRChain
from lightning_resctl.rules.mgr.inversion import select_exact
from lightning_resctl.runtime.triton import load_kernels
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)


@pytest.fixture(scope="module")
def kern():
    return load_kernels("mgr")


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Launch plans made with a shrunk launch table (``monkeypatch``) are forgotten before and after each test."""
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    yield
    tiles.clear_launch_plans()


def small_tiles(monkeypatch):
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    for entry in tiles.MGR.values():
        monkeypatch.setitem(entry, "single_elems", 0)
        monkeypatch.setitem(entry, "loop_elems", 64)


def gated_case(c=29, tokens=7, n=4, dtype=torch.float32, competitive=True, seed=0, near_one=()):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(tokens, n, c, generator=g, dtype=torch.float64) * 2).to(dtype)
    u = torch.randn(tokens, c, generator=g, dtype=torch.float64).to(dtype)
    w, q = torch.randn(c, generator=g).to(dtype), torch.randn(c, generator=g).to(dtype) * 3
    cb = torch.randn(n, generator=g).to(dtype)
    for i in near_one:  # a stream whose gate is near 1 for every token
        cb[i] = 12.0
    fb = torch.tensor(-1.0, dtype=dtype) if competitive else None
    return streams, u, w, q, cb, fb


@pytest.mark.parametrize("tiled", [False, True])
def test_forward_saves_the_rows_that_need_it_within_the_budget(kern, monkeypatch, tiled):
    """Rows saved: beta above the threshold or the gain past log(max_gain), at most each program's share of the
    budget, first come in its token order; their slots hold the input rows bit for bit; the gain restarts where a
    row is saved and adds -log(1 - beta) elsewhere."""
    if tiled:
        small_tiles(monkeypatch)
    streams, u, w, q, cb, fb = gated_case(near_one=(1,))
    tokens, n, c = streams.shape
    gain_in = torch.rand(tokens, n, generator=torch.Generator().manual_seed(5)) * 2.5
    inv = kern.Inversion(gain_in, 0.1, 0.5, 8.0)
    out, h, beta, a, exact = kern.step_forward(streams, u, w, q, cb, fb, 1e-6, inv)
    step = -torch.log1p(-beta.clamp(max=1 - 1e-7))
    gain = gain_in + step
    must = (beta > 0.5) | (gain > math.log(8.0))
    assert must[:, 1].all() and must.sum() > 4  # the near-one stream everywhere, and rows by their gain
    programs = 4  # the interpreter's persistent grid
    budget = kern.exact_budget(tokens * n, 0.1, programs)
    assert budget == 1 and exact.exact.shape == (programs * budget, c)
    want_slot = torch.full((tokens, n), -1, dtype=torch.int32)
    for p in range(programs):  # program p takes tokens p, p + 4, ...: the first rows that need it, in order
        taken = 0
        for t in range(p, tokens, programs):
            for i in range(n):
                if must[t, i] and taken < budget:
                    want_slot[t, i] = p * budget + taken
                    taken += 1
    assert torch.equal(exact.slot, want_slot)
    saved = want_slot >= 0
    assert torch.equal(exact.exact[want_slot[saved].long()], streams[saved])  # bit for bit
    torch.testing.assert_close(exact.gain, torch.where(saved, torch.zeros_like(gain), gain), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("competitive", [True, False])
def test_backward_rebuilds_the_inputs_and_matches_the_saved_streams_backward(kern, monkeypatch, tiled, competitive,
                                                                            dtype):
    """The inverted backward reads the merge's output and the exact rows: the inputs it hands on are the exact rows
    bit for bit and the rest within rounding x 1/(1 - beta); its gradients are those of the backward that read the
    saved inputs."""
    if tiled:
        small_tiles(monkeypatch)
    streams, u, w, q, cb, fb = gated_case(dtype=dtype, competitive=competitive, near_one=(2,))
    tokens, n, c = streams.shape
    out, h, beta, a, exact = kern.step_forward(streams, u, w, q, cb, fb, 1e-6, kern.Inversion(None, 0.3, 0.5, 8.0))
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    grad_h = torch.randn(h.shape, generator=g, dtype=torch.float64).to(dtype)
    want = kern.step_backward(streams, u, beta, a, w, q, cb, fb, grad_out, grad_h, 1e-6)
    got = kern.step_backward(out, u, beta, a, w, q, cb, fb, grad_out, grad_h, 1e-6,
                             exact=kern.ExactRows(None, exact.slot, exact.exact), deliver=True)
    rebuilt = got[-1]
    saved = exact.slot >= 0
    assert saved.any() and (~saved).any()
    assert torch.equal(rebuilt[saved], streams[saved])
    eps = torch.finfo(dtype).eps
    bound = 8 * eps * (out.abs() + u.abs().unsqueeze(1)).amax(-1) / (1 - beta)
    assert ((rebuilt - streams).abs().amax(-1) <= bound).all()
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for x, y in zip(got[:6], want[:6]):
        if x is None:
            assert y is None
            continue
        scale = y.abs().max().clamp_min(1.0)
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * scale)


def test_budget_overflow_leaves_rows_to_the_inversion(kern):
    """Past the budget the rows that need saving are rebuilt (slot -1), their gain not restarted."""
    streams, u, w, q, cb, fb = gated_case(near_one=(0, 1, 2, 3), competitive=False)
    tokens, n, _ = streams.shape
    _, _, beta, _, exact = kern.step_forward(streams, u, w, q, cb, fb, 1e-6, kern.Inversion(None, 0.05, 0.5, 8.0))
    assert (beta > 0.5).all()
    saved = exact.slot >= 0
    assert saved.sum() == 4 * kern.exact_budget(tokens * n, 0.05, 4)  # the budget, used up
    assert (exact.gain[~saved] > 0).all() and (exact.gain[saved] == 0).all()


def test_torch_selection_spends_the_budget_on_the_rows_that_need_it():
    """The torch path's rows: ceil(top_p * rows) of them, those that need saving first (the largest gain first), the
    rest of the budget to the largest beta; a static shape whatever the gates."""
    t, n, c = 10, 4, 3
    beta = torch.full((t, n), 0.1)
    beta[2, 1], beta[7, 3] = 0.6, 0.55  # need saving: above the threshold
    beta[5, 0] = 0.4  # the largest of the rest
    gain = torch.zeros(t, n)
    gain[9, 2] = 3.0  # needs saving: its gain
    s2 = torch.randn(t, n, c)
    sel = select_exact(s2, beta, gain, 0.1, 0.5, 8.0)
    assert sel.index.shape == (4,) and sel.exact.shape == (4, c)
    rows = sorted(sel.index.tolist())
    assert rows == sorted([2 * n + 1, 7 * n + 3, 9 * n + 2, 5 * n + 0])
    assert torch.equal(sel.exact, s2.reshape(-1, c)[sel.index])
    assert (sel.gain.reshape(-1)[sel.index] == 0).all()
    few = select_exact(s2, beta, gain, 0.05, 0.5, 8.0)  # a budget of 2: the gain first, then the largest beta
    assert sorted(few.index.tolist()) == sorted([9 * n + 2, 2 * n + 1])


@pytest.mark.parametrize("gating", ["competitive", "independent"])
def test_inverted_chain_on_triton_equals_the_saved_one_in_fp64(gating):
    """A chain with gates near 1 at some merges (every row saved there: a budget of every row) and small ones: the
    Triton path's inverted gradients equal the non-inverted ones (fp64) and the reference's."""
    c, n, merges = 33, 4, 9
    chain = MGRChain(c, merges, streams=n, gating=gating, backend="triton", invert_top_p=1.0).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        chain.merges[5].gate_bias.fill_(9.0)
    fs = [torch.randn(c, c, generator=g, dtype=torch.float64) / math.sqrt(c) for _ in range(merges)]
    x0 = torch.randn(2, 3, c, generator=g, dtype=torch.float64)
    results = []
    for backend, invert in (("triton", True), ("triton", False), ("reference", False)):
        chain.set_backend(backend)
        chain.invert = invert
        chain.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = chain(x, [lambda h, f=f: torch.tanh(h @ f) for f in fs])
        (y * torch.cos(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape)).sum().backward()
        results.append([y, x.grad] + [p.grad for p in chain.parameters()])
    for inverted, saved, ref in zip(*results):
        torch.testing.assert_close(inverted, saved, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(inverted, ref, rtol=1e-9, atol=1e-11)


def test_bf16_update_beside_fp32_streams_is_read_in_the_kernel(kern):
    """Under autocast a branch returns bf16 beside fp32 streams: the Triton path reads u as it is (no cast kernel)
    and writes du in bf16; results equal the step on u cast to fp32, bit for bit."""
    c, n = 24, 4
    chain = MGRChain(c, 6, streams=n, backend="triton", invert=False)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    s = torch.randn(5, n, c, generator=g)
    u16 = torch.randn(5, c, generator=g).bfloat16()
    results = []
    for u in (u16, u16.float()):
        s_ = s.clone().requires_grad_(True)
        u_ = u.detach().clone().requires_grad_(True)
        out, h = chain.step(4, s_, u_)
        (out.sum() + (h * h).sum()).backward()
        results.append((out, h, s_.grad, u_.grad))
    (out16, h16, ds16, du16), (out32, h32, ds32, du32) = results
    assert du16.dtype == torch.bfloat16
    assert torch.equal(out16, out32) and torch.equal(h16, h32) and torch.equal(ds16, ds32)
    assert torch.equal(du16, as_triton_bf16(du32))


def as_triton_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` stored as bf16 by a kernel: round to nearest even on a GPU; Triton's interpreter (3.9) truncates
    (``fp_downcast_rounding="rtne"`` too)."""
    from lightning_resctl.runtime.triton import interpreter_mode

    if not interpreter_mode():
        return x.bfloat16()
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).bfloat16()
