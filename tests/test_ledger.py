"""The communication ledger: bytes measured from real traces (2 ranks, gloo) equal the corrected formulas
(bench/core/comm_volume/ `corrected`), each correction stated; the trace arithmetic and the bubble rule."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ptbench.core import trace_ledger as tl
from ptbench.core.comm_volume import corrected, record_fields, volume
from tests.helpers import GPT2_REFERENCE, bench, check_ok, only_run, summary

RUN = [o for o in GPT2_REFERENCE if not o.startswith("trainer.max_steps")] + [
    "trainer.max_steps=5",
    "trainer.eval_every_epoch=false",
    "launcher.nprocs=2",
    "trainer.profile=3:2",
]

TP2PP2 = ["adapter=megatron", "adapter.tensor_parallel=2", "adapter.pipeline_parallel=2", "trainer.batch_size=8"]
CASES = {
    "zero1": (["adapter=zero", "adapter.stage=1"], "use_multi_rank_bucket_allreduce"),
    "zero3": (["adapter=zero", "adapter.stage=3"], "stage3_max_reuse_distance"),
    "fsdp": (["adapter=fsdp"], "reshard_after_forward=False"),
    "megatron_tp2": (["adapter=megatron", "adapter.tensor_parallel=2"], "vocab-parallel cross-entropy"),
    "megatron-sp": (
        ["adapter=megatron", "adapter.tensor_parallel=2", "adapter.sequence_parallel=true"],
        "adapter.sequence_parallel=true",
    ),
    "pipeline_pp2": (["adapter=pipeline", "adapter.schedule=gpipe", "trainer.batch_size=8"], "TiedPair"),
    "megatron_pp2": (["adapter=megatron", "adapter.pipeline_parallel=2", "trainer.batch_size=8"], "embedding group"),
    # 4 ranks, TP=2 x PP=2: the embedding's collectives on the first stage, the output layer's and loss's on the last
    "megatron_tp2pp2": ([*TP2PP2, "launcher.nprocs=4"], "busiest stage counted, p = 2"),
    "megatron_tp2pp2-sp": (
        [*TP2PP2, "adapter.sequence_parallel=true", "launcher.nprocs=4"],
        "busiest stage counted, p = 2",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_measured_bytes_within_2_percent_of_the_corrected_formula(tmp_path, case):
    overrides, cause = CASES[case]
    proc = bench(*RUN, *overrides, results=tmp_path)
    check_ok(proc)
    prof = summary(only_run(tmp_path))["profile"]
    rows = {r["kind"]: r for r in prof["ledger"]}
    for kind, formula in prof["formula"]["by_op"].items():
        assert rows[kind]["measured_bytes"] == pytest.approx(formula, rel=0.02), (kind, rows[kind])
    for row in rows.values():  # nothing sizeable measured that the formula lacks
        if row["formula_bytes"] is None:
            assert row["measured_bytes"] < 0.001 * prof["formula"]["total_bytes"], row
    assert any(cause in d for d in prof["formula"]["differences"]), prof["formula"]["differences"]
    if case in ("pipeline_pp2", "megatron_pp2"):
        b = prof["bubble"]
        assert b["stages"] == 2 and b["microbatches"] == 8 and b["theory"] == pytest.approx(1 / 9)
        assert len(b["per_stage"]) == 2 and all(0 <= v < 1 for v in b["per_stage"]), b


def test_ledger_command_measures_busbw_and_the_report_times_each_kind_at_it(tmp_path, capsys):
    """`python -m ptbench.studies.ledger --only bytes --runs ddp`: the table's row (measured = formula), the bus bandwidth
    measured at 2 ranks stored where the report looks, and the report's ledger row timed at that bandwidth."""
    from ptbench.analysis.load import load, load_comm
    from ptbench.analysis.report import why_lines

    cmd = [sys.executable, "-m", "ptbench.studies.ledger", "--only", "bytes", "--runs", "ddp", "--root", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("ddp "))
    assert row[1] == "all_reduce" and row[4] == "1.000", row
    comm = json.loads((tmp_path / "ledger" / "comm" / "gloo-2.json").read_text())
    assert {r["op"] for r in comm["results"]} == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert f"python -m ptbench.analysis report {tmp_path}" in proc.stdout
    assert re.search(r"^ledger \[1/1\] ddp: ok in \d+s$", proc.stdout, re.M), proc.stdout  # its progress line
    lines = "\n".join(why_lines(load(tmp_path), load_comm(tmp_path))).splitlines()
    head = next(line for line in lines if line.startswith("| run") and "ms at measured busbw" in line)
    col = [c.strip() for c in head.split("|")].index("ms at measured busbw")
    cells = next([c.strip() for c in line.split("|")] for line in lines if "| all_reduce " in line)
    assert float(cells[col]) > 0, cells
    # a second ledger on the same root keeps the measurement there, never overwrites it
    from ptbench.studies.ledger import measure_busbw

    before = (tmp_path / "ledger" / "comm" / "gloo-2.json").read_bytes()
    assert measure_busbw(tmp_path) == tmp_path / "ledger" / "comm" / "gloo-2.json"
    assert (tmp_path / "ledger" / "comm" / "gloo-2.json").read_bytes() == before
    assert "kept the measurement already in" in capsys.readouterr().out


def _cost(*overrides: str):
    """The adapter's own cost inputs (what `corrected` reads) for a composed config."""
    from ptbench.adapters import get_adapter_class
    from ptbench.runner.compose import compose, typed

    cfg = typed(compose(["workload=gpt2_tiny", *overrides]))
    return get_adapter_class(cfg.adapter.name).cost_inputs(cfg)


WL = SimpleNamespace(kind="language", n_layer=2, n_embd=128, vocab_size=1024)


def test_corrections_change_what_the_frameworks_change():
    psi = 1_000_000
    z1 = record_fields(volume("zero1", params=psi, world_size=4))
    c = corrected(z1, _cost("adapter=zero", "adapter.stage=1"), WL)
    assert c["total_bytes"] == pytest.approx(1.5 * z1["total_bytes"])
    assert c["uncorrected_total_bytes"] == z1["total_bytes"] and len(c["differences"]) == 1
    z3 = record_fields(volume("zero3", params=psi, world_size=4))
    c = corrected(z3, _cost("adapter=zero", "adapter.stage=3"), WL)
    assert c["total_bytes"] == pytest.approx(z3["total_bytes"] / 1.5)
    ddp = record_fields(volume("none", params=psi, world_size=4))
    assert corrected(ddp, _cost("adapter=ddp"), WL)["total_bytes"] == ddp["total_bytes"]
    assert corrected(ddp, _cost("adapter=ddp"), WL)["differences"] == []
    fs = record_fields(volume("fsdp", params=psi, world_size=4))
    c = corrected(fs, _cost("adapter=fsdp", "adapter.reshard_after_forward=true"), WL, root_params=psi // 4)
    g = 3 / 4 * psi * 4
    assert c["total_bytes"] == pytest.approx(3 * g - g / 4)
    tp = record_fields(volume("none", params=psi, world_size=2, tp=2, layers=2, hidden=128, seq_len=32, micro_batch=4))
    c = corrected(tp, _cost("adapter=megatron", "adapter.sequence_parallel=false"), WL)
    act = 4 * 32 * 128 * 4
    assert c["total_bytes"] - tp["total_bytes"] == pytest.approx(2 * act + 3 * 4 * 32 * 4)


def test_sequence_parallel_formula_and_megatron_corrections():
    """[SP] (Korthikanti et al. 2022, 4.2.2): each layer's 4 all-reduces become 4 all-gathers + 4 reduce-scatters,
    the same bytes; megatron-core adds the backward re-gathers, the embedding / output layer / loss collectives
    and the all-reduce of the sequence-parallel LayerNorm and bias gradients. t=2, L=2, h=128, s=32, b=4, m=1."""
    kw = dict(params=1_000_000, world_size=2, tp=2, layers=2, hidden=128, seq_len=32, micro_batch=4)
    act = 4 * 32 * 128 * 4  # b*s*h*B
    plain = volume("none", **kw)
    sp = volume("none", sequence_parallel=True, **kw)
    assert set(sp["bytes"]) == {"tp_activation_all_gather", "tp_activation_reduce_scatter"}
    assert sp["bytes"]["tp_activation_all_gather"] == sp["bytes"]["tp_activation_reduce_scatter"] == 8 * act / 2
    assert sp["total"] == pytest.approx(plain["total"])
    # stage sends carry the sequence shard
    pp = volume("none", sequence_parallel=True, **{**kw, "world_size": 4, "pp": 2})
    assert pp["bytes"]["pp_activation_send"] == act / 2
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        volume("none", sequence_parallel=True, **{**kw, "tp": 1})

    c = corrected(
        record_fields(sp), _cost("adapter=megatron", "adapter.tensor_parallel=2", "adapter.sequence_parallel=true"), WL
    )
    # all-gathers: [SP] 4 a layer, megatron's 2 backward re-gathers a layer, 3 of the embedding and output layer
    assert c["by_op"]["all_gather"] == pytest.approx((8 + 4 + 3) * act / 2)
    # reduce-scatters: [SP] 4 a layer, the output layer's input gradient
    assert c["by_op"]["reduce_scatter"] == pytest.approx((8 + 1) * act / 2)
    norms = 2 * (2 * 2 * 128 + 2 * 128) + 2 * 128  # 2 layers x (2 LayerNorms + 2 row-parallel biases) + final norm
    assert c["by_op"]["all_reduce"] == pytest.approx(act + 3 * 4 * 32 * 4 + norms * 4)
    assert len(c["differences"]) == 3 and all("adapter.sequence_parallel=true" in d for d in c["differences"])


def test_megatron_tp_with_pp_counts_each_kind_on_its_busiest_stage():
    """TP=2 x PP=2 (L=2, one layer a stage, m=1): the embedding's collectives are the first stage's, the output
    layer's, the loss's and the final norm's the last stage's; each kind is counted on the stage that moves more
    of it (the ledger's busiest rank per kind), never both stages' summed as at p = 1."""
    kw = dict(params=1_000_000, world_size=4, tp=2, pp=2, layers=2, hidden=128, seq_len=32, micro_batch=4)
    act, ce = 4 * 32 * 128 * 4, 3 * 4 * 32 * 4  # b*s*h*B; the loss's 3 fp32 b*s all-reduces (ring factor 1 at t=2)
    cost = ["adapter=megatron", "adapter.tensor_parallel=2", "adapter.pipeline_parallel=2"]

    def extra(c: dict, base: dict, op: str) -> float:  # beyond the papers' items and the tied embedding's
        tied = sum(it["bytes"] for it in c["collectives"] if it["name"].startswith("pp_tied") and it["op"] == op)
        return c["by_op"].get(op, 0.0) - base["by_op"].get(op, 0.0) - tied

    plain = record_fields(volume("none", **kw))
    c = corrected(plain, _cost(*cost, "adapter.sequence_parallel=false"), WL)
    assert extra(c, plain, "all_reduce") == pytest.approx(act + ce)  # the last stage's output layer and loss
    assert any("busiest stage counted, p = 2" in d for d in c["differences"])

    sp = record_fields(volume("none", sequence_parallel=True, **kw))
    c = corrected(sp, _cost(*cost, "adapter.sequence_parallel=true"), WL)
    # all-gathers: the layer's 2 backward re-gathers (every stage) + the output layer's 2 (last; the first's
    # embedding gradient makes 1)
    assert extra(c, sp, "all_gather") == pytest.approx((2 + 2) * act / 2)
    assert extra(c, sp, "reduce_scatter") == pytest.approx(act / 2)  # the output layer's input gradient (last)
    layer = 2 * 128 + 2 * 128 + 2 * 128  # one layer's LayerNorms (weight, bias) and row-parallel biases
    first, last = act + layer * 4, ce + (layer + 2 * 128) * 4  # embedding output vs loss + the final norm
    assert first > last and extra(c, sp, "all_reduce") == pytest.approx(first)


def test_interval_arithmetic():
    assert tl.union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert tl.length([(0, 3), (5, 6)]) == 4
    assert tl.minus([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == pytest.approx(10 - 3 - 2)
    assert tl.minus([(0, 1)], []) == 1 and tl.minus([], [(0, 1)]) == 0
    assert tl.clip([(0, 5), (6, 9)], 2, 7) == [(2, 5), (6, 7)]


def test_bubble_of_an_ideal_gpipe_schedule_is_the_theory():
    """p stages, m micro-batches of unit forward and backward work, laid out as GPipe does."""
    for p, m in ((2, 4), (4, 8)):
        per_rank = []
        for s in range(p):
            fwd = [[s + i, s + i + 1] for i in range(m)]
            b0 = m + p - 1 + (p - 1 - s)  # backward starts at the last stage
            bwd = [[b0 + i, b0 + i + 1] for i in range(m)]
            per_rank.append({"stage_work": {7: fwd + bwd}})
        b = tl.bubble(per_rank, m)
        assert b["theory"] == pytest.approx((p - 1) / (m + p - 1))
        assert b["mean"] == pytest.approx(b["theory"]) and b["ratio"] == pytest.approx(1.0)


def test_replay_of_measured_items_in_gpipe_order():
    """Equal unit items in GPipe order replay to the theory; a slow stage raises the others' bubble."""
    p, m = 3, 4
    items = [[["fwd", 0, 1]] * m + [["bwd", 0, 1]] * m for _ in range(p)]
    got = tl.replay(items)
    assert got == pytest.approx([(p - 1) / (m + p - 1)] * p)
    items[1] = [["fwd", 0, 2]] * m + [["bwd", 0, 2]] * m
    slow = tl.replay(items)
    assert slow[1] < got[1] and slow[0] > got[0] and slow[2] > got[2]


def test_marks_are_counted_and_a_mark_inside_another_is_found():
    assert tl.marked([["fwd", 0, 1], ["fwd", 1, 2], ["bwd", 2, 4]]) == ({"fwd": 2, "bwd": 1}, 0)
    # a wrapped function calling another wrapped one: the inner mark is the same item marked twice
    assert tl.marked([["fwd", 0, 3], ["fwd", 1, 2], ["bwd", 3, 4], ["bwd", 3, 4]]) == ({"fwd": 2, "bwd": 2}, 2)
    p, m = 2, 2
    per_rank = []
    for s in range(p):
        items = [["fwd", s + i, s + i + 1] for i in range(m)] + [
            ["bwd", 4 + i + (1 - s), 5 + i + (1 - s)] for i in range(m)
        ]
        per_rank.append({"stage_work": {3: [it[1:] for it in items]}, "stage_items": {3: items}})
    b = tl.bubble(per_rank, m, "pipeline gpipe")
    assert b["marked_once"] and b["nested_marks"] == 0 and b["schedule"] == "pipeline gpipe"
    assert b["marks"] == [{"fwd": [m], "bwd": [m]}] * p
    assert b["item_cv"] == {"fwd": 0.0, "bwd": 0.0}  # equal items, as the theory assumes
    per_rank[1]["stage_items"][3].append(["bwd", 5.5, 5.6])  # one backward marked twice
    b = tl.bubble(per_rank, m)
    assert not b["marked_once"] and b["nested_marks"] == 1 and b["marks"][1]["bwd"] == [m + 1]
    bwd = [1, 1, 1, 1, 0.1]  # the items' spread: population std / mean
    assert b["item_cv"]["bwd"] == pytest.approx(statistics.pstdev(bwd) / statistics.mean(bwd))


def _gpipe_step(m: int, fwd: list[list[float]], bwd: list[list[float]]) -> list[list]:
    """Per stage (2), one GPipe step's [tag, t0, t1] items with the given item durations (fwd[s][i], bwd[s][i]),
    each started as soon as the schedule's dependencies allow."""
    items: list[list] = [[], []]
    end = {}
    for i in range(m):
        for s in range(2):
            t0 = max(end.get((s, "fwd", i - 1), 0.0), end.get((s - 1, "fwd", i), 0.0))
            end[(s, "fwd", i)] = t0 + fwd[s][i]
            items[s].append(["fwd", t0, end[(s, "fwd", i)]])
    last = max(end.values())
    for i in range(m):
        for s in (1, 0):
            t0 = max(end.get((s, "bwd", i - 1), last if s == 1 else 0.0), end.get((s + 1, "bwd", i), 0.0))
            end[(s, "bwd", i)] = t0 + bwd[s][i]
            items[s].append(["bwd", t0, end[(s, "bwd", i)]])
    return items


def test_steady_steps_are_chosen_on_item_times_and_a_heavier_stage_is_not_spread():
    """The bubble's steady figure averages only the steps whose items kept equal times (the theory's setting): a
    step with one slow item is left out (its bubble is wider), a stage uniformly heavier than the other is not
    counted as spread, and with no steady step the figure is absent rather than made up."""
    m = 4
    even = _gpipe_step(m, [[1.0] * m, [1.1] * m], [[2.0] * m, [2.2] * m])  # stage 1 10 % heavier throughout
    slow = _gpipe_step(m, [[1.0] * m, [1.1, 1.1, 2.2, 1.1]], [[2.0] * m, [2.2] * m])  # one forward 2x
    per_rank = [{"stage_work": {}, "stage_items": {}} for _ in range(2)]
    for g, step in ((2, even), (3, slow), (4, even)):
        for s in range(2):
            per_rank[s]["stage_items"][g] = step[s]
            per_rank[s]["stage_work"][g] = [it[1:] for it in step[s]]
    b = tl.bubble(per_rank, m, "pipeline gpipe")
    assert b["steps"] == 3 and b["steady_cv"] == tl.STEADY_CV
    assert b["step_item_cv"][0] == pytest.approx(0.0, abs=1e-12) == b["step_item_cv"][2]  # heavier stage: no spread
    assert b["step_item_cv"][1] > tl.STEADY_CV  # the slow forward
    assert b["per_step"][1] > b["per_step"][0]  # which widened that step's bubble
    assert b["steady_steps"] == 2 and b["steady_mean"] == pytest.approx((b["per_step"][0] + b["per_step"][2]) / 2)
    assert b["steady_ratio"] == pytest.approx(b["steady_mean"] / b["theory"]) and b["mean"] > b["steady_mean"]
    only_slow = [{"stage_work": {3: r["stage_work"][3]}, "stage_items": {3: r["stage_items"][3]}} for r in per_rank]
    b = tl.bubble(only_slow, m)  # one step: each item is its own stage's median in that direction but one
    assert b["steps"] == 1 and b["step_item_cv"][0] > tl.STEADY_CV
    assert b["steady_steps"] == 0 and b["steady_mean"] is None and b["steady_ratio"] is None


def _stage_marks(trace: dict) -> dict[int, list[tuple[str, float, float]]]:
    """Per profiled step (ptbench.step#G), the rank's ptbench.stage marks in time order, read from the raw trace."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = {
        int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith(tl.STEP)
    }
    marks = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][len(tl.STAGE) :]) for e in spans if e["name"].startswith(tl.STAGE)
    )
    return {g: [(tag, t0, t1) for t0, t1, tag in marks if a <= t0 < b] for g, (a, b) in steps.items()}


def test_megatron_pipeline_bubble_marks_every_item_once(tmp_path):
    """megatron-core's 1F1B (forward_backward_pipelining_without_interleaving) at 2 stages, m = 4 micro-batches
    of one sequence: every micro-batch's forward and backward is marked once on each stage, in 1F1B order (stage
    s: p-s-1 warm-up forwards, then one forward one backward, then the cool-down backwards), and the recorded
    wall bubble is what the raw trace's marks give; each stage idles part of the span (it waits for the other)."""
    p, m = 2, 4
    proc = bench(
        "workload=gpt2_tiny",
        "workload.vocab_size=256",
        "workload.seq_len=32",
        "data.train_samples=64",
        "data.val_samples=8",
        "trainer.max_eval_batches=1",
        "trainer.eval_every_epoch=false",
        "trainer.progress=false",
        "trainer.epochs=1",
        "trainer.max_steps=3",
        "trainer.profile=1:2",
        "adapter=megatron",
        f"adapter.pipeline_parallel={p}",
        f"adapter.microbatches={m}",
        "trainer.batch_size=2",  # batch_policy linear: 2 x 2 ranks = 4 sequences per step, one per micro-batch
        f"launcher.nprocs={p}",
        results=tmp_path,
    )
    check_ok(proc)
    run = only_run(tmp_path)
    b = summary(run)["profile"]["bubble"]
    for key in (
        "schedule",
        "stages",
        "microbatches",
        "steps",
        "marks",
        "nested_marks",
        "marked_once",
        "per_stage",
        "mean",
        "theory",
        "ratio",
        "replayed_per_stage",
        "replayed_mean",
        "replayed_ratio",
        "definition",
    ):
        assert key in b, key
    assert b["schedule"] == "megatron 1f1b" and b["stages"] == p and b["microbatches"] == m and b["steps"] == 2
    assert b["theory"] == pytest.approx((p - 1) / (m + p - 1))
    assert b["marked_once"] and b["nested_marks"] == 0 and b["marks"] == [{"fwd": [m, m], "bwd": [m, m]}] * p
    assert len(b["per_stage"]) == p and all(0 < v < 1 for v in b["per_stage"]), b
    assert len(b["replayed_per_stage"]) == p and all(0 < v < 1 for v in b["replayed_per_stage"]), b
    assert b["mean"] == pytest.approx(sum(b["per_stage"]) / p) and b["ratio"] == pytest.approx(b["mean"] / b["theory"])
    assert len(b["per_step"]) == 2 and b["mean"] == pytest.approx(sum(b["per_step"]) / 2)  # the spread over steps
    assert set(b["item_cv"]) == {"fwd", "bwd"}, b["item_cv"]  # its size is the machine's noise: checked below
    assert len(b["step_item_cv"]) == 2 and 0 <= b["steady_steps"] <= 2, b
    steady = [v for v, c in zip(b["per_step"], b["step_item_cv"]) if c <= b["steady_cv"]]
    assert b["steady_mean"] == (pytest.approx(sum(steady) / len(steady)) if steady else None)

    marks = {s: _stage_marks(json.loads((run / "traces" / f"rank{s}.json").read_text())) for s in range(p)}
    assert sorted(marks[0]) == sorted(marks[1]) == [1, 2]
    for tag in ("fwd", "bwd"):  # the spread of one direction's item times over stages and steps, from the raw marks
        ds = [t1 - t0 for s in range(p) for g in (1, 2) for t, t0, t1 in marks[s][g] if t == tag]
        assert b["item_cv"][tag] == pytest.approx(statistics.pstdev(ds) / statistics.fmean(ds), rel=1e-3), tag
    idle = [[] for _ in range(p)]
    for g in (1, 2):
        for s in range(p):
            warmup = p - s - 1
            order = ["fwd"] * warmup + ["fwd", "bwd"] * (m - warmup) + ["bwd"] * warmup
            assert [tag for tag, _, _ in marks[s][g]] == order, (s, g, marks[s][g])
            for (_, _, end), (_, start, _) in zip(marks[s][g], marks[s][g][1:]):
                assert end <= start  # one item at a time: none inside another
        lo = min(t0 for s in range(p) for _, t0, _ in marks[s][g])
        hi = max(t1 for s in range(p) for _, _, t1 in marks[s][g])
        for s in range(p):
            idle[s].append(1 - sum(t1 - t0 for _, t0, t1 in marks[s][g]) / (hi - lo))
    assert b["per_stage"] == pytest.approx([sum(v) / len(v) for v in idle], rel=1e-6)
