"""trainer.profile: per-rank Chrome traces and a merged one that Perfetto opens, the communication ledger in
the record, per-rank collective waits and the straggler an injected fault makes (real runs at 2 ranks, gloo)."""

from __future__ import annotations

import json

import pytest

from ptbench.core.errors import ConfigError
from ptbench.runner.compose import compose, typed
from ptbench.runner.plan import make_plan
from tests.helpers import GPT2_REFERENCE, bench, check_ok, events, only_run, summary

RUN = [o for o in GPT2_REFERENCE if not o.startswith("trainer.max_steps")] + [
    "trainer.max_steps=6",
    "trainer.eval_every_epoch=false",
    "launcher.nprocs=2",
]


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    """DDP at 2 ranks, steps 3-4 profiled, rank 1 a straggler (every step 2x longer, asleep)."""
    results = tmp_path_factory.mktemp("traces")
    proc = bench(*RUN, "adapter=ddp", "trainer.profile=3:2", "trainer.inject_fault=straggler@1:2.0", results=results)
    check_ok(proc)
    return only_run(results)


def _check_trace(trace: dict) -> None:
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        assert "pid" in e and "tid" in e and isinstance(e["name"], str), e


def test_traces_per_rank_and_merged_are_valid_trace_json(straggler_run):
    prof = summary(straggler_run)["profile"]
    assert prof["window"] == {"start": 3, "count": 2}
    assert prof["activities"] == ["cpu"]
    traces = {}
    for rank in (0, 1):
        path = straggler_run / "traces" / f"rank{rank}.json"
        assert str(path) == prof["traces"][rank]
        traces[rank] = json.loads(path.read_text())
        _check_trace(traces[rank])
        steps = sorted(e["name"] for e in traces[rank]["traceEvents"] if e.get("name", "").startswith("ptbench.step#"))
        assert steps == ["ptbench.step#3", "ptbench.step#4"]
    merged = json.loads((straggler_run / "traces" / "merged.json").read_text())
    assert prof["merged_trace"] == str(straggler_run / "traces" / "merged.json")
    _check_trace(merged)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}  # one process row per rank
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    spans = sum(1 for t in traces.values() for e in t["traceEvents"] if e.get("ph") == "X")
    assert sum(1 for e in merged["traceEvents"] if e.get("ph") == "X") == spans


def test_ledger_bytes_equal_the_formula_and_times_are_consistent(straggler_run):
    prof = summary(straggler_run)["profile"]
    (row,) = prof["ledger"]  # DDP: one gradient all-reduce per step
    assert row["kind"] == "all_reduce"
    assert row["ratio"] == pytest.approx(1.0, abs=0.02), row
    assert row["calls"] >= 1 and row["time_s"] > 0
    for r in prof["ranks"]:
        assert 0 <= r["exposed_comm_s"] <= r["comm_time_s"] + 1e-9 <= r["step_time_s"] + 1e-6, r
        assert 0 < r["compute_s"] <= r["step_time_s"] + 1e-6, r


def test_injected_straggler_is_named(straggler_run):
    (event,) = events(straggler_run)
    assert event["slowest_rank"] == 1, event
    assert event["slowest_rank_by"].startswith("step time less collective wait")
    waits = event["rank_comm_wait_s"]
    assert len(waits) == 2 and all(w is not None and w >= 0 for w in waits)
    assert waits[0] > waits[1]  # rank 0 waits for the straggler in the gradient all-reduce
    assert len(event["rank_step_time_mean_s"]) == 2
    assert all("comm_wait_s" not in r for r in event["ranks"])


def test_no_profile_names_the_slowest_by_step_time(tmp_path):
    proc = bench(*RUN, "adapter=ddp", "trainer.max_steps=4", "trainer.inject_fault=straggler@0:0.5", results=tmp_path)
    check_ok(proc)
    run = only_run(tmp_path)
    (event,) = events(run)
    assert event["rank_comm_wait_s"] is None
    assert event["slowest_rank"] in (0, 1) and event["slowest_rank_by"].startswith("own step time")
    assert "profile" not in summary(run)
    assert not (run / "traces").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.profile=3", "trainer.profile=3: use START:COUNT"),
        ("trainer.profile=2:0", "trainer.profile=2:0: use START:COUNT"),
        ("trainer.inject_fault=straggler@1", "straggler@RANK:FRACTION"),
    ],
)
def test_bad_profile_and_straggler_specs_fail_before_launch(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        make_plan(typed(compose(["adapter=ddp", override, f"results.root={tmp_path}"])), "local")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_report_why_section_from_the_record(straggler_run):
    from ptbench.analysis.load import load
    from ptbench.analysis.report import why_lines

    text = "\n".join(why_lines(load(straggler_run.parent)))
    assert "## Why (measured from traces" in text
    assert "### Communication ledger: formula vs measured" in text and "all_reduce" in text
    assert "### Stragglers: who the others wait for" in text
    table = [line for line in text.split("### Stragglers")[1].splitlines() if line.startswith("| ddp")]
    assert table and all(line.split("|")[3].strip() == "1" for line in table), table  # slowest rank column
