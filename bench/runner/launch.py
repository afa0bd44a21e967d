"""From a composed config to finished ranks and a run record.

`launch(cfg)` runs in the process the user started. It finds what started it (a cluster
environment: torchrun, srun, a framework's launcher; else nothing), computes the run plan (every
check, one line per problem, before any rank starts), then either becomes one rank of that job or
starts the ranks itself: spawned processes, or the adapter's own launcher (horovodrun). A run that
fails after it began still ends with a record (summary.json status failed, with the failing rank
and its error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ptbench.adapters import get_adapter_class
from ptbench.core.dist import DistContext, default_backend, free_port
from ptbench.core.environments import (
    SlurmEnvironment,
    TorchrunEnvironment,
    detect,
    in_srun_step,
    unseen_gpus_line,
)
from ptbench.core.errors import ConfigError
from ptbench.core.records import STORAGE_ERRNOS, RunWriter, mark_killed, point_folders, settler_environment
from ptbench.core.sinks import write_sinks
from ptbench.core.stopping import STOP_SIGNALS
from ptbench.core.torch_support import torch_warnings
from ptbench.runner import multirun
from ptbench.runner.checks import contention_warnings, slurm_warnings
from ptbench.runner.compose import in_multirun, typed
from ptbench.runner.lifeline import record_failure
from ptbench.runner.plan import RunPlan, plan_run, run_dir_of
from ptbench.runner.rank import packages, run_rank


def launch(cfg: DictConfig) -> int:
    """Run one benchmark point; returns the process exit code (0 ok/preempted, 1 failed, 2 bad input)."""
    cfg = typed(cfg)  # once in this process: the ranks it becomes or forks take it as it is
    unseen = unseen_gpus_line()  # a GPU host whose torch sees none: no quiet CPU run in its place
    if unseen:
        raise ConfigError(unseen)
    OmegaConf.resolve(cfg)  # every rank sees the values the launcher saw (${visible_gpus_or:2} ...)
    adapter_cls = get_adapter_class(cfg.adapter.name)
    environment = detect(adapter_cls, cfg.launcher.name)
    if cfg.launcher.name == "torchrun" and environment is not TorchrunEnvironment:
        raise ConfigError(
            "launcher=torchrun but RANK/WORLD_SIZE/LOCAL_RANK are not set: start with `torchrun -m ptbench ...`"
        )
    if environment is None and in_srun_step() > 1:
        raise ConfigError(
            f"this process is one of {in_srun_step()} srun tasks but launcher={cfg.launcher.name} would "
            "start its own ranks in every task: add launcher=slurm (one rank per task)"
        )
    if environment is not None:  # this process is one rank of a job someone else started
        return _as_started_rank(cfg, adapter_cls, environment)
    multirun.hold()  # a stop signal from here on ends a multirun after this point, not the process
    plan, command = _local_plan(cfg, adapter_cls)
    multirun.stop_before_point()
    mark_killed(point_folders(cfg.results), plan.point)  # a record its killed launcher left `running`
    writer = RunWriter(run_dir_of(cfg, plan), plan.identity())
    multirun.hold(always=not command)  # from the record on, a stop signal goes to the ranks spawn_local starts
    writer.start(OmegaConf.to_yaml(cfg, resolve=True), packages())
    print(f"run {writer.dir}: {plan.adapter} x {plan.workload}, {plan.world_size} rank(s)", flush=True)
    code = _run_ranks(cfg, plan, command, writer, adapter_cls)
    multirun.stop_after_point(writer.dir, (writer.record.summary() or {}).get("status"))
    return code


def _as_started_rank(cfg: DictConfig, adapter_cls, environment) -> int:
    """This process as one rank of a job torchrun, srun or submitit started: checked, planned, run."""
    if cfg.launcher.cpu_bind != "none":
        raise ConfigError(
            f"launcher.cpu_bind={cfg.launcher.cpu_bind} binds the ranks launcher=local spawns, but "
            f"{environment.name} started these: bind them there (srun --cpu-bind=cores, torchrun "
            "--numa-binding) and leave launcher.cpu_bind=none"
        )
    ctx = environment.context(os.environ, cfg.launcher.backend, cfg.launcher.master_port)
    if (
        environment is SlurmEnvironment
        and os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
        and ctx.world_size != adapter_cls.processes(cfg)
    ):
        raise ConfigError(
            f"this submitit job has {ctx.world_size} task(s) but the point needs "
            f"{adapter_cls.processes(cfg)} ranks: use hydra/launcher=bench_slurm "
            "(conf/hydra/launcher/bench_slurm.yaml), which sizes each job"
        )
    # the one rank that writes the summary records the comm volume; every rank checks the memory (a refusal
    # ends them all alike), rank 0 alone says so: under torchrun / srun no launcher of ours checked before
    plan, _ = plan_run(
        cfg,
        environment.name,
        ctx.world_size,
        backend=ctx.backend if ctx.rank == 0 else None,
        on_host=ctx.local_world_size,
        quiet=ctx.rank != 0,
    )
    if ctx.rank == 0:  # the rank that writes the summary: a Slurm allocation that oversubscribes its cores
        threads = cfg.launcher.threads_per_rank or int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
        warnings = (*torch_warnings(), *slurm_warnings(ctx.local_world_size, threads))
        plan = dataclasses.replace(plan, warnings=warnings)
        for w in plan.warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
    return run_rank(cfg, plan, ctx, run_dir=None)


def _local_plan(cfg: DictConfig, adapter_cls) -> tuple[RunPlan, list[str] | None]:
    """The plan when this launcher starts the ranks, its warnings said, and the framework's own launcher
    command if it has one (horovodrun); every check that needs no record happens here."""
    plan, _ = plan_run(cfg, "local")
    # an untested torch first: one line before launch, kept in the record with the others
    warnings = (*torch_warnings(), *contention_warnings(cfg, plan.world_size))
    plan = dataclasses.replace(plan, warnings=warnings)
    for w in plan.warnings:  # before our own record exists: it is not one of the other runs
        print(f"warning: {w}", file=sys.stderr, flush=True)
    command = adapter_cls.launch_command(cfg, plan.world_size)
    if command:
        if plan.rank_cpus:
            raise ConfigError(
                f"launcher.cpu_bind={cfg.launcher.cpu_bind}: {command[0]} starts {plan.adapter}'s ranks, not "
                "launcher=local; use launcher.cpu_bind=none"
            )
        plan = dataclasses.replace(plan, start_method=None)
    if cfg.launcher.master_port:
        _check_port(cfg.launcher.master_port)  # before the record: rank 0 would fail, the others wait for it
    return plan, command


def _run_ranks(cfg: DictConfig, plan: RunPlan, command, writer: RunWriter, adapter_cls) -> int:
    """Start the ranks (ours or the framework's launcher), sample contention beside them, write the sinks; the
    exit code. A record's final status is written whatever ends the run."""
    port = cfg.launcher.master_port or free_port()
    # contention during the run (bench/runner/contention.py), added to the final summary in its one final write
    contention = _Contention(_start_sampler(plan), plan.world_size, cfg.launcher.threads_per_rank or 1)
    writer.complete = contention
    # variables CUDA reads when it starts (CUDA_DEVICE_MAX_CONNECTIONS=1 for megatron TP > 1): in each rank's
    # environment from its first instruction, since a rank that sets them itself may be too late; and the one
    # that makes their final summary wait for this process to complete it (records.SETTLER_ENV)
    rank_env = {**adapter_cls.rank_environment(cfg), **settler_environment(writer.dir)}
    try:
        if command:
            code = run_with_launcher(command, cfg.launcher.master_addr, port, writer, rank_env)
        else:
            code = spawn_local(
                OmegaConf.to_container(cfg, resolve=True), plan, port, writer, plan.start_method, rank_env
            )
        contention.stop()
        write_sinks(
            writer.dir,
            mllog=cfg.results.mllog,
            tensorboard=cfg.results.tensorboard,
            wandb=cfg.results.wandb,
            mlflow=cfg.results.mlflow,
        )
    except KeyboardInterrupt:  # Ctrl-C outside the ranks' training (before they started, after they ended)
        writer.fail("interrupted", "interrupted (SIGINT) before the ranks trained", stop_signal="SIGINT")
        code = _exit_code(writer)  # an outcome already written is kept (the first word wins)
    except OSError as e:  # the record's own storage refuses its final status (records.storage_error names it)
        if e.errno not in STORAGE_ERRNOS:
            raise
        print(f"run failed: {e.strerror}; {writer.dir} keeps status running (no final record)", file=sys.stderr)
        code = 1
    return code


def _start_sampler(plan: RunPlan):
    """The contention sampler of a local launch, started before the ranks; on CUDA it also watches our GPUs."""
    from ptbench.runner.contention import node_sampler

    return node_sampler(plan.world_size, plan.devices_per_process)


class _Contention:
    """The launcher's RunWriter.complete: the sampler stopped once (at the run's first final summary, or after the
    ranks) and its figures with their `contention:` warnings put into that summary (`contention.add_sampled`)."""

    def __init__(self, sampler, ranks: int, threads: int):
        self.sampler, self.ranks, self.threads, self.figures = sampler, ranks, threads, None

    def stop(self) -> dict:
        if self.figures is None:
            self.figures = self.sampler.stop()
        return self.figures

    def __call__(self, summary: dict) -> None:
        from ptbench.runner.contention import add_sampled

        add_sampled(summary, self.stop(), self.ranks, self.threads)


def _check_port(port: int) -> None:
    """One line, before any rank starts, when launcher.master_port is taken on this host (rank 0 listens there)."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's: a TIME_WAIT leftover is no owner
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (a privileged port as root is fine, ...): the ranks say
            raise ConfigError(
                f"launcher.master_port={port} is in use on this host (another run or program listens there): "
                "choose another port, or leave launcher.master_port unset for a free one"
            ) from None


def _launch_t0() -> str:
    import psutil

    return str(psutil.Process().create_time())  # startup_s counts from the user's command


class _StopForwarder:
    """The launcher's handler of stop signals: each reaches every rank (SIGKILL after a second Ctrl-C); those
    that come before the ranks exist wait for them."""

    def __init__(self):
        self.procs = None  # the ranks, once spawned
        self.pending: list[int] = []  # stop signals that came before them
        self.interrupts: list[float] = []  # SIGINTs so far: the second ends the ranks at once

    def __call__(self, signum, frame):
        multirun.note(signum)
        if signum == signal.SIGINT:
            self.interrupts.append(time.time())
            if len(self.interrupts) == 2:
                print(
                    "second interrupt: ending the ranks now (no checkpoint at this stop)", file=sys.stderr, flush=True
                )
        if self.procs is None:
            self.pending.append(signum)
            return
        self.deliver(signum)

    def deliver(self, signum):
        hard = len(self.interrupts) >= 2
        for p in self.procs.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL if hard else signum)

    def deliver_pending(self) -> None:
        """The ranks exist: the signals held until now reach them."""
        for signum in self.pending:
            self.deliver(signum)


def _start_ranks(cfg_dict: dict, plan: RunPlan, port: int, writer: RunWriter, method: str, rank_env: dict):
    """mp.start_processes with stop signals blocked meanwhile (held, not lost: the ranks inherit the mask and
    unblock once their handlers are set, bench/core/stopping.py)."""
    # multiprocessing's resource tracker, started by the first spawn, *unblocks* SIGINT and SIGTERM in
    # this process as a side effect: start it first (a signal meanwhile is caught and kept), then block
    from multiprocessing import resource_tracker

    import torch.multiprocessing as mp

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # the ranks inherit the framework instead of importing it; not in a multirun process, which runs point
    # after point: the ranks of its later points (forked from it) would carry an earlier point's framework
    if method == "fork" and not in_multirun():
        _preload(plan.adapter_cls.framework_module)
    sys.stdout.flush()  # a forked rank would print the launcher's unflushed output again
    sys.stderr.flush()
    with environment(rank_env):  # what a spawned or forked rank inherits; this process keeps its own
        procs = mp.start_processes(
            _spawned_rank,
            args=(cfg_dict, plan, port, str(writer.dir)),
            nprocs=plan.world_size,
            start_method=method,
            join=False,
        )
    return procs


def spawn_local(
    cfg_dict: dict,
    plan: RunPlan,
    port: int,
    writer: RunWriter,
    method: str = "spawn",
    rank_env: dict[str, str] | None = None,
) -> int:
    """Start the ranks with `method` (spawn | fork: ptbench.runner.checks.start_method) and `rank_env` in
    their environment from the start (`Adapter.rank_environment`), forward stop signals to them, wait, and
    record a failed run's outcome."""
    import torch.multiprocessing as mp

    start = time.time()
    os.environ["BENCH_LAUNCH_T0"] = _launch_t0()  # inherited by the ranks
    forward = _StopForwarder()  # SIGUSR1, SIGTERM (preempted) and SIGINT (Ctrl-C: interrupted)
    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    forward.pending += multirun.received()  # a multirun's stop that came after its point's record was made
    procs = _start_ranks(cfg_dict, plan, port, writer, method, rank_env or {})
    forward.procs = procs  # from here a stop signal goes straight to the ranks
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    forward.deliver_pending()
    try:
        # join() ends the other ranks as soon as one fails: no orphans. A rank takes SIGTERM as a graceful stop
        # (useless once a peer is gone; one waiting for a dead peer never gets to it), so SIGKILL follows soon,
        # not after torch's default 30 s. The wait wakes every JOIN_POLL_S: a stop signal that some native thread
        # took runs its handler only once this thread takes the GIL again (core/stopping.py, helper_thread)
        while not procs.join(timeout=JOIN_POLL_S, grace_period=JOIN_GRACE_S):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if len(forward.interrupts) >= 2:  # the ranks ended by a second Ctrl-C: still a final status
            writer.fail(
                "interrupted",
                "interrupted twice (SIGINT): the ranks were ended at once, after their last checkpoint",
                total_time_s=time.time() - start,
                stop_signal="SIGINT",
            )
        else:
            record_failure(writer, e, time.time() - start)
        return _exit_code(writer)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if forward.interrupts:  # the record is final: a further Ctrl-C while this process ends must not kill it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    writer.settle()  # rank 0's final summary, completed and written in one write
    return _exit_code(writer)


JOIN_GRACE_S = 3.0  # after a rank failed: the others' time to end by themselves, then again after SIGTERM
JOIN_POLL_S = 0.5


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """os.environ with `extra` set for the block (processes started in it inherit them), restored after."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _preload(module: str) -> None:
    """Import the adapter's framework in the launcher before forking its ranks (~2 s less per rank for
    DeepSpeed or Megatron). One that fails to import is left to the ranks, whose error the record carries."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - reported by the ranks, with their traceback
        pass


def run_with_launcher(
    command: list[str], addr: str, port: int, writer: RunWriter, rank_env: dict[str, str] | None = None
) -> int:
    """Ranks started by the framework's own launcher (horovodrun); each runs
    `python -m ptbench.runner.rank RUN_DIR` and reads the config this process wrote there. Our process
    group's address and `rank_env` go in the environment."""
    import subprocess

    start = time.time()
    env = {
        **os.environ,
        **(rank_env or {}),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "BENCH_LAUNCH_T0": _launch_t0(),
        "BENCH_LAUNCHER_PID": str(os.getpid()),  # the ranks end themselves once it is gone (lifeline.watch_launcher)
    }
    proc = subprocess.Popen([*command, sys.executable, "-m", "ptbench.runner.rank", str(writer.dir)], env=env)

    def forward(signum, frame):  # horovodrun stops its ranks on SIGTERM (SIGUSR1 would kill it outright)
        multirun.note(signum)
        proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code:
        record_failure(writer, RuntimeError(f"{' '.join(command[:3])} exited with status {code}"), time.time() - start)
    writer.settle()
    return _exit_code(writer)


def _exit_code(writer: RunWriter) -> int:
    """0 ok / preempted, 130 interrupted (as a shell's Ctrl-C), else 1; not ok: one line on stderr saying why."""
    summary = writer.record.summary() or {}
    status = summary.get("status")
    if status == "interrupted":
        from ptbench.core import checkpoint as ckpt

        newest = ckpt.latest(writer.dir)  # also when the ranks were ended at once (no totals in the record)
        latest = newest.name if newest is not None else None
        after = f" after step {summary['steps']}" if summary.get("steps") is not None else ""
        then = (
            f"trainer.resume=auto continues it from {latest}"
            if latest
            else "it has no checkpoint: a rerun starts from step 0 (trainer.checkpoint_every=N saves)"
        )
        print(f"run interrupted (Ctrl-C){after}: {writer.dir} is final (status interrupted); {then}", file=sys.stderr)
        return 130
    if status not in ("ok", "preempted"):
        rank = summary.get("failed_rank")
        where = "" if rank is None else f"rank {rank}: "
        print(f"run {status}: {where}{summary.get('error')}", file=sys.stderr)
        return 1
    return 0


def _spawned_rank(local_rank: int, cfg_dict: dict, plan: RunPlan, port: int, run_dir: str) -> None:
    """A rank started by `spawn_local`: the resolved config comes as a plain dict (what pickles to a spawned
    process) and is typed once here."""
    ctx = DistContext(
        rank=local_rank,
        world_size=plan.world_size,
        local_rank=local_rank,
        local_world_size=plan.world_size,
        master_port=port,
        backend=default_backend(cfg_dict["launcher"]["backend"]),
        launcher="local",
    )
    if plan.rank_cpus:  # launcher.cpu_bind=cores: first, so that every thread this rank starts inherits it
        os.sched_setaffinity(0, plan.rank_cpus[local_rank])
    try:
        code = run_rank(typed(cfg_dict), plan, ctx, Path(run_dir))
    except (KeyboardInterrupt, SystemExit, Exception):
        raise
    except BaseException as e:  # a framework's own BaseException (torch DCP's CheckpointException): torch's spawn
        # wrapper passes on only an Exception, multiprocessing would print this one's traceback on the console
        raise RuntimeError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    if code:
        sys.exit(code)


def rank_environment_lines(overrides: list[str]) -> list[str]:
    """NAME=VALUE for each variable the point's adapter needs in every rank's environment from the rank's
    start (`Adapter.rank_environment`; megatron TP > 1: CUDA_DEVICE_MAX_CONNECTIONS=1). slurm/run.sbatch
    exports them before srun: a rank started without them sets them too late for CUDA."""
    from ptbench.runner.compose import compose

    cfg = typed(compose(overrides))
    return [f"{k}={v}" for k, v in get_adapter_class(cfg.adapter.name).rank_environment(cfg).items()]


def main(argv: list[str] | None = None) -> int:
    """`python -m ptbench.runner.launch --rank-env OVERRIDE ...`: `rank_environment_lines`, one per line."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["--rank-env"]:
        print("usage: python -m ptbench.runner.launch --rank-env [hydra overrides]", file=sys.stderr)
        return 2
    try:
        lines = rank_environment_lines([a for a in args[1:] if a.strip()])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
