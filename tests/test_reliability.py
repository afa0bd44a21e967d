"""Failures become records: raise, OOM, hang, kill -9 on one of 2 CPU ranks.

Each case checks the status written, that every rank of the run is gone (no orphans), that the
run ended within its timeout, and that an earlier run's record is untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.core.records import RunRecord, write_json
from tests.helpers import REPO, bench, check_ok, run_dirs, summary

SMALL = ["experiment=smoke", "trainer.progress=false"]
LONG = ["data.train_samples=8192", "trainer.max_steps=1000"]  # minutes of steps: killed long before the end


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results tree holding one good run, whose files must survive every failure below."""
    root = tmp_path_factory.mktemp("results")
    check_ok(bench(*SMALL, results=root))
    return root


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def start(results: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench", *SMALL, *overrides, f"results.root={results}"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ranks_of(proc: subprocess.Popen, count: int = 2, timeout: float = 120) -> list[psutil.Process]:
    """The rank processes the launcher spawned (not multiprocessing's resource tracker)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [p for p in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        if len(kids) >= count:
            return kids
        time.sleep(0.2)
    raise AssertionError("ranks did not start")


def finish(proc: subprocess.Popen, ranks: list[psutil.Process], timeout: float):
    t0 = time.time()
    out, err = proc.communicate(timeout=timeout)
    elapsed = time.time() - t0
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"orphan rank processes: {alive}"
    return out, err, elapsed


def new_run(results: Path, before: set) -> dict:
    new = [d for d in run_dirs(results) if d not in before]
    assert len(new) == 1, new
    return summary(new[0])


@pytest.mark.parametrize("fault,status,rank", [("raise@1:2", "failed", 1), ("oom@0:2", "oom", 0)])
def test_rank_failure_is_recorded(results, fault, status, rank):
    before, files = set(run_dirs(results)), digest(results)
    proc = start(results, "trainer.max_steps=50", f"trainer.inject_fault={fault}")
    ranks = ranks_of(proc)
    _, err, _ = finish(proc, ranks, timeout=180)
    assert proc.returncode == 1
    s = new_run(results, before)
    assert s["status"] == status and s["failed_rank"] == rank
    assert "injected" in s["error"] and f"rank {rank}" in err
    assert {k: v for k, v in digest(results).items() if k in files} == files  # earlier record intact


def test_hung_rank_times_out(results):
    before = set(run_dirs(results))
    proc = start(results, "trainer.max_steps=50", "trainer.inject_fault=hang@1:2", "trainer.hang_timeout_s=8")
    ranks = ranks_of(proc)
    _, _, elapsed = finish(proc, ranks, timeout=180)
    s = new_run(results, before)
    assert proc.returncode == 1 and s["status"] == "timeout"
    assert "no progress" in s["error"]
    assert elapsed < 8 + 60  # watchdog timeout + start-up, not the 300 s collective timeout


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
    _, _, elapsed = finish(proc, ranks, timeout=120)
    s = new_run(results, before)
    assert proc.returncode == 1 and s["status"] == "failed"
    assert "SIGKILL" in s["error"] or "killed" in s["error"] or "closed" in s["error"], s["error"]
    assert elapsed < 60


def test_preemption_signal_gives_preempted_record(results):
    before = set(run_dirs(results))
    proc = start(results, *LONG)
    ranks = ranks_of(proc)
    deadline = time.time() + 120
    while time.time() < deadline and not [d for d in run_dirs(results) if d not in before]:
        time.sleep(0.5)
    time.sleep(5)
    proc.send_signal(signal.SIGUSR1)
    finish(proc, ranks, timeout=120)
    s = new_run(results, before)
    assert proc.returncode == 0 and s["status"] == "preempted" and s["stop_signal"] == "SIGUSR1"
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
