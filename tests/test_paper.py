"""The paper's protocol (ptbench.paper): phase dependency, the OOM fallback, the ZeRO optimizer exception."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ptbench.paper import choose_stateff, layout, plan, write_plan
from ptbench.runner.compose import compose
from tests.helpers import REPO, python_m, run_dirs, summary
from tests.test_slurm import (  # noqa: F401
    ARRAY,
    cancel_leftover_jobs,
    final_states,
    job_env,
    job_logs,
    sbatch,
    slurm,
    wait_done,
)


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
    plan_args = ("--workloads", "gpt2_tiny", "--adapters", "ddp,gpipe", "--gpus", "1,2", "--gpus-per-node", "1")
    proc = python_m("ptbench.paper", "plan", *plan_args, "--out", str(out), "--dry-run", timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sbatch")]
    epoch = [ln for ln in lines if "epoch.txt" in ln]
    memory = [ln for ln in lines if "memory.txt" in ln]
    stateff = [ln for ln in lines if "bench-paper-stateff" in ln]
    assert (
        len(stateff) == 1 and len(epoch) == 2 and len(memory) == 2
    )  # 1 and 2 ranks; gpipe x2 needs 2 GPUs on a 1-GPU node
    # phase 2 waits for every phase-1 array, and only for them; phase 3 waits for nothing
    assert "--dependency=afterok:<epoch-0>:<epoch-1>" in stateff[0] and "ptbench.paper stateff" in stateff[0]
    assert not any("--dependency" in ln for ln in epoch + memory)
    assert "skipped: gpt2_tiny gpipe x2: one process drives every partition (one node)" in proc.stdout.splitlines()
    assert not out.exists()  # a dry run writes nothing (issue 31)


def _epoch_phase_record(run_dir, point: str, epoch_s: float) -> None:
    """A finished phase-1 (epoch) record of gpt2_tiny on ddp, all that choose_stateff reads of it."""
    run_dir.mkdir(parents=True)
    record = {"status": "ok", "experiment": "paper-epoch-gpt2_tiny", "workload": "gpt2_tiny", "adapter": "ddp"}
    (run_dir / "summary.json").write_text(json.dumps({**record, "point": point, "epoch_time_steady_s": epoch_s}))


def test_stateff_picks_each_adapters_fastest_gpu_count(tmp_path):
    out, results = tmp_path / "plan", tmp_path / "results"
    phases = plan(["gpt2_tiny"], ["ddp"], [1, 2], 0, [])
    write_plan(out, phases, "test")
    from ptbench.runner.points import point_id

    for point, t in zip(phases["epoch"], (3.0, 2.0)):  # 2 ranks faster
        _epoch_phase_record(results / "paper-epoch-gpt2_tiny" / f"run-{t}", point_id(point), t)
    chosen = choose_stateff(out, results)
    assert len(chosen) == 1 and "launcher.nprocs=2" in chosen[0]
    assert not any(o.startswith("trainer.epochs=") for o in chosen[0])  # the preset's full training


@pytest.mark.slow
def test_oom_point_is_retried_once_with_half_the_batch(tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text(
        "experiment=smoke workload.vocab_size=256 trainer.batch_size=4 launcher.nprocs=1 trainer.inject_fault=oom@0:1\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.sweep", "run", str(sweep), "--", f"results.root={tmp_path / 'r'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and "once more with trainer.batch_size=2" in proc.stdout, proc.stdout + proc.stderr
    runs = {summary(d)["global_batch"] if summary(d).get("global_batch") else None: d for d in run_dirs(tmp_path / "r")}
    records = [summary(d) for d in run_dirs(tmp_path / "r")]
    assert sorted(r["status"] for r in records) == ["oom", "oom"]  # the injected fault fires again: retried only once
    configs = [(d / "config.yaml").read_text() for d in run_dirs(tmp_path / "r")]
    assert sum("batch_reduced_from: 4" in c for c in configs) == 1 and sum("batch_size: 2" in c for c in configs) == 1
    assert runs  # both records exist


def test_array_task_retries_only_an_oom_record_with_half_the_batch(tmp_path):
    """`ptbench.sweep point --oom-retry` (what slurm/array.sbatch asks after a failed srun): the retry's
    overrides when the point's newest record says oom, `skip` otherwise."""
    from ptbench.runner.points import compose_point

    sweep, root = tmp_path / "sweep.txt", tmp_path / "r"
    sweep.write_text("experiment=smoke trainer.batch_size=4 launcher.nprocs=2\n")
    extra = [f"results.root={root}"]
    cfg = compose_point(["experiment=smoke", "trainer.batch_size=4", "launcher.nprocs=2", *extra])

    def ask() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "ptbench.sweep", "point", str(sweep), "0", "--oom-retry", "--", *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert ask() == "skip"  # no record
    for name, status in (("a", "failed"), ("b", "oom")):  # the newest record decides
        d = root / "smoke" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"point": cfg.results.point, "status": status}))
        time.sleep(0.05)
    assert ask() == "2 1 trainer.batch_size=2 ++extra.batch_reduced_from=4"
    (root / "smoke" / "b" / "summary.json").write_text(json.dumps({"point": cfg.results.point, "status": "ok"}))
    assert ask() == "skip"


@pytest.mark.slurm
def test_array_task_on_slurm_retries_an_oom_point_once(slurm, tmp_path):
    """slurm/array.sbatch on the local cluster: the injected OOM (every attempt) is retried once, with half the batch."""
    sweep, results = tmp_path / "sweep.txt", tmp_path / "results"
    sweep.write_text(
        "experiment=smoke workload.vocab_size=256 trainer.batch_size=4 launcher.nprocs=1 trainer.inject_fault=oom@0:1\n"
    )
    job = sbatch("--array=0", str(ARRAY), str(sweep), cwd=tmp_path, env=job_env(results))
    wait_done(job, 300, tmp_path)
    assert final_states(job)[f"{job}_0"][0] == "FAILED", job_logs(tmp_path)  # the retry ran out of memory too
    assert "out of memory; once more with trainer.batch_size=2" in job_logs(tmp_path)
    configs = sorted(((d / "config.yaml").read_text(), summary(d)["status"]) for d in run_dirs(results))
    assert [s for _, s in configs] == ["oom", "oom"] and sum("batch_reduced_from: 4" in c for c, _ in configs) == 1


# --- the report's "Paper claims" section (analysis/claims.py), from hand-built per-run frames ---------
def frame(rows: list[tuple], repeats: tuple = (1.0,)):
    """(adapter, label, devices, MiB, s/sample) -> a frame shaped like ptbench.analysis.tables.runs' rows, one
    run per factor in `repeats` (its memory and time times the factor)."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "run_id": f"{lab}-x{n}" + (f"-{i}" if len(repeats) > 1 else ""),
                "run_dir": f"/nowhere/{lab}-{n}-{i}",
                "workload": "w",
                "adapter": a,
                "label": lab,
                "devices": n,
                "status": "ok",
                "mem_plot_bytes": mib * f * 2**20,
                "time_per_sample_used_s": t * f,
                "batch_size": 8,
                "batch_reduced_from": None,
            }
            for i, f in enumerate(repeats)
            for a, lab, n, mib, t in rows
        ]
    )


def verdicts(df) -> dict[str, str]:
    from ptbench.analysis.claims import claims

    return {c["claim"]: c["verdict"] for c in claims(df)["w"]}


HOLD = [
    ("ddp", "ddp", 1, 100, 1.0),
    ("ddp", "ddp", 2, 102, 0.5),
    ("ddp", "ddp", 4, 98, 0.25),
    ("zero", "zero2", 1, 60, 1.1),
    ("zero", "zero2", 2, 50, 0.56),
    ("zero", "zero2", 4, 45, 0.28),  # 60/49/46 %
    ("gpipe", "gpipe", 1, 100, 1.3),
    ("gpipe", "gpipe", 2, 60, 0.8),
    ("gpipe", "gpipe", 4, 57, 0.5),  # -40 %, -5 %
    ("megatron", "meg", 1, 100, 1.2),
    ("megatron", "meg", 2, 70, 0.7),
    ("megatron", "meg", 4, 90, 0.3),
]


TWICE = (0.998, 1.002)  # two repeats per point: every claim is decided on an interval


def test_claims_hold_on_records_that_show_them():
    v = verdicts(frame(HOLD, TWICE))
    assert v == {
        "ZeRO per-GPU memory is 42-66 % of DDP's": "holds",
        "ZeRO per-GPU memory falls with GPU count while DDP's stays flat": "holds",
        "ZeRO epoch time within 15 % of DDP's": "holds",
        "pipeline memory per GPU falls, then plateaus": "holds",
        "Megatron per-GPU memory is U-shaped": "holds",
        "PipeDream needs more epochs to a validation target than a flushing pipeline or DDP at the same global "
        "batch": "not measured",
        "PipeDream's weight stash costs memory (stashed parameter versions per stage)": "not measured",
        "fastest framework at x1": "measured",
        "fastest framework at x2": "measured",
        "fastest framework at x4": "measured",
    }
    from ptbench.analysis.claims import claims

    found = {c["claim"]: c for c in claims(frame(HOLD, TWICE))["w"]}
    x1 = found["fastest framework at x1"]["numbers"]
    assert x1.startswith("**ddp** 1e+03 ms/sample (geometric mean); ddp is 10.0 % faster than zero2 [")
    assert found["fastest framework at x4"]["numbers"].startswith("**ddp**")  # 0.25 < megatron 0.3
    share = found["ZeRO per-GPU memory is 42-66 % of DDP's"]["numbers"]
    # ZeRO is checked where it shards, at 2 or more GPUs (at x1 it holds the whole model, as DDP does)
    assert share.startswith("zero2 x2 / ddp: 49 % [49, 49] (90 %, n=2); zero2 x4 / ddp: 46 %"), share
    assert found["Megatron per-GPU memory is U-shaped"]["runs"] == [f"meg-x{n}-{i}" for n in (1, 2, 4) for i in (0, 1)]
    # the same records without repeats: no interval, so every claim is undecided
    assert {
        k: x for k, x in verdicts(frame(HOLD)).items() if not k.startswith(("fastest", "PipeDream"))
    } == dict.fromkeys(list(v)[:5], "undecided")


def test_claims_fail_on_records_that_contradict_them():
    bad = [
        ("ddp", "ddp", 1, 100, 1.0),
        ("ddp", "ddp", 2, 130, 0.5),  # DDP not flat (100 -> 130)
        ("zero", "zero2", 1, 80, 1.3),
        ("zero", "zero2", 2, 50, 0.65),  # 38 % of DDP; 1.30x slower (x1 is not checked: nothing to shard)
        ("gpipe", "gpipe", 1, 100, 1),
        ("gpipe", "gpipe", 2, 95, 1),
        ("gpipe", "gpipe", 4, 60, 1),  # -5 % first
        ("megatron", "meg", 1, 100, 1),
        ("megatron", "meg", 2, 80, 1),
        ("megatron", "meg", 4, 60, 1),
    ]  # falls only
    v = verdicts(frame(bad, TWICE))
    assert [v[k] for k in list(v)[:5]] == ["does not hold"] * 5


def test_claims_not_measured_without_the_runs_and_oom_retries_named(tmp_path):
    from ptbench.analysis.claims import claims_lines, oom_retried

    df = frame([("ddp", "ddp", 1, 100, 1.0)])
    assert set(verdicts(df).values()) == {"not measured"}
    df.loc[0, "batch_reduced_from"] = 16
    assert "- `ddp-x1` w ddp x1: per-device batch 16 ran out of memory, retried with 8 (ok)" in claims_lines(df)
    run = tmp_path / "run"  # records without the column: read from the run's config.yaml
    run.mkdir()
    (run / "config.yaml").write_text("extra:\n  batch_reduced_from: 4\ntrainer:\n  batch_size: 2\n")
    df = frame([("ddp", "ddp", 1, 100, 1.0), ("ddp", "ddp", 2, 100, 1.0)]).drop(columns="batch_reduced_from")
    df.loc[1, "run_dir"] = str(run)
    assert oom_retried(df)["run_id"].tolist() == ["ddp-x2"]


def test_stateff_epochs_from_the_plan(tmp_path):
    """`plan --stateff-epochs 3` (make paper-demo): phase 2 trains 3 epochs instead of the preset's 100."""
    out, results = tmp_path / "plan", tmp_path / "results"
    phases = plan(["gpt2_tiny"], ["ddp"], [1], 0, [])
    write_plan(out, phases, "test", stateff_epochs=3)
    from ptbench.runner.points import point_id

    _epoch_phase_record(results / "paper-epoch-gpt2_tiny" / "run", point_id(phases["epoch"][0]), 1.0)
    (chosen,) = choose_stateff(out, results)
    assert [o for o in chosen if o.startswith("trainer.epochs=")] == ["trainer.epochs=3"]


def test_wait_on_a_folder_without_a_submitted_plan_fails_in_one_line(tmp_path):
    """`ptbench.paper wait DIR` never reads a missing or never-submitted plan as "every job has left the queue"."""
    for folder, says in ((tmp_path / "missing", "no such folder"), (tmp_path, "nothing was submitted")):
        p = subprocess.run([sys.executable, "-m", "ptbench.paper", "wait", str(folder)], capture_output=True, text=True)
        assert p.returncode == 2 and says in p.stderr and p.stderr.count("\n") == 1, p.stderr
