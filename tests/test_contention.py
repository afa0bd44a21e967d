"""Contention detected before launch (issue 29, bench/runner/checks.py contention_warnings): more ranks x
threads than the CPUs of the process's affinity, and another run of this harness going on this host."""

import json
import os
import socket
import subprocess
import sys

import psutil

from ptbench.runner.checks import affinity_cpus, contention_warnings
from ptbench.runner.points import compose_point


def _cfg(tmp_path, *overrides):
    return compose_point(["experiment=smoke", f"results.root={tmp_path}", *overrides])


def test_more_ranks_than_cpus_warns_and_a_quiet_run_has_none(tmp_path):
    cpus = affinity_cpus()
    assert cpus == len(os.sched_getaffinity(0))
    over = contention_warnings(_cfg(tmp_path, f"launcher.nprocs={2 * cpus}"), 2 * cpus)
    assert len(over) == 1 and over[0].startswith(f"contention: {2 * cpus} rank(s) x 1 thread(s) on {cpus} CPU(s)")
    assert contention_warnings(_cfg(tmp_path, "launcher.nprocs=2"), 2, cpus=2) == []  # the quiet 2-rank run
    two_threads = _cfg(tmp_path, "launcher.nprocs=2", "launcher.threads_per_rank=2")
    assert contention_warnings(two_threads, 2, cpus=2)[0].startswith("contention: 2 rank(s) x 2 thread(s) on 2 CPU(s)")


def test_another_running_run_on_this_host_warns(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = tmp_path / "smoke" / "other-run"
        run.mkdir(parents=True)
        owner = {"host": socket.gethostname(), "pid": other.pid, "started": psutil.Process(other.pid).create_time()}
        (run / "summary.json").write_text(json.dumps({"status": "running", "owner": owner}))
        w = contention_warnings(_cfg(tmp_path, "launcher.nprocs=1"), 1, cpus=2)
        assert len(w) == 1 and "1 other run(s) of this harness running on this host" in w[0] and "other-run" in w[0]
    finally:
        other.kill()
        other.wait()
    assert contention_warnings(_cfg(tmp_path, "launcher.nprocs=1"), 1, cpus=2) == []  # its owner is gone


def test_the_warning_reaches_the_record_and_a_quiet_run_has_none(tmp_path, smoke_run):
    """End to end: `launcher.nprocs` at twice the affinity's CPUs puts the contention line on stderr and in
    the summary's `warnings`; the suite's 2-rank smoke run (2 ranks on >= 2 CPUs) has no contention warning."""
    from tests.helpers import SMOKE, bench, check_ok, only_run, summary

    cpus = affinity_cpus()
    proc = bench(*SMOKE, f"launcher.nprocs={2 * cpus}", "trainer.max_steps=2", results=tmp_path / "over")
    check_ok(proc)
    line = f"contention: {2 * cpus} rank(s) x 1 thread(s) on {cpus} CPU(s)"
    assert f"warning: {line}" in proc.stderr, proc.stderr
    assert any(w.startswith(line) for w in summary(only_run(tmp_path / "over"))["warnings"])
    if cpus >= 2:
        assert not [w for w in summary(smoke_run)["warnings"] if w.startswith("contention:")]
