"""One rank's life: process group, workload, adapter, the training loop, its part of the record.

`run_rank` is what every rank runs, however it was started (spawned by the launcher, torchrun,
srun, horovodrun). `python -m bench.runner.rank RUN_DIR` is a rank started by a framework's own
launcher for `launcher=local` (horovodrun): the launcher process wrote the run's resolved config to
RUN_DIR/config.yaml and records the outcome of a failed run, as for spawned ranks.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or "1")  # before torch: see bench/__main__.py

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import adapters  # noqa: E402
from bench.core.dist import DistContext, dist_timeout_s, init_process_group, set_cpu_threads  # noqa: E402
from bench.core.precision import apply_tf32  # noqa: E402
from bench.core.records import RunWriter  # noqa: E402
from bench.runner.compose import typed  # noqa: E402
from bench.runner.console import print_summary  # noqa: E402
from bench.runner.plan import RunPlan, make_plan, run_dir_of  # noqa: E402
from workloads import build_workload  # noqa: E402


def packages() -> tuple[str, ...]:
    """Distributions whose versions the record states: every adapter's framework."""
    return tuple(adapters.frameworks())


def frameworks_imported() -> list[str]:
    """Frameworks other than torch that this process has imported (ddp must import none)."""
    tops = {m.split(".")[0] for m in adapters.frameworks().values()} - {"torch"}
    return sorted(m for m in tops if m in sys.modules)


def run_rank(cfg_dict: dict, plan: RunPlan, ctx: DistContext, run_dir: Path | None) -> int:
    """Everything one rank does. `run_dir` None: rank 0 creates the record and tells the others."""
    cfg = typed(cfg_dict)
    threads = set_cpu_threads(cfg.launcher.threads_per_rank)
    apply_tf32(cfg.trainer.tf32)
    import torch.distributed as dist

    from bench.core.guard import StopFlag, Watchdog

    stop = StopFlag()
    stop.install()
    init_process_group(ctx, dist_timeout_s(cfg.trainer))
    adapter = None
    watchdog = None
    try:
        if run_dir is None:
            run_dir = _agree_on_run_dir(cfg, plan, ctx)
        writer = RunWriter(run_dir, plan.identity())

        def on_hang(idle: float) -> None:
            _record_rank_error(writer, ctx, "timeout", f"no progress for {idle:.0f}s (trainer.hang_timeout_s="
                               f"{cfg.trainer.hang_timeout_s}): a rank stopped calling collectives or hangs", "")

        watchdog = Watchdog(cfg.trainer.hang_timeout_s, on_hang).start()
        from bench.runner.trainer import CONVENTIONS, Trainer

        torch.manual_seed(cfg.trainer.seed)
        workload = build_workload(cfg.workload, cfg.data)
        adapter = plan.adapter_cls(cfg, workload, ctx)
        adapter.setup()
        watchdog.beat()
        trainer = Trainer(cfg, plan, ctx, adapter, workload, writer.record if ctx.rank == 0 else None, stop, watchdog)
        summary = trainer.run()
        if ctx.rank == 0:
            summary.update(adapter_settings=adapter.describe(), plan=plan.describe(), precision=plan.precision,
                           phase_semantics=adapter.phase_semantics, precision_semantics=adapter.precision_semantics,
                           batch_policy=plan.batch_policy, warmup_steps=cfg.trainer.warmup_steps,
                           launcher=ctx.launcher, conventions=CONVENTIONS, frameworks_imported=frameworks_imported(),
                           cpu_threads_per_rank=threads)
            writer.finish(summary)
            print_summary({**summary, **writer.identity})
        return 0
    except BaseException as e:  # record every failure, then let it end the rank
        if run_dir is not None:
            status = "oom" if _is_oom(e) else "failed"
            _record_rank_error(RunWriter(run_dir, plan.identity()), ctx, status, f"{type(e).__name__}: {e}",
                               traceback.format_exc())
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if adapter is not None:
            adapter.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _record_rank_error(writer: RunWriter, ctx: DistContext, status: str, message: str, tb: str) -> None:
    err = {"rank": ctx.rank, "host": socket.gethostname(), "status": status,
           "error": message.strip().splitlines()[0][:500] if message.strip() else status,
           "traceback": tb, "time": time.time()}
    writer.record.write_rank_error(ctx.rank, err)
    if ctx.launcher != "local" and ctx.rank == 0:  # no launcher process of ours to write the outcome
        writer.fail(status, err["error"], ctx.rank)


def _agree_on_run_dir(cfg, plan: RunPlan, ctx: DistContext) -> Path:
    import torch.distributed as dist

    box = [None]
    if ctx.rank == 0:
        writer = RunWriter(run_dir_of(cfg, plan), plan.identity())
        writer.start(OmegaConf.to_yaml(cfg, resolve=True), packages())
        box = [str(writer.dir)]
        print(f"run {writer.dir}: {plan.adapter} x {plan.workload}, {ctx.world_size} rank(s) via {ctx.launcher}",
              flush=True)
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()


def rank_main(run_dir: str) -> int:
    """A rank started by the adapter's own launcher (`Adapter.launch_command`) for launcher=local."""
    import dataclasses

    from bench.runner.launch import detect

    cfg = typed(OmegaConf.load(Path(run_dir) / "config.yaml"))
    environment = detect(adapters.get_adapter_class(cfg.adapter.name), cfg.launcher.name)
    if environment is None:
        raise SystemExit(f"error: python -m bench.runner.rank {run_dir}: no launcher environment found")
    ctx = environment.context(os.environ, cfg.launcher.backend, cfg.launcher.master_port)
    plan = make_plan(cfg, environment.name, ctx.world_size, check=False)  # the launcher checked
    # the launcher process waits and records a failed run's outcome, as for spawned ranks
    return run_rank(OmegaConf.to_container(cfg, resolve=True), plan, dataclasses.replace(ctx, launcher="local"),
                    Path(run_dir))


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))
