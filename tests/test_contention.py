"""Contention (issue 29): before launch (bench/runner/checks.py contention_warnings): more ranks x threads than
the CPUs of the process's affinity, another run of this harness going on this host, a Slurm allocation that
oversubscribes its cores; during the run (bench/runner/contention.py): other processes' CPU, steal, other
processes on our GPUs."""

import contextlib
import json
import os
import socket
import subprocess
import sys

import psutil
import pytest

from ptbench.runner.checks import affinity_cpus, contention_warnings, slurm_warnings
from ptbench.runner.contention import Sampler, busy_limit, other_gpu_processes, sampled_warnings, visible_gpu_indices
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
    if cpus >= 2:  # no rank x thread warning; what the sampler saw is recorded (others' load: see below)
        quiet = summary(smoke_run)
        assert not [w for w in quiet["warnings"] if w.startswith("contention: 2 rank(s)")]
        sampled = quiet["contention_sampled"]
        assert sampled["samples"] >= 1 and sampled["cpus"] == cpus and sampled["own_busy_cpus_mean"] > 0
        # the observer's own cost, recorded: above nothing, within its goal of half a percent of one core
        assert 0 < sampled["sampler_cpu_s"] and sampled["sampler_cpu_share"] <= 0.005, sampled
        # the decision on that run's own figures: a warning exactly when others passed the stated threshold
        fired = [w for w in quiet["warnings"] if w.startswith("contention: during the run")]
        assert bool(fired) == (sampled["other_busy_cpus_mean"] >= busy_limit(cpus, 2))


# --- during the run (bench/runner/contention.py) ----------------------------------------------------------
QUIET = {"interval_s": 1.0, "samples": 9, "span_s": 9.0, "cpus": 2, "other_busy_cpus_mean": 0.06,
         "other_busy_cpus_max": 0.2, "steal_share": 0.0, "own_busy_cpus_mean": 1.9, "loadavg_1m_max": 2.1,
         "gpu_other_pids": None, "gpu_error": None}  # fmt: skip


def test_thresholds_quiet_busy_steal():
    assert sampled_warnings(QUIET, ranks=2) == []  # a quiet run: none
    assert sampled_warnings({**QUIET, "samples": 0}, ranks=2) == []  # nothing measured: nothing said
    busy = sampled_warnings({**QUIET, "other_busy_cpus_mean": 0.9, "other_busy_cpus_max": 1.4}, ranks=2)
    assert len(busy) == 1 and busy[0].startswith("contention: during the run other processes kept 0.90 CPU(s)")
    assert "(threshold 0.50)" in busy[0]
    # a large machine: a quarter of the CPUs our ranks leave free (64 - 8 = 56 -> 14)
    assert busy_limit(64, 8) == 14.0 and busy_limit(2, 2) == busy_limit(2, 1) == 0.5
    assert sampled_warnings({**QUIET, "cpus": 64, "other_busy_cpus_mean": 10.0, "other_busy_cpus_max": 12.0}, 8) == []
    stolen = sampled_warnings({**QUIET, "steal_share": 0.12}, ranks=2)
    assert len(stolen) == 1 and "stole 12.0 %" in stolen[0]


def _detached_burner(seconds: float) -> int:
    """A CPU-bound python that is NOT a descendant of this process (its shell parent exits): someone else's work."""
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'import time; t = time.time() + {seconds}\nwhile time.time() < t: pass' "
         "> /dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


@contextlib.contextmanager
def _burners(n: int, seconds: float):
    """`n` detached CPU burners (`_detached_burner`) for the block; their pids; killed when it ends."""
    pids = [_detached_burner(seconds) for _ in range(n)]
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_sampler_sees_other_work_and_not_its_own():
    """Two detached CPU burners (another user's work) are counted as others; a burner that is our child is ours.
    Bounds only load cannot break: others' CPU can only grow with the machine's load."""
    import time

    with _burners(max(2, affinity_cpus()), 4.0):
        s = Sampler(interval_s=0.5).start()
        time.sleep(3.0)
        fig = s.stop()
    assert fig["samples"] >= 3 and fig["cpus"] == affinity_cpus()
    assert fig["other_busy_cpus_mean"] >= 0.5, fig  # the burners alone keep the CPUs near full
    w = sampled_warnings(fig, ranks=1)
    assert len(w) == 1 and w[0].startswith("contention: during the run other processes kept")

    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time() + 3\nwhile time.time() < t: pass"])
    try:
        s = Sampler(interval_s=0.5).start()
        child.wait()
        fig = s.stop()
    finally:
        child.kill()
        child.wait()
    assert fig["own_busy_cpus_mean"] > 0.1, fig  # the child's CPU is ours (reaped or live)


def test_two_runs_started_together_both_warn(tmp_path):
    """Two 1-rank runs started at the same moment: each record says contention (the other run's ranks busy
    beside it, seen by the sampler, or the other run's `running` record seen before launch)."""
    from tests.helpers import SMOKE, kill_group, start

    procs = [
        start([sys.executable, "-m", "ptbench", *SMOKE, "launcher.nprocs=1", "trainer.max_steps=8",
               f"results.root={tmp_path / name}"])
        for name in ("a", "b")
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "warning: contention:" in err, err[-3000:]
    for name in ("a", "b"):
        from tests.helpers import only_run, summary

        assert any(w.startswith("contention:") for w in summary(only_run(tmp_path / name))["warnings"])


def test_gpu_decision_with_real_pids():
    """The NVML decision on CPU: real pid lists (this process, a child of ours, a process of someone else)."""
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = _detached_burner(0.0)  # ended at once: only its pid number is used
    try:
        own = {os.getpid(), ours.pid}
        running = {0: [os.getpid(), ours.pid, other], 1: [ours.pid]}
        assert other_gpu_processes(running, own) == {0: [other]}
        assert other_gpu_processes({0: [os.getpid()]}, own) == {}
        # another pid namespace (a container): no pid is ours, so count beyond our ranks per device
        assert other_gpu_processes({0: [424242, 424243], 1: [424244]}, own, {0: 1, 1: 1}) == {0: [-1]}
        w = sampled_warnings({**QUIET, "gpu_other_pids": {"0": [other]}}, ranks=2)
        assert len(w) == 1 and w[0].startswith("contention: 1 other process(es) on GPU 0") and str(other) in w[0]
    finally:
        ours.kill()
        ours.wait()
    assert visible_gpu_indices(2, {"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    assert visible_gpu_indices(2, {}) == [0, 1]
    assert visible_gpu_indices(1, {"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == ["GPU-abc"]


def test_slurm_allocation_that_oversubscribes_its_cores():
    job = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "2"}
    assert slurm_warnings(2, 1, {}, host_cpus=2) == []  # not in a Slurm job
    assert slurm_warnings(2, 1, {**job, "SLURM_CPUS_ON_NODE": "2"}, host_cpus=2, advertised=2) == []
    over = slurm_warnings(4, 1, {**job, "SLURM_CPUS_ON_NODE": "2"}, host_cpus=2, advertised=2)
    assert len(over) == 1 and "4 rank(s) x 1 thread(s) on this node above the 2 CPU(s)" in over[0]
    # no SLURM_CPUS_ON_NODE: tasks per node x cpus-per-task ("2(x3)": 2 per node)
    env = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "1", "SLURM_TASKS_PER_NODE": "2(x3)"}
    assert "above the 2 CPU(s)" in slurm_warnings(2, 2, env, host_cpus=8, advertised=8)[0]
    big = slurm_warnings(2, 1, {**job, "SLURM_CPUS_ON_NODE": "4"}, host_cpus=2)
    assert len(big) == 1 and "gave this job 4 CPU(s) on a node that has 2" in big[0]
    # the local Slurm of old: the node claims 4 CPUs on a 2-core box, each job gets 2, two jobs share the cores
    adv = slurm_warnings(2, 1, {**job, "SLURM_CPUS_ON_NODE": "2"}, host_cpus=2, advertised=4)
    assert len(adv) == 1 and "advertises 4 CPU(s) (CPUTot) but has 2" in adv[0]


def test_tree_walk_of_proc_matches_psutils_scan_and_records_its_cost():
    """The sampler's own-tree CPU read from /proc (children lists) equals psutil's scan of every process: the
    same pids (a child and its child) and CPU seconds; a sampled child tree's CPU is the run's own; and the
    sampler's CPU time is recorded. Bounds load cannot break: CPU time, not CPU share."""
    import resource
    import time

    from ptbench.runner.contention import _proc_tree_cpu_s, _psutil_tree_cpu_s

    grand = "import time; t = time.time() + 2\nwhile time.time() < t: pass"
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grand!r}])"]
    me = psutil.Process()
    child = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(child.pid).children() and time.monotonic() < deadline:  # the grandchild started
            time.sleep(0.05)
        for _ in range(5):  # another test's leftover child of this process may end meanwhile: a stable read
            ref_cpu, ref_pids = _psutil_tree_cpu_s(me)
            cpu, pids = _proc_tree_cpu_s(me.pid)
            if _psutil_tree_cpu_s(me)[1] == ref_pids:
                break
        grandchild = {p.pid for p in psutil.Process(child.pid).children()}
        assert pids == ref_pids and {me.pid, child.pid, *grandchild} <= pids and grandchild, (pids, ref_pids)
        assert abs(cpu - ref_cpu) <= 0.05, (cpu, ref_cpu)  # read a moment apart, a grandchild running
    finally:
        child.kill()
        child.wait()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = Sampler(interval_s=0.2).start()
    subprocess.run(cmd, check=True)
    with open(f"/proc/self/task/{s._thread.native_id}/stat") as f:  # its thread alone at the lowest priority
        assert int(f.read().rsplit(")", 1)[1].split()[16]) == 19
    fig = s.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # child and grandchild
    # at nice 19 on a loaded machine the sampler's last interval can end before the tree's (0.82 of it seen in a
    # full suite on 2 busy cores): most of the tree's CPU is the run's own, none of it counted as others'
    assert tree > 0 and fig["own_busy_cpus_mean"] * fig["span_s"] >= 0.7 * tree - 0.05, (tree, fig)
    assert fig["sampler_cpu_s"] > 0  # span_s is rounded to the ms: the share from it to 1 %
    assert fig["sampler_cpu_share"] == pytest.approx(fig["sampler_cpu_s"] / fig["span_s"], rel=0.01, abs=1e-5)


def test_sampler_root_makes_that_tree_the_runs_own():
    """`root`: the tree counted as the run's own is that process's (a detached burner here), not this one's."""
    import time

    with _burners(1, 4.0) as (pid,):
        s = Sampler(interval_s=0.5, root=psutil.Process(pid), scope="rank0_node").start()
        time.sleep(2.5)
        fig = s.stop()
    assert fig["scope"] == "rank0_node" and fig["samples"] >= 2
    assert fig["own_busy_cpus_mean"] > 0.1, fig  # the burner's CPU is the root's tree's, so ours


def _torchrun_smoke(results, burners: int):
    """The SMOKE run under torchrun (2 ranks, as test_launch starts it) beside `burners` detached CPU burners."""
    from tests.helpers import SMOKE, check_ok, only_run, run, summary

    with _burners(burners, 240.0):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "ptbench", "launcher=torchrun", *SMOKE, f"results.root={results}"]  # fmt: skip
        proc = run(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    check_ok(proc)
    s = summary(only_run(results))
    assert s["status"] == "ok" and s["launcher"] == "torchrun"
    return proc, s


def test_torchrun_run_beside_other_work_records_contention(tmp_path):
    """Under torchrun (no launcher of ours) global rank 0 samples its node: burners beside the run are others'
    work, recorded in `contention_sampled` (scope rank0_node) and as a `contention:` warning (stderr too)."""
    proc, s = _torchrun_smoke(tmp_path, burners=max(2, affinity_cpus()))
    fig = s["contention_sampled"]
    assert fig["scope"] == "rank0_node" and fig["samples"] >= 1 and fig["cpus"] == affinity_cpus(), fig
    assert fig["own_busy_cpus_mean"] > 0, fig
    assert fig["other_busy_cpus_mean"] >= busy_limit(fig["cpus"], 2), fig  # the burners alone keep the CPUs near full
    assert any(w.startswith("contention: during the run other processes kept") for w in s["warnings"]), s["warnings"]
    assert "warning: contention: during the run" in proc.stderr, proc.stderr[-3000:]


def test_torchrun_run_without_burners_decides_on_its_own_figures(tmp_path):
    """Without burners: sampled too; others' load on a shared box is not ours to assert (the suite runs beside
    itself), so, as for the local smoke run, a warning exactly when its own figures passed the threshold."""
    _proc, s = _torchrun_smoke(tmp_path, burners=0)
    fig = s["contention_sampled"]
    assert fig["scope"] == "rank0_node" and fig["samples"] >= 1 and fig["own_busy_cpus_mean"] > 0, fig
    fired = [w for w in s["warnings"] if w.startswith("contention: during the run")]
    assert bool(fired) == (fig["other_busy_cpus_mean"] >= busy_limit(fig["cpus"], 2)), (fig, s["warnings"])
