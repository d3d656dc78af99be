"""One merge of a frame chain (``hc``, ``mhc``, ``mhc-lite``) as one autograd Function that keeps no streams.

Merge k writes the streams and the merge read next (``next_k``) reads them (:mod:`.frame`)::

    S'   = res_k S + post_k u_k                       (frame_write: S'[t] = sum_s res_k[t, s] S[s] + post_k[t] u_k)
    pre', res', post' = coefficients_next(S')          (the reader's norm, projection, Sinkhorn / permutation mix)
    h    = sum_s pre'[s] S'[s]                        (frame_read; the chain's output: reduce(S'))

Plain autograd saves S, S' and the coefficient math's intermediates (several n·C per token and merge).
:class:`FrameStepFn` saves u_k, res_k, post_k and the reader's parameters, and recomputes the streams in the
backward from the **anchor** — the streams entering the first merge of the merge's *recompute group*, kept once per
group of ``recompute_every`` merges (DeepSeek's mHC recomputation) — through the **tape** of the group's earlier
merges::

    S_g = anchor;   S_{j+1} = res_j S_j + post_j u_j     (j = g .. k-1: the tape's (res_j, post_j, u_j))

The backward is the closed form of the write and the vector-Jacobian product of the read (``torch.func.vjp`` of the
reader's coefficients, recomputed from S')::

    dS' += vjp(read)(dh, dres', dpost')
    dS[s] = sum_t res_k[t, s] dS'[t]        dres_k[t, s] = dS'[t] . S[s]
    dpost_k[t] = dS'[t] . u_k               du_k = sum_t post_k[t] dS'[t]

so a whole-model ``torch.compile`` traces the recomputation into its backward graph (no Python state between the
merges' backwards) and saves per merge u_k and the coefficients, plus one anchor per group. The mixing is written as
multiply-adds over the streams (no batched n x n matmul, which a compiler cannot fuse with its neighbours). The
gradients equal plain autograd's (the same values recomputed; tests/test_rule_hc.py).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from ..runtime.autograd import autocast_off, traced_under_saved_tensor_hooks

__all__ = ["FrameState", "FrameStepFn", "Reader", "mix_streams", "frame_step", "replays"]


class FrameState(NamedTuple):
    """The chain state between merges: the streams, the ``res``/``post`` of the merge that reads the state next
    (computed when its branch input was read; None: not computed yet), and how the streams are rebuilt in the
    backward: ``anchor`` (None: the streams are their own anchor, the first merge of a recompute group), the
    ``tape`` of ``(res, post, u)`` of the group's merges since, and ``every``, the merges per group (1: every merge
    keeps its streams; the chain's ``recompute_every``, or 1 where its merges run in graphs compiled one block at a
    time, whose state must keep one structure from block to block)."""

    streams: Tensor
    res: Optional[Tensor]
    post: Optional[Tensor]
    anchor: Optional[Tensor] = None
    tape: tuple = ()
    every: int = 1


def mix_streams(weights: Tensor, streams: Tensor) -> Tensor:
    """``out[t] = sum_s weights[t, s] streams[s]`` for ``weights (..., m, n)`` and ``streams (..., n, C)``, in
    ``weights``' dtype: n multiply-adds of broadcast rows (one fused kernel under a compiler; no ``(m, n, C)``
    temporary in eager, unlike an ``einsum`` broadcast). With one-hot weights the result is bitwise the selected
    stream, as a product with the identity is."""
    s = streams.to(weights.dtype)
    out = weights[..., :, 0:1] * s[..., 0:1, :]
    for j in range(1, s.shape[-2]):
        out = out.addcmul(weights[..., :, j:j + 1], s[..., j:j + 1, :])
    return out


def _pair_dots(a: Tensor, b: Tensor) -> Tensor:
    """``out[t, s] = a[t] . b[s]`` over the last dim for ``a (..., m, C)``, ``b (..., n, C)``: one reduction of the
    broadcast product where a compiler fuses it, n row reductions in eager (no ``(m, n, C)`` temporary)."""
    if torch.compiler.is_compiling():
        return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)
    return torch.stack([(a * b[..., j:j + 1, :]).sum(-1) for j in range(b.shape[-2])], dim=-1)


def _after(t: Tensor, grad: Optional[Tensor]) -> Tensor:
    """``t`` itself, made to depend on ``grad`` while a compiler traces the backward: ``where(c, t, t)`` is ``t``
    whatever ``c``, and a ``c`` read from one element of the incoming gradient makes the recomputation that starts
    here a backward computation. (Otherwise AOTAutograd's partitioner sees it depends on saved values only and may
    move it into the forward graph, saving its intermediates — the streams' norm — instead of recomputing them.)"""
    if grad is None or not torch.compiler.is_compiling():
        return t
    first = grad.reshape(-1)[:1]
    return torch.where(first == first, t, t)


def _write(streams: Tensor, res: Tensor, post: Tensor, u: Tensor) -> Tensor:
    out = mix_streams(res, streams).addcmul(post.unsqueeze(-1), u.to(res.dtype).unsqueeze(-2))
    return out.to(streams.dtype)


def _reduce(streams: Tensor, reduce: str) -> Tensor:
    s = streams.to(torch.float64 if streams.dtype == torch.float64 else torch.float32)
    return (s.sum(-2) if reduce == "sum" else s.mean(-2)).to(streams.dtype)


def _reduce_grad(d_h: Tensor, streams: Tensor, reduce: str) -> Tensor:
    """The gradient :func:`_reduce` gives ``streams`` for ``d_h`` (each stream's: ``d_h``, or ``d_h / n``)."""
    g = d_h.to(torch.float64 if streams.dtype == torch.float64 else torch.float32).unsqueeze(-2)
    g = g.expand_as(streams) if reduce == "sum" else g.expand_as(streams) / streams.shape[-2]
    return g.to(streams.dtype)


def _read(pre: Tensor, streams: Tensor) -> Tensor:
    return (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(-2).to(streams.dtype)


class Reader:
    """A frame layer as :class:`FrameStepFn` calls it: the layer (whose ``forward`` is its ``coefficients``, see
    :class:`~.frame.FrameLayer`) and its parameters' names, for ``torch.func.functional_call``."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.names = tuple(name for name, _ in layer.named_parameters())

    def params(self) -> tuple:
        return tuple(p for _, p in self.layer.named_parameters())

    def coefficients(self, streams: Tensor, *params: Tensor):
        """``(pre, res, post)`` of the layer on ``streams``, with ``params`` standing in for its parameters."""
        return torch.func.functional_call(self.layer, dict(zip(self.names, params)), (streams,))

    def read(self, streams: Tensor, *params: Tensor):
        """``(h, res, post)``: the read of ``streams`` and the coefficients of the merge it feeds."""
        pre, res, post = self.coefficients(streams, *params)
        return _read(pre, streams), res, post

    def write(self, streams: Tensor, *params: Tensor):
        """``(res, post)``: what the layer's own merge writes with."""
        _, res, post = self.coefficients(streams, *params)
        return res, post


def _vjp(fn, primals: tuple, cotangents: tuple) -> tuple:
    """``fn``'s vector-Jacobian product at ``primals`` (``torch.func.vjp``) for ``cotangents`` (None: zero)."""
    outs, vjp = torch.func.vjp(fn, *primals)
    return vjp(tuple(torch.zeros_like(o) if d is None else d.to(o.dtype) for o, d in zip(outs, cotangents)))


class FrameStepFn(torch.autograd.Function):
    """Merge k and the read after it, saving no streams (module docstring). Inputs: ``streams, res, post, u, anchor,
    cfg, *tape (res_j, post_j, u_j flattened), *params, *writer_params`` with ``cfg = (len(tape), reader or None,
    reduce, writer or None)``; ``anchor`` None: the merge starts its group and keeps ``streams`` (one tensor passed
    twice would be refused by dynamo); ``writer`` (the chain's first merge, whose coefficients no read computed
    before): ``res``/``post`` None, computed here from ``streams`` by the merge's own layer. Outputs
    ``(S', h, res', post', res, post)`` (``res'``/``post'`` empty when the merge is the chain's last; ``res``/``post``
    the writer's, for the tape, else empty)."""

    @staticmethod
    def forward(ctx, streams, res, post, u, anchor, cfg, *rest):
        taped, reader, reduce, writer = cfg
        tape, params, wparams = _split(rest, cfg)
        with autocast_off(streams.device.type):
            written = (streams.new_empty(0), streams.new_empty(0))  # (two tensors: one returned twice confuses dynamo)
            if writer is not None:
                # copies saved and copies returned: dynamo refuses a saved view of an intermediate, or an output saved
                res, post = (t.clone() for t in writer.write(streams, *wparams))
                written = (res.clone(), post.clone())
            out = _write(streams, res, post, u)
            if reader is None:
                h, res1, post1 = _reduce(out, reduce), res.new_empty(0), post.new_empty(0)
            else:
                h, res1, post1 = reader.read(out, *params)
        ctx.cfg = cfg
        ctx.save_for_backward(res, post, u, streams if anchor is None else anchor, *tape, *params, *wparams)
        return out, h, res1, post1, *written

    @staticmethod
    def backward(ctx, d_out, d_h, d_res1, d_post1, _d_res, _d_post):  # (the written res/post: recomputations only)
        taped, reader, reduce, writer = ctx.cfg
        res, post, u, anchor, *rest = ctx.saved_tensors
        tape, params, wparams = _split(rest, ctx.cfg)
        with autocast_off(res.device.type):
            streams = _after(anchor, d_out if d_out is not None else d_h)
            for j in range(taped):
                streams = _write(streams, *tape[3 * j:3 * j + 3])
            out = _write(streams, res, post, u)
            # the gradient of S' (of S below) summed in its own dtype, as autograd sums a tensor's gradients: the
            # same rounding as the plain-autograd frame (a bf16 stream's), then the write's math in fp32
            g = torch.zeros_like(out) if d_out is None else d_out
            d_params = (None,) * len(params)
            if reader is None:
                if d_h is not None:
                    g = g + _reduce_grad(d_h, out, reduce)
            else:
                d_read = _vjp(reader.read, (out, *params), (d_h, d_res1, d_post1))
                g = g + d_read[0]
                d_params = tuple(d_read[1:])
            g = g.to(res.dtype)
            d_streams = mix_streams(res.mT, g).to(streams.dtype)
            d_res = _pair_dots(g, streams.to(res.dtype))
            d_post = (g * u.to(res.dtype).unsqueeze(-2)).sum(-1)
            d_u = (post.unsqueeze(-1) * g).sum(-2).to(u.dtype)
            d_wparams = ()
            if writer is not None:  # res and post came from the streams through the merge's own layer
                d_write = _vjp(writer.write, (streams, *wparams), (d_res, d_post))
                d_streams = d_streams + d_write[0]
                d_res = d_post = None
                d_wparams = tuple(d_write[1:])
        return (d_streams, d_res, d_post, d_u, None, None, *(None,) * (3 * taped), *d_params, *d_wparams)


def _split(rest: tuple, cfg: tuple) -> tuple:
    """``(tape, reader params, writer params)`` of :class:`FrameStepFn`'s trailing inputs."""
    taped, reader, _, writer = cfg
    n = len(reader.names) if reader is not None else 0
    tape, rest = rest[:3 * taped], rest[3 * taped:]
    return tape, rest[:n], rest[n:]


def replays() -> bool:
    """Whether a merge may run :class:`FrameStepFn` here: autograd records this forward and no transform or
    forward-mode AD is active (those run the plain-autograd frame, which supports them), nor ``torch.export``
    (whose program records a Function's forward only), nor a graph dynamo traces inside an eager activation
    checkpoint (its backward's ``torch.func.vjp`` cannot be traced under saved-tensor hooks:
    :func:`~lightning_resctl.runtime.autograd.traced_under_saved_tensor_hooks`)."""
    return (torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
            and torch.autograd.forward_ad._current_level < 0 and not torch.compiler.is_exporting()
            and not (torch.compiler.is_compiling() and traced_under_saved_tensor_hooks()))


def frame_step(state: FrameState, u: Tensor, writer: Reader, reader: Optional[Reader], reduce: str
               ) -> tuple[FrameState, Tensor]:
    """Merge ``u`` into ``state`` with the merge's ``res``/``post`` (the state's, or computed by ``writer``, the
    merge's own layer, when it has none), read by ``reader`` (None: the chain's output, ``reduce``):
    ``(state', h)`` through :class:`FrameStepFn`, the streams recomputed in groups of ``state.every`` merges."""
    tape = state.tape
    flat = tuple(t for entry in tape for t in entry)
    params = reader.params() if reader is not None else ()
    writes = state.res is None
    cfg = (len(tape), reader, reduce, writer if writes else None)
    out, h, res1, post1, *written = FrameStepFn.apply(state.streams, state.res, state.post, u, state.anchor, cfg,
                                                      *flat, *params, *(writer.params() if writes else ()))
    res, post = written if writes else (state.res, state.post)
    if torch.compiler.is_compiling():
        # the state carries these to the next merge, also out of a checkpoint dynamo traces (a higher-order op): as
        # the Function's own outputs dynamo cannot lift them there, as views made here it can (as MGR's step does)
        out, res1, post1, res, post = (t if t is None else t.view_as(t) for t in (out, res1, post1, res, post))
    every = state.every
    if reader is None:
        return FrameState(out, None, None, every=every), h
    tape = tape + ((res, post, u),)
    if len(tape) >= every:  # the next merge starts a group: its streams are its anchor
        return FrameState(out, res1, post1, every=every), h
    anchor = state.streams if state.anchor is None else state.anchor
    return FrameState(out, res1, post1, anchor, tape, every), h
