"""Checks before any rank starts: each raises ConfigError with one line naming the problem and the fix.

Hydra's schema has already refused unknown keys and wrong types (bench/core/config.py,
adapters/configs.py); these are the checks of values. Workloads check their own fields
(ptbench.workloads.check_config), adapters theirs (`Adapter.validate`).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ptbench.core.config import BATCH_POLICIES, BenchConfig
from ptbench.core.errors import ConfigError
from ptbench.core.optim import OPTIMIZERS
from ptbench.core.precision import check_precision
from ptbench.core.schedule import check_schedule
from ptbench.core.sinks import check_sinks
from ptbench.workloads import check_config as check_workload

LAUNCHERS = ("local", "torchrun", "slurm")
START_METHODS = ("auto", "spawn", "fork")
CPU_BINDS = ("none", "cores")  # launcher.cpu_bind (rank_cpus)
MEMORY_CHECKS = ("warn", "refuse", "off")  # trainer.memory_check


def check_config(cfg: BenchConfig) -> None:
    positive = {
        "trainer.batch_size": cfg.trainer.batch_size,
        "trainer.epochs": cfg.trainer.epochs,
        "trainer.grad_accum": cfg.trainer.grad_accum,
        "trainer.stop_check_every": cfg.trainer.stop_check_every,
        "launcher.nprocs": cfg.launcher.nprocs,
        "optimizer.lr": cfg.optimizer.lr,
    }
    for key, value in positive.items():
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")
    t = cfg.trainer
    if t.dist_timeout_s and t.hang_timeout_s > 0 and t.dist_timeout_s <= t.hang_timeout_s:
        raise ConfigError(
            f"trainer.dist_timeout_s={t.dist_timeout_s} must exceed trainer.hang_timeout_s="
            f"{t.hang_timeout_s:g}, or the backend kills hung ranks before the watchdog records the "
            "hang; leave it 0 (= hang_timeout_s + 60 s)"
        )
    for key in (
        "trainer.untimed_steps",
        "trainer.max_steps",
        "trainer.max_eval_batches",
        "trainer.log_every",
        "trainer.timing_sample",
        "trainer.timing_sample_cap",
        "trainer.dist_timeout_s",
        "trainer.hang_timeout_s",
        "launcher.threads_per_rank",
    ):
        group, name = key.split(".")
        if (getattr(getattr(cfg, group), name) or 0) < 0:  # max_eval_batches None: the default cap
            raise ConfigError(f"{key}={getattr(getattr(cfg, group), name)} must be >= 0")
    check_workload(cfg.workload, cfg.data)
    if cfg.adapter.batch_policy not in BATCH_POLICIES:
        raise ConfigError(f"adapter.batch_policy={cfg.adapter.batch_policy}: choose {', '.join(BATCH_POLICIES)}")
    if cfg.launcher.name not in LAUNCHERS:
        raise ConfigError(f"launcher.name={cfg.launcher.name}: choose {', '.join(LAUNCHERS)}")
    if cfg.launcher.start_method not in START_METHODS:
        raise ConfigError(f"launcher.start_method={cfg.launcher.start_method}: choose {', '.join(START_METHODS)}")
    if cfg.launcher.cpu_bind not in CPU_BINDS:
        raise ConfigError(f"launcher.cpu_bind={cfg.launcher.cpu_bind}: choose {', '.join(CPU_BINDS)}")
    check_precision(cfg.trainer.precision)
    if cfg.trainer.memory_check not in MEMORY_CHECKS:
        raise ConfigError(f"trainer.memory_check={cfg.trainer.memory_check}: choose {', '.join(MEMORY_CHECKS)}")
    check_sinks(cfg.results)
    fault = cfg.trainer.inject_fault
    frac = r"(\d+\.?\d*|\.\d+)"
    if fault and not re.fullmatch(rf"(raise|oom|hang|exit)@\d+:\d+|slow@{frac}|straggler@\d+:{frac}", fault):
        raise ConfigError(
            f"trainer.inject_fault={fault}: use KIND@RANK:STEP with KIND raise, oom, hang or exit, or "
            "slow@FRACTION (every step FRACTION longer, e.g. slow@0.15), or straggler@RANK:FRACTION (that rank only)"
        )
    if cfg.trainer.profile is not None and not re.fullmatch(r"\d+:[1-9]\d*", str(cfg.trainer.profile)):
        raise ConfigError(
            f"trainer.profile={cfg.trainer.profile}: use START:COUNT (COUNT >= 1 optimizer steps from global step "
            "START >= 0), e.g. trainer.profile=3:2"
        )
    if cfg.optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer.name '{cfg.optimizer.name}': choose one of {', '.join(OPTIMIZERS)}")
    check_schedule(cfg.lr_schedule)
    check_compile(cfg)
    check_triton(cfg)


def check_compile(cfg: BenchConfig) -> None:
    """trainer.compile=true: an adapter that declares support, a warm-up step to hold the compilation, a
    known backend, and for inductor on CPU a C++ compiler (it builds the kernels with one)."""
    t = cfg.trainer
    if not t.compile:
        return
    from ptbench.adapters import get_adapter_class

    cls = get_adapter_class(cfg.adapter.name)
    refusal = cls.compile_refusal(cfg)
    if refusal:
        raise ConfigError(
            f"trainer.compile=true: adapter={cls.name} does not support it ({refusal}); "
            "drop trainer.compile or use adapter=ddp, fsdp or zero"
        )
    if t.untimed_steps < 1:
        raise ConfigError(
            "trainer.compile=true compiles in the first step(s), which must stay out of the step "
            "statistics: set trainer.untimed_steps >= 1"
        )
    from torch._dynamo import list_backends

    backends = list_backends(exclude_tags=())
    if t.compile_backend not in backends:
        raise ConfigError(
            f"trainer.compile_backend={t.compile_backend} is not a torch.compile backend; choose one of "
            f"{', '.join(sorted(backends))}"
        )
    import shutil

    import torch

    cxx = os.environ.get("CXX") or "g++"
    if t.compile_backend == "inductor" and not torch.cuda.is_available() and not shutil.which(cxx):
        raise ConfigError(
            f"trainer.compile_backend=inductor on CPU needs a C++ compiler ({cxx} not found): install "
            "g++ (or set CXX), or set trainer.compile_backend=aot_eager"
        )


def triton_missing(which=None, include_dir: str | None = None) -> list[str]:
    """What Triton's launcher build lacks here: the C compiler it picks (CC, else gcc, else clang) and
    Python.h (sysconfig's include directory), as in triton/runtime/build.py."""
    import shutil
    import sysconfig

    which = which or shutil.which
    include_dir = include_dir or sysconfig.get_paths()["include"]
    cc = os.environ.get("CC")
    missing = []
    if not (which(cc) if cc else (which("gcc") or which("clang"))):
        missing.append(f"a C compiler ({f'CC={cc}' if cc else 'gcc or clang'} not found)")
    if not (Path(include_dir) / "Python.h").is_file():
        missing.append(f"Python's headers ({include_dir}/Python.h)")
    return missing


def check_triton(cfg: BenchConfig, which=None, include_dir: str | None = None) -> None:
    """On CUDA, Triton builds a C launcher per kernel with the host's C compiler against Python's headers:
    for torch.compile's inductor (trainer.compile) and for megatron, whose fusions always go through
    torch.compile on GPU. A minimal host (a slim container) lacks them and the run crashes in its first step."""
    import torch

    t = cfg.trainer
    uses = []
    if t.compile and t.compile_backend == "inductor":
        uses.append("trainer.compile=true (inductor)")
    from ptbench.adapters import get_adapter_class

    cls = get_adapter_class(cfg.adapter.name)
    if cls.compiles_on_cuda:
        uses.append(f"adapter={cls.name} ({cls.compiles_on_cuda})")
    if not uses or not torch.cuda.is_available():
        return
    missing = triton_missing(which, include_dir)
    if missing:
        raise ConfigError(
            f"{' and '.join(uses)} on CUDA builds Triton kernels, which need {' and '.join(missing)}: install "
            "them (e.g. apt-get install gcc python3-dev, or set CC)"
            + (", or set trainer.compile=false" if t.compile and not cls.compiles_on_cuda else "")
        )


def start_method(requested: str, cuda: bool) -> str:
    """The multiprocessing start method for launcher=local ranks: `auto` is fork on a CPU-only machine
    and spawn when CUDA is visible; fork is refused there (the forked ranks could not use CUDA)."""
    if requested == "fork" and cuda:
        raise ConfigError(
            "launcher.start_method=fork with CUDA visible: forked ranks cannot use CUDA; use "
            "launcher.start_method=spawn (or auto)"
        )
    if requested == "auto":
        return "spawn" if cuda else "fork"
    return requested


def check_devices(world: int, devices_per_process: int, device_count: int) -> None:
    """launcher=local on a GPU machine: one GPU per device a rank drives (NCCL refuses two ranks on one GPU)."""
    need = world * devices_per_process
    if device_count and need > device_count:
        raise ConfigError(
            f"{world} rank(s) x {devices_per_process} device(s) need {need} GPUs but this node has "
            f"{device_count}: lower launcher.nprocs (or use launcher=slurm across nodes)"
        )


def check_results_dir(root: Path) -> None:
    """Create and remove a probe folder in the nearest existing ancestor of `root`: the real test of
    writability (os.access says yes to root on /proc, where nothing can be created), leaving nothing."""
    root = Path(root)
    probe = root.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fix = "set results.root=<a writable folder>"
    if not probe.is_dir():
        raise ConfigError(f"results.root={root} is not writable ({probe} is a file); {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".bench-write-probe-"))
    except OSError as e:
        raise ConfigError(
            f"results.root={root} is not writable ({probe}: {e.strerror or type(e).__name__}); {fix}"
        ) from None


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity: a cgroup, taskset or Slurm binding), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_cpus(requested: str, nprocs: int, cpus=None) -> tuple[tuple[int, ...], ...] | None:
    """launcher.cpu_bind for the ranks launcher=local spawns: None for `none`; for `cores`, each local rank's
    CPUs: this process's affinity (sorted) split evenly in local-rank order (a remainder stays unused), as
    DeepSpeed's launcher --bind_cores_to_rank splits a node's cores; more ranks than CPUs: rank r on CPU
    r mod n (they share; contention_warnings says so)."""
    if requested == "none":
        return None
    if cpus is None:
        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError(
                "launcher.cpu_bind=cores: this platform cannot bind a process to CPUs (no sched_setaffinity); "
                "use launcher.cpu_bind=none"
            )
        cpus = os.sched_getaffinity(0)
    cpus = sorted(cpus)
    share = len(cpus) // nprocs
    if share:
        return tuple(tuple(cpus[r * share : (r + 1) * share]) for r in range(nprocs))
    return tuple((cpus[r % len(cpus)],) for r in range(nprocs))


def running_harness_runs(results_root, exclude_pids=()) -> list[str]:
    """Other runs of this harness going now on this host: `running` summaries under results_root whose
    owner (host, pid, start time) is alive here (ptbench.core.records.owner_gone says not gone)."""
    import socket

    from ptbench.core.records import owner_gone, summaries

    host, found = socket.gethostname(), []
    for path, s in summaries([results_root]):
        o = s.get("owner") if s.get("status") == "running" else None
        if not isinstance(o, dict) or o.get("host") != host or type(o.get("pid")) is not int:
            continue
        if o["pid"] not in (os.getpid(), *exclude_pids) and owner_gone(o) is None and _runs_as(o["pid"], path):
            found.append(f"{path.parent} (pid {o['pid']})")
    return found


def _runs_as(pid: int, path) -> bool:
    """The process `pid` runs as the user who wrote the record at `path`: a `running` record another user planted
    in a shared results folder, naming a process that is not theirs (pid 1), is no run of this harness and must not
    mark ours contended."""
    import psutil

    try:
        return psutil.Process(pid).uids().effective == path.stat().st_uid
    except (psutil.Error, OSError, ValueError):
        return False


def contention_warnings(cfg: BenchConfig, world_size: int, cpus: int | None = None) -> list[str]:
    """Before launch: what will make this run's times suspect, as one-line warnings for the
    record's `warnings`: local ranks x threads per rank above the CPUs of the process's affinity, and
    other runs of this harness going on this host (their steps and ours share the cores)."""
    out = []
    cpus = cpus or affinity_cpus()
    threads = cfg.launcher.threads_per_rank or int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
    if cfg.launcher.name == "local" and world_size * threads > cpus:
        out.append(
            f"contention: {world_size} rank(s) x {threads} thread(s) on {cpus} CPU(s) of this process's affinity: "
            "ranks share cores, times are not comparable; lower launcher.nprocs or launcher.threads_per_rank"
        )
    out += slurm_warnings(world_size, threads)
    others = running_harness_runs(cfg.results.root, exclude_pids=(os.getppid(),))
    if others:
        out.append(
            f"contention: {len(others)} other run(s) of this harness running on this host: {', '.join(others[:3])}"
            + (" ..." if len(others) > 3 else "")
            + "; run timing points one at a time"
        )
    return out


def _first_count(value: str | None) -> int | None:
    """The first count of a Slurm per-node list ("2(x3),1" -> 2), None when unset or not a count."""
    head = (value or "").split(",")[0].split("(")[0].strip()
    return int(head) if head.isdigit() else None


def _node_cpus_advertised(node: str | None) -> int | None:
    """CPUTot of this node as Slurm advertises it (`scontrol show node`), None when it cannot be asked."""
    import re
    import shutil
    import subprocess

    if not node or not shutil.which("scontrol"):
        return None
    try:
        text = subprocess.run(
            ["scontrol", "show", "node", node], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CPUTot=(\d+)", text)
    return int(m.group(1)) if m else None


def slurm_warnings(
    local_ranks: int, threads: int, env=None, host_cpus: int | None = None, advertised=None
) -> list[str]:
    """Inside a Slurm allocation (SLURM_JOB_ID set): an allocation that oversubscribes its cores, as
    `contention:` warnings. Ranks on this node x threads above the CPUs Slurm gave the job here
    (SLURM_CPUS_ON_NODE; tasks per node x cpus-per-task when that is unset); a job given more CPUs than the
    node has; a node advertising more CPUs than it has (CPUTot of `scontrol show node`, `advertised`: its
    value for tests), so that jobs beside ours share our cores."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return []
    host_cpus = host_cpus or os.cpu_count() or 1
    out = []
    per_task = _first_count(env.get("SLURM_CPUS_PER_TASK")) or 1
    tasks = _first_count(env.get("SLURM_NTASKS_PER_NODE")) or _first_count(env.get("SLURM_TASKS_PER_NODE"))
    on_node = _first_count(env.get("SLURM_CPUS_ON_NODE")) or (tasks * per_task if tasks else None)
    if on_node and local_ranks * threads > on_node:
        out.append(
            f"contention: {local_ranks} rank(s) x {threads} thread(s) on this node above the {on_node} CPU(s) "
            f"Slurm gave the job here (SLURM_CPUS_ON_NODE): ranks share cores; ask for --cpus-per-task={threads} "
            f"with {local_ranks} task(s) per node, or fewer ranks"
        )
    if on_node and on_node > host_cpus:
        out.append(
            f"contention: Slurm gave this job {on_node} CPU(s) on a node that has {host_cpus}: the node's "
            "slurm.conf advertises more CPUs than it has (CPUs=), so jobs share cores; set CPUs= to the real count"
        )
    else:
        total = advertised if advertised is not None else _node_cpus_advertised(env.get("SLURMD_NODENAME"))
        if total and total > host_cpus:
            out.append(
                f"contention: this Slurm node advertises {total} CPU(s) (CPUTot) but has {host_cpus}: other jobs "
                "placed beside this one share its cores; set CPUs= in slurm.conf to the real count"
            )
    return out
