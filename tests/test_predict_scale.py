"""`python -m ptbench.predict --target 'adapter=A launcher.nprocs=W'` at a device count no run measured: the
collectives and the memory per rank come from a `python -m ptbench.scale` dry run at W (its record, status
dry_run), and without one a line says so with the command that writes it; that command, run as printed, makes
the record the next prediction reads. Real runs, a real ptbench.comm measurement and real dry runs (about a
minute and a half on 2 cores)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import bench, check_ok, run

COMMON = [
    "workload=gpt2_tiny",
    "workload.seq_len=32",
    "workload.vocab_size=4096",
    "data=synthetic",
    "data.train_samples=32",
    "data.val_samples=8",
    "trainer.epochs=2",
    "trainer.batch_size=8",
    "trainer.untimed_steps=1",
    "trainer.progress=false",
    "results.experiment=predict_scale",
]
DRY = ["adapter=fsdp", "workload=gpt2_tiny", "workload.seq_len=32", "workload.vocab_size=4096", "trainer.batch_size=8"]


def predict(*args: str) -> object:
    return run([sys.executable, "-m", "ptbench.predict", *args], timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """fsdp measured at one rank only, ptbench.comm at 2 ranks, and a dry run of the same point at W = 2."""
    root = tmp_path_factory.mktemp("predict_scale") / "results"
    check_ok(bench("adapter=fsdp", "launcher.nprocs=1", *COMMON, results=root))
    comm = [sys.executable, "-m", "ptbench.comm", "--world-size", "2", "--ops", "all_gather,reduce_scatter,all_reduce"]
    check_ok(run([*comm, "--max-bytes", "4M", "--iters", "3", "--warmup", "1", "--out", str(root / "comm")], 300))
    scale = [sys.executable, "-m", "ptbench.scale", *DRY, f"results.root={root}", "--world-size", "2"]
    check_ok(run(scale, 300))
    return root


def test_a_target_at_w_takes_the_dry_runs_ledger_and_memory(folder):
    """At W = 2 (measured at 1 rank only): the step's communication is the dry run's ledger, call by call at its
    padded buffer through the ptbench.comm fit, and the memory per rank is the dry run's tracker peak."""
    from ptbench.predict.at_scale import ledger_collectives, load_dry_runs
    from ptbench.predict.model import fit_comm
    from ptbench.predict.points import load_comm

    proc = predict(str(folder), "--target", "adapter=fsdp launcher.nprocs=2")
    check_ok(proc)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("fsdp |")]
    assert "collectives from dry run at W=2" in line and re.search(r"memory [\d.]+ [MG]iB/rank \(dry run", line), line
    (dry,) = load_dry_runs(folder)
    assert dry.world_size == 2 and {r["op"] for r in dry.ledger} == {"all_gather", "reduce_scatter"}, dry.ledger
    fits = fit_comm(load_comm(folder))
    want = sum(c["calls"] * fits[(c["op"], 2)].time(c["message_bytes"], None) for c in ledger_collectives(dry))
    comm_ms = float(re.search(r"x comm ([\d.]+) ms", line).group(1))
    assert comm_ms == pytest.approx(want * 1e3, abs=0.051), line
    written = json.loads((folder / "predictions.jsonl").read_text().splitlines()[-1])
    assert written["world_size"] == 2 and written["memory_bytes_per_rank"] == dry.tracker_peak


def test_without_a_dry_run_at_w_the_line_gives_the_command_that_makes_one(folder, tmp_path):
    """W = 4: no dry run there, so one line names the command; run as printed, it writes the dry run, and then
    the target at W = 4 shows the ledger and memory per rank beside the step time's refusal (4 ranks are more
    than this machine's ptbench.comm measured, or its cores)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    proc = predict(str(copy), "--target", "adapter=fsdp launcher.nprocs=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "no dry run at W=4 (its dry runs: W=2)" in err[0], err
    cmd = err[0].split("make one: ")[1]
    assert cmd.startswith("python -m ptbench.scale adapter=fsdp workload=gpt2_tiny") and "--world-size 4" in cmd, cmd
    check_ok(run([sys.executable, *shlex.split(cmd)[1:]], 300))
    proc = predict(str(copy), "--target", "adapter=fsdp launcher.nprocs=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("fsdp | n=4 m=1 b=8 | -: step time not predicted (") and "dry run at W=4 rank 0" in line
    assert re.search(r"\d+ all_gather \+ \d+ reduce_scatter per step, [\d.]+ MB bus \(params x dtype", line), line
    assert re.search(r"memory [\d.]+ [MG]iB/rank \(tracker, memory model [\d.]+ [MG]iB\)", line), line


def test_a_stage_not_measured_names_the_stage_and_the_command_that_measures_it(folder, tmp_path):
    """ZeRO measured at stage 1 only, a target at stage 2: the refusal says zero was measured as stage 1 (not
    "no measured run of zero") and gives the training command; run as printed, it makes the target a measured
    point, which is then predicted with its measured step beside it."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    check_ok(bench("adapter=zero", "adapter.stage=1", "launcher.nprocs=2", *COMMON, results=copy))
    proc = predict(str(copy), "--target", "adapter=zero adapter.stage=2 ranks=2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (err,) = proc.stderr.strip().splitlines()
    assert "adapter.stage=2 to take its compute from: zero was measured as zero stage=1" in err, err
    cmd = shlex.split(err.split("measure it: ")[1])
    assert cmd[:3] == ["python", "-m", "ptbench"] and "adapter.stage=2" in cmd and "data=synthetic" in cmd, cmd
    check_ok(run([sys.executable, *cmd[1:]], 600))
    proc = predict(str(copy), "--target", "adapter=zero adapter.stage=2 ranks=2")
    check_ok(proc)
    assert re.search(r"^zero stage=2 \| n=2 m=1 b=8 \| -: step [\d.]+ ms .*; measured [\d.]+ ms", proc.stdout, re.M)
