"""The paper's protocol (bench.paper): phase dependency, the OOM fallback, the ZeRO optimizer exception."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.paper import choose_stateff, layout, plan, write_plan
from bench.runner.compose import compose
from tests.helpers import REPO, run_dirs, summary


def test_zero_runs_use_adam_in_the_language_preset():
    for preset in ("paper_language", "paper_language_small"):
        for adapter in ("zero", "zero1", "zero2", "zero3"):
            c = compose([f"experiment={preset}", f"adapter={adapter}"])
            assert (c.optimizer.name, c.optimizer.lr, c.optimizer.weight_decay) == ("adam", 1e-3, 0.01)
            assert "Table III" in c.extra.paper_exception
        c = compose([f"experiment={preset}", "adapter=ddp"])
        assert c.optimizer.name == "lamb" and c.extra is None
    assert compose(["experiment=paper_language"]).data.root.endswith("wikitext-103")
    assert compose(["experiment=paper_language_small"]).data.root.endswith("wikitext-2")
    assert compose(["adapter=zero3"]).optimizer.name == "adamw"  # no preset, no exception


def test_layouts_per_gpu_count():
    assert layout("ddp", 8, 4) == ["launcher.nprocs=8"]
    assert layout("megatron", 8, 4) == ["launcher.nprocs=8", "adapter.tensor_parallel=4"]  # TP inside a node
    assert layout("gpipe", 8, 4) is None  # one process drives every partition: one node at most
    assert layout("gpipe", 4, 4) == ["launcher.nprocs=1", "adapter.pipeline_parallel=4"]
    assert layout("pipeline", 32, 4, layers=12) == ["launcher.nprocs=32", "adapter.pipeline_parallel=8"]


def test_plan_dry_run_submits_phase_two_after_phase_one(tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "bench.paper", "plan", "--workloads", "gpt2_tiny", "--adapters", "ddp,gpipe",
                           "--gpus", "1,2", "--gpus-per-node", "1", "--out", str(out), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sbatch")]
    epoch = [ln for ln in lines if "epoch.txt" in ln]
    memory = [ln for ln in lines if "memory.txt" in ln]
    stateff = [ln for ln in lines if "bench-paper-stateff" in ln]
    assert len(stateff) == 1 and len(epoch) == 2 and len(memory) == 2  # 1 and 2 ranks; gpipe x2 needs 2 GPUs on a 1-GPU node
    # phase 2 waits for every phase-1 array, and only for them; phase 3 waits for nothing
    assert "--dependency=afterok:<epoch-0>:<epoch-1>" in stateff[0] and "bench.paper stateff" in stateff[0]
    assert not any("--dependency" in ln for ln in epoch + memory)
    assert json.loads((out / "plan.json").read_text())["skipped"] == [
        "gpt2_tiny gpipe x2: one process drives every partition (one node)"]


def test_stateff_picks_each_adapters_fastest_gpu_count(tmp_path):
    out, results = tmp_path / "plan", tmp_path / "results"
    phases = plan(["gpt2_tiny"], ["ddp"], [1, 2], 0, [])
    write_plan(out, phases, "test")
    from bench.sweep import point_id

    for point, t in zip(phases["epoch"], (3.0, 2.0)):  # 2 ranks faster
        d = results / "paper-epoch-gpt2_tiny" / f"run-{t}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"status": "ok", "experiment": "paper-epoch-gpt2_tiny",
                                                    "workload": "gpt2_tiny", "adapter": "ddp",
                                                    "point": point_id(point), "epoch_time_steady_s": t}))
    chosen = choose_stateff(out, results)
    assert len(chosen) == 1 and "launcher.nprocs=2" in chosen[0]
    assert not any(o.startswith("trainer.epochs=") for o in chosen[0])  # the preset's full training


@pytest.mark.slow
def test_oom_point_is_retried_once_with_half_the_batch(tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("experiment=smoke workload.vocab_size=256 trainer.batch_size=4 launcher.nprocs=1 "
                     "trainer.inject_fault=oom@0:1\n")
    proc = subprocess.run([sys.executable, "-m", "bench.sweep", "run", str(sweep), "--", f"results.root={tmp_path / 'r'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "once more with trainer.batch_size=2" in proc.stdout, proc.stdout + proc.stderr
    runs = {summary(d)["global_batch"] if summary(d).get("global_batch") else None: d for d in run_dirs(tmp_path / "r")}
    records = [summary(d) for d in run_dirs(tmp_path / "r")]
    assert sorted(r["status"] for r in records) == ["oom", "oom"]  # the injected fault fires again: retried only once
    configs = [(d / "config.yaml").read_text() for d in run_dirs(tmp_path / "r")]
    assert sum("batch_reduced_from: 4" in c for c in configs) == 1 and sum("batch_size: 2" in c for c in configs) == 1
    assert runs  # both records exist
