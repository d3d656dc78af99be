"""Forward-mode AD and the torch.func transforms through ResController and MGR.

The torch and Triton paths are autograd.Functions with a hand-written (closed-form) backward: forward-mode AD,
``vmap`` and ``torch.func.grad`` through them raise a RuntimeError that names ``backend="reference"``; that
backend (plain autograd over the oracle) supports all of them, with the oracle's values."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

from lightning_resctl.rules.mgr import MGRChain
from lightning_resctl.rules.rescontroller import ResController, rescontroller, rescontroller_reference
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

C = 8
CLOSED_FORM = ["torch-eager", "torch"]  # "torch" is the compiled region on CPU when a compiler is present


def _rc(backend):
    return lambda r, u: rescontroller(r, u, backend=backend)


def _mgr(backend):
    torch.manual_seed(0)
    chain = MGRChain(C, 3, streams=2, invert=False, backend=backend)
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(torch.randn_like(p))

    def step(streams, u):  # a gated merge (merge 2 of streams=2) and the output pool
        return chain.step(2, streams, u)[1]
    return step


def _inputs(rule):
    torch.manual_seed(1)
    if rule == "rescontroller":
        return torch.randn(3, C), torch.randn(3, C)
    return torch.randn(3, 2, C), torch.randn(3, C)


FNS = {"rescontroller": _rc, "mgr": _mgr}


@pytest.mark.parametrize("rule", ["rescontroller", "mgr"])
@pytest.mark.parametrize("backend", CLOSED_FORM)
def test_forward_mode_ad_is_refused_naming_the_reference_backend(rule, backend):
    f = FNS[rule](backend)
    a, b = _inputs(rule)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD.*backend='reference'"):
        f(forward_ad.make_dual(a, torch.randn_like(a)), b)
    with pytest.raises(RuntimeError, match="torch.func transforms.*backend='reference'"):
        torch.func.jvp(f, (a, b), (torch.randn_like(a), torch.randn_like(b)))


@pytest.mark.parametrize("rule", ["rescontroller", "mgr"])
@pytest.mark.parametrize("backend", CLOSED_FORM)
def test_vmap_and_func_grad_are_refused_naming_the_reference_backend(rule, backend):
    f = FNS[rule](backend)
    a, b = _inputs(rule)
    with pytest.raises(RuntimeError, match="torch.func transforms.*backend='reference'"):
        torch.func.vmap(f)(a.unsqueeze(0).expand(2, *a.shape), b.unsqueeze(0).expand(2, *b.shape))
    with pytest.raises(RuntimeError, match="torch.func transforms.*backend='reference'"):
        torch.func.grad(lambda a: f(a, b).sum())(a)


def test_reference_backend_supports_forward_ad_vmap_and_func_grad():
    """ResController(backend="reference") and MGR's reference run every transform, with the oracle's values."""
    r, u = _inputs("rescontroller")
    tr, tu = torch.randn_like(r), torch.randn_like(u)
    f = _rc("reference")
    ref = rescontroller_reference
    out, tangent = torch.func.jvp(f, (r, u), (tr, tu))
    want_out, want_tangent = torch.func.jvp(ref, (r, u), (tr, tu))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(tangent, want_tangent)
    rs, us = torch.randn(2, 3, C), torch.randn(2, 3, C)
    torch.testing.assert_close(torch.func.vmap(f)(rs, us), torch.stack([ref(a, b) for a, b in zip(rs, us)]))
    grad = torch.func.grad(lambda a: f(a, u).square().sum())(r)
    want = torch.autograd.grad(ref(r.requires_grad_(), u).square().sum(), r)[0]
    torch.testing.assert_close(grad, want)
    assert ResController(backend="reference")(r, u).equal(ref(r, u))

    s, v = _inputs("mgr")
    g = _mgr("reference")
    out, tangent = torch.func.jvp(g, (s, v), (torch.randn_like(s), torch.randn_like(v)))
    assert torch.isfinite(tangent).all() and out.equal(g(s, v))
    eps = 1e-3  # the tangent is the directional derivative (central difference, fp32)
    ts, tv = torch.randn_like(s), torch.randn_like(v)
    _, tangent = torch.func.jvp(g, (s, v), (ts, tv))
    fd = (g(s + eps * ts, v + eps * tv) - g(s - eps * ts, v - eps * tv)) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=1e-2, atol=1e-3)
    vm = torch.func.vmap(g)(torch.stack([s, 2 * s]), torch.stack([v, v]))
    torch.testing.assert_close(vm, torch.stack([g(s, v), g(2 * s, v)]))


def test_mgr_reference_chain_runs_under_torch_func_from_its_first_merge():
    """A whole reference chain (its first merge included) under torch.func.grad and vmap equals plain autograd."""
    torch.manual_seed(0)
    chain = MGRChain(C, 3, streams=2, backend="reference")
    ws = [torch.randn(C, C) / C ** 0.5 for _ in range(3)]
    branches = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
    x = torch.randn(4, C)
    grad = torch.func.grad(lambda x: chain(x, branches).square().sum())(x)
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad(chain(xr, branches).square().sum(), xr)[0])
    xs = torch.randn(2, 4, C)
    torch.testing.assert_close(torch.func.vmap(lambda x: chain(x, branches))(xs),
                               torch.stack([chain(a, branches) for a in xs]))

