"""How much a comparison can tell: the smallest paired difference its seeds could have detected (80 % power of the
paired t test at 5 %, two-sided) and how many seeds the observed difference would need."""
from __future__ import annotations

import math
import random

import pytest

from lightning_resctl.compare.stats import describe, detectable_difference, paired, seeds_needed, verdict

# Student t quantiles from printed tables (not from the implementation): t(0.975, df) and t(0.80, df)
T975 = {2: 4.303, 4: 2.776, 5: 2.571, 9: 2.262}
T80 = {2: 1.061, 4: 0.941, 5: 0.920, 9: 0.883}


def test_known_case_three_seeds():
    """Per-seed differences -0.03, -0.01, -0.05: mean -0.03, sd 0.02. With 3 seeds the smallest difference the
    paired test detects with 80 % power is (t.975,2 + t.80,2) * 0.02 / sqrt(3); the observed 0.03 needs the
    smallest n with (t.975,n-1 + t.80,n-1) * 0.02 / sqrt(n) <= 0.03, which is 6 (5 gives 0.0333)."""
    plain = {0: 2.0, 1: 2.0, 2: 2.0}
    method = {0: 1.97, 1: 1.99, 2: 1.95}
    pair = paired(method, plain, "min")
    want = (T975[2] + T80[2]) * 0.02 / math.sqrt(3)
    assert pair["detectable"] == pytest.approx(want, rel=2e-3)
    assert (T975[4] + T80[4]) * 0.02 / math.sqrt(5) > 0.03 >= (T975[5] + T80[5]) * 0.02 / math.sqrt(6)
    assert pair["seeds_needed"] == 6
    text = verdict(describe(method.values()), describe(plain.values()), pair, "val_loss", "min")
    assert "could detect" in text and f"{want:.4f}" in text and "6 seeds" in text


def test_two_seeds_still_say_what_they_could_have_detected():
    pair = paired({0: 1.0, 1: 1.02}, {0: 1.01, 1: 1.01})  # differences -0.01, +0.01: no difference shown
    sd = math.sqrt(2) * 0.01
    assert pair["detectable"] == pytest.approx((12.706 + 1.376) * sd / math.sqrt(2), rel=2e-3)
    assert pair["seeds_needed"] is None  # a zero mean difference: no number of seeds shows it
    text = verdict(describe([1.0, 1.02]), describe([1.01, 1.01]), pair, "val_loss", "min")
    assert "no difference shown" in text and "measured mean difference is 0" in text


@pytest.mark.parametrize("method, below", [({0: 1.99, 1: 1.95}, True), ({0: 1.5, 1: 1.5}, False)])
def test_the_detectable_difference_is_stated_beside_the_measured_one_and_the_verdicts_basis(method, below):
    """Better in 2 of 2 seeds and a detectable difference larger than the measured one do not contradict each
    other once both numbers and what each rests on are said: the sentence gives the measured mean difference, the
    detectable one, which is larger, and that the count of better seeds is a count, not the test."""
    plain = {0: 2.0, 1: 2.0}
    pair = paired(method, plain, "min")
    assert pair["better"] == 2
    text = verdict(describe(method.values()), describe(plain.values()), pair, "val_loss", "min")
    power = text.split("What these seeds can detect:", 1)[1]
    assert f"{pair['mean']:+.4f}" in power and f"{pair['detectable']:.4f}" in power
    assert "lower in 2 of 2 seeds" in power and "a count, not a test" in power
    assert (abs(pair["mean"]) < pair["detectable"]) == below
    assert ("smaller than" if below else "at least as large as") + " the detectable difference" in power
    assert "none smaller could have been shown" not in text


def test_one_seed_has_no_detectable_difference():
    pair = paired({0: 1.0}, {0: 2.0})
    assert pair["detectable"] is None and pair["seeds_needed"] is None


@pytest.mark.parametrize("effect", [0.5, 1.0])
def test_with_the_seeds_it_asks_for_the_paired_test_finds_the_effect_about_80_percent_of_the_time(effect):
    """A synthetic table with a known effect: per-seed differences ~ N(effect, 1). With seeds_needed(effect, 1)
    seeds, a paired t test at 5 % must reject 'no difference' in about 80 % of the comparisons (the power the
    number is for), and with half as many seeds clearly less often."""
    n = seeds_needed(effect, 1.0)
    assert 5 <= n <= 40
    rng = random.Random(0)

    def power(seeds, trials=3000):
        hits = 0
        for _ in range(trials):
            plain = {s: 0.0 for s in range(seeds)}
            method = {s: rng.gauss(effect, 1.0) for s in range(seeds)}
            ci = paired(method, plain, "max")["ci"]
            hits += ci[0] > 0 or ci[1] < 0
        return hits / trials

    assert 0.74 <= power(n) <= 0.87
    assert power(max(3, n // 2)) < 0.65


def test_detectable_difference_shrinks_with_the_square_root_of_the_seeds():
    big = detectable_difference(0.1, 30)
    assert big == pytest.approx((2.045 + 0.854) * 0.1 / math.sqrt(30), rel=5e-3)
    assert detectable_difference(0.1, 4 * 30) == pytest.approx(big / 2, rel=0.05)


def test_every_summary_has_the_detectable_difference_column(tmp_path):
    from lightning_resctl.compare.summary import write_summary

    manifest = {"fingerprint": "x", "identity": {"compare": {"methods": ["plain", "a"], "first_seed": 0, "seeds": 3,
                                                              "mode": "min", "monitor": None}}}
    rec = {"status": "done", "monitor": "val_loss", "curve": [[1, 1.0]], "final_train_loss": 1.0, "steps": 1,
           "params_added": 0, "sites": 0, "init_difference": {"output": 0.0, "grad_norm": 0.0}}
    records = [{**rec, "method": "plain", "seed": s, "final": 2.0} for s in range(3)]
    records += [{**rec, "method": "a", "seed": s, "final": v} for s, v in enumerate([1.97, 1.99, 1.95])]
    table = write_summary(manifest, records, None, tmp_path)
    mde = (T975[2] + T80[2]) * 0.02 / math.sqrt(3)
    assert table["a"]["detectable_diff"] == pytest.approx(mde, rel=2e-3) and table["a"]["seeds_needed"] == 6
    md = (tmp_path / "summary.md").read_text()
    assert "detectable / seeds needed" in md and f"| {mde:.4f} / 6 |" in md
    assert "would need about 6 seeds" in md
