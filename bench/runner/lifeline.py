"""How a rank's life ends other than by its last step, and what it leaves in the record.

- The launcher's death (launcher=local): a launcher killed outright (SIGKILL, the OOM killer) can neither
  record the run nor end its ranks, so each rank watches it (`watch_launcher`) and does both itself.
- A hang: the watchdog (trainer.hang_timeout_s) calls `on_hang`, which writes this rank's error record
  and says whether it froze or only waited for a rank that did.
- A failure: `failed` classifies it (oom / interrupted / failed), writes this rank's error record,
  aborts the process groups (never a teardown that waits on peers) and sets the last-resort alarm.
- The run's outcome from the ranks' error records (`causes`): written by rank 0 under torchrun / srun,
  else by the launcher of ours once its ranks have ended (`record_failure`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ptbench.core.dist import DistContext
from ptbench.core.records import RunWriter

FAILED_EXIT_S = 10  # a failed rank's time to leave after its record is written and its groups aborted


# --- the launcher's death -------------------------------------------------------------------------
def launcher_pid(ctx: DistContext) -> tuple[int, bool] | None:
    """(pid, whether it is this rank's parent) of the launcher process of ours that waits for this rank
    (launcher=local: it records a failed run's outcome; BENCH_LAUNCHER_PID when horovodrun started the rank),
    else None (torchrun / srun: rank 0 writes the record itself)."""
    if ctx.launcher != "local":
        return None
    pid = int(os.environ.get("BENCH_LAUNCHER_PID") or 0)
    return (pid, False) if pid and pid != os.getppid() else (os.getppid(), True)


def launcher_gone(pid: int, parent: bool) -> bool:
    """Whether the launcher `pid` has ended. This rank's parent: the rank was reparented (at once when the
    parent dies, before anyone reaps it). Another process (horovodrun's ranks): no such pid, or a zombie."""
    if parent:
        return os.getppid() != pid
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def watch_launcher(pid: int, parent: bool, on_gone, every_s: float = 0.5) -> None:
    """A daemon thread that calls `on_gone` once the launcher `pid` has ended, then ends this process: a
    launcher killed outright (SIGKILL, the OOM killer) can neither record the run nor end its ranks, so
    each rank does both for itself within `every_s`, even while its main thread waits in a collective."""
    from ptbench.core.stopping import helper_thread

    def watch() -> None:
        while not launcher_gone(pid, parent):
            time.sleep(every_s)
        try:
            on_gone()
        finally:
            os._exit(137)  # as the launcher's own end: SIGKILL

    helper_thread(watch, "bench-launcher-watch")


def launcher_killed(writer: RunWriter, ctx: DistContext, pid: int, step: Callable[[], int | None]) -> None:
    """The final status `killed`, with the step reached (`step()`: None before the first) and the time, written
    by the first rank that finds the launcher gone (a status already final is kept); one line on the console
    (the launcher's)."""
    step = step()
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    where = f"at step {step}" if step is not None else "before the first step"
    error = (
        f"the launcher (pid {pid}) was killed outright (SIGKILL, the OOM killer) {where}; rank {ctx.rank} "
        f"found it gone at {at} and ended the ranks"
    )
    import fcntl

    fd = os.open(writer.dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the ranks notice together: one writes, one line on the console
        if (writer.record.summary() or {}).get("status") not in (None, "running"):
            return
        writer.fail("killed", error, None, steps=step)
    finally:
        os.close(fd)
    print(f"run killed: {error}: {writer.dir} is final (status killed)", file=sys.stderr, flush=True)


# --- a hang ---------------------------------------------------------------------------------------
def on_hang(writer: RunWriter, ctx: DistContext, hang_timeout_s: float, idle: float) -> None:
    """The watchdog's call after `idle` seconds without progress: this rank's error record says whether it
    froze or waited in a collective for one that did. torchrun / srun: rank 0, once the frozen rank has had
    time to report, writes the run's outcome (the cause first: a rank that froze before one that waited)."""
    waiting, where = _main_thread_at()
    what = (
        f"waiting in a collective ({where}) for a rank that stopped"
        if waiting
        else f"rank {ctx.rank} stopped in {where}, the others wait for it in a collective"
    )
    message = f"no progress for {idle:.0f}s (trainer.hang_timeout_s={hang_timeout_s}): {what}"
    record_rank_error(writer, ctx, "timeout", message, "", waiting=waiting)
    if waiting:  # the rank that froze reports too (its watchdog fires about now): its error is the cause
        time.sleep(min(5.0, hang_timeout_s / 2))
        if ctx.launcher != "local" and ctx.rank == 0:  # no launcher of ours to choose it: this rank does
            cause = causes(writer)[0]
            writer.fail("timeout", cause["error"], cause["rank"])  # its own when no other wrote


def _main_thread_at() -> tuple[bool, str]:
    """(whether the main thread waits inside torch's collectives or autograd, where it is: file:line in
    function of its innermost Python frame), for the watchdog's word on a hang."""
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "an unknown place"
    path = frame.f_code.co_filename.replace(os.sep, "/")
    waiting = any(f"/torch/{part}/" in path for part in ("distributed", "autograd", "nn/parallel"))
    return waiting, f"{Path(path).name}:{frame.f_lineno} in {frame.f_code.co_name}"


# --- a failure ------------------------------------------------------------------------------------
def failed(e: BaseException, writer: RunWriter | None, ctx: DistContext) -> bool:
    """A rank's failure `e`, recorded (its error file in `writer`'s record, None: no record yet), its process
    groups aborted and its end assured within FAILED_EXIT_S. True: let `e` end the rank (the launcher of ours
    records the run and says why in one line; a Ctrl-C or an exit); False: end it with exit status 1, after
    the one line that torchrun / srun leave to the rank."""
    # a KeyboardInterrupt here came before the stop handlers (they turn SIGINT into a stop)
    status = "oom" if is_oom(e) else "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
    where = None
    if writer is not None:
        try:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            record_rank_error(writer, ctx, status, f"{type(e).__name__}: {e}", tb)
            where = writer.dir / f"error-rank{ctx.rank}.json"
        except OSError as unwritten:  # the record's storage refuses too: the console line says so
            where = f"nowhere: {unwritten}"
    abort_process_groups()
    end_within(FAILED_EXIT_S)
    if ctx.launcher == "local" or isinstance(e, (KeyboardInterrupt, SystemExit)):
        return True
    # torchrun / srun: no launcher of ours to say it; one line per failed rank, its traceback in its file
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"run {status}: rank {ctx.rank}: {type(e).__name__}: {message} (traceback: {where})", file=sys.stderr)
    return False


def is_oom(e: BaseException) -> bool:
    import torch

    # the CPU allocator's own refusal ("DefaultCPUAllocator: can't allocate memory") is an out of memory too
    text = str(e).lower()
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text or "can't allocate" in text


def record_rank_error(
    writer: RunWriter, ctx: DistContext, status: str, message: str, tb: str, waiting: bool = False
) -> None:
    """This rank's error file; torchrun / srun: rank 0's own error (not a wait) is the run's outcome too."""
    err = {
        "rank": ctx.rank,
        "host": socket.gethostname(),
        "status": status,
        "error": message.strip().splitlines()[0][:500] if message.strip() else status,
        "traceback": tb,
        "time": time.time(),
        "waiting": waiting,  # a hang: this rank only waited for another (never the cause when one froze)
    }
    writer.record.write_rank_error(ctx.rank, err)
    if ctx.launcher != "local" and ctx.rank == 0 and not waiting:  # no launcher process of ours to write it
        writer.fail(status, err["error"], ctx.rank)


def causes(writer: RunWriter) -> list[dict]:
    """Every rank's error record, the cause first: in a hang a rank that froze before one that only waited
    for it, else the earliest."""
    return sorted(writer.record.rank_errors(), key=lambda e: (bool(e.get("waiting")), e.get("time", 0)))


def record_failure(writer: RunWriter, exc: Exception, elapsed: float) -> None:
    """The launcher's word on a failed run: the earliest rank error is the cause; a rank killed by a
    signal (it could write nothing) is named from the exit status."""
    errors = causes(writer)
    killed = getattr(exc, "signal_name", None)
    if killed and not any(e.get("status") == "timeout" for e in errors):
        cause = {"rank": exc.error_index, "status": "failed", "error": f"rank {exc.error_index} killed by {killed}"}
    elif errors:
        cause = errors[0]
    else:
        cause = {
            "rank": getattr(exc, "error_index", None),
            "status": "failed",
            "error": str(exc).strip().splitlines()[-1],
        }
    writer.fail(
        cause["status"],
        cause["error"],
        cause["rank"],
        total_time_s=elapsed,
        rank_errors=[{k: e.get(k) for k in ("rank", "status", "error")} for e in errors],
    )


def end_within(seconds: int) -> None:
    """A failed rank's last resort: SIGALRM at its default action ends the process if leaving still waits. On
    torch 2.11 an aborted gloo group still waits at the interpreter's exit for a collective a peer never joins
    (2.14 does not); the error record and the traceback for the launcher are written before this fires."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():  # signal handlers: the main thread's only
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(seconds)


def abort_process_groups() -> None:
    """Abort every process group of this rank (ProcessGroup.abort), not destroy it: destroy_process_group
    waits for the group's outstanding collectives, which a peer may never join (until the backend's timeout)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)  # every group, the default one last (torch's own abort order)
    groups = sorted(getattr(world, "pg_names", {}), key=lambda g: g is dist.group.WORLD) or [dist.group.WORLD]
    for group in groups:
        abort = getattr(group, "abort", None)
        if abort is None:  # a torch without ProcessGroup.abort: leaving the process does not wait either
            continue
        try:
            abort()
        except Exception:  # noqa: BLE001 - the rank is ending with its own error already recorded
            pass
