"""How a run ends when its surroundings fail: real processes, real signals, real file systems, no mocks.

A launcher SIGKILLed alone (the OOM killer picks the biggest process): its ranks find it gone, the first
writes the final status `killed` with the step, and none outlives it by more than a few seconds.

The storage under a run refuses a write (a full tmpfs, a read-only remount): one line on the console naming the
path and the fix, the traceback only in the rank's error file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ptbench.core.dist import free_port
from tests.helpers import SMOKE, bench, kill_group, only_run, run, run_dirs, start, summary
from tests.test_faults_records import fill, small_fs  # noqa: F401 - a fixture (a real 2 MiB tmpfs)
from tests.test_reliability import ranks_of
from tests.test_slurm import slurm  # noqa: F401 - a fixture (the local Slurm cluster)

RUN = [
    "experiment=smoke",
    "workload.vocab_size=256",
    "trainer.progress=false",
    "data.train_samples=8192",
    "trainer.checkpoint_every=1",  # its first checkpoint folder: a step is done
]


def test_a_sigkilled_launcher_leaves_no_rank_and_a_killed_record(tmp_path):
    proc = start([sys.executable, "-m", "ptbench", *RUN, "trainer.max_steps=100000", f"results.root={tmp_path}"])
    try:
        ranks = ranks_of(proc)
        deadline = time.time() + 240
        while not list(tmp_path.rglob("checkpoints/step-*")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer does
        killed_at = time.time()
        _, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks outlived their launcher by 10 s: {alive}"
        gone_after = time.time() - killed_at
        _, err = proc.communicate(timeout=30)
    finally:
        kill_group(proc)
        proc.wait()
    run_dir = only_run(tmp_path)
    s = summary(run_dir)
    assert s["status"] == "killed" and "owner" not in s, s
    assert isinstance(s["steps"], int) and s["steps"] >= 1, s
    assert f"the launcher (pid {proc.pid}) was killed outright" in s["error"], s
    assert f"at step {s['steps']}" in s["error"], s
    lines = [line for line in err.splitlines() if line.startswith("run killed:")]
    assert len(lines) == 1 and str(run_dir) in lines[0] and "(status killed)" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not (Path(run_dir) / ".space-reserve").exists()
    print(f"ranks gone {gone_after:.1f} s after the launcher; {lines[0]}")


# --- the storage refuses a write mid-run: one line naming the path and the fix, no traceback ----------------
LONG = ["experiment=smoke", "workload.vocab_size=256", "trainer.max_steps=1000000", "trainer.epochs=1000000"]


def _break_storage_mid_run(root: Path, breaks) -> tuple[subprocess.Popen, str]:
    """A long run under `root`; once its first epoch event is written, `breaks(root)`; (proc, stderr) at its end."""
    proc = start([sys.executable, "-m", "ptbench", *LONG, f"results.root={root}"])
    try:
        deadline = time.time() + 240
        while not list(root.rglob("events.jsonl")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        breaks(root)
        _, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
        proc.wait()
    return proc, err


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("run failed")]
    assert len(lines) == 1, err[-3000:]
    print(lines[0])  # for the record of what a user sees (pytest -s)
    return lines[0]


def test_disk_full_at_a_checkpoint_is_one_line_without_traceback(small_fs):
    proc = bench(*SMOKE, "trainer.checkpoint_every=1", "trainer.checkpoint_keep=10", results=small_fs, timeout=300)
    line = _one_line(proc.stderr)
    assert proc.returncode == 1 and "checkpoint step-000001 not saved" in line, line
    assert f"(No space left on device); free space under {small_fs}/smoke" in line, line
    (run_dir,) = run_dirs(small_fs)
    assert summary(run_dir)["status"] == "failed"
    assert "Traceback" in (run_dir / "error-rank0.json").read_text() + (run_dir / "error-rank1.json").read_text()


def test_disk_full_at_an_epoch_event_names_the_file(small_fs):
    proc, err = _break_storage_mid_run(small_fs, fill)
    line = _one_line(err)
    (run_dir,) = run_dirs(small_fs)
    events = run_dir / "events.jsonl"
    assert proc.returncode == 1 and f"cannot write {events} (No space left on device): free space there" in line, line
    s = summary(run_dir)
    assert s["status"] == "failed" and s["failed_rank"] == 0 and str(events) in s["error"], s
    assert "Traceback" in (run_dir / "error-rank0.json").read_text()


def test_read_only_results_mid_run_is_one_line_naming_the_path(small_fs):
    def read_only(root: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)

    proc, err = _break_storage_mid_run(small_fs, read_only)
    line = _one_line(err)
    (run_dir,) = run_dirs(small_fs)
    assert proc.returncode == 1, err[-3000:]
    assert f"cannot write {run_dir}/" in line and "(Read-only file system): it is on a read-only file system" in line
    assert line.endswith(f"{run_dir} keeps status running (no final record)"), line
    assert summary(run_dir)["status"] == "running"  # nothing could be written there: the line says so


# --- a run predicted not to fit: the warning reaches the console of ranks that torchrun / srun started -------
def _too_big() -> list[str]:
    """A GPT-2 whose token embedding alone is twice this machine's memory: predicted not to fit, and the
    allocator refuses it at once (no page is touched), so the run ends `oom` without straining the machine."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("vm.overcommit_memory=1 would grant the allocation; the run would then fill the machine")
    machine = psutil.virtual_memory().total + psutil.swap_memory().total
    return [*SMOKE, f"workload.vocab_size={2 * machine // (4 * 128)}", "trainer.memory_check=warn"]  # n_embd 128


def test_a_run_predicted_not_to_fit_says_so_under_torchrun(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = bench(
        *_too_big(), "launcher=torchrun", results=tmp_path, timeout=300, env={**env, "MASTER_PORT": str(free_port())}
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: predicted memory per rank")]
    assert len(warnings) == 1 and "exceeds 90% of the host available memory / 1 ranks" in warnings[0], proc.stderr
    assert "running anyway" in warnings[0], warnings
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("run ")]
    run_dir = only_run(tmp_path)
    assert proc.returncode == 1 and lines == [
        f"run oom: rank 0: RuntimeError: {summary(run_dir)['error'].split(': ', 1)[1]} "
        f"(traceback: {run_dir}/error-rank0.json)"
    ], proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "oom"


# --- a job that never assembles: torchrun-style ranks of which one never starts ---------------------------
def test_a_rank_that_never_starts_is_named_within_the_timeout(tmp_path):
    """WORLD_SIZE=2, only rank 0 started (its peer's node never came up): rank 0 ends within the process-group
    timeout (trainer.hang_timeout_s=5: 65 s) with one line naming rank 1, and writes no record, saying so."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    t0 = time.time()
    proc = bench(*SMOKE, "launcher=torchrun", "trainer.hang_timeout_s=5", results=tmp_path, timeout=300, env=env)
    took = time.time() - t0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("run never assembled: rank(s) 1 of 2 never joined rank 0 at 127.0.0.1:"), lines
    assert "within 65s" in lines[0] and lines[0].endswith("no record was written"), lines
    assert run_dirs(tmp_path) == [] and took < 65 + 60, took  # the timeout, plus the start-up of one process


def _port_no_one_picks() -> int:
    """A free port below the kernel's ephemeral range: no bind(0) of a test beside this one (a TCPStore, gloo's
    pair listeners) can take it in the minute rank 1 waits. An ephemeral one was once taken, and rank 1 talked to
    that listener instead of naming rank 0."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10000, min(low, 20000)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 10000-19999")


def test_a_missing_rank_0_is_named_within_the_timeout(tmp_path):
    """WORLD_SIZE=2, only rank 1 started (the store's host, rank 0, never came up): rank 1 ends within the
    timeout (65 s) with one line naming rank 0, where torch's own connect retried past it with C++ traces."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_port_no_one_picks())
    t0 = time.time()
    proc = bench(*SMOKE, "launcher=torchrun", "trainer.hang_timeout_s=5", results=tmp_path, timeout=300, env=env)
    took = time.time() - t0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    print(lines[0])
    assert lines[0].startswith(f"run never assembled: rank(s) 0 of 2 never listened at 127.0.0.1:{env['MASTER_PORT']}")
    assert "within 65s (rank 1 waited: Connection refused;" in lines[0], lines
    assert lines[0].endswith("no record was written"), lines
    assert run_dirs(tmp_path) == [] and 65 <= took < 65 + 60, took


def test_a_port_another_program_holds_is_named_by_rank_0(tmp_path):
    """Rank 0 hosts the store at MASTER_PORT; a port already bound by another program (a derived Slurm port that
    an outgoing connection took) ends it at once with one line naming the port, not "could not reach rank 0"."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env["MASTER_PORT"] = str(held.getsockname()[1])
        proc = bench(*SMOKE, "launcher=torchrun", results=tmp_path, timeout=300, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines == [
        f"run never assembled: rank 0 could not listen at 127.0.0.1:{env['MASTER_PORT']}: another program holds "
        f"port {env['MASTER_PORT']}: set MASTER_PORT (launcher.master_port) to a free port; no record was written"
    ], proc.stderr[-3000:]
    assert run_dirs(tmp_path) == []


# --- an interrupted sweep: the running point ends with a final record, no other starts, --resume finishes it ----
POINTS = [
    "experiment=smoke workload.vocab_size=256 trainer.seed=1",
    "experiment=smoke workload.vocab_size=256 trainer.seed=2 trainer.max_steps=60 data.train_samples=4096",
    "experiment=smoke workload.vocab_size=256 trainer.seed=3",
]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


BLOCK_SIGTERM_THEN_EXEC = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])  # Ctrl-C; scancel
def test_an_interrupted_sweep_stops_after_its_point_and_resume_runs_the_rest(tmp_path, sig):
    sweep_file, root = tmp_path / "sweep.txt", tmp_path / "results"
    sweep_file.write_text("\n".join(POINTS) + "\n")
    cmd = [sys.executable, "-m", "ptbench.sweep", "run", str(sweep_file), "--no-comm"]
    # SIGTERM: from a parent that blocks it (a test worker that imported ptbench.__main__ does), which the sweep
    # inherits through exec; it must still stop
    blocked = [sys.executable, "-c", BLOCK_SIGTERM_THEN_EXEC] if sig == signal.SIGTERM else [sys.executable]
    proc = start([*blocked, *cmd[1:], "--", f"results.root={root}"])
    try:
        deadline = time.time() + 300
        while len(run_dirs(root)) < 2:  # the second point has its record: it is starting or training
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)  # the sweep alone: its point runs in a session of its own
        _, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
        proc.wait()
    first, second = run_dirs(root)  # the third point never started
    status = {signal.SIGINT: "interrupted", signal.SIGTERM: "preempted"}[sig]
    ran = {signal.SIGINT: "1 interrupted, 1 ok", signal.SIGTERM: "1 ok, 1 preempted"}[sig]  # the tally, by name
    assert summary(first)["status"] == "ok" and summary(second)["status"] == status, summary(second)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("sweep stopped")]
    assert lines == [
        f"sweep stopped by {sig.name} after 2 of 3 run(s) ({ran}); its record {second} is final "
        f"(status {status}); 1 not started: `python -m ptbench.sweep run {sweep_file} --resume` runs every point "
        "without an ok record"
    ], err[-3000:]
    if sig == signal.SIGTERM:
        return
    before = {d: _files(d) for d in (first, second)}
    again = run([*cmd, "--resume", "--", f"results.root={root}"], timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already ok" in again.stdout and "sweep: 3 run(s): 2 ok, 1 skipped" in again.stdout, again.stdout
    assert {d: _files(d) for d in (first, second)} == before  # no record rewritten, the ok one not rerun
    new = [d for d in run_dirs(root) if d not in before]
    assert sorted(summary(d)["status"] for d in new) == ["ok", "ok"] and len(new) == 2, new


MULTIRUN = ["experiment=smoke", "workload.vocab_size=256", "trainer.max_steps=60", "data.train_samples=4096"]


@pytest.mark.parametrize("launcher", ["basic", "ptbench_local"])  # points in the sweep's process; a job each
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])  # Ctrl-C; scancel
def test_an_interrupted_multirun_stops_after_its_point(tmp_path, sig, launcher):
    """`python -m ptbench -m ...` gets the signal while its second point trains: that point's record is final,
    the third never starts, and results.skip_done=true then runs only what is left."""
    cmd = [sys.executable, "-m", "ptbench", "-m", f"hydra/launcher={launcher}", *MULTIRUN, "trainer.seed=1,2,3"]
    cmd.append(f"results.root={tmp_path}")
    proc = start(cmd)
    try:
        deadline = time.time() + 300
        while len(run_dirs(tmp_path)) < 2:  # the second point has its record: it is starting or training
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)  # the multirun process alone, as `kill` or scancel's batch step signal
        _, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
        proc.wait()
    first, second = run_dirs(tmp_path)  # no third record
    status = {signal.SIGINT: "interrupted", signal.SIGTERM: "preempted"}[sig]
    assert summary(first)["status"] == "ok" and summary(second)["status"] == status, summary(second)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("multirun stopped")]
    print(lines)
    ran = {signal.SIGINT: "1 interrupted, 1 ok", signal.SIGTERM: "1 ok, 1 preempted"}[sig]
    which = (
        f"point #1: its record {second} is final (status {status})"
        if launcher == "basic"
        else "point(s) #1: their records are final"
    )
    assert lines == [
        f"multirun stopped by {sig.name} during {which}; no later point starts (2 record(s) in {second.parent}: "
        f"{ran}): the same command with results.skip_done=true runs every point without an ok record"
    ], err[-3000:]
    if sig == signal.SIGTERM or launcher != "basic":
        return
    before = {d: _files(d) for d in (first, second)}
    again = run([*cmd, "results.skip_done=true"], timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {d: _files(d) for d in (first, second)} == before  # no record rewritten, the ok point not rerun
    new = [d for d in run_dirs(tmp_path) if d not in before]
    assert sorted(summary(d)["status"] for d in new) == ["ok", "ok"], new


TASK = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGINT, lambda *a: (out.write_text("SIGINT"), sys.exit(0)))
(out.parent / "ready").write_text("")
time.sleep(60)
"""


def test_the_sweep_forwards_a_stop_past_a_controller_that_just_ended(tmp_path, monkeypatch):
    """An earlier point's controller, listed by the sweep a moment before it ended: psutil raises NoSuchProcess
    for its children (seen in CI: the loop stopped there, and the running point trained to its end `ok`). The
    stop still reaches the running point's task, a grandchild as under submitit."""
    import psutil

    from ptbench.runner import multirun

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    stale = psutil.Process(ended.pid)
    ended.wait()  # gone and reaped: its psutil handle raises NoSuchProcess, as in the race
    controller = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {TASK!r}, sys.argv[1]])",
         str(tmp_path / "got")]
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and controller.poll() is None
            time.sleep(0.05)
        listed = psutil.Process.children
        monkeypatch.setattr(
            psutil.Process,
            "children",
            lambda self, **kw: ([stale] if self.pid == os.getpid() else []) + listed(self, **kw),
        )
        monkeypatch.setattr(multirun, "_received", [])
        with multirun.forwarding_to_jobs():
            os.kill(os.getpid(), signal.SIGINT)
        controller.wait(timeout=60)
    finally:
        controller.kill()
    assert (tmp_path / "got").read_text() == "SIGINT" and multirun.received() == [signal.SIGINT]


@pytest.mark.slurm
def test_a_run_predicted_not_to_fit_says_so_in_the_batch_log(slurm, tmp_path):
    """slurm/run.sbatch (2 srun tasks): rank 0 warns before training, in the job's log, and the record ends oom."""
    from tests.test_slurm import RUN as RUN_SBATCH
    from tests.test_slurm import job_env, job_logs, sbatch, wait_done

    results = tmp_path / "results"
    job = sbatch(str(RUN_SBATCH), *_too_big(), cwd=tmp_path, env=job_env(results))
    wait_done(job, 300, tmp_path)
    log = job_logs(tmp_path)
    warnings = [line for line in log.splitlines() if line.startswith("warning: predicted memory per rank")]
    assert len(warnings) == 1 and "exceeds 90% of the host available memory / 2 ranks" in warnings[0], log
    assert "Traceback" not in log and "run oom: rank 0: RuntimeError: " in log, log
    assert summary(only_run(results))["status"] == "oom"
