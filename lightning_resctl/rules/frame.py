"""The frame the hyper-connection family (``hc``, ``mhc``, ``mhc-lite``) shares, written once.

* the **common "pre / res / post" frame** of the hyper-connection family (docs/rules/hc.md): n streams
  per token ``S (..., n, C)``; sub-layer j has coefficients ``pre_j (n)``, ``res_j (n, n)``, ``post_j (n)``
  computed from ``S_j``::

      h_j        = sum_s pre_j[s] S_j[s]                      (frame_read)
      S_{j+1}[t] = sum_s res_j[t, s] S_j[s] + post_j[t] u_j    (frame_write; row t = output stream t)

  :class:`FrameChain` holds one coefficient module per merge (each with ``coefficients(S)`` and
  ``reset_parameters()``); :class:`FrameRule` is the chain-rule runtime for any such family (HC, mHC,
  mHC-lite differ only in their coefficient modules); its diagnostics: :class:`~.stats.FrameStats`.

Surgery mapping (site k receives u_k): the chain input x is expanded into n copies; the coefficients of
merge k are computed lazily from the streams entering it (the *reader* owns them: after merge k the model
sees ``h_{next_k}``, computed with merge ``next_k``'s parameters from the new streams, and ``res/post`` of
``next_k`` are stashed for its merge); the last merge returns ``reduce(S_K)`` (sum or mean over streams).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..runtime.autograd import autocast_off
from .base import ChainPosition, ChainRule
from .checks import check_choice, check_eps, check_int
from .common import compute_dtype
from .frame_step import FrameState, Reader, frame_step, mix_streams, replays

__all__ = ["FrameState", "FrameChain", "FrameLayer", "RECOMPUTE_EVERY", "FramePosition", "FrameRule", "frame_read",
           "frame_write", "frame_reduce",
           "frame_step_reference", "frame_chain_reference", "gated_pre_post", "pm_one", "check_frame_options",
           "REDUCES"]

REDUCES = ("sum", "mean")


# ---------------------------------------------------------------------------------------------- frame math
def frame_step_reference(streams: Tensor, u: Optional[Tensor], pre: Tensor, res: Tensor, post: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """The frame of one layer (the oracle), in the coefficients' dtype::

        h        = sum_s pre[s] S[s]
        S'[t]    = sum_s res[t, s] S[s] + post[t] u       (u None: the update is dropped)

    ``streams`` (..., n, C); ``pre``/``post`` (..., n); ``res`` (..., n, n), row = output stream.
    Returns ``(h (..., C), S' (..., n, C))``."""
    cd = pre.dtype
    s = streams.to(cd)
    with autocast_off(s.device.type):
        h = torch.einsum("...s,...sc->...c", pre, s)
        out = torch.einsum("...ts,...sc->...tc", res, s)
    if u is not None:
        out = out + post.unsqueeze(-1) * u.to(cd).unsqueeze(-2)
    return h, out


def frame_read(pre: Tensor, streams: Tensor) -> Tensor:
    """``h = sum_s pre[s] S[s]``, accumulated in the coefficients' dtype, returned in the streams' dtype.

    Elementwise products and a sum (no matmul): with one-hot ``pre`` the result is bitwise the selected
    stream, on every device (no TF32)."""
    h = (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(-2)
    return h.to(streams.dtype)


def frame_write(streams: Tensor, res: Tensor, post: Tensor, u: Optional[Tensor]) -> Tensor:
    """``S'[t] = post[t] u + sum_s res[t, s] S[s]`` in the coefficients' dtype, returned in the streams' dtype.

    n multiply-adds of broadcast rows (:func:`~.frame_step.mix_streams`: one fused kernel under a compiler, no batched
    n x n matmul) and one of ``u``, in the coefficients' dtype (autocast does not reach elementwise math): autograd
    saves ``S`` (in that dtype), ``u`` and the coefficients, never an (n, n, C) product; with ``res = I``,
    ``post = 1`` the result is bitwise ``S[t] + u`` (a product with the identity is exact: one rounding, as the plain
    residual)."""
    cd = res.dtype
    acc = mix_streams(res, streams)
    if u is not None:
        acc = torch.addcmul(acc, post.unsqueeze(-1), u.to(cd).unsqueeze(-2))
    return acc.to(streams.dtype)


def pm_one(n: int, j: int, ref: Tensor) -> Tensor:
    """+1 at stream ``j mod n``, -1 elsewhere (FFTYYY's bias init of pre and post; mHC and mHC-lite)."""
    v = torch.full((n,), -1.0, dtype=ref.dtype, device=ref.device)
    v[j % n] = 1.0
    return v


def gated_pre_post(m: Tensor, alpha: Tensor, bias: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The mHC / mHC-lite head of the projection ``m (..., 2n + r) = [pre | post | res]``::

        z = m * (a_pre x n, a_post x n, a_res x r) + b;  pre = sigmoid(z[:n]);  post = 2 sigmoid(z[n:2n])

    Returns ``(pre, post, res logits z[2n:])`` in ``m``'s dtype."""
    a = alpha.to(m.dtype)
    r = m.shape[-1] - 2 * n
    scale = torch.cat([a[0:1].expand(n), a[1:2].expand(n), a[2:3].expand(r)])
    z = m * scale + bias.to(m.dtype)
    return torch.sigmoid(z[..., :n]), 2 * torch.sigmoid(z[..., n:2 * n]), z[..., 2 * n:]


def frame_reduce(streams: Tensor, reduce: str) -> Tensor:
    """The chain output: ``sum_s S[s]`` (``"sum"``) or the mean, accumulated in fp32, in the streams' dtype."""
    s = streams.to(compute_dtype(streams))
    out = s.sum(-2) if reduce == "sum" else s.mean(-2)
    return out.to(streams.dtype)


def frame_chain_reference(layers, x: Tensor, branches, reduce: str = "sum") -> tuple[Tensor, list]:
    """A whole frame chain as the hc/mHC papers write it (the oracle of the runtime): ``S_0 = n copies of x``;
    sub-layer 0 reads x (the surgery's convention); sub-layer j >= 1 reads ``h_j``; returns
    ``(reduce(S_K), [h_0, ..., h_{K-1}])`` in the coefficients' dtype."""
    n = layers[0].streams
    s = x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])
    hs = []
    for j, (layer, f) in enumerate(zip(layers, branches)):
        pre, res, post = layer.coefficients(s)
        h, _ = frame_step_reference(s, None, pre, res, post)
        h = x.to(h.dtype) if j == 0 else h
        hs.append(h)
        _, s = frame_step_reference(s, f(h), pre, res, post)
    s = s.to(compute_dtype(s))
    return (s.sum(-2) if reduce == "sum" else s.mean(-2)), hs


# ---------------------------------------------------------------------------------------------- chain + rule
class FrameLayer(nn.Module):
    """One layer's parameters of a frame rule: subclasses implement ``coefficients(S) -> (pre, res, post)`` and
    ``reset_parameters()``; ``forward`` is ``coefficients`` (what the recomputing step calls through
    ``torch.func.functional_call``)."""

    def coefficients(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.coefficients(streams)


class FrameChain(nn.Module):
    """One chain of a frame rule: ``merges[j]`` (a :class:`FrameLayer`) holds layer j's parameters and computes its
    coefficients."""

    def __init__(self, dim: int, num_merges: int, streams: int, reduce: str, merges: list):
        super().__init__()
        self.dim, self.num_merges, self.streams, self.reduce = int(dim), int(num_merges), int(streams), reduce
        self.merges = nn.ModuleList(merges)

    def reset_parameters(self) -> None:
        for m in self.merges:
            m.reset_parameters()

    def coefficients(self, j: int, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(pre (..., n), res (..., n, n), post (..., n))`` of layer j on the streams entering it (fp32)."""
        return self.merges[j].coefficients(streams)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_merges={self.num_merges}, streams={self.streams}, reduce={self.reduce!r}"


class FramePosition(ChainPosition):
    """Merge ``k`` of a frame chain: its layer (``res``/``post`` when the state has none stashed) and the layer of
    merge ``next_k``, which reads the new streams (None: ``h`` is the chain's output, the streams reduced). Holds
    the two layer modules and the reduce, no position: every middle merge of a chain runs the same graph."""

    shares_graphs = True

    def __init__(self, rule, chain, k, next_k):
        super().__init__(rule, chain, k, next_k)
        self.__dict__["layer"] = chain.merges[k]
        self.__dict__["reader"] = None if self.output else chain.merges[next_k]
        self.__dict__["write_fn"] = Reader(chain.merges[k])
        self.__dict__["read_fn"] = None if self.output else Reader(chain.merges[next_k])
        self.reduce = chain.reduce

    def step(self, state, u):
        if replays():  # one Function, saving u and the coefficients, the streams recomputed (frame_step.py)
            return frame_step(state, u, self.write_fn, self.read_fn, self.reduce)
        res, post = state.res, state.post
        if res is None:
            _, res, post = self.layer.coefficients(state.streams)
        return self._read(frame_write(state.streams, res, post, u), state.every)

    def skip(self, state):
        return self._read(state.streams, state.every)

    def _read(self, streams, every):
        if self.reader is None:
            return FrameState(streams, None, None, every=every), frame_reduce(streams, self.reduce)
        pre, res, post = self.reader.coefficients(streams)
        return FrameState(streams, res, post, every=every), frame_read(pre, streams)


#: Merges per recompute group (``recompute_every``): the streams entering a group's first merge are kept for the
#: backward, the group's other streams recomputed from them (frame_step.py; 4 is DeepSeek's sqrt(nL / (n + 2)) for
#: n = 4 streams and L = 24 merges). Ours.
RECOMPUTE_EVERY = 4


def check_frame_options(config) -> None:
    """The options every frame rule has: ``streams`` (an int >= 1), ``reduce``, ``eps``, ``recompute_every`` (an
    int >= 1) (its configs call this)."""
    check_int("streams", config.streams, 1)
    check_choice("reduce", config.reduce, REDUCES)
    check_eps("eps", config.eps)
    check_int("recompute_every", config.recompute_every, 1)


class FrameRule(ChainRule):
    """Chain-rule runtime of the pre/res/post frame. Subclasses set ``Config`` (with ``streams``, ``reduce``,
    ``eps``, ``recompute_every``; its ``validate()`` calls :func:`check_frame_options`) and implement
    :meth:`build_layer`, which returns a :class:`FrameLayer` (its ``coefficients(S)``)."""

    #: how the streams are kept for the backward, not what the merges compute: any value loads a checkpoint
    execution_options = ("recompute_every",)

    def summary(self):
        return f"n={self.config.streams}"

    def build_layer(self, index: int, dim: int) -> nn.Module:
        raise NotImplementedError

    def build_chain(self, dim, num_merges):
        layers = [self.build_layer(j, dim) for j in range(num_merges)]
        return FrameChain(dim, num_merges, self.config.streams, self.config.reduce, layers)

    # ---- runtime
    def start(self, chain, x):
        n = chain.streams
        return FrameState(x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]), None, None,
                          every=self.config.recompute_every)

    def start_apart(self, chain, x):
        """:meth:`start` for merges compiled a block at a time: every merge keeps its own streams (a recompute
        group's tape would give the state entering a block another structure per position in its group: a graph
        each)."""
        return self.start(chain, x)._replace(every=1)

    def position(self, chain, k, next_k):
        return FramePosition(self, chain, k, next_k)

    def step(self, chain, k, state, u, next_k):
        return self.position(chain, k, next_k).step(state, u)

    def skip(self, chain, k, state, next_k):
        """Ablation *(choice)*: layer k is removed — the streams pass unchanged (no res mix, no update);
        the next reader computes its coefficients from them."""
        return self.position(chain, k, next_k).skip(state)

    def streams(self, chain, state):
        return state.streams if isinstance(state, FrameState) else state

    def stage_state(self, chain, state=None, *, packed=None):
        """The n streams ``(..., n, C)`` and, once the next merge's branch input was read, that merge's ``res (..., n,
        n)`` and ``post (..., n)`` (what it merges with; not computed again on the next stage)."""
        if packed is None:
            return (state.streams,) if state.res is None else (state.streams, state.res, state.post)
        streams, res, post = (*packed, None, None) if len(packed) == 1 else packed
        return FrameState(streams, res, post)

    # ---- diagnostics
    def make_stats(self, num_depths, model):
        from .stats import FrameStats  # torchmetrics: imported when diagnostics are asked for

        return FrameStats(num_depths, self.config.streams, prefix=self.stats_prefix)

    stats_prefix = "hc"

    def observe(self, stats, depth, site, position, stream, update, state):
        if state is None:
            return
        s = state.streams if isinstance(state, FrameState) else state
        pre, res, post = site.chain_module.coefficients(int(position), s.detach())
        stats.update(depth, pre=pre, res=res, post=post)
