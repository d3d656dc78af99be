"""``mgr`` (and ``mgr-competitive`` / ``mgr-independent``): Multi-Gate Residuals as a chain rule.

The math and the modules are in this folder (:mod:`.reference`; :mod:`.modules`: ``MGRChain``, n gated streams per
token, an AttnPool per merge, an output pool); this module wires the chain into the registry. The chain
state is the stream tensor ``S (..., m, C)``; what the model sees after merge ``k`` is the pool that
merge ``next_k`` reads (fused into the step when ``next_k == k + 1``).
"""
from __future__ import annotations

from ..base import ChainRule, register_merge_rule
from .config import MGRConfig
from .modules import MGRChain, MGRPosition
from .ops import MGRState, close_carry
from .reference import attn_pool_reference

__all__ = ["MGRRule"]


class MGRRule(ChainRule):
    Config = MGRConfig
    description = "Multi-Gate Residuals: n gated streams per token, AttnPool read, depth-aware gate init"
    chain_attr = "_resctl_mgr"

    def summary(self):
        return f"n={self.config.streams}"

    def build_chain(self, dim, num_merges):
        return MGRChain(dim=dim, num_merges=num_merges, config=self.config)

    def start(self, chain, x):
        streams, _ = chain.start(x)
        return MGRState(streams, None, None) if chain.inverts_traced(x) else streams

    def position(self, chain, k, next_k):
        if next_k != k + 1:  # merges between that do not run in this mode (rare): the positions read
            return super().position(chain, k, next_k)
        return MGRPosition(self, chain, k, next_k)

    def step(self, chain, k, state, u, next_k):
        streams, h = chain.step(k, state, u)
        if next_k != k + 1:
            streams, h = self._pass(chain, k, streams, next_k)
        return streams, h

    def skip(self, chain, k, state, next_k):
        streams, h = chain.skip(k, _streams_of(state))
        if next_k != k + 1:
            streams, h = self._pass(chain, k, streams, next_k)
        return streams, h

    def _pass(self, chain, k, streams, next_k):
        """Merges k+1..next_k-1 do not run in this forward: each leaves the streams as they are (an
        accumulating one appends a zero stream, keeping the stream count); then the pool of next_k."""
        streams = _streams_of(streams)
        for j in range(k + 1, next_k):
            streams, _ = chain.skip(j, streams)
        return streams, self._read(chain, next_k, streams)

    @staticmethod
    def _read(chain, j, streams):
        query = chain.merges[j].pool_query if j < chain.num_merges else chain.output_pool.pool_query
        h, _ = attn_pool_reference(streams, query, chain.eps)
        return h.to(streams.dtype)

    def streams(self, chain, state):
        return state.streams if isinstance(state, MGRState) else state

    def stage_state(self, chain, state=None, *, packed=None):
        """The streams ``(..., min(k + 1, n), C)`` cross a stage boundary as they are. Rebuilt on the next stage, the
        chain starts a new inversion run for this forward (:meth:`MGRChain.start`: its merges' outputs are this
        microbatch's, never another's in flight). A traced inversion's state (:class:`~.ops.MGRState`) hands its
        streams on as a chain end does (:func:`~.ops.close_carry`: the merge before rebuilds its inputs from them)."""
        if packed is None:
            return (close_carry(state) if isinstance(state, MGRState) else state,)
        (streams,) = packed
        chain.start(streams[..., 0, :])
        return streams

    def make_stats(self, num_depths, model):
        from .stats import MGRStats  # torchmetrics: imported when diagnostics are asked for

        return MGRStats(num_depths, self.config.streams)

    def observe(self, stats, depth, site, position, stream, update, state):
        if state is None:
            return
        state = self.streams(None, state)
        chain = site.chain_module
        k = int(position)
        beta = forget = None
        if not chain.merges[k].accumulating:
            beta, forget = chain.gate_values(k, state)
        pool = chain.pool_weights(k, state)
        stats.update(depth, streams=state, beta=beta, forget=forget, pool=pool)


def _streams_of(state):
    """The streams of a state, for code other than the next inverting merge (:func:`~.ops.close_carry`)."""
    return close_carry(state) if isinstance(state, MGRState) else state


register_merge_rule("mgr", MGRRule)
register_merge_rule("mgr-competitive", MGRRule, gating="competitive",
                    description="Multi-Gate Residuals with competitive gating (softmax with a forget logit)")
register_merge_rule("mgr-independent", MGRRule, gating="independent",
                    description="Multi-Gate Residuals with independent sigmoid gates")
