"""Every merge rule computes its own math in its documented compute dtype whatever the autocast state.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (Lightning's ``precision="bf16-mixed"`` on CPU) the
matmuls, ``bmm`` and ``vecdot`` inside a rule would run in bf16; the rules take their math out of autocast
(:mod:`lightning_resctl.runtime.autograd`), so with fp32 streams and updates the outputs and gradients under
autocast (forward and backward inside it) are those of the fp32 run — per rule (every registered one,
automatically) and per torch backend that runs on CPU (the Triton kernels compute in fp32 by construction; in
the CPU interpreter they pass this check too, at ~20 s per rule, too slow for the suite). The model's branches
keep autocast (the last test)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_resctl.rules import get_merge_rule, make_rule, merge_rules
from lightning_resctl.runtime.backends import cpu_compile_available
from lightning_resctl.surgery import patch_residuals
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

K, C = 4, 12  # merges per chain, width (small: the compiled regions and the chains stay cheap)


def _cpu_backends(method: str) -> list:
    """The CPU backends ``method`` accepts (None: the rule has no backend option)."""
    if "backend" not in get_merge_rule(method).option_names():
        return [None]
    out = []
    for backend in ("reference", "torch-eager", "torch-compiled"):
        if backend == "torch-compiled" and not cpu_compile_available():
            continue
        try:
            make_rule(method, {"backend": backend})
        except ValueError:  # the rule does not have this backend
            continue
        out.append(backend)
    return out


def _distinct(methods) -> list:
    """One name per distinct rule configuration ("mgr" and "mgr-competitive" are the same rule)."""
    seen, out = set(), []
    for m in methods:
        rule = make_rule(m)
        key = (type(rule), repr(sorted(rule.options().items())))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _cases() -> list:
    """(name, backend) per distinct rule configuration and CPU backend; the compiled region (the same math, seconds
    of compile time per graph) for the first configuration of each rule class only."""
    out, compiled = [], set()
    for m in _distinct(merge_rules()):
        for b in _cpu_backends(m):
            if b == "torch-compiled":
                if get_merge_rule(m).rule_class in compiled:
                    continue
                compiled.add(get_merge_rule(m).rule_class)
            out.append((m, b))
    return out


CASES = _cases()


def _drive(method: str, backend, autocast: bool, compile_with: str | None = None):
    """Run K merges of ``method`` on fp32 tensors (forward and backward inside the autocast region when
    ``autocast``; the merges inside ``torch.compile(backend=compile_with)`` when given); returns (what the
    model sees after each merge, gradients of inputs and rule parameters)."""
    torch.manual_seed(0)
    rule = make_rule(method, {} if backend is None else {"backend": backend})
    x = torch.randn(3, 5, C, requires_grad=True)
    us = [(0.5 * torch.randn(3, 5, C)).requires_grad_() for _ in range(K)]
    if rule.kind == "chain":
        module = rule.build_chain(C, K)
    else:
        module = rule.build_merge_sized(-1, C)  # (what the patch builds: a rule with parameters needs C)
    params = [] if module is None else list(module.parameters())
    with torch.no_grad():  # away from the init (zero queries would make every product exact)
        for p in params:
            p.add_(0.5 * torch.randn_like(p))

    def merges(x, *us):
        outs = []
        if rule.kind == "chain":
            state = rule.start(module, x)
            for k in range(K):
                state, h = rule.step(module, k, state, us[k], k + 1)
                outs.append(h)
        else:
            s = x
            for u in us:
                s = rule.merge(module, s, u, None)
                outs.append(s)
        return outs

    run = merges if compile_with is None else torch.compile(merges, backend=compile_with, fullgraph=True)
    weight = torch.linspace(-1.0, 1.0, C)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = run(x, *us)
        loss = sum((h * weight).sum() for h in outs)
        grads = torch.autograd.grad(loss, [x, *us, *params])
    return outs, grads


def _assert_same(got, want):
    (outs, grads), (ref_outs, ref_grads) = got, want
    for k, (a, b) in enumerate(zip(outs, ref_outs)):
        assert a.dtype == torch.float32, f"merge {k}: {a.dtype}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"output of merge {k}: {m}")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"gradient {i}: {m}")


@pytest.mark.parametrize("method,backend", CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_rule_math_is_fp32_under_bf16_autocast(method, backend):
    _assert_same(_drive(method, backend, autocast=True), _drive(method, backend, autocast=False))


@pytest.mark.parametrize("method,backend", [("hc", None), ("rescontroller", "torch-eager")])
def test_rule_math_is_fp32_under_autocast_inside_torch_compile(method, backend):
    """torch.compile traces the backward graph under the forward's autocast state: a plain-autograd rule (hc)
    and a closed-form one (rescontroller) still give the fp32 outputs and gradients."""
    _assert_same(_drive(method, backend, autocast=True, compile_with="aot_eager"),
                 _drive(method, backend, autocast=False))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(C), nn.Linear(C, C)) for _ in range(3))

    def forward(self, x):  # x: the fp32 stream (an embedding would give bf16 under autocast)
        for blk in self.blocks:
            x = x + blk(x)
        return x


@pytest.mark.parametrize("method", list(merge_rules()))
def test_branches_keep_autocast_in_a_patched_model(method):
    """Only the merge leaves autocast: the branch's Linear still runs in bf16 inside the patched forward, and
    the merged stream keeps its dtype (fp32), as ``x + blk(x)`` does under autocast."""
    model = _Net()
    patch_residuals(model, method=method, example_input=(torch.randn(2, 5, C),))
    seen = []
    handles = [blk[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype)) for blk in model.blocks]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 5, C))
    for h in handles:
        h.remove()
    assert seen == [torch.bfloat16] * 3
    assert out.dtype == torch.float32
