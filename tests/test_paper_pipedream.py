"""The paper's protocol with PipeDream: each adapter places itself on a GPU count (no adapter name steers
bench/paper.py), PipeDream's statistical-efficiency point comes with 2BW, the flushing 1F1B pipeline and DDP at its
global batch and learning rate, and --one-at-a-time runs every task of the plan alone."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from ptbench.adapters import available
from ptbench.paper import choose_stateff, layout, placement, plan, release_serial, serial_args, write_plan
from ptbench.runner.compose import compose, typed
from ptbench.runner.plan import make_plan
from ptbench.runner.points import point_id
from tests.helpers import REPO
from tests.test_slurm import cancel_leftover_jobs, sbatch, slurm, wait_done  # noqa: F401


def test_paper_names_no_adapter():
    """Layouts and companions come from the adapters (Adapter.paper_layout / paper_companions): no string of
    bench/paper.py outside its docstrings is an adapter's name."""
    tree = ast.parse((REPO / "bench" / "paper.py").read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
    names = {"zero1", "zero2", "zero3", *available()}
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs and n.value in names]
    assert found == []


def test_pipedream_places_one_stage_per_rank_from_two_ranks():
    assert layout("pipedream", 4, 4, layers=12) == ["launcher.nprocs=4"]
    assert placement("pipedream", 1, 4) == "one stage is no pipeline (plain SGD, no staleness to measure)"
    assert "no stage replication: 16 ranks for 12 layers" in placement("pipedream", 16, 4, layers=12)
    assert layout("zero2", 8, 4) == ["launcher.nprocs=8"]  # a preset's adapter (zero) answers for it
    phases = plan(["gpt2_tiny"], ["pipedream"], [1, 2], 0, [])
    assert phases["skipped"] == [
        "gpt2_tiny pipedream x1: one stage is no pipeline (plain SGD, no staleness to measure)"
    ]
    assert len(phases["epoch"]) == len(phases["memory"]) == 1


def test_stateff_trains_pipedreams_comparators_at_its_global_batch(tmp_path):
    out, results = tmp_path / "plan", tmp_path / "results"
    size = ["data=synthetic", "trainer.batch_size=8"]
    phases = plan(["gpt2_tiny"], ["pipedream"], [2], 0, size)
    write_plan(out, phases, "test", stateff_epochs=3)
    d = results / "paper-epoch-gpt2_tiny" / "run"
    d.mkdir(parents=True)
    record = {"status": "ok", "experiment": "paper-epoch-gpt2_tiny", "workload": "gpt2_tiny", "adapter": "pipedream"}
    (d / "summary.json").write_text(
        json.dumps({**record, "point": point_id(phases["epoch"][0]), "epoch_time_steady_s": 1.0})
    )
    chosen = choose_stateff(out, results)
    assert len(chosen) == 4 and len({point_id(p) for p in chosen}) == 4
    setups = []
    for point in chosen:
        cfg = typed(compose(point))
        p = make_plan(cfg, "local", check=False)
        setups.append((cfg.adapter.name, getattr(cfg.adapter, "schedule", ""), p.world_size, p.local_batch * p.dp_size))
        assert (cfg.optimizer.lr, cfg.trainer.epochs, cfg.results.experiment) == (1e-3, 3, "paper-stateff-gpt2_tiny")
    assert setups == [
        ("pipedream", "pipedream", 2, 8),
        ("pipedream", "2bw", 2, 8),
        ("pipeline", "1f1b", 2, 8),
        ("ddp", "", 2, 8),  # the same global batch, split over two replicas
    ]


def test_one_at_a_time_holds_every_array_and_passes_on_to_phase_two(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "ptbench.paper", "plan", "--workloads", "gpt2_tiny", "--adapters", "ddp,pipedream",
           "--gpus", "1,2", "--out", str(out), "--dry-run", "--one-at-a-time"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sbatch")]
    arrays = [ln for ln in lines if "array.sbatch" in ln]
    name = re.search(r"--job-name=(bench-paper-[0-9a-f]{8})", arrays[0]).group(1)
    assert len(arrays) == 4 and all(f"--hold --dependency=singleton --job-name={name}" in ln for ln in arrays)
    assert serial_args(out)[-1] == f"--job-name={name}"  # phase 2's arrays get the same name from the same folder
    (phase2,) = [ln for ln in lines if "bench-paper-stateff" in ln]
    assert "--one-at-a-time" in phase2 and "--hold" not in phase2


@pytest.mark.slurm
def test_held_arrays_run_one_task_at_a_time(slurm, tmp_path):  # noqa: F811
    """On the local cluster (2 CPUs): two arrays of 1-CPU tasks that would run side by side run one after another."""
    args = serial_args(tmp_path / "plan")
    stamp = "date +%s.%N; sleep 2; date +%s.%N"
    jobs = [sbatch(*args, f"--array=0-{n}", "--ntasks=1", f"--output={tmp_path}/t-%A_%a.out", f"--wrap={stamp}",
                   cwd=tmp_path, env=None) for n in (2, 1)]  # fmt: skip
    assert release_serial(jobs) == 0
    for job in jobs:
        wait_done(job, 120, tmp_path)
    spans = sorted(tuple(map(float, p.read_text().split())) for p in tmp_path.glob("t-*.out"))
    assert len(spans) == 5
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # none started before the last had ended
