"""Statistics of a comparison over seeds, and the sentences that state them.

Per method, over its seeds: mean, *spread* = half the range (with 2 seeds, mean ± spread is exactly the interval
of the two runs), min, max.

Seeds are *paired*: for a given seed every method starts from the same initial weights and sees the same batches.
So each method is compared with plain seed by seed: the per-seed differences ``d_s = method_s - plain_s``, their
mean and range, how many seeds are better (lower for ``mode="min"``, higher for ``"max"``) and, with at least 3
seeds, a 95 % paired *t* interval of the mean difference, ``mean(d) ± t(0.975, n-1) · sd(d) / sqrt(n)``.

The headline stays conservative: a difference is called *beyond the seed spread* only when the per-seed ranges of
the method and of plain do not overlap. With one seed no claim is made.

How much the seeds could tell (with at least 2 seeds): the *detectable difference* is the smallest true mean
difference that the paired t test at 5 % (two-sided) finds with 80 % power at the seed-to-seed spread observed,

    MDE(n) = (t(0.975, n-1) + t(0.80, n-1)) · sd(d) / sqrt(n)

(the usual power approximation of the one-sample t test on the differences, with the sample sd standing in for
the true one); and *seeds needed* is the smallest n with ``MDE(n) <= |mean(d)|``: about how many seeds the observed
difference would need to be shown with that power (None when the mean difference is 0). The sentence states the
measured mean difference beside the MDE and says which is larger, and that the count of better seeds is a count, not
the test: "lower in 2 of 2 seeds" and an MDE larger than the measured difference are both true. 80 % and 5 % are the
conventional choices, not ours.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["describe", "paired", "t_quantile_975", "t_quantile_80", "detectable_difference", "seeds_needed",
           "verdict"]

# t(0.975, df) for df = 1..30 (beyond: the Cornish-Fisher expansion around the normal quantile, error < 1e-3)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.306, 2.2622, 2.2281, 2.201, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.093, 2.086, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


# t(0.80, df) for df = 1..30
_T80 = (1.3764, 1.0607, 0.9785, 0.941, 0.9195, 0.9057, 0.896, 0.8889, 0.8834, 0.8791, 0.8755, 0.8726, 0.8702,
        0.8681, 0.8662, 0.8647, 0.8633, 0.862, 0.861, 0.86, 0.8591, 0.8583, 0.8575, 0.8569, 0.8562, 0.8557, 0.8551,
        0.8546, 0.8542, 0.8538)


def _t_quantile(table: tuple, z: float, df: int) -> float:
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    if df <= len(table):
        return table[df - 1]
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom."""
    return _t_quantile(_T975, 1.959964, df)


def t_quantile_80(df: int) -> float:
    """The 80 % quantile of Student's t with ``df`` degrees of freedom."""
    return _t_quantile(_T80, 0.841621, df)


def detectable_difference(sd: float, n: int) -> float:
    """The smallest mean paired difference that ``n`` seeds with per-seed differences of standard deviation ``sd``
    detect with 80 % power (paired t test, 5 % two-sided; see the module docstring)."""
    if n < 2:
        raise ValueError(f"n must be >= 2 seeds, got {n!r}")
    return (t_quantile_975(n - 1) + t_quantile_80(n - 1)) * sd / math.sqrt(n)


def seeds_needed(difference: float, sd: float, limit: int = 100_000) -> int | None:
    """The smallest number of seeds whose :func:`detectable_difference` at ``sd`` is at most ``|difference|``
    (None when ``difference`` is 0, or more than ``limit`` seeds would be needed)."""
    difference = abs(difference)
    if difference == 0 or not math.isfinite(difference):
        return None
    if sd == 0:
        return 2
    # beyond the tables MDE(n) ~ (z.975 + z.80) sd / sqrt(n): start the search near that and walk down, then up
    n = max(2, min(limit, int(((1.959964 + 0.841621) * sd / difference) ** 2)))
    while n > 2 and detectable_difference(sd, n - 1) <= difference:
        n -= 1
    while detectable_difference(sd, n) > difference:
        n += 1
        if n > limit:
            return None
    return n


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

    Returns ``{"seeds", "diffs", "mean", "min", "max", "better", "n", "ci", "sd", "detectable", "seeds_needed"}``;
    ``ci`` is the 95 % paired t interval ``[lo, hi]`` of the mean difference (None with fewer than 3 seeds);
    ``sd`` the differences' standard deviation, ``detectable`` the :func:`detectable_difference` of these seeds and
    ``seeds_needed`` the seeds the observed mean difference would need (:func:`seeds_needed`) — None with fewer
    than 2 seeds."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    seeds = sorted(s for s in method if s in plain and all(math.isfinite(v) for v in (method[s], plain[s])))
    diffs = [method[s] - plain[s] for s in seeds]
    n = len(diffs)
    out: dict[str, object] = {"seeds": seeds, "diffs": diffs, "n": n, "ci": None, "sd": None, "detectable": None,
                              "seeds_needed": None,
                              "better": sum(1 for d in diffs if (d < 0 if mode == "min" else d > 0))}
    if not n:
        out.update(mean=math.nan, min=math.nan, max=math.nan)
        return out
    mean = sum(diffs) / n
    out.update(mean=mean, min=min(diffs), max=max(diffs))
    if n >= 2:
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        out.update(sd=sd, detectable=detectable_difference(sd, n), seeds_needed=seeds_needed(mean, sd))
    if n >= 3:
        half = t_quantile_975(n - 1) * out["sd"] / math.sqrt(n)
        out["ci"] = [mean - half, mean + half]
    return out


def power_sentence(pair: Mapping[str, object], digits: int = 4, mode: str = "min") -> str:
    """What the seeds could detect, beside what was measured: the measured mean difference and the count of better
    seeds (a count, not a test), the detectable difference (80 % power of the paired t test, 5 % two-sided, at
    these seeds' spread), which of the two is larger, and the seeds the measured difference would need."""
    n, mde, need = pair["n"], pair.get("detectable"), pair.get("seeds_needed")
    if mde is None:
        return ""
    mean, ci = pair["mean"], pair.get("ci")
    better_word = "lower" if mode == "min" else "higher"
    text = (f" What these seeds can detect: the measured mean difference is {mean:+.{digits}f} ({better_word} in "
            f"{pair['better']} of {n} seeds: a count, not a test); with {n} seeds at the spread of their "
            f"differences, the paired t test (5% two-sided) could detect with 80% power a true difference of "
            f"{mde:.{digits}f} or more (the detectable difference).")
    if need is None:
        return text + " The measured mean difference is 0: no number of seeds would show it."
    if ci is not None and (ci[0] > 0 or ci[1] < 0):
        return text + " The interval above excludes 0: this difference is shown."
    if abs(mean) < mde:
        return text + (f" The measured difference is smaller than the detectable difference: these seeds can "
                       f"neither show it nor rule it out; a difference of this size would need about {need} seeds.")
    return text + (" The measured difference is at least as large as the detectable difference, yet "
                   + ("2 seeds give no interval" if ci is None else "the interval includes 0")
                   + f": 80% power is a chance, not a certainty ({need} seeds give it at this size).")


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
    return head + tail + power_sentence(pair, digits, mode)
