"""One rank's life: process group, workload, adapter, the training loop, its part of the record.

`run_rank` is what every rank runs, however it was started (spawned by the launcher, torchrun,
srun, horovodrun). `python -m ptbench.runner.rank RUN_DIR` is a rank started by a framework's own
launcher for `launcher=local` (horovodrun): the launcher process wrote the run's resolved config to
RUN_DIR/config.yaml and records the outcome of a failed run, as for spawned ranks.

Resume (`trainer.resume=auto`, bench/core/checkpoint.py): rank 0 looks for an unfinished record of
the same point with a complete checkpoint. Ranks started by srun/torchrun then continue in THAT
record folder (no new one is made). Under `launcher=local` the launcher process has already made a
fresh folder before the ranks start (bench/runner/launch.py), so rank 0 moves the unfinished
record's checkpoints and event log into it and removes the old folder: either way one record per
point, with one continuous event log. A stop with a checkpoint inside a Slurm job that may be
requeued ends with rank 0 calling `scontrol requeue` (bench/core/stopping.py) after the record is written.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault(
    "OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or "1"
)  # before torch: see bench/__main__.py

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from ptbench import adapters  # noqa: E402
from ptbench.core import checkpoint as ckpt  # noqa: E402
from ptbench.core.config import BenchConfig  # noqa: E402
from ptbench.core.dist import DistContext, dist_timeout_s, init_process_group, set_cpu_threads  # noqa: E402
from ptbench.core.environments import detect  # noqa: E402
from ptbench.core.precision import apply_tf32  # noqa: E402
from ptbench.core.records import RunWriter, mark_killed, owner, point_folders  # noqa: E402
from ptbench.core.sinks import write_sinks  # noqa: E402
from ptbench.runner.compose import typed  # noqa: E402
from ptbench.runner.console import print_summary  # noqa: E402
from ptbench.runner.plan import RunPlan, plan_run, run_dir_of  # noqa: E402
from ptbench.workloads import build_workload  # noqa: E402


def packages() -> tuple[str, ...]:
    """Distributions whose versions the record states: every adapter's framework."""
    return tuple(adapters.frameworks())


def frameworks_imported() -> list[str]:
    """Frameworks other than torch that this process has imported (ddp must import none)."""
    tops = {m.split(".")[0] for m in adapters.frameworks().values()} - {"torch"}
    return sorted(m for m in tops if m in sys.modules)


def run_rank(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, run_dir: Path | None) -> int:
    """Everything one rank does, on the config typed once in this process. `run_dir` None: rank 0 creates
    the record and tells the others."""
    required = plan.adapter_cls.rank_environment(cfg)
    at_start = {k: os.environ.get(k) for k in (*RECORDED_ENV, *required)}  # first: before anything starts CUDA
    launcher = _launcher_pid(ctx)  # now, while the launcher surely lives
    threads = set_cpu_threads(cfg.launcher.threads_per_rank)
    apply_tf32(cfg.trainer.tf32)
    import torch.distributed as dist

    from ptbench.core.stopping import StopFlag, Watchdog, requeue_slurm_job, slurm_job_requeueable
    from ptbench.runner.contention import external_sampler, record_external

    stop = StopFlag()
    stop.install()
    running = {}  # the trainer, once made: the launcher watcher reads its step
    if launcher and run_dir is not None:  # from the start: a launcher killed during start-up leaves no rank behind
        killed = RunWriter(run_dir, plan.identity())
        watch_launcher(*launcher, lambda: _launcher_killed(killed, ctx, launcher[0], running.get("trainer")))
    _late_environment(required, at_start, ctx)
    try:
        store = assemble(ctx, dist_timeout_s(cfg.trainer)) if ctx.launcher != "local" else None
        init_process_group(ctx, dist_timeout_s(cfg.trainer), store)
    except NeverAssembled as e:  # one line; the traceback would only repeat where torch waited
        print(f"run never assembled: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # torchrun / srun: a peer left while the group started (rank 0 gave up on one)
        if ctx.launcher == "local":
            raise
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"run never assembled: rank {ctx.rank}: the process group did not start ({said})", file=sys.stderr)
        return 1
    stop.prepare()  # its CPU group now, not inside the timed loop at the first stop check
    adapter = None
    watchdog = None
    failed = False
    try:
        run_dir, resume_from, resume_info = _agree_on_run_dir(cfg, plan, ctx, run_dir)
        writer = RunWriter(run_dir, plan.identity())
        if ctx.rank != 0:  # rank 0's was set aside with the record
            writer.record.reserve(ctx.rank)
        sampler = external_sampler(ctx, plan.devices_per_process)  # torchrun / srun: rank 0 samples its node

        def on_hang(idle: float) -> None:
            waiting, where = _main_thread_at()
            what = (
                f"waiting in a collective ({where}) for a rank that stopped"
                if waiting
                else f"rank {ctx.rank} stopped in {where}, the others wait for it in a collective"
            )
            _record_rank_error(
                writer,
                ctx,
                "timeout",
                f"no progress for {idle:.0f}s (trainer.hang_timeout_s={cfg.trainer.hang_timeout_s}): {what}",
                "",
                waiting=waiting,
            )
            if waiting:  # the rank that froze reports too (its watchdog fires about now): its error is the cause
                time.sleep(min(5.0, cfg.trainer.hang_timeout_s / 2))
                if ctx.launcher != "local" and ctx.rank == 0:  # no launcher of ours to choose it: this rank does
                    errors = sorted(writer.record.rank_errors(), key=lambda e: (bool(e.get("waiting")), e["time"]))
                    writer.fail("timeout", errors[0]["error"], errors[0]["rank"])  # its own when no other wrote

        watchdog = Watchdog(cfg.trainer.hang_timeout_s, on_hang).start()
        from ptbench.runner.trainer import CONVENTIONS, Trainer

        torch.manual_seed(cfg.trainer.seed)
        workload = build_workload(cfg.workload, cfg.data)
        adapter = plan.adapter_cls(cfg, workload, ctx)
        adapter.setup()
        watchdog.beat()
        trainer = Trainer(
            cfg,
            plan,
            ctx,
            adapter,
            workload,
            writer.record if ctx.rank == 0 else None,
            stop,
            watchdog,
            run_dir=run_dir,
            resume_from=resume_from,
            resume_info=resume_info,
        )
        running["trainer"] = trainer
        summary = trainer.run()
        requeue = None
        if ctx.rank == 0 and summary["status"] == "preempted" and trainer.saved_on_stop:
            requeue = slurm_job_requeueable()  # sbatch --requeue: this job starts again and resumes
            if requeue:
                summary["requeue"] = {"slurm_job_id": requeue, "time": time.time()}
        if summary["status"] == "interrupted" and not summary.get("error"):  # the report's one line on it
            summary["error"] = f"interrupted (Ctrl-C, SIGINT) after step {summary['steps']}"
        if ctx.rank == 0:
            extra = OmegaConf.to_container(cfg.extra) if OmegaConf.is_config(cfg.extra) else cfg.extra
            summary.update(
                adapter_settings=adapter.describe(),
                plan=plan.describe(),
                layout=plan.layout.as_dict(),
                precision=plan.precision,
                predicted_memory=plan.predicted_memory,
                comm_volume=plan.comm_volume,
                extra=extra,
                batch_reduced_from=(extra or {}).get("batch_reduced_from") if isinstance(extra, dict) else None,
                phase_semantics=adapter.phase_semantics,
                precision_semantics=adapter.precision_semantics,
                batch_policy=plan.batch_policy,
                warmup_steps=cfg.trainer.untimed_steps,
                launcher=ctx.launcher,
                conventions=CONVENTIONS,
                frameworks_imported=frameworks_imported(),
                cpu_threads_per_rank=threads,
                rank_environment={"required": required, "at_start": at_start},
            )
            record_external(sampler, summary, ctx.local_world_size, threads)  # its node's contention, if sampled
            writer.finish(summary)
            if ctx.launcher != "local":  # no launcher process of ours: this rank writes the sinks
                write_sinks(
                    run_dir,
                    mllog=cfg.results.mllog,
                    tensorboard=cfg.results.tensorboard,
                    wandb=cfg.results.wandb,
                    mlflow=cfg.results.mlflow,
                )
            print_summary({**summary, **writer.identity})
        if requeue:  # last: Slurm ends this job's steps now; the checkpoint and the record are complete
            print(f"scontrol requeue {requeue}: the job resumes from {summary['checkpoint']['latest']}", flush=True)
            error = requeue_slurm_job(requeue)
            if error:
                print(f"warning: scontrol requeue {requeue} failed: {error}", file=sys.stderr, flush=True)
                writer.finish({**summary, "requeue": {**summary["requeue"], "error": error}})
        return 0
    except BaseException as e:  # record every failure, then let it end the rank
        failed = True
        # a KeyboardInterrupt here came before the stop handlers (they turn SIGINT into a stop)
        status = "oom" if _is_oom(e) else "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        where = None
        if run_dir is not None:
            try:
                _record_rank_error(
                    RunWriter(run_dir, plan.identity()), ctx, status, f"{type(e).__name__}: {e}", traceback.format_exc()
                )
                where = run_dir / f"error-rank{ctx.rank}.json"
            except OSError as unwritten:  # the record's storage refuses too: the console line says so
                where = f"nowhere: {unwritten}"
        abort_process_groups()
        end_within(FAILED_EXIT_S)
        if ctx.launcher == "local" or isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise  # the launcher of ours records the run and says why in one line
        # torchrun / srun: no launcher of ours to say it; one line per failed rank, its traceback in its file
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"run {status}: rank {ctx.rank}: {type(e).__name__}: {message} (traceback: {where})", file=sys.stderr)
        return 1
    finally:
        if watchdog is not None:
            watchdog.stop()
        # a failed rank's groups are aborted: no teardown that talks to the peers (adapter.close destroys
        # Megatron's groups), each could wait for work that never completes
        if adapter is not None and not failed:
            adapter.close()
        if dist.is_initialized() and not failed:
            dist.destroy_process_group()


def _launcher_pid(ctx: DistContext) -> tuple[int, bool] | None:
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


def _launcher_killed(writer: RunWriter, ctx: DistContext, pid: int, trainer) -> None:
    """The final status `killed`, with the step reached and the time, written by the first rank that
    finds the launcher gone (a status already final is kept); one line on the console (the launcher's)."""
    step = trainer.global_step if trainer is not None else None
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


class NeverAssembled(RuntimeError):
    """The ranks of a job did not all meet within the process-group timeout."""


def assemble(ctx: DistContext, timeout_s: int):
    """torchrun / srun: the ranks meet on rank 0's TCPStore (MASTER_ADDR:MASTER_PORT), each saying it is
    there, before the process group starts on that store. A rank that never started is then named, and the
    job ends within `timeout_s` (trainer.dist_timeout_s), where torch would only count clients. Returns the store."""
    import datetime

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
        while True:
            missing = [r for r in range(ctx.world_size) if not store.check([f"{key}{r}"])]
            if not missing:
                break
            if time.monotonic() > deadline:
                names = ", ".join(map(str, missing))
                raise NeverAssembled(
                    f"rank(s) {names} of {ctx.world_size} never joined rank 0 at {where} within {timeout_s}s "
                    f"(trainer.dist_timeout_s, 0 = trainer.hang_timeout_s + 60): {fix}"
                )
            time.sleep(0.2)
    return store


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


# recorded as the process had them when it started (summary rank_environment.at_start), beside the adapter's own
RECORDED_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def _late_environment(required: dict[str, str], at_start: dict[str, str | None], ctx: DistContext) -> None:
    """Set what the adapter needs in this rank's environment; on CUDA, one line (rank 0) for a value the
    process did not start with: CUDA may have read it already (torchrun/srun started this rank without it)."""
    late = {k: v for k, v in required.items() if at_start.get(k) != v}
    os.environ.update(required)
    if late and ctx.is_cuda and ctx.rank == 0:
        names = " ".join(f"{k}={v}" for k, v in late.items())
        print(
            f"warning: this rank started without {names} (set now, after the start, it may not take effect): "
            f"export {names} before {ctx.launcher} starts the ranks (slurm/run.sbatch does)",
            file=sys.stderr,
            flush=True,
        )


FAILED_EXIT_S = 10  # a failed rank's time to leave after its record is written and its groups aborted


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


def _record_rank_error(
    writer: RunWriter, ctx: DistContext, status: str, message: str, tb: str, waiting: bool = False
) -> None:
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


def _agree_on_run_dir(cfg, plan: RunPlan, ctx: DistContext, run_dir: Path | None):
    """(record folder, checkpoint to resume from or None, facts for `resumed_from`), decided by rank 0.
    `run_dir` None: rank 0 creates the record (or continues the unfinished one of this point)."""
    import torch.distributed as dist

    box = [None, None, None]
    if ctx.rank == 0:
        found = None
        if run_dir is None:  # srun / torchrun: no launcher of ours looked for records its killed run left
            mark_killed(point_folders(cfg.results), plan.point)
        if cfg.trainer.resume == "auto" and ckpt.enabled(cfg, plan.adapter_cls.checkpoint_refusal(cfg)):
            found = ckpt.find_resumable(
                point_folders(cfg.results), plan.point, plan.adapter, plan.world_size, exclude=run_dir
            )
        info = None
        if found:
            old, checkpoint = found
            previous = RunWriter(old, plan.identity()).record.summary() or {}
            info = {"previous_status": previous.get("status")}
        if run_dir is None and found:  # continue in that record
            writer = RunWriter(old, plan.identity())
            keys = ("run_id", "status", "error", "steps", "epochs_completed")  # as ckpt.adopt keeps them
            writer.record.write_summary(
                {
                    "status": "running",
                    **writer.identity,
                    "resuming_from": checkpoint.name,
                    "owner": owner(),
                    "previous_record": {k: previous.get(k) for k in keys},  # kept when this attempt fails
                }
            )
            writer.record.reserve()
            box = [str(old), str(checkpoint), info]
            print(
                f"run {old}: resuming {plan.adapter} x {plan.workload} from {checkpoint.name} "
                f"({info['previous_status']}), {ctx.world_size} rank(s) via {ctx.launcher}",
                flush=True,
            )
        elif run_dir is None:
            writer = RunWriter(run_dir_of(cfg, plan), plan.identity())
            writer.start(OmegaConf.to_yaml(cfg, resolve=True), packages())
            box = [str(writer.dir), None, None]
            print(
                f"run {writer.dir}: {plan.adapter} x {plan.workload}, {ctx.world_size} rank(s) via {ctx.launcher}",
                flush=True,
            )
        elif found:  # the launcher made this record already: take the unfinished one's history into it
            ckpt.adopt(old, run_dir)
            box = [str(run_dir), str(ckpt.folder(run_dir) / checkpoint.name), info]
            print(
                f"run {run_dir}: resuming from {checkpoint.name} of {old} ({info['previous_status']}), "
                "moved into this record",
                flush=True,
            )
        else:
            box = [str(run_dir), None, None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]), (Path(box[1]) if box[1] else None), box[2]


def _is_oom(e: BaseException) -> bool:
    # the CPU allocator's own refusal ("DefaultCPUAllocator: can't allocate memory") is an out of memory too
    text = str(e).lower()
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text or "can't allocate" in text


def rank_main(run_dir: str) -> int:
    """A rank started by the adapter's own launcher (`Adapter.launch_command`) for launcher=local."""
    import dataclasses

    cfg = typed(OmegaConf.load(Path(run_dir) / "config.yaml"))
    environment = detect(adapters.get_adapter_class(cfg.adapter.name), cfg.launcher.name)
    if environment is None:
        raise SystemExit(f"error: python -m ptbench.runner.rank {run_dir}: no launcher environment found")
    ctx = environment.context(os.environ, cfg.launcher.backend, cfg.launcher.master_port)
    # the launcher checked and warned; rank 0, which writes the summary, records the predictions as it would
    plan, _ = plan_run(
        cfg,
        environment.name,
        ctx.world_size,
        check=False,
        memory=ctx.rank == 0,
        backend=ctx.backend if ctx.rank == 0 else None,
        quiet=True,
    )
    # the launcher process waits and records a failed run's outcome, as for spawned ranks
    return run_rank(cfg, plan, dataclasses.replace(ctx, launcher="local"), Path(run_dir))


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))
