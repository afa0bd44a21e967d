"""The report's layout: report.md opens with its answers (fastest per device count with its interval or "not
distinguishable", best scaling, lowest memory, the claims' verdicts counted, what could not be decided and why),
then the figures, then the tables; every table treats contended and single runs as the verdicts do; per-run
tables and ledgers go to report-details.md, which report.md links; the epoch-time figure dodges its series."""

import json

import numpy as np
import pandas as pd
from test_analysis import MIB, _two_epochs, write_run

from ptbench.analysis import load, plots
from ptbench.analysis.report import SECTIONS, write_report

BUSY = "contention: during the run other processes kept 1.6 CPU(s) busy: times are not comparable; run alone"


def _point(root, name, adapter, devices, times, settings=None, busy=(), peak=100):
    """One run per epoch time in `times` (the steady epoch), each its own seed; runs whose index is in `busy`
    warn of contention."""
    for i, t in enumerate(times):
        epochs = _two_epochs(t, 10, 8 * devices, devices, peak=peak * MIB, delta=peak * MIB)
        d = write_run(root, f"{name}{i}", adapter, devices, epochs=epochs, settings=settings, trainer={"seed": i})
        if i in busy:
            s = json.loads((d / "summary.json").read_text())
            (d / "summary.json").write_text(json.dumps({**s, "warnings": [BUSY]}))


def _sweep(root, busy_zero=(1,)):
    _point(root, "ddp1_", "ddp", 1, [4.0, 4.1, 3.9])
    _point(root, "ddp2_", "ddp", 2, [2.5, 2.6, 2.4], peak=120)
    _point(root, "fsdp2_", "fsdp", 2, [2.2, 2.6, 2.35], peak=80)  # within ddp's spread: not distinguishable
    # zero's second run was contended and very fast: the verdicts leave it out, so must the tables
    _point(root, "zero2_", "zero", 2, [3.5, 0.5, 3.6], settings={"stage": 1}, busy=busy_zero, peak=90)


def _sections(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("## ")]


def _row(text: str, label: str, devices: int) -> dict:
    """The summary table's row of a point, as {column: cell}."""
    table = text.split("## Summary (finished runs)")[1].split("\n## ")[0]
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    for ln in lines[2:]:
        cells = dict(zip(cols, [c.strip() for c in ln.strip("|").split("|")]))
        if cells["series"] == label and cells["devices"] == str(devices):
            return cells
    raise AssertionError(f"no row {label} x{devices}")


def test_the_report_answers_first_and_links_its_details(tmp_path):
    root = tmp_path / "r"
    _sweep(root)
    path = write_report(root, tmp_path / "out")
    text = path.read_text()
    assert text.splitlines()[0] == f"# Benchmark report: {root}"
    assert _sections(text) == list(SECTIONS)
    assert "[report-details.md](report-details.md)" in text
    answers = text.split("## Answers")[1].split("## Figures")[0]
    # fastest per device count: the best point with its interval, "not distinguishable" where it is not shown
    assert "- **Fastest at 1 device**: only `ddp gb=8/replica` ran there, nothing to compare." in answers
    x2 = next(ln for ln in answers.splitlines() if ln.startswith("- **Fastest at 2 devices**"))
    assert "**`fsdp gb=8/replica`**" in x2 and "ms/sample [" in x2 and "not distinguishable from `ddp" in x2
    assert "faster than `zero stage=1 gb=8/replica` by" in x2  # its contended 0.5 s run is left out
    assert "- **Best scaling at 2 devices**: **`fsdp gb=8/replica`** efficiency" in answers
    assert "2 devices **`fsdp gb=8/replica`** 80 MiB" in answers
    assert "- **Paper claims**: " in answers and "undecided" in answers
    assert "**1 of 12 finished runs warn of contention**: left out of every answer and verdict" in answers
    assert "- **Could not decide**: " in answers
    details = (tmp_path / "out" / "report-details.md").read_text()
    for section in ("### Intervals over repeats", "## Which adapter"):  # per-run tables: only in the details
        assert section in details and section not in text
    assert "## Paper claims" in details and "zero2_0, zero2_2" in details and "zero2_0" not in text  # with its runs


def test_tables_treat_contended_and_single_runs_as_the_verdicts_do(tmp_path):
    root = tmp_path / "r"
    _sweep(root)
    _point(root, "tp2_", "tensor_parallel", 2, [2.7])  # one run: no interval
    _point(root, "hvd2_", "horovod", 2, [1.0], busy=(0,))  # its only run contended: out of every verdict
    text = write_report(root, tmp_path / "out").read_text()
    zero = _row(text, "zero stage=1 gb=8/replica", 2)
    assert zero["in verdicts"] == "2 of 3 runs: 1 contended" and zero["runs"] == "2"
    # the table's numbers are those of the runs the verdicts use: (3.5 + 3.6) / 2, not the contended 0.5
    assert float(zero["epoch time (s)"]) == np.mean([3.5, 3.6])
    assert _row(text, "tensor_parallel gb=8/replica", 2)["in verdicts"] == "1 run: no interval"
    assert _row(text, "horovod gb=8/replica", 2)["in verdicts"] == "no: 1 contended run"
    assert _row(text, "ddp gb=8/replica", 1)["in verdicts"] == "yes"
    summary = pd.read_csv(tmp_path / "out" / "summary.csv").set_index(["label", "devices"])
    assert summary.loc[("zero stage=1 gb=8/replica", 2), "runs"] == 2
    intervals = pd.read_csv(tmp_path / "out" / "intervals.csv").set_index(["label", "devices"])
    assert intervals.loc[("zero stage=1 gb=8/replica", 2), "repeats"] == 2
    assert intervals.loc[("horovod gb=8/replica", 2), "in verdicts"] == "no: 1 contended run"
    # asked to keep them: every run counts, and the table says so
    text = write_report(root, tmp_path / "kept", include_contended=True).read_text()
    assert _row(text, "zero stage=1 gb=8/replica", 2)["in verdicts"] == "yes"
    assert "warn of contention** and are kept (`--include-contended`)" in text


def test_every_run_contended_still_answers_why_nothing_was_decided(tmp_path):
    root = tmp_path / "r"
    _point(root, "ddp1_", "ddp", 1, [4.0, 4.1], busy=(0, 1))
    _point(root, "ddp2_", "ddp", 2, [2.5, 2.6], busy=(0, 1))
    text = write_report(root, tmp_path / "out").read_text()
    answers = text.split("## Answers")[1].split("## Figures")[0]
    assert "**4 of 4 finished runs warn of contention**" in answers and "1.6 CPU(s) busy" in answers
    assert "- **Could not decide**: every finished run warns of contention, so no time compares" in answers
    assert "- **Paper claims**: none checked" in answers
    assert _row(text, "ddp gb=8/replica", 2)["in verdicts"] == "no: 2 contended runs"


def test_the_epoch_time_figure_dodges_its_series(tmp_path):
    root = tmp_path / "r"
    _sweep(root, busy_zero=())
    fig = plots.epoch_time(load(root))
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines() if ln.get_label() in fig.bench_dodge["wl"]}
    at2 = {lab: float(ln.get_xdata()[-1]) for lab, ln in lines.items()}
    assert len(set(at2.values())) == 3  # three series at 2 devices, three x positions
    assert all(2 / 2**0.15 - 1e-9 <= x <= 2 * 2**0.15 + 1e-9 for x in at2.values())
    assert sorted(at2, key=at2.get) == sorted(at2)  # in the legend's order, left to right
    assert [int(t) for t in fig.axes[0].get_xticks()] == [1, 2]  # the ticks stay at the device counts
    caps = [c for c in fig.axes[0].collections if len(c.get_segments())]  # error bars follow their points
    xs = {round(float(s[0][0]), 9) for c in caps for s in c.get_segments()}
    assert {round(x, 9) for x in at2.values()} <= xs
