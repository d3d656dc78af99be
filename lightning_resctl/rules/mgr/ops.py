"""The fused MGR step (merge k + the AttnPool of merge k+1) as one autograd Function.

* torch path: :func:`torch_step_forward` / :func:`torch_step_backward` — a few fused torch ops per step and
  the closed-form backward (formulas in :func:`torch_step_backward`);
* Triton path: ``lightning_resctl.kernels.mgr`` (one fused kernel per direction, ``torch.library`` ops);
* :class:`MGRStepFn` dispatches to either and, with a :class:`~.inversion.InvertRun`, saves only what the
  fallback inversion needs;
* :func:`mgr_step` is the one public dispatch of a step to the backends (reference, torch, Triton) that
  :class:`~.modules.MGRChain` calls; :func:`check_step_backend` checks a backend name where a chain is configured.

The math is stated (and implemented as the oracle) in :mod:`.reference`.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ...runtime.autograd import autocast_off, refuse_second_derivative, refuse_transforms
from ...runtime.backends import exporting_for_training, resolve_backend, torch_mode
from ...runtime.regions import CompiledMath
from ...runtime.triton import load_kernels, triton_available
from ..common import check_rule_backend, compute_dtype
from .inversion import InvertRun, output_streams, reconstruct_inputs, select_exact
from .reference import mgr_step_reference

__all__ = ["MGRStepFn", "TieZeroGrad", "tie_zero_grad", "torch_step_forward", "torch_step_backward", "mgr_step",
           "check_step_backend", "MGRState", "TracedInvertStep", "traced_invert_step", "close_carry"]


def _gates_from_logits(z: Tensor, forget_bias: Optional[Tensor]) -> Tensor:
    if forget_bias is None:
        return torch.sigmoid(z)
    f = forget_bias.to(z.dtype).reshape(1, 1).expand(z.shape[0], 1)
    return torch.softmax(torch.cat([f, z], dim=-1), dim=-1)[:, 1:].contiguous()  # beta is saved, masked, reshaped


def _rsqrt_mean_sq(x: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim (one pass, no temporary)."""
    c = x.shape[-1]
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square_().div_(c).add_(eps))


def torch_step_forward(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
                        gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], eps: float):
    """streams (..., m, C), u (..., C).

    Returns ``out (..., m', C), h (..., C)`` (fresh tensors, not views) and, flattened over the leading dims,
    ``beta (T, m) | None, a (T, m'), stats`` where ``stats`` holds the per-row fp32 quantities the closed-form
    backward reuses: ``(r, q.s, r', w.s')`` (r, q.s None when accumulating), r = 1/rms."""
    lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    cd = compute_dtype(streams)
    inv = 1.0 / math.sqrt(c)
    if gate_query is None:
        out = torch.cat([streams, u.unsqueeze(-2)], dim=-2)
        beta = r = pq = None
    else:
        s = streams.to(cd).reshape(-1, m, c)
        r = _rsqrt_mean_sq(s, eps)
        pq = s @ gate_query.to(cd)
        z = pq * r * inv + gate_bias.to(cd)
        beta = _gates_from_logits(z, forget_bias)
        full = streams.to(cd)
        out = torch.lerp(full, u.to(cd).unsqueeze(-2).expand_as(full), beta.reshape(*lead, m, 1)).to(streams.dtype)
    of = out.to(cd).reshape(-1, out.shape[-2], c)
    r2 = _rsqrt_mean_sq(of, eps)
    p2 = of @ next_query.to(cd)
    a = torch.softmax(p2 * r2 * inv, dim=-1)
    # no out=: a training-mode export records the call as aten ops and runs them with grad
    h = torch.bmm(a.unsqueeze(1), of).view(*lead, c)
    return out, h.to(streams.dtype), beta, a, (r, pq, r2, p2)


def torch_step_backward(streams: Tensor, u: Optional[Tensor], beta: Optional[Tensor], a: Tensor,
                         out: Optional[Tensor], stats, next_query: Tensor, gate_query: Optional[Tensor],
                         forget_bias: Optional[Tensor], grad_out: Optional[Tensor], grad_h: Optional[Tensor],
                         eps: float):
    """Closed-form backward of :func:`torch_step_forward` (flat shapes). ``out`` and ``stats`` may be None
    (recomputed). Returns ``(d_streams, d_u, d_gate_query, d_gate_bias, d_forget_bias, d_next_query)``.

    Pool: ``G_i = dS'_i + a_i dh + k_i (w - (w.s'_i) r'_i^2 s'_i / C)`` with ``k = a (da - sum a da) r' / sqrt(C)``,
    ``da_i = dh.s'_i``; lerp: ``dS_i = (1 - beta_i) G_i + cz_i (q - (q.s_i) r_i^2 s_i / C)``,
    ``du = sum beta_i G_i``, ``dbeta_i = G_i.(u - s_i)``, ``cz = dz r / sqrt(C)`` with dz the gate-logit grads."""
    t, m, c = streams.shape
    cd = compute_dtype(streams)
    inv = 1.0 / math.sqrt(c)
    gated = gate_query is not None
    s = streams.to(cd)
    if out is None:
        if gated:
            out = torch.lerp(s, u.to(cd).unsqueeze(1).expand_as(s), beta.unsqueeze(-1)).to(streams.dtype)
        else:
            out = torch.cat([streams, u.unsqueeze(1)], dim=1)
    of = out.to(cd)
    r, pq, r2, p2 = stats if stats is not None else (None, None, None, None)
    # --- next pool: h = sum a_i s'_i, a = softmax(w . RMSNorm(s'_i) / sqrt(C))
    if grad_h is not None:
        dh = grad_h.to(cd)
        wq = next_query.to(cd)
        if r2 is None:
            r2 = _rsqrt_mean_sq(of, eps)
            p2 = of @ wq
        da = torch.linalg.vecdot(of, dh.unsqueeze(1))  # (batched matvecs via bmm are slow on CPU)
        coef = a * (da - (a * da).sum(-1, keepdim=True)) * r2 * inv
        # G = dS' + a dh + coef w - coef (w.s') r'^2 / C s': pointwise (fused when compiled); a baddbmm with an
        # inner size of 2 is an unfused library call that costs more than the rest of the backward at small C
        g = torch.addcmul(grad_out.to(cd), a.unsqueeze(-1), dh.unsqueeze(1)) if grad_out is not None else \
            a.unsqueeze(-1) * dh.unsqueeze(1)
        g.addcmul_(coef.unsqueeze(-1), wq)
        g.addcmul_((coef * p2 * r2 * r2 / -c).unsqueeze(-1), of)
        d_next = (coef.reshape(1, -1) @ of.reshape(-1, c)).reshape(c).to(next_query.dtype)
    else:
        g = grad_out.to(cd).clone() if grad_out is not None else torch.zeros_like(of)
        d_next = torch.zeros_like(next_query)
    if not gated:
        du = g[:, m].to(u.dtype if u is not None else streams.dtype)
        return g[:, :m].to(streams.dtype), du, None, None, None, d_next
    # --- lerp + gates
    uf = u.to(cd)
    du = torch.bmm(beta.unsqueeze(1), g).squeeze(1)
    dbeta = torch.linalg.vecdot(g, uf.unsqueeze(1)) - torch.linalg.vecdot(g, s)
    if forget_bias is None:
        dz = dbeta * beta * (1.0 - beta)
        d_forget = None
    else:
        sb = (beta * dbeta).sum(-1, keepdim=True)
        dz = beta * (dbeta - sb)
        d_forget = (-(1.0 - beta.sum(-1)) * sb.squeeze(-1)).sum().to(forget_bias.dtype)
    q = gate_query.to(cd)
    if r is None:
        r = _rsqrt_mean_sq(s, eps)
        pq = s @ q
    cz = dz * r * inv
    ds = g.mul_((1.0 - beta).unsqueeze(-1))
    ds.addcmul_(cz.unsqueeze(-1), q)
    ds.addcmul_((cz * pq * r * r / -c).unsqueeze(-1), s)
    d_q = (cz.reshape(1, -1) @ s.reshape(-1, c)).reshape(c).to(gate_query.dtype)
    d_bias = dz.sum(0)
    return ds.to(streams.dtype), du.to(u.dtype), d_q, d_bias, d_forget, d_next


#: (forward, backward) of the torch path for a torch_mode: eager ops, or one compiled region each
#: (lightning_resctl.runtime.backends)
_torch_fns = CompiledMath(torch_step_forward, torch_step_backward, rule="mgr")


def _triton_inversion(kernels, run: Optional[InvertRun], gated: bool, beta_shape):
    """The kernels' :class:`Inversion` settings of a gated step of ``run`` (None: no inversion)."""
    if run is None or not gated:
        return None
    return kernels.Inversion(run.gain_for(beta_shape), run.top_p, run.threshold, run.max_gain)


class MGRStepFn(torch.autograd.Function):
    """One step (merge + next pool) with a closed-form backward, on the torch path or the Triton kernels (one
    launch forward, two backward: ``kernels/mgr.py``); optionally with the fallback inversion.

    ``cfg = (mode, eps, run, k, last)``: ``mode`` "triton" or the torch path's ("eager" / "compiled" /
    "background"); ``run`` the chain's :class:`InvertRun` or None (save the input streams as usual). Gradients of
    unused outputs are not materialised (a backward without dS' or dh reads neither)."""

    @staticmethod
    def forward(ctx, streams, u, next_query, gate_query, gate_bias, forget_bias, cfg):
        mode, eps, run, k, last = cfg
        ctx.set_materialize_grads(False)
        gated = gate_query is not None
        lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
        params = (next_query, gate_query, gate_bias, forget_bias)
        ctx.cfg, ctx.shapes, ctx.u_dtype = cfg, (lead, m, c), u.dtype
        if mode == "triton":
            kernels = load_kernels("mgr")
            out, h, beta, a, exact = kernels.step_forward(streams, u, *params, eps,
                                                          _triton_inversion(kernels, run, gated, (*lead, m)))
            stats = (None, None, None, None)
            rows = (None, None)
            if exact is not None:
                run.gain = exact.gain
                rows = (exact.slot, exact.exact)
        else:
            with autocast_off(streams.device.type):
                out, h, beta, a, stats = _torch_fns(mode)[0](streams, u, *params, eps)
            stats = stats if stats is not None else (None, None, None, None)
            rows = (None, None)
            if run is not None and gated:
                sel = select_exact(streams.reshape(-1, m, c), beta, run.gain_for(beta.shape), run.top_p,
                                   run.threshold, run.max_gain)
                run.gain = sel.gain
                rows = (sel.index, sel.exact)
        if run is None:
            ctx.save_for_backward(streams, u, beta, a, *stats, *params)
            return out, h
        ctx.deliver = run.claim(streams)
        saved_out = out if last else None
        ctx.save_for_backward(u if gated else None, beta, a, *rows, saved_out, *stats, *params)
        if not last:
            run.outputs[k] = (weakref.ref(out), out.detach(), out._version)
        ctx.run = run
        return out, h

    @staticmethod
    def backward(ctx, grad_out, grad_h):
        refuse_second_derivative("MGR (fused step)", "backend='reference'")
        mode, eps, run, k, last = ctx.cfg
        lead, m, c = ctx.shapes
        rows = None
        if run is None:
            streams, u, beta, a, r, pq, r2, p2, *params = ctx.saved_tensors
            out = None
        else:
            u, beta, a, i0, i1, saved_out, r, pq, r2, p2, *params = ctx.saved_tensors
            out = output_streams(run, k, saved_out)
            if params[1] is None:  # accumulating: the inputs are the output's first m streams, u its last
                streams, u = out[..., :m, :], out[..., m, :]
                if ctx.deliver is not None:
                    run.slots[ctx.deliver] = streams
            else:
                streams, rows = None, (i0, i1)
        deliver = run is not None and ctx.deliver is not None and rows is not None
        if mode == "triton":
            kernels = load_kernels("mgr")
            exact = kernels.ExactRows(None, *rows) if rows is not None else None
            ds, du, dq, db, df, dw, rebuilt = kernels.step_backward(
                out if rows is not None else streams, u, beta, a, *params, grad_out, grad_h, eps, exact=exact,
                deliver=deliver, du_dtype=ctx.u_dtype)
        else:
            with autocast_off(u.device.type):
                ds, du, dq, db, df, dw, rebuilt = _torch_backward(mode, streams, u, beta, a, out, rows,
                                                                  (r, pq, r2, p2), params, grad_out, grad_h, eps,
                                                                  (lead, m, c))
        if deliver:
            run.slots[ctx.deliver] = rebuilt
        return ds, du, dw, dq, db, df, None


def _torch_backward(mode, streams, u, beta, a, out, rows, stats, params, grad_out, grad_h, eps, shapes):
    """:class:`MGRStepFn`'s backward on the torch path (flat shapes inside): the inputs rebuilt from ``out`` when
    ``rows`` (the exact rows) are given; returns the gradients in the caller's shapes and the rebuilt inputs."""
    lead, m, c = shapes
    next_query, gate_query, gate_bias, forget_bias = params
    rebuilt = None
    if rows is not None:  # s = (s' - beta u) / (1 - beta); the exact rows put back
        out2 = out.reshape(-1, m, c)
        s2 = reconstruct_inputs(out2, u.reshape(-1, c), beta, *rows)
        rebuilt = s2.reshape(*lead, m, c)
    else:
        s2 = streams.reshape(-1, m, c)
        out2 = None if out is None else out.reshape(-1, out.shape[-2], c)
    if grad_out is not None:
        grad_out = grad_out.reshape(-1, grad_out.shape[-2], c)
    if grad_h is not None:
        grad_h = grad_h.reshape(-1, c)
    stats = None if stats[2] is None else stats
    ds, du, dq, db, df, dw = _torch_fns(mode)[1](s2, u.reshape(-1, c), beta, a, out2, stats, next_query, gate_query,
                                                 forget_bias, grad_out, grad_h, eps)
    return ds.reshape(*lead, m, c), du.reshape(*lead, c), dq, db, df, dw, rebuilt


def check_step_backend(name) -> str:
    """A step backend name in its canonical form (``"native"`` -> ``"triton"``); refuses ``"triton"`` where Triton
    cannot run, and imports the Triton kernels (registering their ops) when the name resolves to them, outside any
    ``torch.compile`` trace."""
    name = check_rule_backend(name)
    if name == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs a CUDA device or TRITON_INTERPRET=1")
    if resolve_backend(name, None) == "triton":
        load_kernels("mgr")
    return name


def mgr_step(streams: Tensor, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
             gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], *, gating: str, eps: float, backend: str,
             claim_run: Callable[[Tensor], Optional[InvertRun]], k: int, last: bool) -> tuple[Tensor, Tensor]:
    """One MGR step (merge k, then the pool read after it) on the resolved ``backend`` ("reference", "triton" or
    a "torch" variant): ``(streams', h_next)``.

    "reference" (and a non-Triton step while ``torch.export`` traces for training) runs the oracle under plain
    autograd; the others refuse ``torch.func`` transforms and forward-mode AD, then ``claim_run(streams)`` gives
    the chain's :class:`~.inversion.InvertRun` (None: save the input streams as usual), and :class:`MGRStepFn` runs
    the torch math (eager or compiled on CPU) or the kernels. Under ``torch.compile`` a Triton step is the fused
    ``torch.library`` op (one opaque op per direction)."""
    if backend == "reference" or (backend != "triton" and exporting_for_training(streams, u, next_query, gate_query,
                                                                                 gate_bias, forget_bias)):
        return mgr_step_reference(streams, u, next_query, gate_query, gate_bias, forget_bias, gating, eps)
    refuse_transforms(f"MGR (fused step, backend={backend!r})", "backend='reference'", streams, u, next_query,
                      gate_query, gate_bias, forget_bias)
    run = claim_run(streams)
    if run is None and backend == "triton" and torch.compiler.is_compiling():
        out, h, _, _ = load_kernels("mgr").mgr_step(streams, u, next_query, gate_query, gate_bias, forget_bias, eps)
        return out.view_as(out), h
    # "torch" on CPU: one compiled region per direction when a C++ compiler is present (lightning_resctl.runtime.
    # backends); under torch.compile the mode is "eager" and dynamo inlines the Function: the compiler traces the
    # step and its closed-form backward
    mode = "triton" if backend == "triton" else torch_mode(backend, streams)
    out, h = MGRStepFn.apply(streams, u, next_query, gate_query, gate_bias, forget_bias, (mode, eps, run, k, last))
    if torch.compiler.is_compiling():
        # the chain hands ``out`` to the next merge, also across checkpointed blocks' subgraphs: as the Function's
        # own output dynamo cannot lift it into the next block's subgraph, as a view made here it can
        out = out.view_as(out)
    return out, h


# ---------------------------------------------------------------------------------------------- inversion, traced
class MGRState(NamedTuple):
    """The chain's state between merges when the inversion runs under ``torch.compile`` (the rule's path): the
    ``streams``, the last merge's ``carry`` (an output that takes no memory, its "gradient" the streams the next
    merge's backward rebuilds: how the rebuilt streams reach the merge before, through autograd itself, so that the
    compiler traces the inversion into the backward graph and saves no merge's input streams) and the running error
    ``gain`` of the rows saved exactly. Eager code keeps the streams as the state (:class:`~.inversion.InvertRun`
    does this bookkeeping there)."""

    streams: Tensor
    carry: Optional[Tensor]
    gain: Optional[Tensor]


class TracedInvertStep(torch.autograd.Function):
    """One step with the fallback inversion as traced code (``torch.compile``: dynamo inlines it): the torch math
    forward, the exact rows chosen in static shapes (:func:`~.inversion.select_exact`); saved: u, beta, a, the exact
    rows and their indices (and the last merge's output); the per-row statistics are taken again in the backward.
    The backward rebuilds the inputs from the output streams it gets as the carry's gradient (or, the last merge, its
    own), and returns them as the gradient of the carry it took.

    ``cfg = (eps, last, top_p, threshold, max_gain)``."""

    @staticmethod
    def forward(ctx, streams, u, next_query, gate_query, gate_bias, forget_bias, carry, gain, cfg):
        eps, last, top_p, threshold, max_gain = cfg
        ctx.set_materialize_grads(False)
        lead, m, c = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
        params = (next_query, gate_query, gate_bias, forget_bias)
        with autocast_off(streams.device.type):
            out, h, beta, a, _ = torch_step_forward(streams, u, *params, eps)
        gated = gate_query is not None
        index = exact = gain_out = None
        if gated:
            sel = select_exact(streams.reshape(-1, m, c), beta, gain, top_p, threshold, max_gain)
            index, exact, gain_out = sel.index, sel.exact, sel.gain
        # the per-row statistics are not saved: the backward takes them of the rebuilt streams (fused there)
        ctx.save_for_backward(u if gated else None, beta, a, index, exact, out if last else None, *params)
        ctx.shapes, ctx.eps, ctx.carried = (lead, m, c), eps, carry is not None
        ctx.u_dtype = u.dtype
        # the carry: an expanded scalar (no memory) the next merge takes; its gradient is this merge's output
        new_carry = out.new_zeros(()).expand(out.shape)
        if gain_out is None:  # an accumulating merge (they come before every gated one): no gain yet
            gain_out = a.new_zeros(())
        ctx.mark_non_differentiable(gain_out)
        return out, h, new_carry, gain_out

    @staticmethod
    def backward(ctx, grad_out, grad_h, rebuilt_out, _grad_gain):
        refuse_second_derivative("MGR (fused step)", "backend='reference'")
        u, beta, a, index, exact, saved_out, *params = ctx.saved_tensors
        lead, m, c = ctx.shapes
        out = saved_out if saved_out is not None else rebuilt_out
        if out is None:
            raise RuntimeError("MGR inversion under torch.compile: the output streams of a merge did not come back "
                               "in the backward (the merge after it did not run its backward); build the chain with "
                               "invert=False for this use")
        rows = None
        if params[1] is None:  # accumulating: the inputs are the output's first m streams, u its last
            streams, u = out[..., :m, :], out[..., m, :]
            rebuilt = streams
        else:
            streams, rows = None, (index, exact)
        with autocast_off(out.device.type):
            ds, du, dq, db, df, dw, rebuilt_gated = _torch_backward("eager", streams, u, beta, a, out, rows,
                                                                    (None,) * 4, params, grad_out, grad_h, ctx.eps,
                                                                    (lead, m, c))
        if rows is not None:
            rebuilt = rebuilt_gated
        return (ds, du.to(ctx.u_dtype), dw, dq, db, df, rebuilt if ctx.carried else None, None, None)


class CloseCarry(torch.autograd.Function):
    """Hands ``streams`` on to code that is not the next inverting merge (a skipped merge, a pool, the chain's
    diagnostics): saves them and returns them as the carry's gradient (the merge before then rebuilds its inputs
    from them). Identity forward."""

    @staticmethod
    def forward(ctx, streams, carry):
        ctx.save_for_backward(streams)
        return streams.view_as(streams)

    @staticmethod
    def backward(ctx, grad):
        (streams,) = ctx.saved_tensors
        return grad, streams


def close_carry(state: MGRState) -> Tensor:
    """The streams of a traced inversion's state, for code other than the next inverting merge."""
    return state.streams if state.carry is None else CloseCarry.apply(state.streams, state.carry)


def traced_invert_step(state: MGRState, u: Tensor, next_query: Tensor, gate_query: Optional[Tensor],
                       gate_bias: Optional[Tensor], forget_bias: Optional[Tensor], *, eps: float, last: bool,
                       top_p: float, threshold: float, max_gain: float) -> tuple[MGRState, Tensor]:
    """One step of a chain whose inversion runs under ``torch.compile`` (:class:`TracedInvertStep`):
    ``(state', h_next)``."""
    out, h, carry, gain = TracedInvertStep.apply(state.streams, u, next_query, gate_query, gate_bias, forget_bias,
                                                 state.carry, state.gain, (eps, last, top_p, threshold, max_gain))
    # the state goes on to the next merge, also across checkpointed blocks' subgraphs: as views made here (not the
    # Function's own outputs) dynamo can lift them into the next subgraph (as mgr_step's streams)
    return MGRState(out.view_as(out), carry.view_as(carry), gain.view_as(gain) if gain.dim() else None), h


class TieZeroGrad(torch.autograd.Function):
    """Identity on ``x`` that gives ``p`` an exact zero gradient (merge 0's pool sees one stream, so its
    softmax is 1 whatever its query: the true gradient is 0; this keeps the parameter 'used' for DDP)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.p_meta = (p.shape, p.dtype, p.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.p_meta
        return g, torch.zeros(shape, dtype=dtype, device=device)


def tie_zero_grad(x: Tensor, p: Tensor) -> Tensor:
    """``x``, with ``p`` given an exact zero gradient (:class:`TieZeroGrad`). Under ``torch.export`` (whose
    program records an ``autograd.Function``'s forward only, and would leave ``p`` without a gradient) the same as
    plain ops: ``x + 0 * sum(p)``."""
    if torch.compiler.is_exporting():
        return x + p.sum() * 0.0
    return TieZeroGrad.apply(x, p)
