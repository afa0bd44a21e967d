"""One rank's life: start, join the others, agree on the record, build, train, finish (`run_rank`).

Its companions: bench/runner/rendezvous.py (the ranks meet, or the run never assembled, in one line),
bench/runner/lifeline.py (a life that ends otherwise: the launcher killed, a hang, a failure, and what
each leaves in the record), bench/runner/trainer.py (the loop) and bench/runner/summary.py (the record).

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

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault(
    "OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or "1"
)  # before torch: see bench/__main__.py

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from ptbench import adapters  # noqa: E402
from ptbench.core import checkpoint as ckpt  # noqa: E402
from ptbench.core.config import BenchConfig  # noqa: E402
from ptbench.core.dist import DistContext, dist_timeout_s, set_cpu_threads  # noqa: E402
from ptbench.core.environments import detect  # noqa: E402
from ptbench.core.precision import apply_tf32  # noqa: E402
from ptbench.core.records import RunRecord, RunWriter, mark_killed, owner, point_folders  # noqa: E402
from ptbench.core.sinks import write_sinks  # noqa: E402
from ptbench.core.stopping import StopFlag, Watchdog, requeue_slurm_job, slurm_job_requeueable  # noqa: E402
from ptbench.runner import lifeline  # noqa: E402
from ptbench.runner.compose import typed  # noqa: E402
from ptbench.runner.console import print_summary  # noqa: E402
from ptbench.runner.plan import RunPlan, plan_run, run_dir_of  # noqa: E402
from ptbench.runner.rendezvous import join  # noqa: E402
from ptbench.workloads import build_workload  # noqa: E402


def packages() -> tuple[str, ...]:
    """Distributions whose versions the record states: every adapter's framework."""
    return tuple(adapters.frameworks())


def run_rank(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, run_dir: Path | None) -> int:
    """Everything one rank does, on the config typed once in this process. `run_dir` None: rank 0 creates
    the record and tells the others."""
    from ptbench.runner.contention import external_sampler

    trainer = None  # read by the launcher watch when it finds the launcher gone: None before the first step
    start = _start(cfg, plan, ctx, run_dir, lambda: trainer.global_step if trainer is not None else None)
    if not join(ctx, dist_timeout_s(cfg.trainer)):
        return 1
    start.stop.prepare()  # its CPU group now, not inside the timed loop at the first stop check
    writer, adapter, watchdog, failed = start.writer, None, None, False
    try:
        writer, resume_from, resume_info = _agree_on_record(cfg, plan, ctx, writer)
        sampler = external_sampler(ctx, plan.devices_per_process)  # torchrun / srun: rank 0 samples its node
        hang = functools.partial(lifeline.on_hang, writer, ctx, cfg.trainer.hang_timeout_s)
        watchdog = Watchdog(cfg.trainer.hang_timeout_s, hang).start()
        adapter, trainer = _build(cfg, plan, ctx, writer, start.stop, watchdog, resume_from, resume_info)
        summary = trainer.run()
        _finish(cfg, ctx, writer, trainer, summary, sampler, start)
        return 0
    except BaseException as e:  # record every failure, then let it end the rank
        failed = True
        if lifeline.failed(e, writer, ctx):
            raise  # the launcher of ours records the run and says why in one line
        return 1
    finally:
        if watchdog is not None:
            watchdog.stop()
        # a failed rank's groups are aborted: no teardown that talks to the peers (adapter.close destroys
        # Megatron's groups), each could wait for work that never completes
        if adapter is not None and not failed:
            adapter.close()
        if torch.distributed.is_initialized() and not failed:
            torch.distributed.destroy_process_group()


@dataclass(frozen=True)
class Start:
    """What a rank's start leaves for the rest of its life."""

    writer: RunWriter | None  # the record's writer, when the launcher of ours made the record already
    stop: StopFlag  # the stop signals, installed
    threads: int  # CPU threads per rank (launcher.threads_per_rank)
    environment: dict  # the adapter's required variables, and the values the process started with


def _start(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, run_dir: Path | None, step) -> Start:
    """The rank's process before any peer: its environment, threads, TF32, the stop signals and, under the
    launcher of ours, the watch that ends the rank (`step()`: the step reached) if that launcher is killed."""
    required = plan.adapter_cls.rank_environment(cfg)
    at_start = {k: os.environ.get(k) for k in (*RECORDED_ENV, *required)}  # first: before anything starts CUDA
    launcher = lifeline.launcher_pid(ctx)  # now, while the launcher surely lives
    threads = set_cpu_threads(cfg.launcher.threads_per_rank)
    apply_tf32(cfg.trainer.tf32)
    stop = StopFlag()
    stop.install()
    writer = RunWriter(run_dir, plan.identity()) if run_dir is not None else None
    if launcher and writer is not None:  # from the start: a launcher killed during start-up leaves no rank behind
        pid, _ = launcher
        lifeline.watch_launcher(*launcher, functools.partial(lifeline.launcher_killed, writer, ctx, pid, step))
    _late_environment(required, at_start, ctx)
    return Start(writer, stop, threads, {"required": required, "at_start": at_start})


def _build(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, writer: RunWriter, stop, watchdog, resume_from, info):
    """(adapter, trainer): the workload, the adapter set up on it, and the training loop around them."""
    from ptbench.runner.trainer import Trainer

    torch.manual_seed(cfg.trainer.seed)
    workload = build_workload(cfg.workload, cfg.data)
    adapter = plan.adapter_cls(cfg, workload, ctx)
    adapter.setup()
    watchdog.beat()
    record = writer.record if ctx.rank == 0 else None
    trainer = Trainer(
        cfg,
        plan,
        ctx,
        adapter,
        workload,
        record,
        stop,
        watchdog,
        run_dir=writer.dir,
        resume_from=resume_from,
        resume_info=info,
    )
    return adapter, trainer


def _finish(cfg: BenchConfig, ctx: DistContext, writer: RunWriter, trainer, summary: dict, sampler, start: Start):
    """Rank 0 writes the final summary (and, with no launcher of ours, the sinks); then a stop that saved a
    checkpoint inside a Slurm job that may be requeued ends with `scontrol requeue`. Other ranks: nothing."""
    from ptbench.runner.contention import record_external

    if ctx.rank != 0:
        return
    # sbatch --requeue: this job starts again and resumes from the checkpoint the stop saved
    requeue = slurm_job_requeueable() if summary["status"] == "preempted" and trainer.saved_on_stop else None
    summary = trainer.summary.record(
        summary, requeue=requeue, threads=start.threads, rank_environment=start.environment
    )
    record_external(sampler, summary, ctx.local_world_size, start.threads)  # its node's contention, if sampled
    writer.finish(summary)
    if ctx.launcher != "local":  # no launcher process of ours: this rank writes the sinks
        r = cfg.results
        write_sinks(writer.dir, mllog=r.mllog, tensorboard=r.tensorboard, wandb=r.wandb, mlflow=r.mlflow)
    print_summary({**summary, **writer.identity})
    if requeue:  # last: Slurm ends this job's steps now; the checkpoint and the record are complete
        print(f"scontrol requeue {requeue}: the job resumes from {summary['checkpoint']['latest']}", flush=True)
        error = requeue_slurm_job(requeue)
        if error:
            print(f"warning: scontrol requeue {requeue} failed: {error}", file=sys.stderr, flush=True)
            writer.finish({**summary, "requeue": {**summary["requeue"], "error": error}})


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


def _agree_on_record(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, writer: RunWriter | None):
    """(the record's writer, checkpoint to resume from or None, facts for `resumed_from`), decided by rank 0.
    `writer` None: rank 0 creates the record (or continues the unfinished one of this point)."""
    import torch.distributed as dist

    box = [None, None, None]
    if ctx.rank == 0:
        writer, box = _decide_record(cfg, plan, ctx, writer)
    dist.broadcast_object_list(box, src=0)
    if writer is None:  # torchrun / srun: the record rank 0 made or continues (a launcher's is never moved)
        writer = RunWriter(Path(box[0]), plan.identity())
    if ctx.rank != 0:  # rank 0's was set aside with the record
        writer.record.reserve(ctx.rank)
    return writer, (Path(box[1]) if box[1] else None), box[2]


def _decide_record(cfg: BenchConfig, plan: RunPlan, ctx: DistContext, writer: RunWriter | None):
    """Rank 0: (its writer, [record folder, checkpoint or None, resume facts or None]) for the others."""
    run_dir = writer.dir if writer is not None else None
    found = None
    if run_dir is None:  # srun / torchrun: no launcher of ours looked for records its killed run left
        mark_killed(point_folders(cfg.results), plan.point)
    if cfg.trainer.resume == "auto" and ckpt.enabled(cfg, plan.adapter_cls.checkpoint_refusal(cfg)):
        found = ckpt.find_resumable(
            point_folders(cfg.results), plan.point, plan.adapter, plan.world_size, exclude=run_dir
        )
    if not found and run_dir is not None:
        return writer, [str(run_dir), None, None]
    if not found:
        writer = RunWriter(run_dir_of(cfg, plan), plan.identity())
        writer.start(OmegaConf.to_yaml(cfg, resolve=True), packages())
        say = f"run {writer.dir}: {plan.adapter} x {plan.workload}, {ctx.world_size} rank(s) via {ctx.launcher}"
        print(say, flush=True)
        return writer, [str(writer.dir), None, None]
    old, checkpoint = found
    previous = RunRecord(old).summary() or {}
    info = {"previous_status": previous.get("status")}
    if run_dir is not None:  # the launcher made this record already: take the unfinished one's history into it
        ckpt.adopt(old, run_dir)
        say = f"run {run_dir}: resuming from {checkpoint.name} of {old} ({info['previous_status']}), moved into this record"
        print(say, flush=True)
        return writer, [str(run_dir), str(ckpt.folder(run_dir) / checkpoint.name), info]
    writer = RunWriter(old, plan.identity())  # continue in that record
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
    print(
        f"run {old}: resuming {plan.adapter} x {plan.workload} from {checkpoint.name} "
        f"({info['previous_status']}), {ctx.world_size} rank(s) via {ctx.launcher}",
        flush=True,
    )
    return writer, [str(old), str(checkpoint), info]


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
