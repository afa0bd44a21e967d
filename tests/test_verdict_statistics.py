"""Verdicts with known answers: Welch's interval on logs, real bounds, per-run medians, points ranked by their
runs (not the single fastest run), claims matched by global batch and decided on 90 % intervals, shape claims
undecided without repeats. Each number is scipy's (`scipy.stats.ttest_ind(..., equal_var=False)`)."""

import math

import numpy as np
import pandas as pd
import pytest
from test_analysis import _epoch, write_run

from ptbench.analysis import load


def test_welch_on_logs_is_scipys_interval_and_never_pairs_by_position():
    from ptbench.analysis.stats import ratio_interval

    a, b = [1.10, 1.32], [1.00, 1.01]  # Welch df 1.006: t 12.6, not the table's 12.7 interpolated
    for iv in (ratio_interval(a, b), ratio_interval(a, b, paired=False)):
        assert (iv.lo, iv.hi) == pytest.approx((0.3820, 3.7638), abs=1e-4)


def test_a_verdict_prints_the_real_bounds_of_the_faster_side():
    from ptbench.analysis.stats import verdict

    a, b = [2.0, 2.1, 1.9, 2.05], [1.0, 1.02, 0.98, 1.01]
    said = verdict("A", a, "B", b)
    assert said.startswith("B is 100.6 % faster than A [88.1 %, 114.0 %]"), said
    assert "±" not in said


def test_a_points_step_time_comes_from_its_run_medians():
    from ptbench.analysis.stats import point_stats

    rng = np.random.default_rng(0)
    steps = [list(m + rng.normal(0, 1.0, 100)) for m in (30.0, 31.0, 40.0)]  # run medians 30.07, 30.99, 39.65
    runs = pd.DataFrame({"point": ["p", "p", "p", "one"], "step_times_s": [*steps, steps[0]]})
    t = point_stats(runs).set_index("point")
    assert (t.loc["p", "step_time_median_lo"], t.loc["p", "step_time_median_hi"]) == pytest.approx(
        (22.85, 48.56), abs=0.01
    )
    assert math.isnan(t.loc["one", "step_time_median_lo"]) and math.isnan(t.loc["one", "step_time_median_hi"])


def _points(root, name, adapter, walls, settings=None):
    """One run per wall time (time to the target scales with it), each with its own seed."""
    for i, w in enumerate(walls):
        epochs = [_epoch(e, 2.0, 10, 8, 1, partial=False, wall_time_s=w * (e + 1)) for e in range(2)]
        write_run(root, f"{name}{i}", adapter, 1, epochs=epochs, settings=settings, trainer={"seed": 1234 + i})


def _kind(text: str) -> str:
    return "faster" if " faster than " in text else text.split(" (")[0].split("; ")[-1]


def test_a_more_precise_measurement_never_gets_a_weaker_verdict(tmp_path):
    from ptbench.analysis.report import which_adapter

    kinds = []
    for s, name in ((0.00384, "tight"), (0.01002, "loose")):  # B/A 1.035, 95 % [1.026, 1.044] and [1.012, 1.059]
        root = tmp_path / name
        _points(root, "a", "ddp", list(10 * np.exp([-s, 0, s])))
        _points(root, "b", "zero", list(10.35 * np.exp([-s, 0, s])), settings={"stage": 1})
        versus = which_adapter(load(root), noise=0.05)["wl"]["fastest"]["versus"]  # an A/A floor of 5 %
        kinds.append(_kind(versus.split("against ")[-1]))
    assert kinds == ["faster", "faster"], kinds


def test_the_headline_names_the_point_its_verdict_ranks_first(tmp_path):
    from ptbench.analysis.report import which_adapter

    root = tmp_path / "r"
    _points(root, "ddp", "ddp", [10, 30, 30.5, 31, 30.2])  # one lucky run
    _points(root, "z", "zero", [12, 12.2, 12.1, 12.3, 11.9], settings={"stage": 1})
    f = which_adapter(load(root))["wl"]["fastest"]
    assert f["label"].startswith("zero"), f
    assert "ddp gb=8/replica` x1 is" not in f["versus"]


def _frame(rows):
    """(adapter, label, devices, global batch, MiB, s/sample) -> per-run rows like ptbench.analysis.tables.runs."""
    return pd.DataFrame(
        [
            {
                "run_id": f"{lab}-x{n}-{i}",
                "run_dir": f"/nowhere/{lab}-{n}-{i}",
                "workload": "w",
                "adapter": a,
                "label": lab,
                "devices": n,
                "global_batch": gb,
                "status": "ok",
                "mem_plot_bytes": mib * 2**20,
                "time_per_sample_used_s": t,
                "batch_size": 8,
                "batch_reduced_from": None,
            }
            for i, (a, lab, n, gb, mib, t) in enumerate(rows)
        ]
    )


def _claim(df, name):
    from ptbench.analysis.claims import claims

    return next(c for c in claims(df)["w"] if c["claim"].startswith(name))


def test_the_memory_claim_compares_the_ddp_of_the_same_global_batch():
    rows = []
    for f in (0.998, 1.002):  # two repeats each
        rows += [("ddp", "ddp gb=16", 2, 16, 1000 * f, 1.0), ("ddp", "ddp gb=8", 2, 8, 600 * f, 1.0)]
        rows += [("zero", "zero stage=2 gb=8", 2, 8, 330 * f, 1.1)]
    c = _claim(_frame(rows), "ZeRO per-GPU memory")
    assert c["verdict"] == "holds" and "55 %" in c["numbers"], c


def test_claims_straddling_the_papers_range_are_undecided():
    s = 0.0749  # 90 % Welch interval of the ZeRO/DDP ratio [0.94, 1.22], ratio 1.07
    rows = [("ddp", "ddp", 2, 8, 100, 1.0 * math.exp(d)) for d in (-s, 0, s)]
    rows += [("zero", "zero2", 2, 8, 50, 1.0709 * math.exp(d)) for d in (-s, 0, s)]
    c = _claim(_frame(rows), "ZeRO epoch time")
    assert c["verdict"] == "undecided" and "1.07" in c["numbers"] and "[0.94, 1.22]" in c["numbers"], c
    meg = _frame([("megatron", "meg", n, 8, m, 1.0) for n, m in ((1, 100), (2, 80), (4, 80.01))])  # no repeats
    assert _claim(meg, "Megatron")["verdict"] == "undecided"
