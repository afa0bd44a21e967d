"""Statistics of analysis/stats.py on samples with known answers (issue 29)."""

import math

import numpy as np
import pandas as pd
import pytest

from ptbench.analysis.stats import (
    NOT_DISTINGUISHABLE,
    bootstrap_median,
    mean_interval,
    point_stats,
    ratio_interval,
    t975,
    verdict,
)


def test_t_quantiles():
    assert t975(1) == pytest.approx(12.706)
    assert t975(4) == pytest.approx(2.776)
    assert t975(1e9) == pytest.approx(1.96, abs=1e-3)


def test_mean_interval_known_answer():
    # mean 2, sd 1, n 4: half-width t(3) * 1 / 2 = 3.182 / 2
    iv = mean_interval([1.0, 2.0, 3.0, 2.0])
    sd = np.std([1.0, 2.0, 3.0, 2.0], ddof=1)
    assert iv.value == 2.0 and iv.n == 4
    assert iv.hi - 2.0 == pytest.approx(3.182 * sd / 2, rel=1e-3)
    assert math.isnan(mean_interval([5.0]).lo)


def test_bootstrap_median_covers_true_median_and_is_reproducible():
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 0.1, 400)  # the median's se ~ 1.2533 * 0.1 / 20 = 0.0063
    iv = bootstrap_median(x)
    assert iv.value == np.median(x) and iv.lo < iv.value < iv.hi
    assert iv.hi - iv.lo == pytest.approx(2 * 1.96 * 0.0063, rel=0.35)
    assert bootstrap_median(x) == iv  # fixed seed
    assert bootstrap_median([1.0, 1.0, 1.0, 1.0]).lo == 1.0
    # coverage: of 200 samples of 51 steps, about 95 % of the intervals hold the true median 1.0
    hits = [
        (i.lo <= 1.0 <= i.hi) for i in (bootstrap_median(rng.normal(1.0, 0.1, 51), resamples=500) for _ in range(200))
    ]
    assert 0.88 <= np.mean(hits) <= 0.99


def test_ratio_interval_paired_exact_and_unpaired():
    a = np.array([1.15, 1.38, 1.265, 1.196])  # exactly 1.15 x b, pair by pair
    b = a / 1.15
    r = ratio_interval(a, b, paired=True)
    assert r.value == pytest.approx(1.15) and r.lo == pytest.approx(1.15) and r.hi == pytest.approx(1.15)
    u = ratio_interval(a, b, paired=False)  # unpaired: the run-to-run spread widens the interval
    assert u.value == pytest.approx(1.15) and u.lo < 1.15 < u.hi


def test_verdicts():
    rng = np.random.default_rng(1)
    base = rng.normal(1.0, 0.01, 8)
    assert verdict("A", base, "B", base * 1.15).startswith("A is 15.0 % ± 0.0 % faster than B")
    assert verdict("A", base * 1.15, "B", base).startswith("B is 15.0 %")
    same = verdict("A", base, "B", base[::-1].copy(), paired=False)
    assert same.startswith(NOT_DISTINGUISHABLE) and "no A/A noise floor measured" in same  # no floor: said so
    # 1 % faster, well measured, but inside a 3 % noise floor
    inside = verdict("A", base, "B", base * 1.01, noise=0.03)
    assert inside.startswith(NOT_DISTINGUISHABLE) and inside.endswith("noise floor ±3.0 %)")
    assert verdict("A", [1.0], "B", [2.0]).startswith(NOT_DISTINGUISHABLE)  # one repeat: no interval


def test_point_stats_columns():
    runs = pd.DataFrame(
        {"point": ["p", "p", "p", "q"], "epoch_time_s": [1.0, 2.0, 3.0, 4.0], "step_times_s": [[1, 2, 3]] * 4}
    )
    t = point_stats(runs).set_index("point")
    assert t.loc["p", "repeats"] == 3 and t.loc["p", "epoch_time_s"] == 2.0
    assert t.loc["p", "epoch_time_s_hi"] == pytest.approx(2 + 4.303 * 1 / math.sqrt(3), rel=1e-3)
    assert math.isnan(t.loc["q", "epoch_time_s_lo"])
    assert t.loc["p", "step_time_median_s"] == 2.0
