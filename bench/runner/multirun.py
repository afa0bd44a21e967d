"""A Hydra multirun stopped by SIGINT (Ctrl-C) or SIGTERM (scancel, a job's end): the point it runs ends as a
single run does (its ranks get the signal, checkpoint if asked, and its record is final), and no later point
starts. Hydra's basic launcher runs the points one after another in this process and would go on to the next;
`hydra/launcher=ptbench_local` runs each in a job of its own (bench/plugins/.../ptbench_launcher), whose
process gets the signal from the sweep's process (`forwarding_to_jobs`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from ptbench.runner.compose import in_multirun

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this sweep process got, first first


def _sweep_process() -> bool:
    """This process runs the multirun's points itself (not a submitit job of one point: its sweep process
    decides there)."""
    return in_multirun() and not os.environ.get("SUBMITIT_EXECUTOR")


def note(signum: int) -> None:
    """A stop signal for this process (the launcher's handler passes on what it forwards to the ranks)."""
    if signum in SIGNALS:
        _received.append(signum)


def received() -> list[int]:
    """The stop signals noted so far (one that came between this point's record and its ranks is theirs too)."""
    return list(_received)


def _noted(signum, frame) -> None:
    note(signum)


def hold(always: bool = False) -> None:
    """In a multirun: from now on a stop signal between points is noted, not fatal. The launcher's own handler
    replaces this one while a point's ranks run (they get the signal) and puts it back after them. In a point's
    own job (hydra/launcher=ptbench_local) too: a signal the sweep forwards after the point's record is made but
    before its ranks start is theirs when they start, where submitit's job handler would pass SIGTERM by and
    the point would train to its end. `always`: in any run, from its record on: a stop signal before the ranks
    start is theirs (a Ctrl-C there once left the record `running`)."""
    if always or in_multirun():
        for sig in SIGNALS:
            signal.signal(sig, _noted)


def stop_before_point() -> None:
    """End the multirun if a stop signal came before this point made its record."""
    if _received and _sweep_process():
        stop(f"before point #{_job_num()} started: no record of it", _sweep_dir())


def stop_after_point(run_dir, status: str | None) -> None:
    """End the multirun if a stop signal came while this point ran: its record is final."""
    if _received and _sweep_process():
        stop(f"during point #{_job_num()}: its record {run_dir} is final (status {status})", _sweep_dir())


@contextlib.contextmanager
def forwarding_to_jobs():
    """The sweep process of a launcher that runs each point as a job of its own (submitit's local jobs: a
    controller process and its task): a stop signal is noted and passed to every job's task, which ends its
    point as a single run does. submitit's controller would end the task hard on SIGINT."""
    import psutil

    def forward(signum, frame) -> None:
        note(signum)
        for controller in psutil.Process().children():
            # an earlier point's controller may end between the two listings: its NoSuchProcess, raised from
            # this handler, would stop the loop before the running point's task got the signal
            with contextlib.suppress(psutil.Error):
                for task in controller.children():
                    with contextlib.suppress(psutil.Error):
                        task.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _job_num() -> int:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.num


def _sweep_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().sweep.dir)


def stop(what: str, folder: Path) -> None:
    """One line: what ran, the sweep folder's records, what is left and how to run it; exit 128 + the signal."""
    from ptbench.runner.points import tally

    sig = signal.Signals(_received[0])
    print(
        f"multirun stopped by {sig.name} {what}; no later point starts ({tally(Path(folder))}): the same command "
        "with results.skip_done=true runs every point without an ok record",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + int(sig))
