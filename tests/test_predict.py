"""`python -m ptbench.predict`: leave-one-out over real CPU records made here (DDP at 1 and 2 ranks, the 1F1B
pipeline at 2 and 4 micro-batches, one ptbench.comm measurement), a target prediction, the one-line refusals,
the report's section, and validate's link shaping in a private network namespace (root only)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import bench, check_ok, run

COMMON = [
    "workload=gpt2_tiny",
    "workload.seq_len=32",
    "workload.vocab_size=4096",
    "data=synthetic",
    "data.train_samples=64",
    "data.val_samples=16",
    "trainer.epochs=2",
    "trainer.batch_size=8",
    "trainer.untimed_steps=1",
    "trainer.progress=false",
]
POINTS = {
    "ddp1": ["adapter=ddp", "launcher.nprocs=1"],
    # one rank at the pipeline's two micro-batch sizes (8 / 2, 8 / 4): how a micro-batch's time moves with its size
    "ddp1_b4": ["adapter=ddp", "launcher.nprocs=1", "trainer.batch_size=4"],
    "ddp1_b2": ["adapter=ddp", "launcher.nprocs=1", "trainer.batch_size=2"],
    "ddp2": ["adapter=ddp", "launcher.nprocs=2"],
    # profiled in its second epoch: the traced collectives and the exposed fraction; its first epoch's steps count
    "pipe2": ["adapter=pipeline", "launcher.nprocs=2", "adapter.microbatches=2", "trainer.profile=8:2"],
    "pipe4": ["adapter=pipeline", "launcher.nprocs=2", "adapter.microbatches=4"],
}
LAST = re.compile(r"^median \|err\| \d+\.\d %, max \d+\.\d %, tau (n/a|-?\d\.\d\d)$")


def predict(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "ptbench.predict", *args], timeout=300)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    """The harness's own runs and comm measurement (about a minute on 2 cores)."""
    root = tmp_path_factory.mktemp("predict") / "results"
    for overrides in POINTS.values():
        mine = {o.split("=")[0] for o in overrides}
        common = [c for c in COMMON if c.split("=")[0] not in mine]
        check_ok(bench(*overrides, *common, "results.experiment=predict", results=root))
    comm = [sys.executable, "-m", "ptbench.comm", "--world-size", "2", "--ops", "all_reduce,send_recv"]
    check_ok(run([*comm, "--max-bytes", "8M", "--iters", "3", "--warmup", "1", "--out", str(root / "comm")], 300))
    return root


def copy_of(records: Path, tmp_path: Path, keep=lambda p: True) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(records, out, ignore=lambda d, names: [n for n in names if not keep(Path(d) / n)])
    return out


def test_leave_one_out_over_real_runs(records, tmp_path):
    folder = copy_of(records, tmp_path)
    proc = predict(str(folder))
    check_ok(proc)
    lines = proc.stdout.strip().splitlines()
    assert LAST.match(lines[-1]), lines[-1]
    assert "run-to-run noise" in proc.stdout and "tau" in proc.stdout
    written = [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
    got = {(r["series"], r["world_size"], r["microbatches"]) for r in written}  # the one-rank b=4, b=2: no peer
    assert got == {
        ("ddp", 1, 1),
        ("ddp", 2, 1),
        ("pipeline schedule=1f1b pp=2", 2, 2),
        ("pipeline schedule=1f1b pp=2", 2, 4),
    }
    steps = {}
    for d in folder.rglob("summary.json"):
        s = json.loads(d.read_text())
        step = s["step_time_mean_s"]
        if s.get("profile"):  # its first epoch: the second holds the profiled steps
            step = json.loads((d.parent / "events.jsonl").read_text().splitlines()[0])["step_time_mean_s"]
        steps[(s["adapter"], s["world_size"], s["layout"]["microbatches"], s["local_batch"])] = step
    for r in written:  # the measured column is the record's, the error is predicted / measured - 1
        assert r["measured_step_s"] == pytest.approx(
            steps[(r["series"].split()[0], r["world_size"], r["microbatches"], r["local_batch"])]
        )
        assert r["err_pct"] == pytest.approx((r["predicted_step_s"] / r["measured_step_s"] - 1) * 100)
        assert r["interval_s"][0] <= r["predicted_step_s"] <= r["interval_s"][1]


def test_the_pipeline_bubble_scales_compute_between_microbatch_counts(records):
    """m=4 predicted from m=2 alone: compute = (step(m=2) - e x comm(m=2)) / k, k = (2+1) t(b) / ((4+1) t(b'))
    with the global batch held (b' = b/2): the p - 1 bubble slots of a 2-stage 1F1B step, t a micro-batch's
    forward and backward time, from the one-rank runs at b and b'. Proportional (t(b') = t(b)/2) the m=4 step
    would compute 5/6 of the m=2 one; measured, a micro-batch of 2 keeps most of the fixed per-operator cost of
    one of 4 (the inverse of the slot count once predicted 6/5, 12-19 % high in validate)."""
    from ptbench.predict.model import comm_time, fit_comm
    from ptbench.predict.points import load_comm, load_points
    from ptbench.predict.table import leave_one_out

    points = load_points(records)
    preds, skipped = leave_one_out(points, load_comm(records), str(records))
    # the one-rank runs at batch 4 and 2 have no other point of their per-rank work: they only calibrate
    assert {(t.world_size, t.local_batch) for t, _ in skipped} == {(1, 4), (1, 2)}, skipped
    for t, why in skipped:  # measured, so the reason is their per-rank work, not a missing measurement
        assert why.startswith(f"no other point of ddp with its per-rank work gpt2_tiny b={t.local_batch} m=1"), why
    m2 = next(p for p in points if p.pp == 2 and p.microbatches == 2)
    pred = next(p for p in preds if p.target.pp == 2 and p.target.microbatches == 4)
    first_epoch = json.loads((Path(m2.run_dirs[0]) / "events.jsonl").read_text().splitlines()[0])
    assert m2.step == first_epoch["step_time_mean_s"]  # the profiled epoch left out: the profiler slows its steps
    assert m2.collectives_from == "trace" and pred.target.collectives_from == "trace of a calibration run"
    assert 0 <= m2.exposed_measured <= 1 and pred.exposed == pytest.approx(m2.exposed_measured)
    t = {p.local_batch: p.fb_steps[0] for p in points if p.world_size == 1}
    k = (2 + 1) * t[4] / ((4 + 1) * t[2])
    assert pred.micro_batch_time_from == "one-rank runs at batch 2,4,8"
    t2 = comm_time(m2, m2.link, fit_comm(load_comm(records)))
    assert pred.compute == pytest.approx((m2.step - pred.exposed * t2) / k)
    assert pred.step == pytest.approx(pred.compute + pred.exposed * pred.comm)


def test_a_micro_batch_time_comes_from_one_rank_runs_that_span_it():
    """Between the one-rank runs' batches: linear in the batch; outside them, or with one batch only: proportional,
    and the prediction says which."""
    from ptbench.predict.model import slot_ratio

    curve = {2: 0.030, 4: 0.040, 8: 0.070}
    assert slot_ratio(4, 2, curve) == (pytest.approx(0.040 / 0.030), "one-rank runs at batch 2,4,8")
    assert slot_ratio(6, 4, curve)[0] == pytest.approx(0.055 / 0.040)
    assert slot_ratio(16, 8, curve) == (2.0, "proportional to the micro-batch size")
    assert slot_ratio(4, 2, {4: 0.04}) == (2.0, "proportional to the micro-batch size")


def test_a_target_not_measured_is_predicted(records, tmp_path):
    folder = copy_of(records, tmp_path)
    targets = tmp_path / "targets.txt"
    targets.write_text(
        "# a sweep file: one target per line\nadapter=pipeline adapter.microbatches=8\nadapter=ddp ranks=2\n"
    )
    proc = predict(str(folder), "--target", str(targets))
    check_ok(proc)
    # on a loaded machine a last line counts the contended runs (test_contended_runs_are_marked_in_one_line)
    out = [x for x in proc.stdout.strip().splitlines() if not x.startswith("contention: ")]
    assert len(out) == 2 and all(re.search(r": step \d+\.\d ms \[[\d.]+-[\d.]+\], epoch", x) for x in out), out
    assert out[0].startswith("pipeline schedule=1f1b pp=2 | n=2 m=8") and "memory model n/a" in out[0]
    assert "MiB/rank" in out[1]  # the measured layout: the memory model's bytes beside it
    assert re.search(r"; measured \d+\.\d ms", out[1]) and "measured" not in out[0]  # ddp at 2 ranks ran
    assert [json.loads(x)["mode"] for x in (folder / "predictions.jsonl").read_text().splitlines()] == ["target"] * 2


def _comm_subset(folder: Path, keep) -> None:
    for path in (folder / "comm").glob("*.json"):
        rep = json.loads(path.read_text())
        rep["results"] = [r for r in rep["results"] if keep(r)]
        path.write_text(json.dumps(rep))


@pytest.mark.parametrize(
    "case, args, want",
    [
        (
            "no_comm",
            [],
            r"no ptbench\.comm measurement under .*: run python -m ptbench\.comm --world-size 2 --out .*/comm",
        ),
        ("one_point", [], r"too few points for leave-one-out in .*: 1 point\(s\)"),
        (
            "kind",
            ["--target", "adapter=ddp"],
            r"no ptbench\.comm measurement of all_reduce at 2 ranks .*: run python -m ptbench\.comm",
        ),
        (
            "size",
            ["--target", "adapter=ddp"],
            r"all_reduce of \d+ bytes at 2 ranks is outside the measured 1024-65536 bytes",
        ),
        (
            "cores",
            ["--target", f"adapter=ddp ranks={(os.cpu_count() or 1) + 1}"],
            r"\d+ ranks on \d+ cores: .*predict at most",
        ),
        (
            "key",
            ["--target", "adapter=ddp trainer.batch_size=4"],
            r"cannot predict 'trainer\.batch_size=4': a target sets only",
        ),
        ("adapter", ["--target", "adapter=fsdp"], r"no measured run of adapter=fsdp to take its compute from"),
        ("stage", ["--target", "adapter=ddp adapter.stage=2"], r"adapter=ddp has no stage setting .*drop adapter"),
        (
            "link",
            ["--target", "adapter=ddp ranks=2 link=300"],
            r"measured only on this machine's own link, whose rate no record states, so no link=300 can be predicted",
        ),
    ],
)
def test_refusals_are_one_line(records, tmp_path, case, args, want):
    if case == "no_comm":
        folder = copy_of(records, tmp_path, keep=lambda p: p.name != "comm")
    elif case == "one_point":
        folder = copy_of(records, tmp_path)
        for d in list(folder.rglob("summary.json"))[1:]:
            shutil.rmtree(d.parent)
    else:
        folder = copy_of(records, tmp_path)
        if case == "kind":
            _comm_subset(folder, lambda r: r["op"] == "send_recv")
        elif case == "size":
            _comm_subset(folder, lambda r: r["bytes"] <= 65536)
    proc = predict(str(folder), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("predict: ") and re.search(want, err[0]), err


def _warn(folder: Path, contended) -> int:
    """Each record's `contention:` warnings replaced: one for the runs `contended(summary)` picks. The count."""
    n = 0
    for path in folder.rglob("summary.json"):
        s = json.loads(path.read_text())
        s["warnings"] = [w for w in s.get("warnings") or [] if not w.startswith("contention:")]
        if contended(s):
            s["warnings"].append("contention: during the run other processes kept 1.20 CPU(s) busy on average (max 2)")
            n += 1
        path.write_text(json.dumps(s))
    return n


def test_contended_runs_are_marked_in_one_line(records, tmp_path):
    """A run whose record warns of contention: its row says so, and one line above the summary counts them
    (all of them, when every run was contended); a quiet folder has no such line."""
    folder = copy_of(records, tmp_path)
    _warn(folder, lambda s: False)
    assert "contention" not in predict(str(folder)).stdout
    _warn(folder, lambda s: s["world_size"] == 2 and s["adapter"] == "ddp")
    lines = predict(str(folder)).stdout.strip().splitlines()
    assert any(x.startswith("ddp | n=2") and x.endswith("; contended 1/1 runs") for x in lines), lines
    assert lines[-2].startswith("contention: 1 of 6 runs behind these figures warn of contention (e.g. during the")
    _warn(folder, lambda s: True)
    proc = predict(str(folder), "--target", "adapter=ddp ranks=1")
    assert proc.stdout.strip().splitlines()[-1].startswith("contention: all 2 runs behind these figures"), proc.stdout


def test_the_report_shows_predicted_vs_measured(records, tmp_path):
    from ptbench.analysis.report import write_report

    folder = copy_of(records, tmp_path)
    check_ok(predict(str(folder)))
    text = write_report(folder, tmp_path / "report").read_text()
    assert "## Predicted vs measured" in text and "### leave-one-out" in text
    section = text.split("## Predicted vs measured")[1]
    assert re.search(r"\| ddp +\| 2 +\| 1 ", section) and re.search(r"median \|err\| \d+\.\d %", section), section[
        :2000
    ]


def test_validate_refuses_without_root(monkeypatch):
    from ptbench.predict import validate
    from ptbench.predict.points import PredictError

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PredictError, match=r"^validate needs root \(network namespaces, tc, slurmd\)"):
        validate.preflight()


def test_validate_shapes_the_link_between_the_nodes():
    """shape() / unshape() on a veth pair named as local_cluster.sh names the nodes' root-side ends, inside a
    private network namespace (nothing of the machine's network is touched; it goes away with the process)."""
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("unshare"):
        pytest.skip("needs root, tc and unshare (a private network namespace)")
    code = (
        "import subprocess as s; from ptbench.predict import validate as v\n"
        "s.run(['ip', 'link', 'add', 'tbv1', 'type', 'veth', 'peer', 'name', 'tbv2'], check=True)\n"
        "v.shape(300); print(s.run(['tc', 'qdisc', 'show', 'dev', 'tbv2'], capture_output=True, text=True).stdout)\n"
        "v.unshape(); print('after', s.run(['tc', 'qdisc', 'show', 'dev', 'tbv1'], capture_output=True, text=True).stdout)\n"
    )
    proc = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    check_ok(proc)
    shaped, after = proc.stdout.split("after")
    assert re.search(r"qdisc tbf .* rate 300Mbit burst (64Kb|65[45][0-9][0-9]b) lat 1s", shaped), (
        shaped
    )  # the same burst at every rate
    assert "tbf" not in after, after


def test_traced_collectives_count_the_bytes_that_cross_the_link():
    """Megatron TP=2 at dp=1, from a profiled run's record (validate, 2026-11-27): its traces hold 14 all-reduces
    a step whose messages sum to 4489728 B, some over the data-parallel group of one, which moves nothing; the bus
    bytes (2627584, the formula's total) are what the link carries, so the model's bytes come from them."""
    from ptbench.predict.points import _traced_collectives

    kind = {"calls": 14.0, "message_bytes": 4489728.0, "bus_bytes": 2627584.0, "time_s": 0.0386}
    prof = {"ranks": [{"rank": r, "by_kind": {"all_reduce": dict(kind)}} for r in (0, 1)]}
    formula = [{"op": "all_reduce", "group": "tp", "group_size": 2, "message_bytes": 262144, "calls": 8}]
    (c,) = _traced_collectives(prof, formula, world=2)
    assert (c["op"], c["group"], c["group_size"], c["calls"]) == ("all_reduce", "tp", 2, 14.0)
    assert c["calls"] * c["message_bytes"] == pytest.approx(2627584.0)  # all-reduce at 2 ranks: bus = message


# --- the alpha-beta per message size, on ptbench.comm reports measured through tbf at 100, 300 and 1000 Mbit/s ---
TBF = Path(__file__).parent / "data" / "predict-tbf"  # two-node Slurm in network namespaces, 2026-11-27


def test_the_comm_fit_per_size_predicts_a_held_out_rate():
    """Fitted at 100 and 1000 Mbit/s, each measured size's t = a + c / rate reproduces both calibration reports,
    and predicts the 300 Mbit/s report (never read by the fit) for messages of 1 MiB or more within 10 %
    (median within 3 %). One line over all sizes missed the 1 MiB all-gather by 29.5 % and send/recv by 17.6 %:
    gloo's time is not affine in the message size there."""
    from ptbench.predict.model import fit_comm
    from ptbench.predict.points import load_comm

    reports = load_comm(TBF)
    fits = fit_comm(reports)
    assert sorted(r.link for r in reports) == [100.0, 1000.0]
    for rep in reports:  # two rates, two coefficients per size: each calibration time comes back
        for r in rep.rows:
            assert fits[(r["op"], 2)].time(r["bytes"], rep.link) == pytest.approx(r["time_s"], rel=1e-9)
    (held,) = load_comm(TBF, "comm-check")
    errs = [fits[(r["op"], 2)].time(r["bytes"], 300.0) / r["time_s"] - 1 for r in held.rows if r["bytes"] >= 1 << 20]
    assert len(errs) == 12 and max(map(abs, errs)) < 0.10 and sorted(map(abs, errs))[6] < 0.03, errs


def test_the_comm_fit_interpolates_between_sizes_and_refuses_outside():
    """A size between two measured ones: linear in the size between them; a rate outside the measured ones and
    a size beyond the largest are refused in one line each."""
    from ptbench.predict.model import comm_time, fit_comm
    from ptbench.predict.points import Point, PredictError, load_comm

    fit = fit_comm(load_comm(TBF))[("all_reduce", 2)]
    lo, hi = fit.time(1 << 20, 300.0), fit.time(2 << 20, 300.0)
    assert fit.time(3 << 19, 300.0) == pytest.approx((lo + hi) / 2)
    big = {"op": "all_reduce", "group_size": 2, "message_bytes": 8 << 20, "calls": 1}
    point = Point("ddp", "ddp", 2, 1, 300.0, collectives=[big])
    with pytest.raises(PredictError, match=r"outside the measured 16384-4194304 bytes"):
        comm_time(point, 300.0, fit_comm(load_comm(TBF)))
    point.collectives[0]["message_bytes"] = 1 << 20
    with pytest.raises(PredictError, match=r"link 50 Mbit/s is outside the measured 100-1000 Mbit/s"):
        comm_time(point, 50.0, fit_comm(load_comm(TBF)))
