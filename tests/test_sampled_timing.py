"""Optional sampled timing (bench/runner/sampling.py): trainer.timing_sample=PCT ends an epoch once the
95 % interval of the mean step time is within +-PCT %, or at trainer.timing_sample_cap timed steps, and records
the epoch's time as an estimate with its interval and the steps measured. Real runs; full epochs by default."""

import math

import numpy as np
import pytest

from ptbench.runner.sampling import CHECK_EVERY, MIN_STEPS, SampledTiming, effective_n, mean_interval
from tests.helpers import SMOKE, bench, check_ok, events, only_run

# 2 ranks x batch 4 over 400 samples: 50 steps an epoch
LONG = [*SMOKE, "trainer.max_steps=0", "data.train_samples=400", "trainer.eval_every_epoch=false"]


def test_mean_interval_known_answer():
    # n 12, sd 0.7385, lag-1 autocorrelation 0, corrected 1/12: n_eff 12 (11/12) / (13/12) = 10.15, t(9.15) 2.2554
    m, h = mean_interval([1.0, 2.0, 3.0, 2.0] * 3)
    assert effective_n([1.0, 2.0, 3.0, 2.0] * 3) == pytest.approx(12 * 11 / 13)
    assert m == 2.0 and h == pytest.approx(2.2554 * 0.73855 / math.sqrt(12 * 11 / 13), rel=1e-3)
    assert mean_interval([5.0])[1] == math.inf


def test_mean_interval_keeps_its_coverage_under_autocorrelation():
    """AR(1) step times at autocorrelation 0.5, 30 steps: the plain t interval covers the true mean ~73 % of the
    time; the effective sample size brings it near 95 %."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        x = np.zeros(130)
        for i in range(1, 130):
            x[i] = 0.5 * x[i - 1] + rng.normal()
        m, h = mean_interval(list(100 + x[100:]))
        hits += abs(m - 100) <= h
    assert 0.86 <= hits / 400 <= 0.99, hits / 400


def test_cap_ends_the_epoch_on_every_rank_with_an_estimate(tmp_path):
    proc = bench(*LONG, "launcher.nprocs=2", "trainer.timing_sample=0.001", "trainer.timing_sample_cap=12",
                 results=tmp_path)  # fmt: skip
    check_ok(proc)
    (e,) = events(only_run(tmp_path))
    est = e["epoch_time_estimate"]
    assert e["partial"] and est["estimate"] is True and est["stopped_by"] == "cap"
    first_check = next(n for n in range(MIN_STEPS, 50, CHECK_EVERY) if n >= 12)  # 15 timed steps
    assert est["timed_steps_measured"] == e["timed_steps"] == first_check == len(e["step_times_s"])
    assert est["steps_measured"] == e["steps"] == first_check + 1 and est["steps_in_epoch"] == 50
    assert est["half_width_pct"] > 0.001 and est["target_pct"] == 0.001
    assert e["epoch_time_s"] <= est["lo_s"] <= est["value_s"] <= est["hi_s"]  # the time spent bounds it below


def test_a_loose_target_stops_early_and_full_epochs_stay_the_default(tmp_path):
    proc = bench(*LONG, "launcher.nprocs=1", "data.train_samples=200", "trainer.timing_sample=200",
                 results=tmp_path / "s")  # fmt: skip
    check_ok(proc)
    (e,) = events(only_run(tmp_path / "s"))
    est = e["epoch_time_estimate"]  # +-200 %: met at the first check on a quiet machine; a slow step under load
    # (seen in CI: 15 steps) widens the interval past it for a few more
    measured = est["timed_steps_measured"]
    assert est["stopped_by"] == "interval" and est["half_width_pct"] <= 200 and MIN_STEPS <= measured < 40, est
    full = bench(*LONG, "launcher.nprocs=1", "data.train_samples=80", results=tmp_path / "f")
    check_ok(full)
    (e,) = events(only_run(tmp_path / "f"))
    assert "epoch_time_estimate" not in e and not e["partial"] and e["steps"] == 20
    # the report labels it an estimate, with its interval
    from ptbench.analysis.report import write_report

    write_report(tmp_path / "s", tmp_path / "out")
    text = (tmp_path / "out" / "report-details.md").read_text()  # per-epoch rows: in the details
    assert "### Estimated epoch times (sampled timing)" in text and "**estimate**" in text
    assert f"from {measured + 1} of 50 steps" in text  # 200 samples, batch 4


def test_an_interval_wider_than_the_mean_never_bounds_the_epoch_below_the_time_spent():
    """One slow step among fast ones (a loaded machine): the interval's lower bound of the mean step is below
    zero, and the epoch's lower bound is then the time already spent, not less."""
    times = [0.05] * 14 + [3.0]
    mean, half = mean_interval(times)
    assert half > mean
    sampler = SampledTiming(target_pct=0.001, cap=15, untimed_steps=0, device="cpu")
    assert sampler.enough(lambda: [{"step": t} for t in times], first_step=0, global_step=15)
    event = sampler.annotate({"steps": 15, "epoch_time_s": sum(times)}, steps_in_epoch=50)
    est = event["epoch_time_estimate"]
    assert est["lo_s"] == pytest.approx(sum(times)) and est["stopped_by"] == "cap"
    assert est["hi_s"] == pytest.approx(sum(times) + (mean + half) * 35)
