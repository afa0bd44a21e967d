"""Ctrl-C and SIGKILL on a real run (issue 28): real processes, real signals, no mocks.

A 2-rank DDP run that checkpoints after every step (its first checkpoint folder is the sign that a step
is done) gets SIGINT on the launcher alone, SIGINT on its whole process group (Ctrl-C in a terminal),
two SIGINTs, or SIGKILL on the whole group (the OOM killer). Interrupted runs end with a final record
`interrupted`, one line on stderr, no traceback, exit 130 and no process left; a rerun continues
them. A run whose launcher was SIGKILLed is marked `killed` by the next run of the same point.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ptbench.core.records import RESERVE
from tests.helpers import bench, check_ok, kill_group, only_run, run_dirs, start, summary

RUN = [
    "experiment=smoke",
    "workload.vocab_size=256",
    "trainer.progress=false",
    "data.train_samples=8192",
    "trainer.stop_check_every=1",
    "trainer.checkpoint_every=1",
    "trainer.resume=auto",
    "results.point=signals",  # one point whatever trainer.max_steps says
]


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def _signalled(root: Path, send, *overrides: str) -> tuple[subprocess.Popen, str, str]:
    """Start a long run, wait for its first step, `send(proc)`; returns (proc, stdout, stderr) once it ended,
    having checked that nothing of its process group is left."""
    cmd = [sys.executable, "-m", "ptbench", *RUN, "trainer.max_steps=1000", *overrides, f"results.root={root}"]
    proc = start(cmd)
    try:
        deadline = time.time() + 240
        while not list(root.rglob("checkpoints/step-*")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        send(proc)
        out, err = proc.communicate(timeout=240)
        deadline = time.time() + 30
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _session(proc.pid), f"processes left: {_session(proc.pid)}"
    finally:
        kill_group(proc)
        proc.wait()
    return proc, out, err


def _interrupted(proc, err: str) -> dict:
    run_dir = only_run(Path(proc.args[-1].split("=", 1)[1]))
    s = summary(run_dir)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert s["status"] == "interrupted" and s["stop_signal"] == "SIGINT" and "owner" not in s, s
    assert s["error"].startswith("interrupted"), s
    lines = [line for line in err.splitlines() if line.startswith("run interrupted")]
    assert len(lines) == 1 and str(run_dir) in lines[0] and "trainer.resume=auto continues it" in lines[0], err
    assert not (run_dir / RESERVE).exists()
    return s


@pytest.mark.parametrize("to", ["launcher", "group"])
def test_sigint_ends_interrupted_and_a_rerun_continues(tmp_path, to):
    def send(proc):
        if to == "launcher":
            # the launcher's helper threads (its contention sampler) leave the stop signals to its main thread
            helpers = {t: m for t, m in _thread_masks(proc.pid).items() if not t.endswith(f":{proc.pid}")}
            assert helpers and all(m >= {signal.SIGINT, signal.SIGTERM} for m in helpers.values()), helpers
            proc.send_signal(signal.SIGINT)
        else:  # Ctrl-C in a terminal: every process of the group, each rank too
            os.killpg(proc.pid, signal.SIGINT)

    # the group's Ctrl-C reaches the ranks' DataLoader workers too: they leave it to their rank
    proc, _, err = _signalled(tmp_path, send, *(["data.num_workers=1"] if to == "group" else []))
    s = _interrupted(proc, err)
    steps = s["steps"]
    assert 1 <= steps < 1000
    if to == "group":  # interrupted is resumable: the next run of the point continues it
        again = bench(*RUN, f"trainer.max_steps={steps + 2}", results=tmp_path)
        check_ok(again)
        s = summary(only_run(tmp_path))
        assert s["status"] == "ok" and s["steps"] == steps + 2, s
        assert [r["previous_status"] for r in s["resumed_from"]] == ["interrupted"], s["resumed_from"]


@pytest.mark.parametrize("gap", [0.05, 0.5])  # the second one while the ranks stop, or as the launcher ends
def test_two_sigints_still_end_interrupted(tmp_path, gap):
    def send(proc):
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        proc.send_signal(signal.SIGINT)

    proc, _, err = _signalled(tmp_path, send)
    _interrupted(proc, err)


def test_a_killed_launcher_is_marked_killed_by_the_next_run(tmp_path):
    proc, _, _ = _signalled(tmp_path, lambda p: os.killpg(p.pid, signal.SIGKILL))
    (old,) = run_dirs(tmp_path)
    assert summary(old)["status"] == "running" and (old / RESERVE).exists()

    again = bench(*RUN, "trainer.max_steps=2", "trainer.resume=never", results=tmp_path)
    check_ok(again)
    lines = [line for line in again.stderr.splitlines() if "marked killed" in line]
    assert lines == [
        f"warning: record {old} was left running: no final status: the process that ran it (pid {proc.pid} on "
        f"{socket.gethostname()}) is gone, killed outright (SIGKILL, the OOM killer); marked killed"
    ], again.stderr[-3000:]
    s = summary(old)
    assert s["status"] == "killed" and "owner" not in s and f"pid {proc.pid}" in s["error"], s
    assert not (old / RESERVE).exists()
    new = [d for d in run_dirs(tmp_path) if d != old]
    assert len(new) == 1 and summary(new[0])["status"] == "ok"


def test_ctrl_c_ends_a_sweep_not_only_its_point(tmp_path):
    """`python -m ptbench -m ...` runs its points one after another in one process: Ctrl-C during the first
    leaves it `interrupted` and starts no other point."""
    cmd = [sys.executable, "-m", "ptbench", "-m", "trainer.seed=1,2", *RUN[:-1], "trainer.max_steps=1000"]
    proc = start([*cmd, f"results.root={tmp_path}"])
    try:
        deadline = time.time() + 240
        while not list(tmp_path.rglob("checkpoints/step-*")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
        proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert [summary(d)["status"] for d in run_dirs(tmp_path)] == ["interrupted"]


def _blocked(status: str) -> set[int]:
    mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}


def _thread_masks(pid: int) -> dict[str, set[int]]:
    """Each thread's name -> its blocked signals, from /proc (what the kernel itself goes by)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[f"{(task / 'comm').read_text().strip()}:{task.name}"] = _blocked((task / "status").read_text())
        except OSError:  # the thread ended meanwhile
            pass
    return out


def test_helper_threads_block_the_stop_signals_and_leave_the_main_thread_as_it_was():
    """CPython runs signal handlers in the main thread; one a helper thread took waits until the main thread
    next takes the GIL (a launcher asleep in its ranks' join heard of a Ctrl-C only when they had ended). So
    every helper thread blocks the stop signals and the kernel gives them to the main thread."""
    code = (
        "import os, signal, threading, time\n"
        "signal.pthread_sigmask(signal.SIG_SETMASK, [])  # not what the test process holds (ptbench.__main__ blocks)\n"
        "from ptbench.core.stopping import helper_thread\n"
        "t = helper_thread(lambda: time.sleep(30), 'helper')\n"
        "print(os.getpid(), t.native_id, threading.main_thread().native_id, flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, helper, main = proc.stdout.readline().split()
        helper_mask = _blocked(Path(f"/proc/{pid}/task/{helper}/status").read_text())
        main_mask = _blocked(Path(f"/proc/{pid}/task/{main}/status").read_text())
    finally:
        proc.kill()
        proc.wait()
    stop = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
    assert stop <= helper_mask and not stop & main_mask, (helper_mask, main_mask)
