"""Graceful stop on preemption signals, and a watchdog for hung collectives.

Stop: SIGUSR1 (Slurm's `--signal=USR1@120`) or SIGTERM (scancel) sets a flag; so does SIGINT (Ctrl-C, to
the launcher or to the whole process group), which ends the run `interrupted` instead of `preempted`
(resumable alike). Ranks may see the
signal at different steps, so every `trainer.stop_check_every` steps (10 by default) they agree
through one tiny all-reduce on a CPU (gloo) group: a CPU tensor, so a GPU run is never forced to
sync the device for it. The trainer then finishes that step, writes a record with status
`preempted`, and exits 0 so Slurm can requeue the job.

Requeue: under Slurm, a job that may be requeued (`sbatch --requeue`) and stopped with a checkpoint
is put back in the queue by rank 0 (`requeue_slurm_job`, `scontrol requeue $SLURM_JOB_ID`) once
its record is written; the requeued job finds the record by its point id and resumes
(trainer.resume=auto, bench/core/checkpoint.py).

Watchdog: a daemon thread watches a heartbeat that the loop beats at every step and validation
batch. If no beat comes for `trainer.hang_timeout_s` seconds (a rank that stopped calling
collectives leaves every other rank blocked inside one), the rank writes its `timeout` error
record and exits at once; the launcher then ends the other ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# what the all-reduce of `agreed` carries: the strongest request of any rank wins
_NONE, _STOP, _INTERRUPT = 0, 1, 2


class StopFlag:
    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self.interrupted = False  # SIGINT (Ctrl-C) on some rank: the run ends `interrupted`, not `preempted`
        self._group = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:  # for the life of the rank process: a late Ctrl-C must not raise in its teardown
            signal.signal(sig, self._handler)
        # the local launcher spawns ranks with these signals blocked, so one sent during start-up
        # waits here instead of killing a rank that is still importing torch
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _handler(self, signum, frame) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, name: str) -> None:
        """Ask for a stop as a signal would (`trainer.inject_stop` uses it for deterministic tests)."""
        self.requested = True
        self.signal_name = name
        self.interrupted |= name == "SIGINT"

    def prepare(self) -> None:
        """Create the CPU group `agreed` all-reduces on (a collective over every rank): call it once after the
        process group starts, so the group's creation (a store round trip and, under NCCL, a new gloo group)
        is not inside the timed loop at the first stop check."""
        import torch.distributed as dist

        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def agreed(self) -> bool:
        """True on every rank once any rank has been asked to stop (a collective: call on all ranks)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.requested
        self.prepare()
        mine = _INTERRUPT if self.interrupted else _STOP if self.requested else _NONE
        flag = torch.tensor([mine], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        agreed = int(flag.item())
        if agreed and not self.requested:
            self.requested, self.signal_name = True, "peer"
        if agreed == _INTERRUPT and not self.interrupted:  # a peer's Ctrl-C: every rank ends the same way
            self.interrupted, self.signal_name = True, "SIGINT"
        return bool(agreed)


def helper_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that never takes a stop signal. CPython runs a Python signal handler in the main
    thread, and one whose signal a helper thread took waits until the main thread next takes the GIL: a
    launcher asleep in its ranks' join, with a sampler thread beside it, heard of a Ctrl-C only when its ranks
    had ended and trained to the end. The thread inherits the mask it is started under, so it has the stop
    signals blocked from its first instruction; the kernel then gives them to the main thread."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return thread


class Watchdog:
    def __init__(self, timeout_s: float, on_timeout: Callable[[float], None]):
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self._last = time.monotonic()

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self.beat()
            self._thread = helper_thread(self._watch, "bench-watchdog")
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                try:
                    self.on_timeout(idle)
                finally:
                    os._exit(124)  # a rank blocked in a collective cannot be unwound; leave at once


def slurm_job_requeueable(env=os.environ) -> str | None:
    """The job id when this process runs in a Slurm job that may be requeued (Requeue=1), else None."""
    import shutil
    import subprocess

    job = env.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return job if "Requeue=1" in out.split() else None


def requeue_slurm_job(job: str) -> str:
    """`scontrol requeue JOB` (rank 0, after the checkpoint and the record): Slurm then ends this job's
    steps and starts the job again. Returns what scontrol said (empty when it succeeded)."""
    import subprocess

    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")
