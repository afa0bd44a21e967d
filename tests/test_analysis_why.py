"""The report's "Why" from real profiled records (2 ranks, gloo): the breakdown figure splits a profiled step
into compute, exposed communication, pipeline bubble and other, parts that add up to the step the traces
measured; the Why section gives MFU both ways (flops_check) and the memory ledger per point."""

from __future__ import annotations

import pytest

from ptbench.analysis import plots
from ptbench.analysis.load import load
from ptbench.analysis.report import _fmt, write_report
from ptbench.analysis.tables import Study
from tests.helpers import GPT2_REFERENCE, bench, check_ok, run_dirs, summary

RUN = [o for o in GPT2_REFERENCE if not o.startswith("trainer.max_steps")] + [
    "trainer.max_steps=5",
    "trainer.eval_every_epoch=false",
    "launcher.nprocs=2",
]
PROFILE = "trainer.profile=3:2"
PIPELINE = ["adapter=pipeline", "adapter.schedule=gpipe", "trainer.batch_size=8"]
# the parts are the per-rank step split into a partition, averaged: only float rounding may separate them
SUM_RTOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A profiled 2-stage gpipe pipeline, a profiled DDP run, and a DDP run at another batch not profiled."""
    root = tmp_path_factory.mktemp("why")
    for overrides in ([*PIPELINE, PROFILE], ["adapter=ddp", PROFILE], ["adapter=ddp", "trainer.batch_size=8"]):
        check_ok(bench(*RUN, *overrides, results=root))
    return root


@pytest.fixture(scope="module")
def report(results, tmp_path_factory):
    out = tmp_path_factory.mktemp("why_report")
    write_report(results, out)
    return out / "report-details.md"  # the ledgers sit beside report.md, which links them


def _records(results) -> dict:
    """{adapter (+ "_plain" when not profiled): summary}"""
    out = {}
    for d in run_dirs(results):
        s = summary(d)
        out[s["adapter"] + ("" if s.get("profile") else "_plain")] = s
    assert set(out) == {"pipeline", "ddp", "ddp_plain"}, sorted(out)
    return out


def test_profiled_parts_add_up_to_the_measured_step(results, report):
    assert (report.parent / "figures" / "breakdown.png").stat().st_size > 0
    table = Study(load(results)).breakdown
    recs = _records(results)
    rows = {r["label"].split()[0] + ("" if r["split"] else "_plain"): r for _, r in table.iterrows()}
    assert set(rows) == set(recs), list(rows)
    for name in ("pipeline", "ddp"):
        row, ranks = rows[name], recs[name]["profile"]["ranks"]
        step = 1e3 * sum(r["step_time_s"] for r in ranks) / len(ranks)
        assert row["profiled_step_ms"] == pytest.approx(step, rel=1e-9)
        parts = [row[f"profiled_{p}_ms"] for p in ("compute", "exposed_comm", "bubble", "other")]
        assert all(p >= 0 for p in parts), parts
        assert sum(parts) == pytest.approx(step, rel=SUM_RTOL), (parts, step)
        # compute is what the traces measured on the ranks (a pipeline stage's too: gloo's p2p runs on its thread)
        compute = 1e3 * sum(r["compute_s"] for r in ranks) / len(ranks)
        assert row["profiled_compute_ms"] == pytest.approx(compute, rel=1e-9) and compute > 0, ranks
    assert rows["pipeline"]["profiled_bubble_ms"] > 0  # 2 stages, m = 8: theory alone is 1/9 of the span
    assert rows["ddp"]["profiled_bubble_ms"] == 0
    plain = rows["ddp_plain"]  # not profiled: today's phases, no split
    assert plain["profiled_step_ms"] != plain["profiled_step_ms"]  # NaN
    assert plain["forward_backward_ms"] > 0 or plain["forward_ms"] > 0


def test_figure_draws_the_split_and_the_phases_apart(results):
    fig = plots.breakdown(load(results))
    (ax,) = fig.axes
    drawn = {c.get_label(): c for c in ax.containers}
    assert {"profiled: compute", "profiled: pipeline bubble", "profiled: other"} <= set(drawn), set(drawn)
    assert any(lab in drawn for lab in ("forward", "forward_backward")), set(drawn)  # the plain point's phases
    data = fig.bench_data
    tops = {}
    for c in ax.containers:
        for bar in c.patches:
            x = round(bar.get_x() + bar.get_width() / 2)
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    points = sorted(zip(data["label"], data["devices"].astype(int)))
    for _, r in data.iterrows():  # each bar's top: the profiled step, or the phases' step
        x = points.index((r["label"], int(r["devices"])))
        want = r["profiled_step_ms"] if r["split"] else r["step_ms"]
        assert tops[x] == pytest.approx(want, rel=SUM_RTOL), (r["label"], tops[x], want)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == len(set(legend))


def test_why_lists_mfu_both_ways_and_the_memory_ledger(results, report):
    text = report.read_text()
    why = text[text.index("## Why (measured from traces") : text.index("## Runs that did not finish")]
    mfu = why[why.index("### MFU both ways") : why.index("### Memory ledger")]
    mem = why[why.index("### Memory ledger") :]
    for name, s in _records(results).items():
        label = next(r for r in load(results).itertuples() if r.run_id == s["run_id"]).label
        fc, ml = s["flops_check"], s["memory_ledger"]
        (row,) = [ln for ln in mfu.splitlines() if ln.startswith(f"| gpt2_tiny: {label} x2 ")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [
            _fmt(fc["formula_train_flops_per_sample"]),
            _fmt(fc["counted_train_flops_per_sample"]),
            _fmt(fc["ratio"]),
        ], (name, row)
        (row,) = [ln for ln in mem.splitlines() if ln.startswith(f"| gpt2_tiny: {label} x2 ")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [
            _fmt(ml["predicted_saved_bytes"] / 1e6),
            _fmt(ml["counted_saved_bytes"] / 1e6),
            _fmt(ml["ratio"]),
        ], (name, row)
    assert fc["convention"] in mfu
    assert "the parts add up to the profiled step" in report.with_name("report.md").read_text()  # under Figures


def test_why_bubble_table_carries_the_records_wall_and_steady_figures(results, report):
    """The bubble table's row of the profiled pipeline: the record's wall ratio, its steady steps out of the
    profiled ones, and the steady ratio ("-" when no step was steady)."""
    text = report.read_text()
    sec = text[text.index("### Pipeline bubble per step") :]
    sec = sec[: sec.index("\n###")] if "\n###" in sec else sec
    b = _records(results)["pipeline"]["profile"]["bubble"]
    header, _, *rows = [ln for ln in sec.splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in header.strip("|").split("|")]
    (row,) = rows
    cells = dict(zip(cols, [c.strip() for c in row.strip("|").split("|")]))
    assert cells["wall/theory"] == _fmt(b["ratio"]) and cells["steady steps"] == f"{b['steady_steps']}/{b['steps']}"
    assert b["steps"] == 2 and cells["steady/theory"] == _fmt(b["steady_ratio"])  # none steady: "-"
