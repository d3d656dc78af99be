"""LAuReL nn.Modules: :class:`LaurelMerge` (one merge's parameters and its merge; formula: :mod:`.reference`),
:class:`LaurelChain` (``laurel-pa``: one chain's merges), its state (:class:`LaurelState`) and the merge a site runs
(:class:`LaurelPosition`)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor, nn

from ..base import ChainPosition
from ..common import init_generator
from .config import LaurelConfig, LaurelPAConfig
from .reference import laurel_reference, orthogonal_down_init, rw_weights_reference

__all__ = ["LaurelMerge", "LaurelChain", "LaurelState", "LaurelPosition", "laurel_start", "laurel_step",
           "laurel_skip"]


class LaurelMerge(nn.Module):
    """One LAuReL merge of width ``width`` (``dim``: the stream's feature dim, -1 or 1 for channels-first).

    Parameters (as the variant has them): ``laurel_rw`` ``(2,)`` or ``(2, C)`` (the RW logits a, b: zeros);
    ``laurel_down`` ``(P, r, C)`` (A: column-orthogonal or Xavier) and ``laurel_up`` ``(P, C, r)`` (B: zeros), with
    P = 1, or the PA history k (a pair per previous activation); ``laurel_norm_weight`` ``(P, C)`` (lr_norm: ones);
    ``laurel_gamma`` ``(k,)`` (PA: zeros for the identity h, ones for low-rank h). Xavier draws from a generator of
    its own seeded with ``seed`` (the rule's: :func:`~..common.init_seed`; the global RNG is not touched). The
    options come whole as ``config`` (:class:`~.config.LaurelConfig` or :class:`~.config.LaurelPAConfig`)."""

    def __init__(self, width: int, config: LaurelConfig, dim: int = -1, seed: int = 0):
        super().__init__()
        config.validate()
        self.width, self.dim, self.config, self.seed = int(width), int(dim), config, int(seed)
        parts = set(config.variant.split("+"))
        self.rw, self.lr, self.pa = "rw" in parts, "lr" in parts, "pa" in parts
        self.history = config.history if self.pa else 1
        C, r, P = self.width, config.rank, self.history
        if self.rw:
            self.laurel_rw = nn.Parameter(torch.empty((2, C) if config.rw_per_dim else (2,)))
        if self.lr:
            self.laurel_down = nn.Parameter(torch.empty(P, r, C))
            self.laurel_up = nn.Parameter(torch.empty(P, C, r))
            if config.lr_norm:
                self.laurel_norm_weight = nn.Parameter(torch.empty(P, C))
        if self.pa:
            self.laurel_gamma = nn.Parameter(torch.empty(P))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.rw:
            self.laurel_rw.zero_()
        if self.lr:
            down = self.laurel_down
            g = init_generator(self.seed)
            P, r, C = down.shape
            for j in range(P):
                if self.config.lr_init == "orthogonal":
                    down[j].copy_(orthogonal_down_init(r, C, down.dtype, down.device))
                else:  # Xavier uniform: U(+-sqrt(6 / (fan_in + fan_out)))
                    bound = (6.0 / (r + C)) ** 0.5
                    down[j].copy_((torch.rand(r, C, generator=g, dtype=torch.float64) * 2 - 1) * bound)
            self.laurel_up.zero_()
            if self.config.lr_norm:
                self.laurel_norm_weight.fill_(1.0)
        if self.pa:
            self.laurel_gamma.fill_(1.0 if self.lr else 0.0)

    def weights(self) -> tuple[Tensor, Tensor]:
        """``(alpha, beta)`` (1, 1 without RW)."""
        if not self.rw:
            one = torch.ones((), dtype=torch.float32)
            return one, one
        return rw_weights_reference(self.laurel_rw, self.config.rw_norm)

    def forward(self, stream: Tensor, update: Tensor, earlier: Sequence[Tensor] = ()) -> Tensor:
        """``x_{i+1}`` from the stream ``x_i``, the update and (PA) the earlier streams ``(x_{i-1}, ..)``."""
        moved = self.dim not in (-1, stream.dim() - 1)
        if moved:
            stream, update = stream.movedim(self.dim, -1), update.movedim(self.dim, -1)
            earlier = [h.movedim(self.dim, -1) for h in earlier]
        out = laurel_reference(
            stream, update, rw=self.laurel_rw if self.rw else None, rw_norm=self.config.rw_norm,
            down=self.laurel_down if self.lr else None, up=self.laurel_up if self.lr else None,
            norm_weight=self.laurel_norm_weight if self.lr and self.config.lr_norm else None,
            gamma=self.laurel_gamma if self.pa else None, earlier=earlier, eps=self.config.eps)
        return out.movedim(-1, self.dim) if moved else out

    def extra_repr(self) -> str:
        c = self.config
        return (f"width={self.width}, variant={c.variant!r}, rank={c.rank}"
                + (f", history={self.history}" if self.pa else "") + f", rw_norm={c.rw_norm!r}")


class LaurelChain(nn.Module):
    """``laurel-pa``'s chain: ``merges[i]`` (:class:`LaurelMerge`) of each of its ``num_merges`` merges."""

    def __init__(self, dim: int, num_merges: int, config: LaurelPAConfig, seed: int = 0):
        super().__init__()
        self.dim, self.num_merges, self.history = int(dim), int(num_merges), config.history
        self.merges = nn.ModuleList(LaurelMerge(dim, config, seed=seed + i) for i in range(num_merges))

    def reset_parameters(self) -> None:
        for m in self.merges:
            m.reset_parameters()

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_merges={self.num_merges}, history={self.history}"


class LaurelState(NamedTuple):
    """``laurel-pa``'s state between merges: the streams entering the latest merges, newest first (at most the
    history k: ``(x_i, x_{i-1}, ..)``; ``x_i`` is what the model sees) and, in eager code, their version counters
    when recorded (the model holds them: a stream it writes in place after the chain recorded it is refused)."""

    streams: tuple
    versions: tuple = ()


def _check_unwritten(state: LaurelState) -> None:
    if not state.versions or torch.compiler.is_compiling():
        return
    for j, (s, v) in enumerate(zip(state.streams, state.versions)):
        if s._version != v:
            raise RuntimeError(
                f"method='laurel-pa': the model wrote in place into the stream {j} merge(s) back after the chain "
                "recorded it, and the next merge reads it as a previous activation: write that residual addition "
                "out of place (x = x + f(x), not x += f(x)); the chain keeps the streams, not copies")


def laurel_start(x: Tensor) -> LaurelState:
    """The state entering the chain's first merge: its input, the one stream so far."""
    return LaurelState((x,), () if torch.compiler.is_compiling() or x.is_inference() else (x._version,))


def _advance(history: int, state: LaurelState, out: Tensor) -> tuple:
    """The state after a merge that returned ``out``, and what the model gets: a view of ``out`` (the model never
    holds the state's own tensor, which a checkpointed region's entry for it would keep alive)."""
    streams = (out, *state.streams[:history - 1])
    if torch.compiler.is_compiling() or not state.versions or out.is_inference():
        return LaurelState(streams, ()), out.view_as(out)
    return LaurelState(streams, (out._version, *state.versions[:history - 1])), out.view_as(out)


def laurel_step(merge: LaurelMerge, history: int, state: LaurelState, u: Tensor) -> tuple:
    """Merge ``u`` with ``merge``'s parameters over the state's streams: ``(state', h)``."""
    _check_unwritten(state)
    x, *earlier = state.streams
    return _advance(history, state, merge(x, u, earlier))


def laurel_skip(history: int, state: LaurelState) -> tuple:
    """Ablation *(choice)*: the merge is removed, as a per-merge rule's (the stream passes unchanged; it is the
    stream entering the next merge)."""
    return _advance(history, state, state.streams[0])


class LaurelPosition(ChainPosition):
    """Merge ``k`` of a ``laurel-pa`` chain as its site runs it: its merge module and the history k, no position —
    past the first k - 1 merges (a shorter history) every merge runs the same graph in blocks compiled one by one."""

    shares_graphs = True

    def __init__(self, rule, chain: LaurelChain, k: int, next_k: int):
        super().__init__(rule, chain, k, next_k)
        self.__dict__["merge"] = chain.merges[k]
        self.history = chain.history

    def step(self, state, u):
        return laurel_step(self.merge, self.history, state, u)

    def skip(self, state):
        return laurel_skip(self.history, state)
