"""Per-step times in the record: the epoch event's `step_times_s` (the timed steps, slowest rank per
step, warm-up excluded, rounded to 1 us), kept by analysis/load.py, joined per run, and the report's intervals
table gives each point its median step time with a bootstrap 95 % interval."""

import numpy as np
import pytest
from test_analysis import _epoch, write_run

from ptbench.analysis import load
from tests.helpers import events


def test_the_epoch_event_holds_the_timed_step_times(smoke_run):
    for e in events(smoke_run):
        times = e["step_times_s"]
        assert len(times) == e["timed_steps"] == e["steps"] - e["warmup_steps_excluded"]
        assert all(t > 0 and round(t, 6) == t for t in times)
        assert float(np.median(times)) == pytest.approx(e["step_time_p50_s"], abs=1e-6)
        assert float(np.mean(times)) == pytest.approx(e["step_time_mean_s"], abs=1e-6)
    df = load(smoke_run)
    assert df["step_times_s"].map(len).tolist() == [e["timed_steps"] for e in events(smoke_run)]


def _run(root, name, epochs_steps):
    epochs = [
        _epoch(i, 2.0, len(ts), 8, 1, partial=False, step_times_s=ts, wall_time_s=2.0 * (i + 1))
        for i, ts in enumerate(epochs_steps)
    ]
    write_run(root, name, "ddp", 1, epochs=epochs)


def test_the_report_gives_each_point_its_step_time_median_interval(tmp_path):
    from ptbench.analysis.report import write_report
    from ptbench.analysis.tables import runs

    rng = np.random.default_rng(3)
    steps = [list(np.round(rng.normal(0.2, 0.01, 60), 6)) for _ in range(2)]
    _run(tmp_path / "r", "one", steps)  # one run, two epochs: its steps joined over the epochs
    per_run = runs(load(tmp_path / "r"))
    assert len(per_run) == 1 and per_run["step_times_s"].iloc[0] == steps[0] + steps[1]
    write_report(tmp_path / "r", tmp_path / "out")
    report = (tmp_path / "out" / "report-details.md").read_text()  # the intervals table: in the details
    assert "### Intervals over repeats" in report and "step_time_median_s_lo" not in report
    t = __import__("pandas").read_csv(tmp_path / "out" / "intervals.csv").iloc[0]
    assert t["repeats"] == 1 and t["step_time_median_s"] == pytest.approx(np.median(steps[0] + steps[1]))
    # a point's interval comes from its runs' medians (steps of one run are not independent samples): one run
    # gives none, however many steps it has
    assert np.isnan(t["step_time_median_lo"]) and np.isnan(t["step_time_median_hi"])
    header = next(line for line in report.splitlines() if line.startswith("| workload") and "repeats" in line)
    assert "step_time_median_lo" in header and "step_time_median_hi" in header
    # the lists stay out of the CSV tables
    assert "step_times_s" not in (tmp_path / "out" / "runs.csv").read_text().splitlines()[0]
