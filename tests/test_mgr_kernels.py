"""Fused Triton MGR step (forward + backward) against the torch reference, under TRITON_INTERPRET=1 on CPU."""
from __future__ import annotations

import pytest
import torch

from lightning_resctl.rules.mgr import MGRChain, mgr_step_reference
from lightning_resctl.runtime.triton import load_kernels
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

KINDS = ("competitive", "independent", "accumulating")


@pytest.fixture(scope="module")
def kern():
    return load_kernels("mgr")


def make_case(kind, n, c, dtype, tokens=(3,), seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n - 1 if kind == "accumulating" else n
    streams = (torch.randn(*tokens, m, c, generator=g) * torch.rand(*tokens, m, 1, generator=g) * 3).to(dtype)
    u = torch.randn(*tokens, c, generator=g).to(dtype)
    params = {"next_query": torch.randn(c, generator=g) * 2}
    if kind != "accumulating":
        params["gate_query"] = torch.randn(c, generator=g) * 2
        params["gate_bias"] = torch.randn(n, generator=g)
        if kind == "competitive":
            params["forget_bias"] = torch.randn((), generator=g)
    if dtype == torch.float64:
        params = {k: v.double() for k, v in params.items()}
    return streams, u, params


def op_call(kern, streams, u, p):
    out, h, beta, a = kern.mgr_step(streams, u, p["next_query"], p.get("gate_query"), p.get("gate_bias"),
                                    p.get("forget_bias"), 1e-6)
    return out, h


def ref_call(streams, u, p, gating):
    return mgr_step_reference(streams, u, p["next_query"], p.get("gate_query"), p.get("gate_bias"),
                              p.get("forget_bias"), gating)


def forward_backward(fn, streams, u, params):
    leaves = [streams.detach().clone().requires_grad_(True), u.detach().clone().requires_grad_(True)]
    ps = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    out, h = fn(leaves[0], leaves[1], ps)
    g = torch.Generator().manual_seed(11)
    w_out = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    w_h = torch.randn(h.shape, generator=g).to(h.device, h.dtype)
    ((out.float() * w_out.float()).sum() + (h.float() * w_h.float()).sum()).backward()
    grads = [leaves[0].grad, leaves[1].grad] + [ps[k].grad for k in sorted(ps)]
    return [out, h], grads


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Launch plans made with a shrunk launch table (``monkeypatch``) are forgotten before and after each test."""
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    yield
    tiles.clear_launch_plans()


def small_tiles(monkeypatch, single_elems=0, loop_elems=64):
    """Shrink the MGR launch table so that small shapes take the column-tiled path the GPU runs on large
    tokens: with ``single_elems=0`` every token is tiled, ``loop_elems=64`` gives 16-32 columns per tile (97
    columns: several tiles, the last one partial)."""
    tiles = load_kernels("tiles")
    tiles.clear_launch_plans()
    for entry in tiles.MGR.values():  # every direction and element size
        assert "single_elems" in entry and "loop_elems" in entry
        monkeypatch.setitem(entry, "single_elems", single_elems)
        monkeypatch.setitem(entry, "loop_elems", loop_elems)


def check_step(kern, kind, n, c, dtype, tokens=(3,), seed=0):
    """Forward and backward of the fused step against the reference (the interpreter runs 4 programs: with
    more than 4 tokens some programs loop over two)."""
    streams, u, params = make_case(kind, n, c, dtype, tokens=tokens, seed=seed)
    gating = "independent" if kind == "independent" else "competitive"
    outs, grads = forward_backward(lambda s, u, p: op_call(kern, s, u, p), streams, u, params)
    routs, rgrads = forward_backward(lambda s, u, p: ref_call(s, u, p, gating), streams, u, params)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    for a, b in zip(outs, routs):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(grads, rgrads):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = b.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(a.float(), b.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [37, 97])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_step_matches_reference(kern, kind, n, c, dtype):
    check_step(kern, kind, n, c, dtype, seed=n * c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_tiled_step_matches_reference(kern, monkeypatch, kind, n, dtype):
    """Tokens larger than a tile: two passes over column tiles (the pool's moments from running sums forward,
    dbeta from row sums backward, the parameter-gradient partials accumulated in place)."""
    small_tiles(monkeypatch)
    check_step(kern, kind, n, 50, dtype, tokens=(5,), seed=n)


@pytest.mark.parametrize("tiled", [False, True])
def test_strided_streams_need_no_copy(kern, monkeypatch, tiled):
    """Streams and u that are views into one (T, m + 1, C) buffer (the inversion path's accumulating merge),
    and a strided dS', are read through their strides: same results as contiguous copies, no copy made."""
    if tiled:
        small_tiles(monkeypatch)
    g = torch.Generator().manual_seed(3)
    m, c = 3, 41
    buf = torch.randn(5, m + 1, c, generator=g)
    streams, u = buf[:, :m], buf[:, m]
    assert not streams.is_contiguous() and not u.is_contiguous()
    assert kern._stream_view(streams, 1)[0] is streams and kern._token_view(u, 1)[0] is u
    params = {"next_query": torch.randn(c, generator=g), "gate_query": torch.randn(c, generator=g),
              "gate_bias": torch.randn(m, generator=g), "forget_bias": torch.randn((), generator=g)}
    grad_out = torch.randn(c, 5, m, generator=g).permute(1, 2, 0)  # feature stride 5 * m: copied, still right
    grad_h = torch.randn(5, 2 * c, generator=g)[:, ::2]
    p = (params["next_query"], params["gate_query"], params["gate_bias"], params["forget_bias"])
    _, _, beta, a, _ = kern.step_forward(streams, u, *p, 1e-6)
    got = kern.step_backward(streams, u, beta, a, *p, grad_out, grad_h, 1e-6)[:6]
    sc, uc = streams.contiguous(), u.contiguous()
    _, _, beta_c, a_c, _ = kern.step_forward(sc, uc, *p, 1e-6)
    want = kern.step_backward(sc, uc, beta_c, a_c, *p, grad_out.contiguous(), grad_h.contiguous(), 1e-6)[:6]
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    out_s, h_s, *_ = kern.mgr_step(streams, u, params["next_query"], None, None, None, 1e-6)
    out_c, h_c, *_ = kern.mgr_step(sc, uc, params["next_query"], None, None, None, 1e-6)
    torch.testing.assert_close(out_s, out_c, rtol=0, atol=0)
    torch.testing.assert_close(h_s, h_c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiled", [False, True])
def test_every_output_and_partial_is_written(kern, monkeypatch, tiled):
    """The backward's outputs and per-program partial sums are ``torch.empty``: with every fresh buffer
    poisoned with NaN the results are still the reference's, so every element is written by a program."""
    if tiled:
        small_tiles(monkeypatch)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    check_step(kern, "competitive", 4, 21, torch.float32, tokens=(5,))
    check_step(kern, "accumulating", 4, 21, torch.float32, tokens=(5,))


@pytest.mark.parametrize("kind", ["competitive", "independent"])
def test_fused_step_fp64_and_gates(kern, kind):
    streams, u, params = make_case(kind, 4, 21, torch.float64, tokens=(2, 3))
    gating = "independent" if kind == "independent" else "competitive"
    out, h, beta, a = kern.mgr_step(streams, u, params["next_query"], params["gate_query"], params["gate_bias"],
                                    params.get("forget_bias"), 1e-6)
    assert beta.dtype == a.dtype == torch.float64 and beta.shape == (2, 3, 4) and a.shape == (2, 3, 4)
    rout, rh = ref_call(streams, u, params, gating)
    torch.testing.assert_close(out, rout, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, rh, rtol=1e-12, atol=1e-12)
    outs, grads = forward_backward(lambda s, u, p: op_call(kern, s, u, p), streams, u, params)
    _, rgrads = forward_backward(lambda s, u, p: ref_call(s, u, p, gating), streams, u, params)
    for x, y in zip(grads, rgrads):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_fused_step_without_stream_grad(kern):
    # the last merge's streams are often unused: the backward gets no grad_out
    streams, u, params = make_case("competitive", 4, 37, torch.float32)
    ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    s = streams.clone().requires_grad_(True)
    _, h = op_call(kern, s, u, ps)
    h.sum().backward()
    s_ref = streams.clone().requires_grad_(True)
    _, rh = ref_call(s_ref, u, params, "competitive")
    rh.sum().backward()
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-5, atol=1e-5)


def test_opcheck_registration(kern):
    streams, u, params = make_case("competitive", 4, 37, torch.float32)
    args = (streams.requires_grad_(True), u.requires_grad_(True), params["next_query"].requires_grad_(True),
            params["gate_query"].requires_grad_(True), params["gate_bias"].requires_grad_(True),
            params["forget_bias"].requires_grad_(True), 1e-6)
    torch.library.opcheck(torch.ops.lightning_resctl.mgr_step.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize("gating", ["competitive", "independent"])
def test_chain_on_triton_matches_reference(gating, invert):
    c, n, merges = 37, 4, 6
    chain = MGRChain(c, merges, streams=n, gating=gating, invert=invert, backend="triton")
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(torch.randn_like(p))
    fs = [torch.nn.Linear(c, c) for _ in range(merges)]
    x0 = torch.randn(2, 2, c)
    results = []
    for backend in ("triton", "reference"):
        chain.set_backend(backend)
        chain.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = chain(x, [lambda h, f=f: torch.tanh(f(h)) for f in fs])
        (y * y).sum().backward()
        results.append([y, x.grad] + [p.grad for p in chain.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_more_than_eight_streams(kern):
    with pytest.raises(ValueError, match="up to 8 streams"):
        kern.mgr_step(torch.randn(2, 9, 5), torch.randn(2, 5), torch.zeros(5), None, None, None, 1e-6)


def test_kernels_come_from_this_checkout():
    """The kernels loaded are the ones beside this package (not another checkout's editable mapping)."""
    from pathlib import Path

    import lightning_resctl

    root = Path(lightning_resctl.__file__).resolve().parent.parent
    if (root / "kernels" / "_library.py").exists():
        assert Path(load_kernels("mgr").__file__).resolve() == root / "kernels" / "mgr.py"
        assert Path(load_kernels("rescontroller").__file__).resolve() == root / "kernels" / "rescontroller.py"


# ----------------------------------------------------------------------------------------------
# device checks: both rules' kernels, forward and backward, against the references. Named test_device_* so
# that benchmarks/gpu_check.sh selects them (-k device_) and runs them on CUDA with TRITON_INTERPRET=0
# (LIGHTNING_RESCTL_TEST_DEVICE=cuda); the normal suite runs them on CPU under the interpreter.
# ----------------------------------------------------------------------------------------------
import os  # noqa: E402

DEVICE = os.environ.get("LIGHTNING_RESCTL_TEST_DEVICE", "cpu")


def _on(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (3, 2, 301), (2, 16411)])
@pytest.mark.parametrize("scale", [1.0, 1e20])
def test_device_rescontroller_kernels_match_reference(dtype, shape, scale):
    """Short rows several to a program, one row per program, and rows past every single-read limit of the
    launch table (two passes over column blocks), ordinary and ~1e20."""
    from lightning_resctl.rules.rescontroller import rescontroller, rescontroller_reference

    g = torch.Generator().manual_seed(7)
    r = (torch.randn(shape, generator=g, dtype=torch.float64) * scale)
    u = torch.randn(shape, generator=g, dtype=torch.float64) * scale * torch.linspace(0.01, 3.0, shape[-1],
                                                                                      dtype=torch.float64)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    r_, u_ = _on(r.to(dtype)).requires_grad_(), _on(u.to(dtype)).requires_grad_()
    out = rescontroller(r_, u_, backend="triton")
    (out.double() * _on(w)).sum().backward()
    r64, u64 = r.to(dtype).double().requires_grad_(), u.to(dtype).double().requires_grad_()
    ref = rescontroller_reference(r64, u64)
    (ref * w).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.isfinite(out).all() and torch.isfinite(r_.grad).all() and torch.isfinite(u_.grad).all()
    for got, want in ((out, ref), (r_.grad, r64.grad), (u_.grad, u64.grad)):
        err = ((got.double().cpu() - want) / want.abs().amax(-1, keepdim=True).clamp_min(1e-30)).abs().max()
        assert err < tol, (err, got.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, c", [(2, 97), (4, 97), (8, 97), (8, 2304)])
@pytest.mark.parametrize("kind", KINDS)
def test_device_mgr_kernels_match_reference(kern, kind, n, c, dtype):
    """C=97: a token is one tile (6 tokens: some programs loop over two); n=8, C=2304: past the launch
    table's single-tile limits, column tiles (2 tokens: the interpreter's cost grows with the tiles)."""
    streams, u, params = make_case(kind, n, c, dtype, tokens=(2, 3) if c < 1000 else (2,), seed=n)
    gating = "independent" if kind == "independent" else "competitive"
    dev = {k: _on(v) for k, v in params.items()}
    got, ggrads = forward_backward(lambda s, x, p: op_call(kern, s, x, p), _on(streams), _on(u), dev)
    want, wgrads = forward_backward(lambda s, x, p: ref_call(s, x, p, gating), streams, u, params)
    tol = dict(rtol=2e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.cpu(), b, **tol)
    for a, b in zip(ggrads, wgrads):  # gradients: tolerance relative to the largest entry; parameter gradients
        scale = b.float().abs().max().clamp_min(1.0)  # sum over tokens (bf16 rounding cancels less than it adds)
        atol = tol["atol"] * scale * (2.0 if dtype == torch.bfloat16 and b.dim() == 0 else 1.0)
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=tol["rtol"], atol=atol)


@pytest.mark.parametrize("gating", ["competitive", "independent"])
def test_device_mgr_inverted_chain_matches_reference(gating):
    """The fused step with the fallback inversion inside the kernels (fp32 streams: the chain's default), a merge
    with gates near 1 (its rows saved exactly): the chain's output and gradients against the reference path (a bf16
    branch output beside the streams: test_mgr_inversion_kernels.py)."""
    c, n, merges = 97, 4, 7
    g = torch.Generator().manual_seed(5)
    chain = MGRChain(c, merges, streams=n, gating=gating, backend="triton", invert_top_p=0.5)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        chain.merges[4].gate_bias.fill_(6.0)
    ws = [torch.randn(c, c, generator=g) / c ** 0.5 for _ in range(merges)]
    x0 = torch.randn(2, 3, c, generator=g)
    results = []
    for backend, dev in (("triton", DEVICE), ("reference", "cpu")):
        chain.to(dev).set_backend(backend)
        chain.zero_grad(set_to_none=True)
        x = x0.to(dev).requires_grad_(True)
        fs = [lambda h, w=w.to(dev): torch.tanh(h @ w) for w in ws]
        y = chain(x, fs)
        (y * y).sum().backward()
        results.append([y.cpu(), x.grad.cpu()] + [p.grad.cpu().clone() for p in chain.parameters()])
    chain.to("cpu")
    for a, b in zip(*results):
        scale = b.abs().max().clamp_min(1.0).item()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("method", ["attnres", "attnres-block"])
@pytest.mark.parametrize("scale", [1.0, 1e20])
def test_device_attnres_kernels_match_reference(method, scale):
    """Full and Block AttnRes (S = 2) on the kernels, fp32, C = 97, rows ordinary and ~1e20 (the chain input): output
    and every gradient against the fp64 oracle."""
    from lightning_resctl.rules import make_rule
    from lightning_resctl.rules.attnres import attnres_chain_reference

    c, merges = 97, 5
    g = torch.Generator().manual_seed(6)
    rule = make_rule(method, {"backend": "triton", **({"block_size": 2} if method == "attnres-block" else {})})
    chain = rule.build_chain(c, merges)
    with torch.no_grad():
        for p in chain.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ws = [torch.randn(c, c, generator=g, dtype=torch.float64) / c ** 0.5 for _ in range(merges)]
    x0 = torch.randn(2, 3, c, generator=g, dtype=torch.float64) * scale

    def kernels(x):
        state, h = rule.start(chain, x), x
        for k, w in enumerate(ws):
            state, h = rule.step(chain, k, state, torch.tanh((h @ w.to(h.device, h.dtype)) / scale) * scale, k + 1)
        return h

    def oracle(x):
        fs = [lambda h, w=w: torch.tanh((h @ w) / scale) * scale for w in ws]
        y, _ = attnres_chain_reference(x, fs, [m.pool_query.double() for m in chain.merges],
                                       [m.key_norm_weight.double() for m in chain.merges], chain.block_size, chain.eps)
        return y

    results = []
    for fn, dev, dt in ((kernels, DEVICE, torch.float32), (oracle, "cpu", torch.float64)):
        chain.to(dev).to(dt).zero_grad(set_to_none=True)
        x = x0.to(dev, dt).requires_grad_(True)
        y = fn(x)
        (y / scale * torch.cos(torch.arange(y.numel(), device=dev, dtype=dt)).reshape(y.shape)).sum().backward()
        results.append([y.cpu().double() / scale, x.grad.cpu().double() * scale]
                       + [p.grad.cpu().double().clone() for p in chain.parameters()])
    chain.to("cpu").float()
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        tol = b.abs().max().clamp_min(1.0).item() * 2e-4
        torch.testing.assert_close(a, b, rtol=2e-4, atol=tol)
