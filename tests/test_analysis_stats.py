"""Statistics of analysis/stats.py on samples with known answers (scipy.stats computes each)."""

import math

import numpy as np
import pandas as pd
import pytest

from ptbench.analysis.stats import (
    EQUIVALENT,
    NOT_DISTINGUISHABLE,
    decide,
    geo_interval,
    holm,
    point_stats,
    rank,
    ratio_interval,
    repeats_for,
    verdict,
)


def test_geometric_mean_interval_is_on_the_log_scale_and_never_negative():
    # two repeats 0.4 and 0.9 s: the t interval of raw values reaches below 0; on logs it cannot
    iv = geo_interval([0.4, 0.9])
    assert iv.value == pytest.approx(0.6) and 0 < iv.lo < 0.4 and iv.hi > 0.9
    half = 12.706 * np.std(np.log([0.4, 0.9]), ddof=1) / math.sqrt(2)  # t(0.975, 1) = 12.706
    assert math.log(iv.hi / iv.value) == pytest.approx(half, rel=1e-4)
    assert math.isnan(geo_interval([5.0]).lo)
    assert geo_interval([2.0, 2.0]).lo == 2.0


def test_ratio_interval_paired_only_when_asked():
    a = np.array([1.15, 1.38, 1.265, 1.196])  # exactly 1.15 x b, pair by pair
    b = a / 1.15
    r = ratio_interval(a, b, paired=True)
    assert r.value == pytest.approx(1.15) and r.lo == pytest.approx(1.15) and r.hi == pytest.approx(1.15)
    u = ratio_interval(a, b)  # unpaired by default: the run-to-run spread widens the interval
    assert u.value == pytest.approx(1.15) and u.lo < 1.15 < u.hi and u.method == "Welch t on logs"
    with pytest.raises(ValueError, match="paired ratio: 4 runs of A against 2 of B"):
        ratio_interval(a, b[:2], paired=True)


def test_verdicts_faster_equivalent_or_not_distinguishable():
    rng = np.random.default_rng(1)
    base = rng.normal(1.0, 0.01, 8)
    assert verdict("A", base, "B", base * 1.15).startswith("A is 15.0 % faster than B [")
    assert verdict("A", base * 1.15, "B", base).startswith("B is 15.0 % faster than A [")
    same = decide("A", base, "B", base[::-1].copy())
    assert same["kind"] == EQUIVALENT and same["text"].startswith("equivalent within ±5 %")
    loose = decide("A", [1.0, 1.3], "B", [1.1, 1.2])  # two wide repeats: neither faster nor inside ±5 %
    assert loose["kind"] == NOT_DISTINGUISHABLE
    assert verdict("A", [1.0], "B", [2.0]).startswith(NOT_DISTINGUISHABLE)  # one repeat: no interval


def test_holm_and_rank_test_the_best_against_every_other_point():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    tight = [1.00, 1.01, 0.99, 1.00]
    r = rank({"a": tight, "b": [t * 1.2 for t in tight], "c": [t * 1.3 for t in tight]})
    assert r["best"] == "a" and r["fastest"] and len(r["versus"]) == 2
    tie = rank({"a": tight, "b": [t * 1.2 for t in tight], "c": [1.0, 1.02, 0.98, 1.01]})
    assert tie["best"] in ("a", "c") and not tie["fastest"]  # a and c tie: no single fastest


def test_repeats_planned_from_the_spread():
    # the noncentral t with df 2(n - 1): 7 runs at 3 % spread have power 0.797, 8 have 0.856; 2 %: 3 runs 0.616, 4 0.818
    assert repeats_for(0.03) == 8 and repeats_for(0.02) == 4
    assert repeats_for(0.001) == 2


def test_point_stats_columns():
    runs = pd.DataFrame(
        {"point": ["p", "p", "p", "q"], "epoch_time_s": [1.0, 2.0, 4.0, 4.0], "step_times_s": [[1, 2, 3]] * 4}
    )
    t = point_stats(runs).set_index("point")
    assert t.loc["p", "repeats"] == 3 and t.loc["p", "epoch_time_s"] == pytest.approx(2.0)  # geometric mean
    assert t.loc["p", "epoch_time_s_hi"] == pytest.approx(2 * math.exp(4.303 * math.log(2) / math.sqrt(3)), rel=1e-3)
    assert math.isnan(t.loc["q", "epoch_time_s_lo"])
    assert t.loc["p", "step_time_median_s"] == pytest.approx(2.0)
