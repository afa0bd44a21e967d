"""Sweeps and Slurm: sweep files and --resume here, then job arrays, preemption and a Hydra multirun
through submitit against a real one-node Slurm cluster started by slurm/local_cluster.sh.

The cluster tests need root on a Debian machine (apt-get installs Slurm, MariaDB for accounting);
elsewhere they are skipped, except in CI (CI=1/true/yes) where a cluster that cannot start fails them
(tests/conftest.py require_or_skip). Jobs are submitted from each test's tmp_path, so their
slurm-*.out logs land there, never in the checkout.
The cluster is stopped at the end if these tests started it. Slurm environment parsing and
per-job MASTER_PORT are tested in test_launch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ptbench.core.errors import ConfigError
from ptbench.runner.points import expand_grid, point_id, read_points
from ptbench.runner.slurm import slurm_shape
from tests.conftest import require_or_skip
from tests.helpers import (
    REPO,
    assert_losses_close,
    bench,
    check_ok,
    events,
    kill_group,
    only_run,
    run,
    run_dirs,
    start,
    step_losses,
    summary,
)

CLUSTER = REPO / "slurm" / "local_cluster.sh"
ARRAY = REPO / "slurm" / "array.sbatch"
RUN = REPO / "slurm" / "run.sbatch"
# Smallest real runs: tiny GPT-2, synthetic data, 2 steps.
TINY = ["workload.vocab_size=256", "trainer.max_steps=2"]


def sweep_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run(
        [sys.executable, "-m", "ptbench.sweep", *args], timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def records(root: Path) -> dict[Path, dict]:
    """run dir -> summary, env.json and config.yaml of every record under root."""
    return {
        d: {
            "summary": summary(d),
            "env": json.loads((d / "env.json").read_text()),
            "config": yaml.safe_load((d / "config.yaml").read_text()),
        }
        for d in run_dirs(root)
    }


# --- sweep files, here (no Slurm) ------------------------------------------------------------------
def test_point_id_names_what_is_measured_not_where_it_runs():
    base = point_id(["adapter=ddp", "launcher.nprocs=2"])
    same = point_id(
        [
            "launcher.nprocs=2",
            "adapter=ddp",
            "results.root=/x",
            "results.skip_done=true",
            "launcher=slurm",
            "hydra.launcher.partition=gpu",
            "launcher.master_port=29999",
        ]
    )
    assert base == same
    assert point_id(["trainer.inject_fault=raise@0\\:0"]) == point_id(["trainer.inject_fault='raise@0:0'"])
    assert base != point_id(["adapter=ddp", "launcher.nprocs=4"]) != point_id(["adapter=zero", "launcher.nprocs=2"])


def test_grid_is_hydras_cartesian_product():
    assert expand_grid(["adapter=ddp,zero", "launcher.nprocs=range(1,3)", "workload=gpt2_small"]) == [
        ["adapter=ddp", "launcher.nprocs=1", "workload=gpt2_small"],
        ["adapter=ddp", "launcher.nprocs=2", "workload=gpt2_small"],
        ["adapter=zero", "launcher.nprocs=1", "workload=gpt2_small"],
        ["adapter=zero", "launcher.nprocs=2", "workload=gpt2_small"],
    ]


def test_slurm_shape_one_task_per_rank_over_gpu_nodes():
    assert slurm_shape(64, 1, 8) == (8, 8, 8)  # the paper's 64 GPUs on 8-GPU nodes
    assert slurm_shape(4, 2, 8) == (1, 4, 8)  # a process driving 2 GPUs (GPipe): 4 per node
    assert slurm_shape(3, 1, None) == (1, 3, None)  # CPU: one node
    with pytest.raises(ConfigError, match="do not split evenly"):
        slurm_shape(5, 1, 4)


def test_submit_makes_one_array_per_point_size(tmp_path):
    sweep = tmp_path / "sweep.txt"
    check_ok(sweep_cli("--grid", "launcher.nprocs=1,2", "trainer.seed=1,2", "-o", str(sweep)))
    proc = sweep_cli("submit", str(sweep), "--dry-run", "--resume", "--sbatch=--partition=p1", "--", "trainer.epochs=3")
    check_ok(proc)
    lines = proc.stdout.strip().splitlines()
    comm = [line for line in lines if "--job-name=bench-comm" in line]  # the network, once per world size > 1
    lines = [line for line in lines if line not in comm]
    assert len(lines) == 2 and len(comm) == 1, proc.stdout
    assert "--ntasks-per-node=2 --partition=p1" in comm[0] and "-m ptbench.comm" in comm[0]
    assert "--array=0,1 --nodes=1 --ntasks-per-node=1 --partition=p1" in lines[0]
    assert "--array=2,3 --nodes=1 --ntasks-per-node=2 --partition=p1" in lines[1]
    assert all(line.endswith(f"array.sbatch {sweep} --resume trainer.epochs=3") for line in lines)


def test_sweep_run_and_resume_reruns_only_points_not_ok(tmp_path):
    sweep, root = tmp_path / "sweep.txt", tmp_path / "results"
    # one point that works and one that fails at its first step
    check_ok(
        sweep_cli(
            "grid", "experiment=smoke", "launcher.nprocs=1", "trainer.inject_fault=null,raise@0:0", "-o", str(sweep)
        )
    )
    points = read_points(sweep)
    assert points == [
        ["experiment=smoke", "launcher.nprocs=1", "trainer.inject_fault=null"],
        ["experiment=smoke", "launcher.nprocs=1", "trainer.inject_fault=raise@0\\:0"],
    ]  # Hydra's escape
    extra = [*TINY, f"results.root={root}"]
    ids = [point_id([*p, *extra]) for p in points]
    assert ids[0] != ids[1]

    proc = sweep_cli("run", str(sweep), "--", *extra)
    assert proc.returncode == 1, proc.stderr  # one point failed
    first = {d: r["summary"] for d, r in records(root).items()}
    assert sorted((s["point"], s["status"]) for s in first.values()) == sorted([(ids[0], "ok"), (ids[1], "failed")])

    proc = sweep_cli("run", str(sweep), "--resume", "--", *extra)
    assert proc.returncode == 1, proc.stderr
    assert f"point {ids[0]} already ok" in proc.stdout
    second = {d: r["summary"] for d, r in records(root).items()}
    new = {d: s for d, s in second.items() if d not in first}
    assert [(s["point"], s["status"]) for s in new.values()] == [(ids[1], "failed")]  # only the failed point ran again
    assert all(second[d] == s for d, s in first.items())  # earlier records untouched


# --- a real Slurm cluster ----------------------------------------------------------------------------
def _unavailable(reason: str):
    require_or_skip("the local Slurm cluster", reason)


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        _unavailable("the local Slurm cluster needs root (slurm/local_cluster.sh)")
    if not (Path("/etc/debian_version").exists() and shutil.which("apt-get")):
        _unavailable("the local Slurm cluster needs a Debian machine with apt-get")
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0
    proc = run(["bash", str(CLUSTER), "start", "--accounting"], timeout=900)
    if proc.returncode:
        _unavailable(f"slurm/local_cluster.sh start --accounting failed: {(proc.stderr or proc.stdout).strip()}")
    yield
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=300)


def job_env(results: Path, **more) -> dict:
    # sbatch exports the caller's environment: the scripts read REPO/PYTHON/RESULTS/DATA from it
    return {**os.environ, "REPO": str(REPO), "PYTHON": sys.executable, "RESULTS": str(results), **more}


_submitted: list[str] = []


@pytest.fixture(autouse=True)
def cancel_leftover_jobs():
    """A failed test must not leave its job running into the next one."""
    yield
    for job in _submitted:
        subprocess.run(["scancel", job], capture_output=True)
    _submitted.clear()


def sbatch(*args: str, cwd: Path, env: dict) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    _submitted.append(job)
    return job


def queued(job: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip())


def wait_done(job: str, timeout: float, logs: Path) -> None:
    """Poll squeue ourselves (sbatch --wait polls at 2, 10, 42, 74 s)."""
    deadline = time.time() + timeout
    while queued(job):
        if time.time() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} still queued after {timeout}s\n{job_logs(logs)}")
        time.sleep(1)


def job_logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("slurm-*.out")))


def final_states(job: str, steps: bool = False) -> dict[str, tuple[str, str]]:
    """JobID -> (State, ExitCode) from accounting, once it has caught up with the job's end."""
    cmd = ["sacct", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode", *([] if steps else ["-X"])]
    deadline = time.time() + 60
    while True:
        rows = [line.split("|") for line in subprocess.run(cmd, capture_output=True, text=True).stdout.split()]
        states = {r[0]: (r[1].split()[0], r[2]) for r in rows if len(r) == 3}
        if states and not any(s in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for s, _ in states.values()):
            return states
        if time.time() > deadline:
            return states
        time.sleep(1)


def rank_processes(marker: str) -> list[str]:
    """Command lines of live processes of `python -m ptbench` mentioning marker (the run's results root)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and "bench" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{p.pid} {cmd}")
    return found


@pytest.mark.slurm
def test_job_array_runs_point_i_in_task_i_and_resume_reruns_only_missing(slurm, tmp_path):
    sweep, results = tmp_path / "sweep.txt", tmp_path / "results"
    check_ok(sweep_cli("grid", "experiment=smoke", "launcher.nprocs=2", "trainer.seed=1,2,3", "-o", str(sweep)))
    points = read_points(sweep)
    env = job_env(results)
    job = sbatch("--array=0-2", str(ARRAY), str(sweep), *TINY, cwd=tmp_path, env=env)
    wait_done(job, 300, tmp_path)
    assert final_states(job) == {f"{job}_{i}": ("COMPLETED", "0:0") for i in range(3)}, job_logs(tmp_path)

    first = records(results)
    by_task = {int(r["env"]["slurm"]["SLURM_ARRAY_TASK_ID"]): (d, r) for d, r in first.items()}
    assert sorted(by_task) == [0, 1, 2], job_logs(tmp_path)
    for task, (_run_dir, r) in by_task.items():
        s = r["summary"]
        assert r["env"]["slurm"]["SLURM_ARRAY_JOB_ID"] == job
        assert f"-j{job}_{task}-" in s["run_id"]  # run ids carry array job and task, plus time and random
        assert (s["status"], s["world_size"], s["launcher"]) == ("ok", 2, "slurm")
        assert r["config"]["trainer"]["seed"] == task + 1  # task i ran line i of the sweep file
        assert s["point"] == point_id([*points[task], *TINY])

    # Point 1's record is lost (say, its node died): --resume runs it again and skips 0 and 2.
    shutil.rmtree(by_task[1][0])
    job2 = sbatch("--array=0-2", str(ARRAY), str(sweep), "--resume", *TINY, cwd=tmp_path, env=env)
    wait_done(job2, 300, tmp_path)
    assert final_states(job2) == {f"{job2}_{i}": ("COMPLETED", "0:0") for i in range(3)}, job_logs(tmp_path)
    second = records(results)
    new = [r for d, r in second.items() if d not in first]
    assert len(second) == 3 and len(new) == 1, job_logs(tmp_path)
    assert new[0]["env"]["slurm"]["SLURM_ARRAY_JOB_ID"] == job2 and new[0]["env"]["slurm"]["SLURM_ARRAY_TASK_ID"] == "1"
    assert new[0]["summary"]["status"] == "ok" and new[0]["summary"]["point"] == by_task[1][1]["summary"]["point"]
    for task in (0, 2):
        assert "already ok" in (tmp_path / f"slurm-bench-sweep-{job2}_{task}.out").read_text()


@pytest.mark.slurm
def test_usr1_to_running_job_gives_preempted_record_and_no_orphans(slurm, tmp_path, data_root):
    # A small real dataset to stage to node-local disk: the start of Wikitext-2 and the GPT-2 BPE files.
    data, results = tmp_path / "data", tmp_path / "results"
    (data / "wikitext-2").mkdir(parents=True)
    for name in ("train.txt", "valid.txt"):
        lines = (data_root / "wikitext-2" / name).read_text(encoding="utf-8").splitlines(keepends=True)
        (data / "wikitext-2" / name).write_text("".join(lines[:1500]), encoding="utf-8")
    shutil.copytree(data_root / "gpt2-tokenizer", data / "gpt2-tokenizer")

    job = sbatch(
        str(RUN),
        "data=wikitext2",
        "workload.seq_len=32",
        "trainer.epochs=1000",
        "trainer.progress=false",
        f"data.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        env=job_env(results, DATA=str(data), RESUME="never"),
    )  # preempted, not checkpointed and requeued
    # The record appears once every rank has its stop handler and joined the process group.
    deadline = time.time() + 240
    while not list(results.rglob("summary.json")):
        assert queued(job), f"job {job} ended before it started training\n{job_logs(tmp_path)}"
        assert time.time() < deadline, f"no record after 240 s\n{job_logs(tmp_path)}"
        time.sleep(1)
    assert rank_processes(str(results)), "the ranks should be running now"
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_done(job, 180, tmp_path)

    states = final_states(job, steps=True)
    assert states[job] == ("COMPLETED", "0:0") and states[f"{job}.batch"] == ("COMPLETED", "0:0"), states
    run_dir = run_dirs(results)[0]
    s = summary(run_dir)
    assert s["status"] == "preempted" and s["stop_signal"] == "SIGUSR1" and s["steps"] >= 1, s
    assert s["world_size"] == 2 and s["launcher"] == "slurm"
    # the ranks read the staged copy, and the copy is gone after the job
    stage = Path(f"/tmp/bench-data-{job}")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["root"] == f"{stage}/wikitext-2"
    assert f"staged {data} -> " in job_logs(tmp_path) and not stage.exists()
    assert rank_processes(str(results)) == [], "orphan rank processes after the job ended"


@pytest.mark.slurm
def test_hydra_multirun_through_submitit_slurm(slurm, tmp_path):
    proc = bench(
        "-m",
        "hydra/launcher=bench_slurm",
        "experiment=smoke",
        "launcher.nprocs=1,2",
        *TINY,
        results=tmp_path,
        timeout=400,
    )
    check_ok(proc)
    recs = records(tmp_path)
    assert len(recs) == 2, proc.stderr
    sweep_dirs = {d.parent for d in recs}
    assert len(sweep_dirs) == 1 and next(iter(sweep_dirs)).name.startswith("multirun-")  # one sweep folder
    sweep_dir = next(iter(sweep_dirs))
    by_world = {r["summary"]["world_size"]: r for r in recs.values()}
    assert sorted(by_world) == [1, 2]
    for world, r in by_world.items():
        assert r["summary"]["status"] == "ok" and r["summary"]["launcher"] == "slurm"
        assert r["summary"]["point"] == point_id(["experiment=smoke", f"launcher.nprocs={world}", *TINY])
        job = r["env"]["slurm"]["SLURM_JOB_ID"]
        # each point was its own job with one Slurm task per rank
        script = (sweep_dir / ".submitit" / job / f"{job}_submission.sh").read_text()
        assert f"#SBATCH --ntasks-per-node={world}" in script and "#SBATCH --signal=USR1@120" in script
        assert final_states(job)[job] == ("COMPLETED", "0:0")
    # Slurm starting the ranks changes who starts them, not the training: the 2-rank point equals a local run
    local = tmp_path / "local"
    check_ok(bench("experiment=smoke", "launcher.nprocs=2", *TINY, results=local))
    slurm_two = next(d for d, r in recs.items() if r["summary"]["world_size"] == 2)
    assert_losses_close(step_losses(slurm_two), step_losses(run_dirs(local)[0]), atol=1e-6)


# --- preempted, requeued, resumed ------------------------------------------------------------------
# 512 samples / (4 x 2 ranks) = 64 steps in one epoch, a checkpoint every 4: the stop lands mid-epoch.
REQUEUE_RUN = [
    "experiment=smoke",
    "workload.vocab_size=256",
    "data.train_samples=512",
    "trainer.max_steps=0",
    "trainer.stop_check_every=1",
    "trainer.progress=false",
    "trainer.eval_every_epoch=false",
]
# The requeue mechanics (USR1, checkpoint, `scontrol requeue`, the record found by point id) are the
# same for every adapter; each adapter's own checkpoint resuming to the uninterrupted losses is
# tests/test_checkpoint.py (ddp, zero3, fsdp, megatron, pipeline). zero3 and fsdp ran here too (all three
# resumed with a loss difference of 0.0): 150 s of the suite for what test_checkpoint.py already covers.
REQUEUE_ADAPTERS = {"ddp": ["adapter=ddp"]}
REQUEUE_STEPS = 64


def job_field(job: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith(f"{key}=")), "")


@pytest.mark.slurm
@pytest.mark.parametrize("name", list(REQUEUE_ADAPTERS))
def test_preempted_job_requeues_and_resumes_to_the_uninterrupted_losses(slurm, tmp_path, name):
    results = tmp_path / "results"
    point = [*REQUEUE_RUN, *REQUEUE_ADAPTERS[name]]
    # the uninterrupted reference, on this machine while the job runs
    reference = start(
        [sys.executable, "-m", "ptbench", *point, "launcher.nprocs=2", f"results.root={tmp_path / 'ref'}"]
    )
    job = sbatch("--requeue", str(RUN), *point, "trainer.checkpoint_every=4", cwd=tmp_path, env=job_env(results))
    try:
        # Slurm's time-limit warning (--signal=USR1@120) signals every task of the job's steps, as this
        # does; sent once the first checkpoint is committed, it stops the run mid-epoch
        deadline = time.time() + 600  # the queue may be busy (other tests' jobs): from submission
        while (state := job_field(job, "JobState")) == "PENDING" and time.time() < deadline:
            time.sleep(0.5)
        deadline = min(deadline, time.time() + 240)  # from the job's start
        while not list(results.glob("*/*/checkpoints/step-*/meta.json")):
            assert state in ("PENDING", "RUNNING"), f"job {job} {state} before a checkpoint\n{job_logs(tmp_path)}"
            assert time.time() < deadline, f"no checkpoint after 240 s\n{job_logs(tmp_path)}"
            time.sleep(0.2)
            state = job_field(job, "JobState")
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        # rank 0 checkpoints, writes the record and runs `scontrol requeue`; the job runs again (after
        # cred_expire, 10 s on the local cluster) and resumes the record of its point
        wait_done(job, 300, tmp_path)
        out, err = reference.communicate(timeout=300)
    finally:
        kill_group(reference)
    assert reference.returncode == 0, f"reference run failed\n{out[-2000:]}\n{err[-3000:]}"

    assert job_field(job, "Restarts") == "1", job_logs(tmp_path)
    assert final_states(job) == {job: ("COMPLETED", "0:0")}, job_logs(tmp_path)  # the last attempt
    attempts = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True
    ).stdout.split()
    assert attempts == ["REQUEUED", "COMPLETED"], attempts  # -D: every attempt of the job
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))  # --open-mode=append: both attempts
    assert f"scontrol requeue {job}" in log and "DUE TO JOB REQUEUE" in log and "resuming" in log, job_logs(tmp_path)
    run_dir = only_run(results)  # one record for the point
    s = summary(run_dir)
    assert s["status"] == "ok" and s["steps"] == REQUEUE_STEPS, s
    assert len(s["resumed_from"]) == 1, s["resumed_from"]
    resumed = s["resumed_from"][0]
    assert 4 <= resumed["step"] < REQUEUE_STEPS, resumed  # mid-epoch
    assert (resumed["previous_status"], resumed["slurm_job_id"], resumed["slurm_restart_count"]) == (
        "preempted",
        job,
        "1",
    ), resumed
    assert s["restart_gap_excluded"] and resumed["restart_gap_s"] > 0
    evs = events(run_dir)
    assert len(evs) == 1 and evs[0]["steps"] == REQUEUE_STEPS and evs[0]["resumed"] and not evs[0]["partial"], evs
    # the epoch's time is its two parts' training time: the restart gap (>= 10 s of requeue delay) left out
    assert evs[0]["restart_gap_excluded"] and evs[0]["epoch_time_s"] < resumed["restart_gap_s"], (evs[0], resumed)
    assert_losses_close(
        step_losses(run_dir),
        step_losses(only_run(tmp_path / "ref")),
        atol=1e-5,
        what=f"{name}: requeued and resumed under Slurm vs uninterrupted",
    )


@pytest.mark.slurm
def test_start_after_daemons_died_mid_job_begins_with_an_empty_queue(slurm, tmp_path):
    """A machine stopped mid-job (a container snapshot, a reboot) leaves the job in slurmctld's saved state:
    the next start cancels it rather than requeue and run it again (CI once found the node 'mixed')."""
    job = sbatch("--wrap", "sleep 600", cwd=tmp_path, env=job_env(tmp_path / "results"))
    deadline = time.time() + 60
    while "R" not in subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True).stdout:
        assert time.time() < deadline, f"job {job} never started"
        time.sleep(0.5)
    # the node dies with the job on it (no stop ran); the controller saves its state on the way down, as
    # it does on its cadence (a SIGKILLed slurmctld may not have saved the newest job yet)
    for daemon in ("slurmd", "slurmstepd"):
        subprocess.run(["pkill", "-KILL", "-x", daemon])
    subprocess.run(["pkill", "-KILL", "-f", "^sleep 600$"])
    subprocess.run(["pkill", "-TERM", "-x", "slurmctld"])
    deadline = time.time() + 30
    while subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "slurmctld did not exit on SIGTERM"
        time.sleep(0.2)
    proc = run(["bash", str(CLUSTER), "start", "--accounting"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    # (an earlier test's job still completing when the daemons died may be restored beside ours)
    restored = proc.stderr.split("cancelling jobs restored from saved state:", 1)[-1].split("\n", 1)[0].split()
    assert job in restored, proc.stderr
    assert not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip()
    assert subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip() == "idle"
