"""The streams' byte floor of a merge rule: the fewest bytes its merges move beyond a plain residual add's, and the
step time that sets at a device's copy bandwidth (issue 55: print it beside each measured figure, so a reader sees
how far from the floor each rule is).

Per merge and token, in elements of C (e_s bytes each for the streams, fp32 under autocast; e_u for the branch
output u, bf16 under autocast), each tensor read or written once (what the fused kernels move, kernels/*.py):

* plain ``x + u``: forward reads x, u and writes x' (2 e_s + e_u); backward casts the gradient to u's dtype
  (e_s + e_u);
* ``rescontroller``: forward as plain; backward reads g, r, u and writes both gradients (3 e_s + 2 e_u);
* ``mgr`` (n streams, a gated merge with the next merge's pool): forward reads S and u, writes S' and h
  ((2n + 1) e_s + e_u); backward reads S, u, dS', dh, writes dS, du ((3n + 1) e_s + 2 e_u), and with the fallback
  inversion writes the rebuilt inputs too (+ n e_s);
* ``attnres`` / ``attnres-block`` (the sources in fp32, e_v = 4 bytes): forward reads the completed sources, u (and
  the partial block), writes the partial and h; backward reads the sources and dh, reads and writes each completed
  source's gradient, reads the partial's, writes du; averaged over the merges of the chain;
* ``hc`` / ``mhc-lite`` / ``mhc`` (n streams; DeepSeek's split, docs gpu.md): the pre (aggregate) reads n streams,
  writes one; the post-and-residual merge reads n + 1, writes n: ((2n + 1) e_s + e_u) read + ((n + 1) e_s) written
  forward; backward taken as twice the forward (an estimate: those kernels are not this project's yet).

``python benchmarks/floor.py`` prints the table for GPT-2 small (12 layers = 24 merges, C = 768, 8 x 1024 tokens,
bf16 autocast: fp32 streams, bf16 updates) at the H200's measured copy bandwidth and plain step
(docs/results/gpu_check_h200.md: 4178 GB/s, 34.0 ms).
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple, Optional

__all__ = ["MergeBytes", "merge_bytes", "Floor", "step_floor", "main"]

#: The H200's measured copy bandwidth (GB/s) and eager plain GPT-2-small step (ms), docs/results/gpu_check_h200.md
H200_COPY_GBS, H200_PLAIN_MS = 4178.0, 34.0


class MergeBytes(NamedTuple):
    """Bytes per token of one merge beyond a plain residual add's, forward and backward (averaged over a chain)."""
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _attnres(c: int, merges: int, block: int, eu: float, ev: float = 4.0) -> MergeBytes:
    fwd = bwd = 0.0
    for k in range(merges):
        closed = k // block + 1  # slot 0 (x) and the completed blocks
        prev = 1 if k % block else 0
        fwd += (closed + prev + 1) * ev + 2 * eu
        bwd += (closed + 1) * ev + eu + 2 * closed * ev + ev + eu + prev * ev
    return MergeBytes(fwd / merges * c, bwd / merges * c)


def merge_bytes(method: str, c: int, n: int = 4, merges: int = 24, stream_bytes: float = 4.0,
                update_bytes: float = 2.0, inverted: Optional[bool] = None, block_size: Optional[int] = None
                ) -> MergeBytes:
    """The floor of one merge of ``method`` beyond a plain add's, per token (bytes): ``n`` streams, a chain of
    ``merges``; ``inverted`` (MGR; default: with fp32 / fp64 streams, as ``invert="auto"``); ``block_size`` (Block
    AttnRes; default: the rule's, ``2 * max(1, floor(K / 16 + 1/2))``)."""
    es, eu = stream_bytes, update_bytes
    plain = MergeBytes((2 * es + eu) * c, (es + eu) * c)
    if method in ("plain", "add"):
        own = plain
    elif method == "rescontroller":
        own = MergeBytes(plain.forward, (3 * es + 2 * eu) * c)
    elif method.startswith("mgr"):
        inverted = es >= 4 if inverted is None else inverted
        own = MergeBytes(((2 * n + 1) * es + eu) * c, ((3 * n + 1 + (n if inverted else 0)) * es + 2 * eu) * c)
    elif method in ("attnres", "attnres-block"):
        block = 1 if method == "attnres" else (block_size or 2 * max(1, int(merges / 16 + 0.5)))
        own = _attnres(c, merges, block, eu)
    elif method in ("hc", "mhc", "mhc-lite"):
        fwd = ((2 * n + 1) * es + eu + (n + 1) * es) * c
        own = MergeBytes(fwd, 2 * fwd)
    else:
        raise ValueError(f"no floor for method {method!r}")
    return MergeBytes(own.forward - plain.forward, own.backward - plain.backward)


class Floor(NamedTuple):
    """A rule's floor in one training step: ``gb`` moved beyond plain's, ``ms`` at the copy bandwidth, ``ratio``
    the step time over plain's at best (plain's step + ms, over plain's)."""
    gb: float
    ms: float
    ratio: float


def step_floor(method: str, tokens: int, c: int, merges: int, plain_ms: float, bandwidth_gbs: float, n: int = 4,
               **options) -> Floor:
    """:class:`Floor` of ``method`` in a step over ``tokens`` tokens of width ``c`` with ``merges`` merges, at a copy
    bandwidth of ``bandwidth_gbs`` (GB/s, bytes read + written) beside a plain step of ``plain_ms``
    (``options``: :func:`merge_bytes`'s)."""
    per = merge_bytes(method, c, n, merges, **options).total
    gb = per * tokens * merges / 1e9
    ms = gb / bandwidth_gbs * 1e3
    return Floor(gb, ms, (plain_ms + ms) / plain_ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8 * 1024)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--merges", type=int, default=24)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--bandwidth", type=float, default=H200_COPY_GBS, help="device copy bandwidth, GB/s")
    p.add_argument("--plain-ms", type=float, default=H200_PLAIN_MS, help="the plain step, ms")
    p.add_argument("--stream-bytes", type=float, default=4.0, help="bytes per stream element (fp32 under autocast)")
    p.add_argument("--update-bytes", type=float, default=2.0, help="bytes per branch-output element (bf16)")
    args = p.parse_args(argv)
    print(f"the streams' byte floor: {args.tokens} tokens, C={args.C}, {args.merges} merges, n={args.n}, streams "
          f"{args.stream_bytes:g} B, updates {args.update_bytes:g} B, copy bandwidth {args.bandwidth:g} GB/s, "
          f"plain step {args.plain_ms:g} ms")
    print(f"{'rule':<22}{'GB/step beyond plain':>22}{'ms':>8}{'floor / plain':>15}")
    for method, opts in (("rescontroller", {}), ("mgr-competitive", {}), ("mgr (no inversion)", {"inverted": False}),
                         ("attnres", {}), ("attnres-block", {}), ("hc", {}), ("mhc-lite", {}), ("mhc", {})):
        name = "mgr-competitive" if method.startswith("mgr") else method
        f = step_floor(name, args.tokens, args.C, args.merges, args.plain_ms, args.bandwidth, args.n,
                       stream_bytes=args.stream_bytes, update_bytes=args.update_bytes, **opts)
        print(f"{method:<22}{f.gb:>22.2f}{f.ms:>8.2f}{f.ratio:>14.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
