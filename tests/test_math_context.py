"""fp32_bmm: the batched product of the hyper-connection family's stream write stays in the inputs' dtype under
autocast (forward, and a backward called inside the autocast region), and supports double backward, forward-mode
AD and vmap like plain ``torch.matmul``."""
from __future__ import annotations

import torch
from torch.autograd import forward_ad

from lightning_resctl.rules.frame import frame_write
from lightning_resctl.runtime.autograd import fp32_bmm


def _inputs(dtype=torch.float32, width=64):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 4, 4, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(3, 5, 4, width, generator=g, dtype=dtype).requires_grad_()
    return a, b


def test_fp32_under_bf16_autocast_forward_and_backward_inside_it():
    a, b = _inputs()
    grad = torch.randn(3, 5, 4, 64, generator=torch.Generator().manual_seed(1))
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    want = a64 @ b64
    want.backward(grad.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp32_bmm(a, b)
        out.backward(grad)  # a backward inside the region (Lightning's manual_backward)
        plain = torch.matmul(a.detach(), b.detach())
    assert out.dtype == torch.float32 and plain.dtype == torch.bfloat16  # what autocast would have done
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad.double(), a64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    # bf16 math would be ~1e-2 off: the tolerance above tells the two apart
    assert (plain.double() - want).abs().max() > 1e-3


def test_double_backward_forward_ad_and_vmap_match_matmul():
    a, b = _inputs(torch.float64, width=6)  # (gradgradcheck's cost grows with the square of the inputs' size)
    assert torch.autograd.gradcheck(fp32_bmm, (a, b)) and torch.autograd.gradgradcheck(fp32_bmm, (a, b))
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    with forward_ad.dual_level():
        out = fp32_bmm(forward_ad.make_dual(a.detach(), ta), forward_ad.make_dual(b.detach(), tb))
        tangent = forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, ta @ b.detach() + a.detach() @ tb)
    batched = torch.vmap(fp32_bmm)(a.detach(), b.detach())
    torch.testing.assert_close(batched, a.detach() @ b.detach())


def test_frame_write_with_identity_coefficients_is_bitwise_the_residual():
    s = torch.randn(2, 7, 4, 32)
    u = torch.randn(2, 7, 32)
    res = torch.eye(4).expand(2, 7, 4, 4)
    post = torch.ones(2, 7, 4)
    out = frame_write(s, res, post, u)
    assert torch.equal(out, s + u.unsqueeze(-2))


def test_compiled_merges_read_the_autocast_state_without_a_graph_break(monkeypatch):
    """torch 2.11's dynamo cannot trace ``torch.amp.is_autocast_available`` (``torch._C._is_autocast_available``):
    seen on an H200, every merge under bf16 autocast broke its block's graph there, and the resumed frames hit
    dynamo's recompile limit. Compiled code must not call it; stood in for here by a function dynamo breaks on."""
    from lightning_resctl.runtime.autograd import fp32_matmul

    def breaks_the_graph(device_type):
        torch._dynamo.graph_break()
        return True

    monkeypatch.setattr(torch.amp, "is_autocast_available", breaks_the_graph)
    a, b = _inputs()
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))

    def f(a, b, w):
        return fp32_matmul(fp32_bmm(a, b), w)

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(f, backend="eager", fullgraph=True)(a, b, w)
        out.sum().backward()
    assert out.dtype == torch.float32  # autocast was seen on, and the products ran outside it
    torch.testing.assert_close(out, (a @ b) @ w, rtol=1e-5, atol=1e-5)
