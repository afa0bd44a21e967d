"""Failures become records: raise, OOM, hang, kill -9 on one of 2 CPU ranks.

Each case checks the status written, that every rank of the run is gone (no orphans), and that an
earlier run's record is untouched. No wall-clock bounds: a timeout is told from the collective
timeout by its message, a kill from the watchdog by its status. Every run starts in its own
session and its process group is killed at teardown, so a failing case leaves nothing running.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ptbench.core.records import RunRecord, write_json
from tests.helpers import kill_group, run_dirs, summary
from tests.helpers import start as start_process

SMALL = ["experiment=smoke", "trainer.progress=false"]
LONG = ["data.train_samples=8192", "trainer.max_steps=1000"]  # minutes of steps: killed long before the end


@pytest.fixture(scope="module")
def results(tmp_path_factory, smoke_run):
    """A results tree holding one good run (a copy of the shared smoke_run's tree, conftest), whose files
    must survive every failure below."""
    root = tmp_path_factory.mktemp("results") / "tree"
    shutil.copytree(smoke_run.parents[1], root)
    assert [summary(d)["status"] for d in run_dirs(root)] == ["ok"]
    return root


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_leftovers():
    """Whatever a case started dies with it, even when the case fails halfway."""
    yield
    while _started:
        kill_group(_started.pop())


def start(results: Path, *overrides: str) -> subprocess.Popen:
    proc = start_process([sys.executable, "-m", "ptbench", *SMALL, *overrides, f"results.root={results}"])
    _started.append(proc)
    return proc


def ranks_of(proc: subprocess.Popen, count: int = 2, timeout: float = 120) -> list[psutil.Process]:
    """The rank processes the launcher started: its direct children, spawned (`spawn_main` in their
    command line) or forked (the launcher's own command line), not multiprocessing's resource tracker."""
    launcher = psutil.Process(proc.pid)

    def is_rank(p: psutil.Process) -> bool:
        try:
            cmd = p.cmdline()
        except psutil.Error:  # a short-lived helper process that has exited (or is a zombie) is no rank
            return False
        return "spawn_main" in " ".join(cmd) or cmd == launcher.cmdline()

    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [p for p in launcher.children() if is_rank(p)]
        if len(kids) >= count:
            return kids
        time.sleep(0.2)
    raise AssertionError("ranks did not start")


def finish(proc: subprocess.Popen, ranks: list[psutil.Process], timeout: float):
    out, err = proc.communicate(timeout=timeout)
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"orphan rank processes: {alive}"
    return out, err


def new_run(results: Path, before: set) -> dict:
    new = [d for d in run_dirs(results) if d not in before]
    assert len(new) == 1, new
    return summary(new[0])


@pytest.mark.parametrize("fault,status,rank", [("raise@1:2", "failed", 1), ("oom@0:2", "oom", 0)])
def test_rank_failure_is_recorded(results, fault, status, rank):
    before, files = set(run_dirs(results)), digest(results)
    proc = start(results, "trainer.max_steps=50", f"trainer.inject_fault={fault}")
    ranks = ranks_of(proc)
    _, err = finish(proc, ranks, timeout=180)
    assert proc.returncode == 1
    s = new_run(results, before)
    assert s["status"] == status and s["failed_rank"] == rank
    assert "injected" in s["error"] and f"rank {rank}" in err
    assert {k: v for k, v in digest(results).items() if k in files} == files  # earlier record intact


def test_hung_rank_times_out(results):
    before = set(run_dirs(results))
    # the collective timeout is an hour: only the watchdog (8 s without progress) can end this run in time
    proc = start(
        results,
        "trainer.max_steps=50",
        "trainer.inject_fault=hang@1:2",
        "trainer.hang_timeout_s=8",
        "trainer.dist_timeout_s=3600",
    )
    ranks = ranks_of(proc)
    finish(proc, ranks, timeout=300)
    s = new_run(results, before)
    assert proc.returncode == 1 and s["status"] == "timeout"
    # both ranks stop beating at the end of step 1 (rank 1 hangs, rank 0 then waits in its collective):
    # whichever watchdog fires first, the record blames the rank that froze, and says where it stopped
    assert s["failed_rank"] == 1, s
    assert s["error"].startswith("no progress for ") and "rank 1 stopped in faults.py:" in s["error"], s


def test_killed_rank_is_recorded(results):
    before = set(run_dirs(results))
    proc = start(results, *LONG, "trainer.hang_timeout_s=60")
    ranks = ranks_of(proc)
    # wait until training runs (the run folder says running and a few seconds pass)
    deadline = time.time() + 120
    while time.time() < deadline and not [d for d in run_dirs(results) if d not in before]:
        time.sleep(0.5)
    time.sleep(8)
    victim = ranks[1]
    os.kill(victim.pid, signal.SIGKILL)
    finish(proc, ranks, timeout=300)
    s = new_run(results, before)
    # failed, not timeout: the launcher saw the death, the 60 s watchdog did not have to
    assert proc.returncode == 1 and s["status"] == "failed"
    assert "SIGKILL" in s["error"] or "killed" in s["error"] or "closed" in s["error"], s["error"]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_preemption_signal_gives_preempted_record(results, sig):
    """Slurm's --signal=USR1@120 and scancel's SIGTERM both end the run gracefully: preempted, exit 0."""
    before = set(run_dirs(results))
    proc = start(results, *LONG)
    ranks = ranks_of(proc)
    deadline = time.time() + 120
    while time.time() < deadline and not [d for d in run_dirs(results) if d not in before]:
        time.sleep(0.5)
    time.sleep(5)
    proc.send_signal(sig)  # to the launcher only, as scancel / Slurm signal the batch step's process
    finish(proc, ranks, timeout=180)
    s = new_run(results, before)
    assert proc.returncode == 0 and s["status"] == "preempted" and s["stop_signal"] == sig.name, s
    assert 0 < s["steps"] < 1000


def test_atomic_writes_keep_the_previous_state(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"status": "ok"})

    class Unserializable:
        def __str__(self):
            raise RuntimeError("crash while serializing")

    with pytest.raises(RuntimeError):
        write_json(path, {"status": Unserializable()})
    assert json.loads(path.read_text()) == {"status": "ok"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"], "no temp file left behind"
    record = RunRecord(tmp_path)
    record.append_event({"epoch": 0})
    with pytest.raises(RuntimeError):
        record.append_event({"epoch": Unserializable()})
    assert record.events() == [{"epoch": 0}]
