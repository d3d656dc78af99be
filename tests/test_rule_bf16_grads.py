"""Under bf16 the rules' parameter gradients are computed in fp32 (issue 27 item 4).

A rule parameter's gradient is a sum over tokens, ``g = sum_t g_t``; some of them cancel strongly (``hc``'s
``hc_scale``, MGR's ``forget_bias``: ``|g|`` can be a few % of ``sum_t |g_t|``), so comparing a bf16 *model's*
gradient with an fp32 model's mostly measures the model's bf16 noise, amplified by that cancellation. This test
isolates the rule's own rounding: it drives each rule on the same bf16 inputs (the branch outputs a bf16 model
gives it) and upstream gradients, once as a bf16-mixed run does (inside ``torch.autocast``, backward included) and
once in fp64, and measures the difference on the scale of the sum of the per-token terms ``||sum_t |g_t| ||``:

* rule math in fp32: the difference is fp32 rounding, ~1e-7 of that scale;
* any part of the gradient in bf16: ~1e-3 of it (bf16's unit roundoff is 3.9e-3), whatever the cancellation.

The whole-model-bf16 run (parameters and the carried stream state in bf16) is the positive control: its stored
bf16 state shows at ~1e-3 of the scale, so the measure does resolve bf16 rounding."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from lightning_resctl.rules import make_rule, merge_rules
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

C, K, N = 16, 5, 12  # width, merges, tokens
FP32_MATH = 1e-5     # the autocast run's difference / the per-token scale (measured <= 5.4e-7; bf16 math: ~1e-3)
BF16_STATE = 5e-5    # the whole-bf16 control must exceed this (measured >= 2e-4): the measure resolves bf16


def _rule_and_module(method):
    rule = make_rule(method)
    if rule.kind == "chain":
        mod = rule.build_chain(C, K)
    else:
        merges = [rule.build_merge_sized(-1, C) for _ in range(K)]  # (what the patch builds)
        mod = None if any(m is None for m in merges) else torch.nn.ModuleList(merges)
    if mod is None or not list(mod.parameters()):
        return rule, None
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the init (hc_scale's gradient is exactly 0 there: tanh(0 @ x) = 0)
        for p in mod.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return rule, mod


def _param_grads(rule, mod, x, updates, upstream, ctx=contextlib.nullcontext()):
    """Drive the rule over ``updates`` from ``x``; loss = sum_k <h_k, upstream_k> (h_k: what merge k+1's branch
    reads; the last: the chain output). Forward and backward inside ``ctx``. Returns {name: grad (fp64)}."""
    mod.zero_grad(set_to_none=True)
    with ctx:
        loss = 0
        if rule.kind == "chain":
            state = rule.start(mod, x)
            for k, u in enumerate(updates):
                state, h = rule.step(mod, k, state, u, k + 1)
                loss = loss + (h.double() * upstream[k]).sum()
        else:
            h = x
            for k, u in enumerate(updates):
                h = rule.merge(mod[k], h, u, None)
                loss = loss + (h.double() * upstream[k]).sum()
        loss.backward()
    return {n: p.grad.double().clone() for n, p in mod.named_parameters() if p.grad is not None}


def _per_token_scale(rule, mod64, x, updates, upstream):
    """``sum_t |g_t|`` per parameter, in fp64: every rule's math is per token, so token t's term is the gradient
    with the upstream gradients of the other tokens zeroed."""
    scale = None
    for t in range(N):
        mask = torch.zeros(N, 1, dtype=torch.float64)
        mask[t] = 1.0
        g = _param_grads(rule, mod64, x, updates, [d * mask for d in upstream])
        scale = {n: v.abs() for n, v in g.items()} if scale is None else {n: scale[n] + g[n].abs() for n in g}
    return scale


#: rules whose merges are linear in the streams: the gradient of the first merge's parameters reads only the drive's
#: inputs (bf16 values in both runs) through constant Jacobians, so no bf16 state can show in the control there
LINEAR_IN_STREAMS = ("laurel", "laurel-pa")


def _reads_no_rounded_state(method: str, name: str) -> bool:
    return method in LINEAR_IN_STREAMS and name.split(".")[-2] == "0"


@pytest.mark.parametrize("method", merge_rules())
def test_rule_parameter_gradients_are_fp32_math_under_bf16(method):
    rule, mod = _rule_and_module(method)
    if mod is None:
        pytest.skip(f"{method} has no parameters")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, C, generator=g).bfloat16()
    updates = [(0.5 * torch.randn(N, C, generator=g)).bfloat16() for _ in range(K)]
    upstream = [(torch.randn(N, C, generator=g) / N).bfloat16().double() for _ in range(K)]
    up64 = [u.double() for u in updates]

    mod64 = copy.deepcopy(mod).double()
    ref = _param_grads(rule, mod64, x.double(), up64, upstream)
    scale = _per_token_scale(rule, mod64, x.double(), up64, upstream)
    # bf16-mixed: fp32 stream and parameters, bf16 branch outputs, autocast around forward and backward
    mixed = _param_grads(rule, mod, x.float(), updates, upstream, torch.autocast("cpu", dtype=torch.bfloat16))
    # whole model in bf16 (the control): bf16 parameters and state; its reference has the same bf16 parameters
    mod_bf16 = copy.deepcopy(mod).bfloat16()
    whole = _param_grads(rule, mod_bf16, x, updates, upstream)
    ref_bf16 = _param_grads(rule, copy.deepcopy(mod_bf16).double(), x.double(), up64, upstream)
    ref_bf16_scale = _per_token_scale(rule, copy.deepcopy(mod_bf16).double(), x.double(), up64, upstream)

    assert set(mixed) == set(ref) == set(scale)
    cancel, errs, controls = {}, {}, {}
    for name in ref:
        s = scale[name].norm()
        if s == 0:  # a parameter this drive does not reach (MGR merge 0's pool query reads the one stream)
            assert ref[name].abs().max() == 0 and mixed[name].abs().max() == 0, name
            continue
        cancel[name] = (ref[name].norm() / s).item()
        errs[name] = ((mixed[name] - ref[name]).norm() / s).item()
        controls[name] = ((whole[name] - ref_bf16[name]).norm() / ref_bf16_scale[name].norm()).item()
    bad = {n: e for n, e in errs.items() if not e < FP32_MATH}
    assert not bad, f"{method}: part of these gradients is not fp32 math under autocast (difference / scale): {bad}"
    weak = {n: c for n, c in controls.items() if not c > BF16_STATE and not _reads_no_rounded_state(method, n)}
    assert not weak, f"{method}: the measure does not resolve the whole-bf16 run's rounding: {weak}"
