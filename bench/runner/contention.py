"""Contention DURING a run: a light sampler in the launching process, and its verdict.

One daemon thread samples every `INTERVAL_S` (1 s) while the ranks run:
- the CPUs of this process's affinity (psutil per-CPU times): their busy time (user + system + nice + irq +
  softirq; not idle, iowait or steal) minus the CPU time of this run's own processes (the launcher, its live
  descendants, and the children it already reaped), i.e. the CPUs other work kept busy; and their steal time
  (a hypervisor giving our vCPUs to another guest);
- the 1-minute load average (/proc/loadavg; ours included, recorded for the reader only);
- on CUDA (nvidia-ml-py, imported lazily), the processes NVML sees on our GPUs that are not ours.
Under torchrun / srun (no launcher process of ours) global rank 0 samples its own node, its "own" tree being
its parent's (torchrun's agent, or the step's slurmstepd): the node's ranks are siblings under it
(`external_sampler` / `record_external`); other nodes are not sampled.

Verdict (`sampled_warnings`), one `contention:` line each, so the report keeps such runs out of verdicts:
- other processes kept on average >= max(OTHER_BUSY_MIN_CPUS, OTHER_BUSY_FREE_SHARE x the CPUs our ranks
  leave free) CPUs busy: 0.5 CPU on a 2-core machine, a quarter of the free CPUs on a large one;
- steal >= STEAL_SHARE (5 %) of the CPUs' time;
- any process of someone else on one of our GPUs.
A quiet run (no other work: others' mean well under half a CPU, no steal, our GPUs ours alone) gets none.

The sampler itself runs beside the ranks (a thread of the launcher): it reads only its own tree's /proc files
(not every process's), runs at the lowest priority (nice 19, its thread alone), and records its own CPU time
(`sampler_cpu_s`, and per second of the run `sampler_cpu_share`, a share of one core: its goal is at most 0.5 %).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ptbench.core.stopping import helper_thread

INTERVAL_S = 1.0
OTHER_BUSY_MIN_CPUS = 0.5
OTHER_BUSY_FREE_SHARE = 0.25
STEAL_SHARE = 0.05


def _tree_cpu_s(root) -> tuple[float, set[int]]:
    """CPU seconds of `root` (a psutil.Process), its live descendants and the children each already reaped;
    with the pids counted. From /proc directly where the kernel lists each thread's children: a walk of our
    own tree, not psutil's scan of every process on the host (which was most of the sampler's CPU)."""
    if _PROC_CHILDREN:
        try:
            return _proc_tree_cpu_s(root.pid)
        except (OSError, ValueError, IndexError):  # the root itself gone or unreadable: psutil says so its way
            pass
    return _psutil_tree_cpu_s(root)


# the kernel lists each thread's children (CONFIG_PROC_CHILDREN); else psutil's scan of every process
_PROC_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid` from /proc/PID/stat, in seconds (psutil's source too)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    return sum(int(v) for v in fields[11:15]) * _TICK_S


def _proc_children(pid: int) -> list[int]:
    """The live children of `pid`: the union of its threads' /proc/PID/task/TID/children lists."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # a thread that just ended
            continue
    return out


def _proc_tree_cpu_s(root: int) -> tuple[float, set[int]]:
    total = _proc_cpu_s(root)  # the root must be readable: else the caller falls back to psutil
    pids, todo = {root}, _proc_children(root)
    while todo:
        pid = todo.pop()
        try:
            todo += _proc_children(pid)
            total += _proc_cpu_s(pid)
            pids.add(pid)
        except (FileNotFoundError, ProcessLookupError):  # ended between the listing and the read
            continue
    return total, pids


def _psutil_tree_cpu_s(root) -> tuple[float, set[int]]:
    import psutil

    total, pids = 0.0, set()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
            pids.add(p.pid)
        except psutil.Error:
            pass
    return total, pids


def _cpu_busy_steal(cpus: list[int]) -> tuple[float, float]:
    """Busy and steal seconds summed over `cpus` (indices into psutil's per-CPU times)."""
    import psutil

    per = psutil.cpu_times(percpu=True)
    busy = steal = 0.0
    for i in cpus:
        if i >= len(per):
            continue
        t = per[i]
        idle = t.idle + getattr(t, "iowait", 0.0)
        st = getattr(t, "steal", 0.0)
        busy += sum(t) - idle - st - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        steal += st
    return busy, steal


def visible_gpu_indices(count: int, env: dict | None = None) -> list[int | str]:
    """The NVML devices our ranks use: CUDA_VISIBLE_DEVICES's first `count` entries (indices or GPU-UUIDs),
    else 0..count-1."""
    env = os.environ if env is None else env
    vis = [v.strip() for v in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if v.strip()]
    if not vis:
        return list(range(count))
    return [int(v) if v.isdigit() else v for v in vis[:count]]


def other_gpu_processes(running: dict, own: set[int], ranks_per_device: dict | None = None) -> dict:
    """{device: [pids]} of processes on our GPUs that are not ours, from NVML's {device: [pids]}. When no
    pid on any device is one of ours (NVML in another pid namespace, as in a container) the pids cannot be
    compared: then a device with more processes than our ranks on it counts the extra as others (their
    pids unknown: -1)."""
    comparable = any(p in own for pids in running.values() for p in pids)
    out = {}
    for dev, pids in running.items():
        if comparable:
            others = sorted(p for p in set(pids) if p not in own)
        else:
            extra = len(set(pids)) - (ranks_per_device or {}).get(dev, 1)
            others = [-1] * max(0, extra)
        if others:
            out[dev] = others
    return out


def nvml_processes(devices: list[int | str]) -> dict:
    """{device: [pids]} of the compute and graphics processes NVML sees on each device (nvidia-ml-py)."""
    import pynvml  # nvidia-ml-py

    out = {}
    for dev in devices:
        h = (
            pynvml.nvmlDeviceGetHandleByIndex(dev)
            if isinstance(dev, int)
            else pynvml.nvmlDeviceGetHandleByUUID(dev.encode() if isinstance(dev, str) else dev)
        )
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h) + pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
        out[dev] = sorted({p.pid for p in procs})
    return out


class Sampler:
    """Samples the machine while a run goes on (`start` before the ranks, `stop` after): `stop` returns the
    figures (the summary's `contention_sampled`)."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        gpus: list | None = None,
        ranks_per_gpu: int = 1,
        root=None,
        scope: str = "machine",
    ):
        """`root` (a psutil.Process; default this process): the tree whose CPU is the run's own. `scope`: what
        the figures cover ("machine": a local launch; "rank0_node": rank 0's node of a torchrun/srun run)."""
        import psutil

        self.interval_s = interval_s
        self.me = root if root is not None else psutil.Process()
        self.scope = scope
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
            if root is not None:  # srun --cpu-bind gives each rank its own cores: the CPUs of the whole tree
                try:
                    for p in root.children(recursive=True):
                        self.cpus = sorted(set(self.cpus) | set(p.cpu_affinity()))
                except psutil.Error:
                    pass
        except (AttributeError, OSError):
            self.cpus = list(range(psutil.cpu_count() or 1))
        self.gpus = gpus or []
        self.ranks_per_gpu = ranks_per_gpu
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._others: list[tuple[float, float]] = []  # (seconds, other CPUs busy) per interval
        self._steal = self._own = self._span = 0.0
        self._load_max = 0.0
        self._gpu_others: dict = {}
        self._gpu_error: str | None = None
        self._last: tuple[float, float, float, float] | None = None
        self._cpu_s = 0.0  # the sampler's own CPU time: an observer must not change what it observes

    def _sample(self) -> None:
        c0 = time.thread_time()
        try:
            self._measure()
        finally:
            self._cpu_s += time.thread_time() - c0

    def _measure(self) -> None:
        now = time.monotonic()
        busy, steal = _cpu_busy_steal(self.cpus)
        own, pids = _tree_cpu_s(self.me)
        self._load_max = max(self._load_max, os.getloadavg()[0])
        if self._last is not None:
            t0, b0, s0, o0 = self._last
            dt = now - t0
            if dt > 0:
                own_d = max(0.0, own - o0)
                self._others.append((dt, max(0.0, (busy - b0) - own_d) / dt))
                self._steal += max(0.0, steal - s0)
                self._own += own_d
                self._span += dt
        self._last = (now, busy, steal, own)
        if self.gpus and self._gpu_error is None:
            try:
                found = other_gpu_processes(nvml_processes(self.gpus), pids, {d: self.ranks_per_gpu for d in self.gpus})
                for dev, others in found.items():
                    self._gpu_others.setdefault(str(dev), set()).update(others)
            except Exception as e:  # noqa: BLE001 - NVML missing or failing: recorded, never fatal
                self._gpu_error = f"{type(e).__name__}: {e}"

    def _loop(self) -> None:
        try:  # the lowest priority for this thread alone (Linux): on a full machine the ranks run first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a sampler must never stop a run
                pass

    def start(self) -> Sampler:
        import psutil

        if self.gpus:
            try:
                import pynvml

                pynvml.nvmlInit()
            except Exception as e:  # noqa: BLE001 - nvidia-ml-py not installed, or no driver
                self._gpu_error = f"NVML unavailable ({type(e).__name__}: {e}): pip install nvidia-ml-py"
        psutil.cpu_times(percpu=True)
        self._sample()
        self._thread = helper_thread(self._loop, "contention-sampler")
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._last is not None and time.monotonic() - self._last[0] > 0.2:
            self._sample()  # the tail since the last sample
        n = len(self._others)
        span = self._span
        others_mean = sum(dt * v for dt, v in self._others) / span if span else None
        return {
            "scope": self.scope,
            "interval_s": self.interval_s,
            "samples": n,
            "span_s": round(span, 3),
            "cpus": len(self.cpus),
            "other_busy_cpus_mean": None if others_mean is None else round(others_mean, 3),
            "other_busy_cpus_max": round(max(v for _, v in self._others), 3) if n else None,
            "steal_share": round(self._steal / (span * len(self.cpus)), 4) if span else None,
            "own_busy_cpus_mean": round(self._own / span, 3) if span else None,
            "loadavg_1m_max": round(self._load_max, 2),
            "sampler_cpu_s": round(self._cpu_s, 6),
            "sampler_cpu_share": round(self._cpu_s / span, 5) if span else None,
            "gpu_other_pids": {k: sorted(v) for k, v in self._gpu_others.items()} if self.gpus else None,
            "gpu_error": self._gpu_error,
        }


def node_sampler(ranks: int, devices_per_process: int = 1, root=None, scope: str = "machine") -> Sampler:
    """A started Sampler for `ranks` ranks on this node; on CUDA it also watches their GPUs (NVML)."""
    import torch

    gpus = None
    if torch.cuda.is_available():  # NVML only then (nvidia-ml-py, imported lazily by the sampler)
        gpus = visible_gpu_indices(ranks * max(1, devices_per_process))
    return Sampler(gpus=gpus, root=root, scope=scope).start()


def add_sampled(summary: dict, figures: dict, ranks: int, threads: int) -> None:
    """A finished run's sampled figures into its `summary` (`contention_sampled`) and a `contention:` warning each
    when other work kept the machine busy (stderr too, only after an ok run: a failed run's last line stays the
    one naming its failure; the record keeps the warning either way)."""
    found = sampled_warnings(figures, ranks, threads)
    for w in found if summary.get("status") == "ok" else ():
        print(f"warning: {w}", file=sys.stderr, flush=True)
    summary["contention_sampled"] = figures
    summary["warnings"] = [*(summary.get("warnings") or []), *found]


def external_sampler(ctx, devices_per_process: int = 1) -> Sampler | None:
    """Global rank 0's sampler of its node under torchrun / srun (started before training), else None. Never
    raises: a sampler that cannot start leaves the run unsampled."""
    if ctx.rank != 0 or ctx.launcher not in ("torchrun", "slurm"):
        return None
    try:
        import psutil

        return node_sampler(ctx.local_world_size, devices_per_process, psutil.Process().parent(), "rank0_node")
    except Exception as e:  # noqa: BLE001 - a sampler must never fail a run
        print(f"warning: contention sampler not started ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None


def record_external(sampler: Sampler | None, summary: dict, ranks: int, threads: int) -> None:
    """Stops `sampler` and adds its figures to rank 0's `summary` before it is written (`add_sampled`). Never
    raises."""
    if sampler is None:
        return
    try:
        add_sampled(summary, sampler.stop(), ranks, threads)
    except Exception as e:  # noqa: BLE001 - a sampler must never fail a run
        print(f"warning: contention sampler failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def busy_limit(cpus: int, needed: int) -> float:
    """Other processes' mean busy CPUs from which a run of `needed` CPUs (ranks x threads) on `cpus` is contended."""
    return max(OTHER_BUSY_MIN_CPUS, OTHER_BUSY_FREE_SHARE * max(cpus - needed, 0))


def sampled_warnings(figures: dict | None, ranks: int, threads: int = 1) -> list[str]:
    """The `contention:` warnings of a run's sampled figures (see the module doc for the thresholds)."""
    if not figures or not figures.get("samples"):
        return []
    out = []
    cpus, needed = figures["cpus"], ranks * threads
    limit = busy_limit(cpus, needed)
    others = figures.get("other_busy_cpus_mean")
    if others is not None and others >= limit:
        out.append(
            f"contention: during the run other processes kept {others:.2f} CPU(s) busy on average (max "
            f"{figures['other_busy_cpus_max']:.2f}; 1-min load up to {figures['loadavg_1m_max']:.1f}) beside its "
            f"{ranks} rank(s) x {threads} thread(s) on {cpus} CPU(s) (threshold {limit:.2f}): times are not "
            "comparable; run timing points on a quiet machine, one at a time"
        )
    steal = figures.get("steal_share")
    if steal is not None and steal >= STEAL_SHARE:
        out.append(
            f"contention: the hypervisor stole {100 * steal:.1f} % of the CPUs' time during the run (threshold "
            f"{100 * STEAL_SHARE:.0f} %): a shared virtual machine, times are not comparable"
        )
    for dev, pids in sorted((figures.get("gpu_other_pids") or {}).items()):
        who = "unknown pids (another pid namespace)" if all(p < 0 for p in pids) else f"pid(s) {pids[:5]}"
        out.append(
            f"contention: {len(pids)} other process(es) on GPU {dev} during the run ({who}): times are not "
            "comparable; run on a GPU of your own"
        )
    return out
