"""``mgr`` (and ``mgr-competitive`` / ``mgr-independent``): Multi-Gate Residuals as a chain rule.

The math and the modules are :mod:`lightning_resctl.mgr` (``MGRChain``: n gated streams per token,
an AttnPool per merge, an output pool); this module wires the chain into the registry. The chain
state is the stream tensor ``S (..., m, C)``; what the model sees after merge ``k`` is the pool that
merge ``next_k`` reads (fused into the step when ``next_k == k + 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import ChainRule, check_choice, check_finite, check_int, check_positive


@dataclass
class MGRConfig:
    """Options of ``mgr`` (see docs/rules/mgr.md; constants marked "ours" there are the project's choices).

    streams: n >= 2 parallel streams per token.
    gating: "competitive" (softmax with a forget logit) or "independent" (sigmoid per stream).
    invert: fallback inversion in the backward (True, False, "auto": fp32/fp64 streams, not under torch.compile).
    backend: "auto" (Triton on CUDA, else torch), "torch" (on CPU one compiled region per direction when a C++
        compiler is present), "torch-eager", "torch-compiled", "triton" ("native" is an alias) or "reference"
        (the oracle).
    b_base, l_base, beta_init_max: depth-aware gate-bias init.
    invert_top_p, invert_threshold, invert_max_gain: rows the inversion saves exactly.
    eps: RMSNorm epsilon.
    """

    streams: int = 4
    gating: str = "competitive"
    invert: object = "auto"
    backend: str = "auto"
    b_base: float = -3.0
    l_base: int = 21
    beta_init_max: float = 0.5
    invert_top_p: float = 0.05
    invert_threshold: float = 0.5
    invert_max_gain: float = 8.0
    eps: float = 1e-6


class MGRRule(ChainRule):
    Config = MGRConfig
    description = "Multi-Gate Residuals: n gated streams per token, AttnPool read, depth-aware gate init"
    chain_attr = "_resctl_mgr"

    def validate(self, config):
        from ..mgr import BACKENDS, GATINGS

        check_int("streams", config.streams, 2)
        check_choice("gating", config.gating, GATINGS)
        check_choice("invert", config.invert, (True, False, "auto"))
        check_choice("backend", config.backend, BACKENDS)
        check_finite("b_base", config.b_base)
        check_int("l_base", config.l_base, 1)
        check_positive("beta_init_max", config.beta_init_max)
        check_positive("eps", config.eps)

    def summary(self):
        return f"n={self.config.streams}"

    def build_chain(self, dim, num_merges):
        from ..mgr import MGRChain

        return MGRChain(dim=dim, num_merges=num_merges, **self.options())

    def start(self, chain, x):
        streams, _ = chain.start(x)
        return streams

    def step(self, chain, k, state, u, next_k):
        streams, h = chain.step(k, state, u)
        if next_k != k + 1:
            streams, h = self._pass(chain, k, streams, next_k)
        return streams, h

    def skip(self, chain, k, state, next_k):
        streams, h = chain.skip(k, state)
        if next_k != k + 1:
            streams, h = self._pass(chain, k, streams, next_k)
        return streams, h

    def _pass(self, chain, k, streams, next_k):
        """Merges k+1..next_k-1 do not run in this forward: each leaves the streams as they are (an
        accumulating one appends a zero stream, keeping the stream count); then the pool of next_k."""
        for j in range(k + 1, next_k):
            streams, _ = chain.skip(j, streams)
        return streams, self._read(chain, next_k, streams)

    @staticmethod
    def _read(chain, j, streams):
        from ..mgr import attn_pool_reference

        query = chain.merges[j].pool_query if j < chain.num_merges else chain.output_pool.pool_query
        h, _ = attn_pool_reference(streams, query, chain.eps)
        return h.to(streams.dtype)

    def streams(self, chain, state):
        return state

    def make_stats(self, num_depths, model):
        from ..metrics import MGRStats

        return MGRStats(num_depths, self.config.streams)

    def observe(self, stats, depth, site, position, stream, update, state):
        if state is None:
            return
        chain = site.chain_module
        k = int(position)
        beta = forget = None
        if not chain.merges[k].accumulating:
            beta, forget = chain.gate_values(k, state)
        pool = chain.pool_weights(k, state)
        stats.update(depth, streams=state, beta=beta, forget=forget, pool=pool)
