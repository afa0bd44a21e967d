"""The ranks meet: `join` starts this rank's process group, and ends a run that never assembled in one line.

torchrun / srun: the ranks first meet on rank 0's TCPStore (`assemble`), so that a rank that never started
is named and the job ends within trainer.dist_timeout_s, where torch would only count clients; the process
group then starts on that store. launcher=local: the launcher of ours started every rank, torch's own
rendezvous serves, and a failure there is the launcher's to report.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

from ptbench.core.dist import DistContext, init_process_group


class NeverAssembled(RuntimeError):
    """The ranks of a job did not all meet within the process-group timeout."""


def join(ctx: DistContext, timeout_s: int) -> bool:
    """Start this rank's default process group; False, after one line on stderr, when the run never
    assembled (torchrun / srun: no launcher of ours to say it)."""
    try:
        store = assemble(ctx, timeout_s) if ctx.launcher != "local" else None
        init_process_group(ctx, timeout_s, store)
    except NeverAssembled as e:  # one line; the traceback would only repeat where torch waited
        print(f"run never assembled: {e}", file=sys.stderr, flush=True)
        return False
    except RuntimeError as e:  # torchrun / srun: a peer left while the group started (rank 0 gave up on one)
        if ctx.launcher == "local":
            raise
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"run never assembled: rank {ctx.rank}: the process group did not start ({said})", file=sys.stderr)
        return False
    return True


def assemble(ctx: DistContext, timeout_s: int):
    """torchrun / srun: the ranks meet on rank 0's TCPStore (MASTER_ADDR:MASTER_PORT), each saying it is
    there, before the process group starts on that store. A rank that never started is then named, and the
    job ends within `timeout_s` (trainer.dist_timeout_s), where torch would only count clients. Returns the store."""
    import torch.distributed as dist

    where = f"{ctx.master_addr}:{ctx.master_port}"
    fix = (
        f"start every rank ({ctx.launcher}: WORLD_SIZE={ctx.world_size} processes, e.g. torchrun --nproc-per-node, "
        f"srun --ntasks) and let them reach {where}; no record was written"
    )
    # torchrun's agent hosts the store at MASTER_PORT itself (as torch's own rendezvous finds it); keys per restart
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    key = f"ptbench/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/joined/"
    deadline = time.monotonic() + timeout_s
    if ctx.rank != 0 or agent:  # a client: torch's own connect retries past its timeout, with a C++ trace each time
        said = _reach(ctx.master_addr, ctx.master_port, deadline)
        if said is not None:
            raise NeverAssembled(
                f"rank(s) 0 of {ctx.world_size} never listened at {where} within {timeout_s}s (rank {ctx.rank} "
                f"waited: {said}; trainer.dist_timeout_s, 0 = trainer.hang_timeout_s + 60): {fix}"
            )
    try:
        store = dist.TCPStore(
            ctx.master_addr,
            ctx.master_port,
            None,
            ctx.rank == 0 and not agent,
            datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())),
            wait_for_workers=False,
            multi_tenant=True,
        )
        store.set(f"{key}{ctx.rank}", socket.gethostname())
    except (RuntimeError, OSError) as e:  # DistStoreError / DistNetworkError: rank 0 never listened there
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if ctx.rank == 0 and not agent and "EADDRINUSE" in said:  # the store's host, not a client of it
            raise NeverAssembled(
                f"rank 0 could not listen at {where}: another program holds port {ctx.master_port}: set "
                f"MASTER_PORT (launcher.master_port) to a free port; no record was written"
            ) from None
        raise NeverAssembled(
            f"rank {ctx.rank} of {ctx.world_size} could not reach rank 0 at {where} within {timeout_s}s ({said}): {fix}"
        ) from None
    if ctx.rank == 0:
        _wait_for_all(store, key, ctx, deadline, timeout_s, fix)
    return store


def _wait_for_all(store, key: str, ctx: DistContext, deadline: float, timeout_s: int, fix: str) -> None:
    """Rank 0: until every rank has said it is there, or NeverAssembled naming those that never did."""
    while True:
        missing = [r for r in range(ctx.world_size) if not store.check([f"{key}{r}"])]
        if not missing:
            return
        if time.monotonic() > deadline:
            names = ", ".join(map(str, missing))
            raise NeverAssembled(
                f"rank(s) {names} of {ctx.world_size} never joined rank 0 at {ctx.master_addr}:{ctx.master_port} "
                f"within {timeout_s}s "
                f"(trainer.dist_timeout_s, 0 = trainer.hang_timeout_s + 60): {fix}"
            )
        time.sleep(0.2)


def _reach(host: str, port: int, deadline: float) -> str | None:
    """Connect to `host:port` until `deadline` (time.monotonic): None once something accepts there, else what
    the last try met (a rank 0 that never started: connection refused, or a host that does not answer)."""
    said = "nothing answered"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return said
        try:
            with socket.create_connection((host, port), timeout=min(5.0, left)):
                return None
        except OSError as e:
            said = e.strerror or str(e) or type(e).__name__
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
