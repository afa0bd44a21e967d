"""The report's verdicts: with repeats, "Which adapter" says `A is x % faster than B [lo, hi]`, `equivalent` or
`not distinguishable`; runs whose record warns of contention are kept out unless asked; the A/A spread plans
repeats and moves no verdict."""

import json

import numpy as np
from test_analysis import _epoch, write_run

from ptbench.analysis import load
from ptbench.analysis.report import run_spread, which_adapter, which_adapter_lines


def _runs(root, name, adapter, walls, settings=None, warnings=None):
    for i, w in enumerate(walls):
        epochs = [_epoch(e, 2.0, 10, 8, 1, partial=False, wall_time_s=w * (e + 1)) for e in range(2)]
        d = write_run(root, f"{name}{i}", adapter, 1, epochs=epochs, settings=settings, trainer={"seed": 1234 + i})
        if warnings:
            s = json.loads((d / "summary.json").read_text())
            (d / "summary.json").write_text(json.dumps({**s, "warnings": warnings}))


def test_which_adapter_gives_an_interval_and_keeps_contended_runs_out(tmp_path):
    root = tmp_path / "r"
    _runs(root, "ddp", "ddp", [10.0, 10.2, 9.9])
    _runs(root, "z", "zero", [12.0, 12.1, 11.9], settings={"stage": 1})
    _runs(root, "busy", "fsdp", [3.0], warnings=["contention: 4 rank(s) x 1 thread(s) on 2 CPU(s) ..."])
    df = load(root)
    v = which_adapter(df)["wl"]
    assert v["fastest"]["label"] == "ddp gb=8/replica"  # the contended fsdp run (3 s) is left out
    said = "`ddp gb=8/replica` x1 is 19.6 % faster than `zero stage=1 gb=8/replica` x1 [15.9 %, 23.4 %]"
    assert said in v["fastest"]["versus"] and v["fastest"]["fastest"]  # 12.0 / 10.03, Welch t on logs
    assert any(u.startswith("left out for contention") and "busy0" in u for u in v["undecided"])
    busy = which_adapter(df, include_contended=True)["wl"]["fastest"]
    assert busy["label"] == "fsdp gb=8/replica" and not busy["fastest"]  # one run: ranked first, no verdict
    assert "1 repeat(s), no interval" in busy["versus"]
    # an A/A spread of 25 % plans repeats; the verdict stays
    lines = "\n".join(which_adapter_lines(df, noise=0.25))
    assert "Run-to-run spread (A/A, `python -m ptbench.sweep noise`): 25.0 %" in lines and said in lines


def test_time_to_target_is_interpolated_and_repeats_need_seeds(tmp_path):
    from ptbench.analysis.tables import time_to_target

    root = tmp_path / "r"
    _runs(root, "ddp", "ddp", [10.0, 10.2])
    # perplexity e^2 at 10 s, e^1.9 at 20 s; a target between them is interpolated
    hi, lo = np.exp(2.0), np.exp(1.9)
    target = lo * 1.01
    t = time_to_target(load(root), target=target).set_index("run_id")
    f = (hi - target) / (hi - lo)
    assert set(t["target"]) == {target} and t.loc["ddp0", "time_s"] == 10 + 10 * f and t["reached"].all()
    # the default: the level reached halfway in epochs to the best (epoch 2 of 2): epoch 1's e^2, at 10 s
    t = time_to_target(load(root)).set_index("run_id")
    assert set(t["target"]) == {hi} and t.loc["ddp0", "time_s"] == 10.0
    assert time_to_target(load(root), target=1.0)["reached"].sum() == 0  # never reached: counted, no time
    same = tmp_path / "same"
    for i, w in enumerate([10.0, 10.2]):
        epochs = [_epoch(e, 2.0, 10, 8, 1, partial=False, wall_time_s=w * (e + 1)) for e in range(2)]
        write_run(same, f"ddp{i}", "ddp", 1, epochs=epochs, trainer={"seed": 1234})  # one seed twice
    v = which_adapter(load(same))["wl"]
    assert not v["fastest"]["fastest"] and any("at least 2 seeds" in u for u in v["undecided"])


def test_run_spread_is_the_newest_aa_measurement(tmp_path):
    assert run_spread(tmp_path) == 0.0
    (tmp_path / "exp" / "noise").mkdir(parents=True)
    (tmp_path / "exp" / "noise" / "noise-1.json").write_text(json.dumps({"kind": "A/A", "spread": 0.031}))
    (tmp_path / "exp" / "noise" / "noise-2.json").write_text(json.dumps({"kind": "A/B", "spread": None}))
    assert run_spread(tmp_path) == 0.031


def test_report_tables_carry_intervals_and_claims_give_verdicts(tmp_path):
    from ptbench.analysis.claims import fastest
    from ptbench.analysis.report import write_report
    from ptbench.analysis.tables import runs

    root = tmp_path / "r"
    _runs(root, "ddp", "ddp", [10.0, 10.2, 9.9])
    _runs(root, "z", "zero", [12.0, 12.1, 11.9], settings={"stage": 1})
    write_report(root, tmp_path / "out")
    assert "### Intervals over repeats" in (tmp_path / "out" / "report-details.md").read_text()
    t = __import__("pandas").read_csv(tmp_path / "out" / "intervals.csv")
    assert {"repeats", "epoch_time_used_s_lo", "epoch_time_used_s_hi", "samples_per_s_lo"} <= set(t.columns)
    assert set(t["repeats"]) == {3}
    # the claims' "fastest framework": a verdict with its interval; equal times: not distinguishable
    per_run = runs(load(root))
    per_run["time_per_sample_used_s"] = [1.0, 1.02, 0.99, 1.2, 1.21, 1.19]
    found = fastest(per_run)[0]["numbers"]
    assert "ddp gb=8/replica is 19.6 % faster than zero stage=1 gb=8/replica [15.9 %, 23.4 %]" in found
    per_run["time_per_sample_used_s"] = [1.0, 1.02, 0.99, 1.0, 0.99, 1.02]
    said = fastest(per_run)[0]["numbers"]
    assert "not faster than every other series" in said and "equivalent within ±5 %" in said


def test_epoch_time_table_and_figure_carry_the_95_interval(tmp_path):
    from ptbench.analysis import plots
    from ptbench.analysis.tables import Study

    root = tmp_path / "r"
    _runs(root, "ddp", "ddp", [10.0, 10.2, 9.9])
    fig = plots.epoch_time(Study(load(root)))
    row = fig.bench_data.iloc[0]
    assert row["runs"] == 3 and row["epoch_time_s"] == 2.0  # equal times: an interval of width 0
    assert row["epoch_time_lo"] == row["epoch_time_hi"] == 2.0
