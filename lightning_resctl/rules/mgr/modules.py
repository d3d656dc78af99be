"""MGR nn.Modules: :class:`MGRPool`, :class:`MGRMerge` (parameters), :class:`MGRChain` (runtime) and
:class:`MGRRun` (a hand-driven pass)."""
from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ...runtime.backends import resolve_backend
from ..base import ChainPosition
from ..checks import check_int, keywords_or_config
from .config import MGRConfig
from .inversion import InvertRun
from .ops import MGRState, check_step_backend, close_carry, mgr_step, tie_zero_grad, traced_invert_step
from .reference import MGRInit, attn_pool_reference, mgr_bias_init, mgr_gates_reference

__all__ = ["MGRPool", "MGRMerge", "MGRPosition", "MGRRun", "MGRChain"]


def _transformed() -> bool:
    """A torch.func transform or a forward-mode AD level is active."""
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


@torch.compiler.assume_constant_result
def _saved_tensor_hooks_active() -> bool:
    """Saved-tensor hooks (activation checkpointing, offloading) are active: read once while tracing, a constant of
    the graph (dynamo cannot trace the query itself)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class MGRPool(nn.Module):
    """The chain's output AttnPool: ``y = sum_i a_i s_i``, ``a = softmax_i(pool_query . RMSNorm(s_i) / sqrt(C))``.

    ``pool_query`` (C,) is zero-initialised: at init the output is the uniform mean of the streams."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = int(dim)
        self.pool_query = nn.Parameter(torch.zeros(self.dim))

    def reset_parameters(self) -> None:
        """The spec init: a zero query (the uniform mean of the streams). Works after ``to_empty``."""
        with torch.no_grad():
            self.pool_query.zero_()

    def forward(self, streams: Tensor) -> Tensor:
        """``streams`` (..., m, C) -> pooled (..., C)."""
        return attn_pool_reference(streams, self.pool_query)[0]

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class MGRMerge(nn.Module):
    """Merge ``index`` of an MGR chain (its parameters; :class:`MGRChain` runs it).

    Parameters: ``pool_query`` (C,) — the AttnPool that builds this merge's branch input; gated merges
    (``accumulating`` False, i.e. ``index >= streams - 1``) also ``gate_query`` (C,), ``gate_bias`` (n,) and,
    for ``gating="competitive"``, ``forget_bias`` (1,) (the spec's scalar f_l, stored 1-d because FSDP2's
    ``fully_shard`` refuses 0-d parameters; a state dict holding it 0-d, as written before, still loads).
    Queries are zero-initialised; biases come from :func:`mgr_bias_init`.
    """

    def __init__(self, index: int, dim: int, streams: int, gating: str = MGRConfig.gating, *,
                 accumulating: bool = False, init: Optional[MGRInit] = None):
        super().__init__()
        self.index, self.dim, self.streams, self.gating = int(index), int(dim), int(streams), gating
        self.accumulating = bool(accumulating)
        self.init = init or MGRInit(0.0, 0.0, 0.0, None)
        self.pool_query = nn.Parameter(torch.empty(self.dim))
        if not self.accumulating:
            self.gate_query = nn.Parameter(torch.empty(self.dim))
            self.gate_bias = nn.Parameter(torch.empty(self.streams))
            if gating == "competitive":
                self.forget_bias = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The spec init: zero queries, gate biases and forget bias from the depth-aware :attr:`init`.

        Exactly the constructor's values, also after ``to_empty`` (meta-device init)."""
        with torch.no_grad():
            self.pool_query.zero_()
            if self.accumulating:
                return
            self.gate_query.zero_()
            self.gate_bias.fill_(float(self.init.gate_bias))
            forget = getattr(self, "forget_bias", None)
            if forget is not None:
                forget.fill_(float(self.init.forget_bias or 0.0))

    def gate_params(self):
        """``(gate_query, gate_bias, forget_bias or None)``; all None for an accumulating merge.

        ``forget_bias`` is returned 0-d (a view of the (1,) parameter).
        """
        if self.accumulating:
            return None, None, None
        forget = getattr(self, "forget_bias", None)
        return self.gate_query, self.gate_bias, None if forget is None else forget.reshape(())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Accept a 0-d ``forget_bias`` (checkpoints written when the parameter was 0-d) as the (1,) parameter."""
        key = prefix + "forget_bias"
        value = state_dict.get(key)
        if isinstance(value, Tensor) and value.dim() == 0 and getattr(self, "forget_bias", None) is not None:
            state_dict[key] = value.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        kind = "accumulating" if self.accumulating else f"gating={self.gating}"
        return f"index={self.index}, dim={self.dim}, streams={self.streams}, {kind}"


class MGRPosition(ChainPosition):
    """Merge ``k`` of an :class:`MGRChain` read next by merge ``k + 1`` (the output pool after the last):
    ``step(streams, u) -> (streams', h_next)``. Holds the merge's and the next pool's modules and what a step reads
    of its position (the stream count entering it, first, last), not the position: every gated merge but the last
    runs the same compiled graph."""

    shares_graphs = True

    def __init__(self, rule, chain: "MGRChain", k: int, next_k: int):
        super().__init__(rule, chain, k, next_k)
        self.__dict__["merge"] = chain.merges[k]
        self.__dict__["reader"] = chain.merges[k + 1] if k + 1 < chain.num_merges else chain.output_pool
        self.count, self.last = chain.stream_count(k), k == chain.num_merges - 1
        self.first_merge = k == 0

    def step(self, streams, u: Tensor) -> tuple:
        """Merge ``u``: append it (an accumulating merge) or gate + lerp it into the streams, then the next pool.
        Returns ``(streams', h_next)``; fused on the Triton path. Under ``torch.compile`` with the inversion the
        state is an :class:`~.ops.MGRState` (the streams and what the inversion carries), returned alike."""
        chain = self.chain
        state = streams if isinstance(streams, MGRState) else None
        if state is not None:
            streams = state.streams
        chain._check_stream_count(streams, self.count, lambda: self.k)
        backend = chain.resolved_backend(streams)
        if isinstance(u, Tensor) and u.dtype != streams.dtype and u.is_floating_point():
            if backend == "triton" and torch.promote_types(u.dtype, streams.dtype) == streams.dtype:
                pass  # u (a bf16 branch output beside fp32 streams) converted in the kernel's registers, exactly
            elif torch.is_autocast_enabled(streams.device.type):
                u = u.to(streams.dtype)  # under autocast a branch returns low precision; the streams keep theirs
            else:  # type promotion as `stream + update` does
                dtype = torch.result_type(streams, u)
                if state is not None and dtype != streams.dtype:  # the inversion's streams change: hand them on
                    streams, state = close_carry(state), None
                streams, u = streams.to(dtype), u.to(dtype)
        chain._check_update(streams, u, exact_dtype=backend != "triton")
        merge = self.merge
        gq, gb, fb = merge.gate_params()
        if self.first_merge and torch.is_grad_enabled() and merge.pool_query.requires_grad and not _transformed():
            u = tie_zero_grad(u, merge.pool_query)  # (for DDP; not under torch.func / forward-mode AD)
        if state is not None:  # the inversion under torch.compile: what it carries flows through the state
            return traced_invert_step(MGRState(streams, state.carry, state.gain), u, self.reader.pool_query, gq, gb,
                                      fb, eps=chain.eps, last=self.last, top_p=chain.invert_top_p,
                                      threshold=chain.invert_threshold, max_gain=chain.invert_max_gain)
        # the position keys the eager inversion's run, which never runs under torch.compile: not read there (a guard)
        k = -1 if torch.compiler.is_compiling() else self.k
        return mgr_step(streams, u, self.reader.pool_query, gq, gb, fb, gating=chain.gating, eps=chain.eps,
                        backend=backend, claim_run=chain._claim_run, k=k, last=self.last)

    def skip(self, streams) -> tuple[Tensor, Tensor]:
        return self.chain.skip(self.k, close_carry(streams) if isinstance(streams, MGRState) else streams)


class MGRRun:
    """One forward pass through an :class:`MGRChain` for hand-written models (see the module docstring).

    ``read()`` -> the pooled input h of the current merge (shape of x); ``write(u)`` merges the branch output
    u (shape of x) and advances; ``end()`` -> the output pool once every merge was written. ``streams`` holds
    the current stream tensor (..., min(k+1, n), C)."""

    def __init__(self, chain: "MGRChain", x: Tensor):
        self.chain = chain
        self.index = 0
        self.streams, self._h = chain.start(x)

    def read(self) -> Tensor:
        """The pooled input of merge ``index`` (after the last merge: the output pool)."""
        return self._h

    def write(self, u: Tensor) -> Tensor:
        """Merge branch output ``u`` as merge ``index``; returns the next pooled input."""
        if self.index >= self.chain.num_merges:
            raise RuntimeError(f"MGR chain used past its end: write() called after all {self.chain.num_merges} "
                               "merges; call end()")
        self.streams, self._h = self.chain.step(self.index, self.streams, u)
        self.index += 1
        return self._h

    def end(self) -> Tensor:
        """The chain's output (output AttnPool of the final streams), shape of x."""
        if self.index != self.chain.num_merges:
            raise RuntimeError(f"MGR chain ended early: end() after {self.index} of {self.chain.num_merges} merges")
        return self._h


class MGRChain(nn.Module):
    """A Multi-Gate-Residual chain of ``num_merges`` merges over ``streams`` (n >= 2) streams of width ``dim``.

    Args:
        dim: feature width C (streams are (..., n, C), features last).
        num_merges: merges in the chain; the first ``streams - 1`` accumulate, the rest are gated
            (``num_gated`` = L of the depth-aware init).
        streams: n >= 2.
        gating: ``"competitive"`` (softmax with a forget logit; gates sum to < 1) or ``"independent"``.
        invert: fallback inversion in the backward: True, False or ``"auto"`` (fp32/fp64 streams; driven by hand,
            not under ``torch.compile``: the rule's path inverts there, :meth:`inverts_traced`).
        backend: ``"auto"``, ``"torch"`` (on CPU the math runs eagerly while one region per direction compiles in
            the background, when a C++ compiler is present; else eager), ``"torch-eager"``, ``"torch-compiled"``
            (the regions compiled before the first call returns), ``"triton"`` (alias ``"native"``) or
            ``"reference"``.
        b_base, l_base, beta_init_max: the depth-aware init (see :func:`mgr_bias_init`).
        invert_top_p, invert_threshold, invert_max_gain: the budget of rows the inversion saves exactly (a fraction
            of a merge's rows) and which rows need it.
        eps: RMSNorm epsilon.
        config: all of these options as one :class:`MGRConfig` instead of the keywords (what the rule passes);
            refused together with an option keyword that differs from its default.

    Runtime: ``start(x) -> (streams, h0)``; ``step(k, streams, u) -> (streams', h_next)``; ``begin(x)`` ->
    :class:`MGRRun`; ``forward(x, branches)`` runs the whole chain with a sequence of branch callables.
    """

    def __init__(self, dim: int, num_merges: int, streams: int = MGRConfig.streams, gating: str = MGRConfig.gating,
                 invert=MGRConfig.invert, backend: str = MGRConfig.backend, *, b_base: float = MGRConfig.b_base,
                 l_base: int = MGRConfig.l_base, beta_init_max: float = MGRConfig.beta_init_max,
                 invert_top_p: float = MGRConfig.invert_top_p, invert_threshold: float = MGRConfig.invert_threshold,
                 invert_max_gain: float = MGRConfig.invert_max_gain, eps: float = MGRConfig.eps,
                 config: Optional[MGRConfig] = None):
        super().__init__()
        keywords = MGRConfig(streams, gating, invert, backend, b_base, l_base, beta_init_max, invert_top_p,
                             invert_threshold, invert_max_gain, eps)
        c = keywords_or_config("MGRChain", keywords, config).validate()
        check_int("dim", dim, 1)
        check_int("num_merges", num_merges, 1)
        self.set_backend(c.backend)
        self.dim, self.num_merges, self.streams, self.gating = dim, num_merges, c.streams, c.gating
        self.invert = c.invert
        self.invert_top_p, self.invert_threshold, self.invert_max_gain = (c.invert_top_p, c.invert_threshold,
                                                                          c.invert_max_gain)
        self.eps = float(c.eps)
        self.num_gated = max(num_merges - (c.streams - 1), 0)
        self.init = mgr_bias_init(self.num_gated, c.streams, c.gating, c.b_base, c.l_base, c.beta_init_max)
        self.init_note: Optional[str] = self.init.note
        self.b_base, self.l_base, self.beta_init_max = c.b_base, c.l_base, c.beta_init_max
        self.merges = nn.ModuleList(MGRMerge(k, dim, c.streams, c.gating, accumulating=k < c.streams - 1,
                                             init=self.init) for k in range(num_merges))
        self.output_pool = MGRPool(dim)
        self._run_ref: Optional[weakref.ref] = None
        self._run_keep: Optional[InvertRun] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_run_ref"] = None  # per-forward inversion state is not part of the module
        state["_run_keep"] = None
        return state

    def reset_parameters(self) -> None:
        """The spec init of every merge and of the output pool (see :meth:`MGRMerge.reset_parameters`)."""
        for merge in self.merges:
            merge.reset_parameters()
        self.output_pool.reset_parameters()

    # ---- configuration
    def set_backend(self, name: str) -> None:
        """Choose ``"auto"``, ``"torch"``, ``"triton"`` (alias ``"native"``), ``"torch-eager"``,
        ``"torch-compiled"`` or ``"reference"`` (see :class:`MGRChain`)."""
        name = check_step_backend(name)
        self.backend = name

    def resolved_backend(self, tensor: Optional[Tensor] = None) -> str:
        """The backend used for ``tensor``: "auto" -> "triton" on CUDA when Triton is available (n <= 8),
        else "torch" (:func:`~lightning_resctl.runtime.backends.resolve_backend`)."""
        return resolve_backend(self.backend, tensor, triton_fits=self.streams <= 8)  # the kernel holds <= 8 streams

    def inverts(self, tensor: Tensor) -> bool:
        """True when a step on ``tensor`` uses the fallback inversion: not with ``invert=False``, without grad
        mode, under ``torch.compile``, on the reference backend, inside a backward pass (checkpoint
        recomputation) or while other saved-tensor hooks are active (activation checkpointing, offloading:
        they decide what is kept); ``invert="auto"`` also needs fp32/fp64 streams."""
        if self.invert is False or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if self.resolved_backend(tensor) == "reference" or torch._C._current_graph_task_id() != -1:
            return False
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is not None and not getattr(hooks[0], "_mgr_transparent", False):
            return False
        if self.invert == "auto":
            return tensor.dtype in (torch.float32, torch.float64)
        return True

    def inverts_traced(self, tensor: Tensor) -> bool:
        """True when a chain starting at ``tensor`` runs the fallback inversion under ``torch.compile`` (the rule's
        path: the state carries what the eager run keeps on the side, :class:`~.ops.MGRState`): while compiling,
        with grad mode, on the torch path (not the Triton op, not the reference), without saved-tensor hooks
        (activation checkpointing decides what is kept), not while ``torch.export`` records (its program keeps no
        ``autograd.Function``'s backward: the step records the reference); ``invert="auto"`` also needs fp32/fp64
        streams."""
        if self.invert is False or not torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return False
        if torch.compiler.is_exporting():
            return False
        if self.resolved_backend(tensor) in ("reference", "triton"):
            return False
        if _saved_tensor_hooks_active():
            return False
        return self.invert is True or tensor.dtype in (torch.float32, torch.float64)

    def next_query(self, k: int) -> Tensor:
        """The pool query read after merge k: merge k+1's ``pool_query``, or the output pool's after the last."""
        return self.merges[k + 1].pool_query if k + 1 < self.num_merges else self.output_pool.pool_query

    def stream_count(self, k: int) -> int:
        """Streams entering merge k: ``min(k + 1, n)`` (k == num_merges: streams after the chain)."""
        return min(k + 1, self.streams)

    # ---- checks
    def _check_index(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"merge index k must be an int, got {type(k).__name__}")
        if not 0 <= k < self.num_merges:
            past = " (the chain is used past its end)" if k >= self.num_merges else ""
            raise IndexError(f"merge index k={k} out of range for a chain of {self.num_merges} merges: "
                             f"valid 0..{self.num_merges - 1}{past}")
        return k

    def _check_streams(self, k: int, streams: Tensor, name: str = "streams") -> None:
        self._check_stream_count(streams, self.stream_count(k), lambda: k, name)

    def _check_stream_count(self, streams: Tensor, want: int, position: Callable[[], int],
                            name: str = "streams") -> None:
        """``streams`` hold ``want`` streams of width C entering merge ``position()`` (read for the message only)."""
        if not isinstance(streams, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(streams).__name__}")
        if streams.dim() < 2 or streams.shape[-1] != self.dim or streams.shape[-2] != want:
            raise ValueError(f"{name} entering merge {position()} must have shape (..., {want}, {self.dim}) "
                             f"(min(k+1, n) streams, features last), got {tuple(streams.shape)}")
        if not streams.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {streams.dtype}")

    def _check_update(self, streams: Tensor, u: Tensor, exact_dtype: bool = True) -> None:
        """u: same leading dims, C, dtype (cast under autocast; ``exact_dtype`` False: any dtype the streams' holds
        exactly, the Triton kernels convert it) and device as the streams."""
        if not isinstance(u, Tensor):
            raise TypeError(f"u must be a Tensor, got {type(u).__name__}")
        want = tuple(streams.shape[:-2]) + (self.dim,)
        if tuple(u.shape) != want:
            raise ValueError(f"u must have shape {want} (the streams' leading dims and C), got {tuple(u.shape)}")
        if not u.is_floating_point():
            raise TypeError(f"u must be floating point, got {u.dtype}")
        if u.dtype != streams.dtype and (exact_dtype or torch.promote_types(u.dtype, streams.dtype) != streams.dtype):
            raise TypeError(f"u dtype {u.dtype} does not match the streams dtype {streams.dtype}")
        if u.device != streams.device:
            raise ValueError(f"u is on {u.device}, the streams on {streams.device}")

    # ---- runtime
    def start(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Begin a chain: ``streams = x[..., None, :]`` (one stream), ``h0 = x`` (merge 0's pool of one stream)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (..., {self.dim}) (features last), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be floating point, got {x.dtype}")
        if self.inverts(x):
            run = InvertRun(self.invert_top_p, self.invert_threshold, self.invert_max_gain)
            self._run_ref = weakref.ref(run)
            self._run_keep = run  # held until the first step hands it to the graph
        return x.unsqueeze(-2), x

    def _claim_run(self, streams: Tensor) -> Optional[InvertRun]:
        """The inversion run a fused step on ``streams`` joins (None: no inversion); once a step holds it, the
        chain lets go of the run :meth:`start` kept."""
        if not self.inverts(streams):
            return None
        run = self._run_ref() if self._run_ref is not None else None
        if run is None:  # a chain driven without start() (or after the graph was freed): begin a new run
            run = InvertRun(self.invert_top_p, self.invert_threshold, self.invert_max_gain)
            self._run_ref = weakref.ref(run)
        self._run_keep = None
        return run

    def step(self, k: int, streams: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """Merge k: append ``u`` (k < n-1) or gate + lerp it into the streams, then the pool of merge k+1
        (the output pool after the last merge). Returns ``(streams', h_next)``; fused on the Triton path."""
        k = self._check_index(k)
        return MGRPosition(None, self, k, k + 1).step(streams, u)

    def skip(self, k: int, streams: Tensor) -> tuple[Tensor, Tensor]:
        """Ablation of merge k's branch: gated merges leave the streams unchanged; accumulating merges append a
        zero stream (keeping the stream count). Returns ``(streams', h_next)`` with the next pool applied."""
        k = self._check_index(k)
        self._check_streams(k, streams)
        if self.merges[k].accumulating:
            streams = torch.cat([streams, torch.zeros_like(streams[..., :1, :])], dim=-2)
        h, _ = attn_pool_reference(streams, self.next_query(k), self.eps)
        return streams, h

    def begin(self, x: Tensor) -> MGRRun:
        """Start a hand-driven pass: ``run = chain.begin(x)``; then ``run.read()`` / ``run.write(u)`` per merge
        and ``y = run.end()``."""
        return MGRRun(self, x)

    def forward(self, x: Tensor, branches: Sequence[Callable[[Tensor], Tensor]]) -> Tensor:
        """Run the whole chain: merge k's branch is ``branches[k]`` (called on the pooled input)."""
        if len(branches) != self.num_merges:
            raise ValueError(f"branches must hold num_merges={self.num_merges} callables, got {len(branches)}")
        run = self.begin(x)
        for f in branches:
            run.write(f(run.read()))
        return run.end()

    # ---- diagnostics (torch, no grad needed)
    def gate_values(self, k: int, streams: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """Gates of merge k on the streams entering it: ``(beta (..., n) fp32, forget (...) or None)``.

        Raises ValueError for an accumulating merge (k < n-1), which has no gates."""
        k = self._check_index(k)
        self._check_streams(k, streams)
        merge = self.merges[k]
        if merge.accumulating:
            raise ValueError(f"merge k={k} is an accumulating merge (k < streams-1 = {self.streams - 1}) and has no "
                             "gates; check MGRMerge.accumulating")
        gq, gb, fb = merge.gate_params()
        return mgr_gates_reference(streams, gq, gb, fb, self.gating, self.eps)

    def pool_weights(self, k: int, streams: Tensor) -> Tensor:
        """Softmax weights ``a (..., min(k+1, n))`` of merge k's AttnPool on the streams entering merge k
        (``k == num_merges``: the output pool on the final streams)."""
        if k == self.num_merges:
            self._check_streams(k, streams)
            return attn_pool_reference(streams, self.output_pool.pool_query, self.eps)[1]
        k = self._check_index(k)
        self._check_streams(k, streams)
        return attn_pool_reference(streams, self.merges[k].pool_query, self.eps)[1]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_merges={self.num_merges}, streams={self.streams}, gating={self.gating}, "
                f"num_gated={self.num_gated}, invert={self.invert}, backend={self.backend}")
