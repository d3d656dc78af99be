"""Statistics of a comparison over seeds, and the sentences that state them.

Per method, over its seeds: mean, *spread* = half the range (with 2 seeds, mean ± spread is exactly the interval
of the two runs), min, max.

Seeds are *paired*: for a given seed every method starts from the same initial weights and sees the same batches.
So each method is compared with plain seed by seed: the per-seed differences ``d_s = method_s - plain_s``, their
mean and range, how many seeds are better (lower for ``mode="min"``, higher for ``"max"``) and, with at least 3
seeds, a 95 % paired *t* interval of the mean difference, ``mean(d) ± t(0.975, n-1) · sd(d) / sqrt(n)``.

The headline stays conservative: a difference is called *beyond the seed spread* only when the per-seed ranges of
the method and of plain do not overlap. With one seed no claim is made.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["describe", "paired", "t_quantile_975", "verdict"]

# t(0.975, df) for df = 1..30 (beyond: the Cornish-Fisher expansion around the normal quantile, error < 1e-3)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.306, 2.2622, 2.2281, 2.201, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.093, 2.086, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def describe(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "spread", "min", "max", "n"}`` of the finite values (NaN and n=0 when there are none)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        nan = math.nan
        return {"mean": nan, "spread": nan, "min": nan, "max": nan, "n": 0}
    lo, hi = min(finite), max(finite)
    return {"mean": sum(finite) / len(finite), "spread": (hi - lo) / 2, "min": lo, "max": hi, "n": len(finite)}


def paired(method: Mapping[int, float], plain: Mapping[int, float], mode: str = "min") -> dict[str, object]:
    """Seed-by-seed comparison of ``method`` with ``plain`` (``{seed: value}``) on the seeds both have.

    Returns ``{"seeds", "diffs", "mean", "min", "max", "better", "n", "ci"}``; ``ci`` is the 95 % paired t interval
    ``[lo, hi]`` of the mean difference (None with fewer than 3 seeds)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    seeds = sorted(s for s in method if s in plain and all(math.isfinite(v) for v in (method[s], plain[s])))
    diffs = [method[s] - plain[s] for s in seeds]
    n = len(diffs)
    out: dict[str, object] = {"seeds": seeds, "diffs": diffs, "n": n, "ci": None,
                              "better": sum(1 for d in diffs if (d < 0 if mode == "min" else d > 0))}
    if not n:
        out.update(mean=math.nan, min=math.nan, max=math.nan)
        return out
    mean = sum(diffs) / n
    out.update(mean=mean, min=min(diffs), max=max(diffs))
    if n >= 3:
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        half = t_quantile_975(n - 1) * sd / math.sqrt(n)
        out["ci"] = [mean - half, mean + half]
    return out


def verdict(method_stats: Mapping[str, float], plain_stats: Mapping[str, float], pair: Mapping[str, object],
            what: str, mode: str = "min", digits: int = 4) -> str:
    """The plain-language comparison of one method with plain (see the module docstring)."""
    if method_stats["n"] < 2 or plain_stats["n"] < 2 or pair["n"] < 2:
        return f"{what}: one seed only, so no seed spread to compare against; no claim."
    diff = method_stats["mean"] - plain_stats["mean"]
    better_word, worse_word = ("lower", "higher") if mode == "min" else ("higher", "lower")
    if method_stats["max"] < plain_stats["min"]:
        head = (f"{what}: lower than plain by {-diff:.{digits}f} on average, beyond the seed spread "
                f"(every seed below every plain seed).")
    elif method_stats["min"] > plain_stats["max"]:
        head = (f"{what}: higher than plain by {diff:.{digits}f} on average, beyond the seed spread "
                f"(every seed above every plain seed).")
    else:
        head = (f"{what}: differs from plain by {diff:+.{digits}f} on average, within the seed spread "
                f"(the seed ranges overlap): no difference shown.")
    n, k = pair["n"], pair["better"]
    tail = (f" Paired by seed: {better_word} than plain in {k} of {n} seeds, difference "
            f"{pair['mean']:+.{digits}f} (range {pair['min']:+.{digits}f} to {pair['max']:+.{digits}f})")
    ci = pair["ci"]
    if ci is None:
        tail += "; fewer than 3 seeds, no interval."
    else:
        excludes = ci[0] > 0 or ci[1] < 0
        tail += (f", 95% paired t interval [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"
                 + (f" (excludes 0: {better_word if (ci[1] < 0) == (mode == 'min') else worse_word} than plain)."
                    if excludes else " (includes 0)."))
    return head + tail
