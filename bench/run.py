"""From a resolved config to finished ranks and a run record.

`launch(cfg)` runs in the process the user started. It checks the config (one line per problem,
before any rank starts), then either spawns the ranks itself (`launcher=local`) or, when this
process is already one rank of torchrun/srun, becomes that rank. A run that fails after it began
still ends with a record (`summary.json` status failed, with the failing rank and its error).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from adapters import get_adapter_class
from bench.config import BenchConfig
from bench.dist import (DistContext, context_from_env, default_backend, free_port, horovodrun_env,
                        init_process_group, set_cpu_threads, torchrun_env)
from bench.errors import ConfigError
from bench.precision import check_precision
from bench.records import RunRecord, new_run_id
from workloads import build_workload


# --- checks before launch ------------------------------------------------------------------------
def check_config(cfg: BenchConfig) -> None:
    """Generic checks; adapters add theirs in `validate`."""
    positive = {
        "trainer.batch_size": cfg.trainer.batch_size,
        "trainer.epochs": cfg.trainer.epochs,
        "trainer.grad_accum": cfg.trainer.grad_accum,
        "trainer.dist_timeout_s": cfg.trainer.dist_timeout_s,
        "launcher.nprocs": cfg.launcher.nprocs,
        "launcher.threads_per_rank": cfg.launcher.threads_per_rank,
        "optimizer.lr": cfg.optimizer.lr,
    }
    if cfg.workload.kind == "language":
        positive.update({f"workload.{k}": getattr(cfg.workload, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "seq_len")})
    else:
        positive.update({f"workload.{k}": getattr(cfg.workload, k) for k in ("num_classes", "image_size", "width_div")})
    for key, value in positive.items():
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")
    for key in ("trainer.warmup_steps", "trainer.max_steps", "trainer.max_eval_batches", "data.num_workers"):
        group, name = key.split(".")
        if getattr(getattr(cfg, group), name) < 0:
            raise ConfigError(f"{key}={getattr(getattr(cfg, group), name)} must be >= 0")
    if cfg.workload.kind not in ("vision", "language"):
        raise ConfigError(f"workload.kind={cfg.workload.kind}: must be vision or language")
    if cfg.workload.kind == "language" and cfg.workload.n_embd % cfg.workload.n_head:
        raise ConfigError(f"workload.n_embd={cfg.workload.n_embd} is not divisible by workload.n_head={cfg.workload.n_head}")
    sources = {"vision": ("synthetic", "imagefolder"), "language": ("synthetic", "wikitext")}[cfg.workload.kind]
    if cfg.data.source not in sources:
        raise ConfigError(
            f"data.source={cfg.data.source} does not fit {cfg.workload.kind} workload {cfg.workload.name}; use one of {', '.join(sources)}"
        )
    if cfg.adapter.batch_policy not in ("per_device", "linear", "fixed", "per_microbatch"):
        raise ConfigError(f"adapter.batch_policy={cfg.adapter.batch_policy}: choose per_device, linear, fixed or per_microbatch")
    if cfg.launcher.name not in ("local", "torchrun", "slurm"):
        raise ConfigError(f"launcher.name={cfg.launcher.name}: choose local, torchrun or slurm")
    check_precision(cfg.trainer.precision)
    fault = cfg.trainer.inject_fault
    if fault and not re.fullmatch(r"(raise|oom|hang|exit)@\d+:\d+", fault):
        raise ConfigError(f"trainer.inject_fault={fault}: use KIND@RANK:STEP with KIND raise, oom, hang or exit")
    from bench.optim import OPTIMIZERS

    if cfg.optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer.name '{cfg.optimizer.name}': choose one of {', '.join(OPTIMIZERS)}")
    check_results_dir(Path(cfg.results.dir or cfg.results.root))


def check_results_dir(root: Path) -> None:
    probe = root
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"results.root={root} is not writable ({probe} is a file); set results.root=<writable dir>")
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"results.root={root} is not writable ({probe} is read-only); set results.root=<writable dir>")


def prepare(cfg: BenchConfig, world_size: int):
    """All checks that need no process group; returns the adapter class."""
    check_config(cfg)
    adapter_cls = get_adapter_class(cfg.adapter.name)
    adapter_cls.validate(cfg, world_size)
    adapter_cls.local_batch_size(cfg, world_size)  # raises on a batch the layout cannot split
    build_workload(cfg.workload, cfg.data).check_data()
    return adapter_cls


# --- the launcher ----------------------------------------------------------------------------------
def launch(cfg: DictConfig) -> int:
    """Run one benchmark point; returns the process exit code (0 ok/preempted, 1 failed, 2 bad input)."""
    # A task of a submitit Slurm job (hydra/launcher=submitit_slurm) is one srun-started rank.
    submitit_slurm = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
    launcher = "slurm" if submitit_slurm else cfg.launcher.name
    external = torchrun_env() or horovodrun_env() or launcher == "slurm"
    if cfg.launcher.name == "torchrun" and not torchrun_env():
        raise ConfigError("launcher=torchrun but RANK/WORLD_SIZE/LOCAL_RANK are not set: start with `torchrun -m bench ...`")
    if external:
        ctx = context_from_env(launcher, cfg.launcher.backend, master_port=cfg.launcher.master_port)
        if submitit_slurm and ctx.world_size != get_adapter_class(cfg.adapter.name).processes(cfg):
            raise ConfigError(f"this submitit job has {ctx.world_size} task(s) but the point needs "
                              f"{get_adapter_class(cfg.adapter.name).processes(cfg)} ranks: use the repo's "
                              "hydra/launcher=submitit_slurm (conf/hydra/launcher), which sizes each job")
        prepare(cfg, ctx.world_size)
        return run_rank(OmegaConf.to_container(cfg, resolve=True), ctx, run_dir=None)

    adapter_cls = get_adapter_class(cfg.adapter.name)
    world = adapter_cls.processes(cfg)
    prepare(cfg, world)
    run_dir = make_run_dir(cfg, world)
    record = RunRecord(run_dir)
    record.create(OmegaConf.to_yaml(cfg, resolve=True))
    record.write_summary({"status": "running", "run_id": run_dir.name, **identity(cfg, world)})
    port = cfg.launcher.master_port or free_port()
    print(f"run {run_dir}: {cfg.adapter.name} x {cfg.workload.name}, {world} rank(s)", flush=True)
    command = adapter_cls.launch_command(cfg, world)
    if command:
        return run_with_launcher(command, cfg.launcher.master_addr, port, run_dir)
    return spawn_local(OmegaConf.to_container(cfg, resolve=True), world, port, run_dir)


def identity(cfg, world: int) -> dict:
    return {
        "experiment": cfg.results.experiment,
        "point": cfg.results.point,  # sweep point id (bench/sweep.py): what --resume matches
        "adapter": cfg.adapter.name,
        "workload": cfg.workload.name,
        "world_size": world,
        # devices used (GPipe drives several from one process): analysis plots against this
        "devices": world * get_adapter_class(cfg.adapter.name).devices_per_process(cfg),
    }


def make_run_dir(cfg, world: int) -> Path:
    run_id = cfg.results.run_id or new_run_id(cfg.adapter.name, cfg.workload.name, world)
    return Path(cfg.results.dir or Path(cfg.results.root) / cfg.results.experiment) / run_id


def spawn_local(cfg_dict: dict, world: int, port: int, run_dir: Path) -> int:
    import psutil
    import torch.multiprocessing as mp

    start = time.time()
    os.environ["BENCH_LAUNCH_T0"] = str(psutil.Process().create_time())  # inherited by the ranks
    stop_signals = (signal.SIGUSR1, signal.SIGTERM)
    # ranks inherit the blocked mask and unblock once their handlers are set (bench/guard.py), so a
    # stop signal forwarded while they still import torch is held, not fatal
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    procs = mp.start_processes(_local_rank_main, args=(cfg_dict, world, port, str(run_dir)), nprocs=world,
                               start_method="spawn", join=False)

    def forward(signum, frame):  # a preemption signal to the launcher reaches every rank
        for p in procs.processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in stop_signals}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    try:
        # join() ends the other ranks (SIGTERM, then SIGKILL) as soon as one fails: no orphans
        while not procs.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        record_failure(run_dir, e, time.time() - start)
        summary = RunRecord(run_dir).summary() or {}
        print(f"run {summary.get('status')}: rank {summary.get('failed_rank')}: {summary.get('error')}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = RunRecord(run_dir).summary() or {}
    return 0 if summary.get("status") in ("ok", "preempted") else 1


def run_with_launcher(command: list[str], addr: str, port: int, run_dir: Path) -> int:
    """Ranks started by the framework's own launcher (horovodrun); each runs `python -m bench.rank RUN_DIR`
    and reads the config this process wrote there. Our process group's address goes in the environment."""
    import subprocess

    import psutil

    start = time.time()
    env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(port),
           "BENCH_LAUNCH_T0": str(psutil.Process().create_time())}  # startup_s counts horovodrun's start too
    proc = subprocess.Popen([*command, sys.executable, "-m", "bench.rank", str(run_dir)], env=env)

    def forward(signum, frame):  # horovodrun stops its ranks on SIGTERM (SIGUSR1 would kill it outright)
        proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = RunRecord(run_dir).summary() or {}
    if code and summary.get("status") in (None, "running"):
        record_failure(run_dir, RuntimeError(f"{' '.join(command[:3])} exited with status {code}"), time.time() - start)
        summary = RunRecord(run_dir).summary() or {}
        print(f"run {summary.get('status')}: rank {summary.get('failed_rank')}: {summary.get('error')}", file=sys.stderr)
    return 0 if summary.get("status") in ("ok", "preempted") else 1


def rank_main(run_dir: str) -> int:
    """One rank started by `run_with_launcher`. Its launcher process waits and records a failed run's
    outcome, as for spawned ranks, hence launcher "local"; the adapter records how ranks started."""
    import dataclasses

    cfg_dict = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    ctx = context_from_env(cfg_dict["launcher"]["name"], cfg_dict["launcher"]["backend"])
    return run_rank(cfg_dict, dataclasses.replace(ctx, launcher="local"), Path(run_dir))


def record_failure(run_dir: Path, exc: Exception, elapsed: float) -> None:
    """The launcher's word on a failed run: the earliest rank error is the cause; a rank killed by a
    signal (it could write nothing) is named from the exit status."""
    record = RunRecord(run_dir)
    summary = record.summary() or {}
    if summary.get("status") not in (None, "running"):
        return  # rank 0 already wrote the outcome
    errors = sorted(record.rank_errors(), key=lambda e: e.get("time", 0))
    killed = getattr(exc, "signal_name", None)
    if killed and not any(e.get("status") == "timeout" for e in errors):
        cause = {"rank": exc.error_index, "status": "failed", "error": f"rank {exc.error_index} killed by {killed}"}
    elif errors:
        cause = errors[0]
    else:
        cause = {"rank": getattr(exc, "error_index", None), "status": "failed", "error": str(exc).strip().splitlines()[-1]}
    summary.update(status=cause["status"], error=cause["error"], failed_rank=cause["rank"], total_time_s=elapsed,
                   rank_errors=[{k: e.get(k) for k in ("rank", "status", "error")} for e in errors])
    record.write_summary(summary)


def _local_rank_main(local_rank: int, cfg_dict: dict, world: int, port: int, run_dir: str) -> None:
    ctx = DistContext(rank=local_rank, world_size=world, local_rank=local_rank, local_world_size=world,
                      master_port=port, backend=default_backend(cfg_dict["launcher"]["backend"]), launcher="local")
    code = run_rank(cfg_dict, ctx, Path(run_dir))
    if code:
        sys.exit(code)


# --- one rank --------------------------------------------------------------------------------------
def run_rank(cfg_dict: dict, ctx: DistContext, run_dir: Path | None) -> int:
    """Everything one rank does. `run_dir` None: rank 0 creates it and tells the others."""
    cfg: BenchConfig = OmegaConf.merge(OmegaConf.structured(BenchConfig), cfg_dict)  # typed access
    set_cpu_threads(cfg.launcher.threads_per_rank)
    import torch.distributed as dist

    from bench.guard import StopFlag, Watchdog

    stop = StopFlag()
    stop.install()
    init_process_group(ctx, cfg.trainer.dist_timeout_s)
    adapter = None
    watchdog = None
    try:
        if run_dir is None:
            run_dir = _agree_on_run_dir(cfg, ctx)
        record = RunRecord(run_dir) if ctx.rank == 0 else None

        def on_hang(idle: float) -> None:
            _record_rank_error(run_dir, ctx, cfg, "timeout", f"no progress for {idle:.0f}s (trainer.hang_timeout_s="
                               f"{cfg.trainer.hang_timeout_s}): a rank stopped calling collectives or hangs", "")

        watchdog = Watchdog(cfg.trainer.hang_timeout_s, on_hang).start()
        from bench.trainer import CONVENTIONS, Trainer

        torch.manual_seed(cfg.trainer.seed)
        workload = build_workload(cfg.workload, cfg.data)
        adapter = get_adapter_class(cfg.adapter.name)(cfg, workload, ctx)
        adapter.setup()
        watchdog.beat()
        trainer = Trainer(cfg, ctx, adapter, workload, record, stop, watchdog)
        summary = trainer.run()
        if record is not None:
            summary.update(run_id=run_dir.name, **identity(cfg, ctx.world_size), adapter_settings=adapter.describe(),
                           precision=cfg.trainer.precision, batch_policy=cfg.adapter.batch_policy,
                           warmup_steps=cfg.trainer.warmup_steps, launcher=ctx.launcher, conventions=CONVENTIONS,
                           frameworks_imported=sorted(m for m in HEAVY_FRAMEWORKS if m in sys.modules))
            record.write_summary(summary)
            _print_summary(summary)
        return 0
    except BaseException as e:  # record every failure, then let it end the rank
        if run_dir is not None:
            status = "oom" if _is_oom(e) else "failed"
            _record_rank_error(run_dir, ctx, cfg, status, f"{type(e).__name__}: {e}", traceback.format_exc())
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if adapter is not None:
            adapter.close()
        if dist.is_initialized():
            dist.destroy_process_group()


HEAVY_FRAMEWORKS = ("deepspeed", "megatron", "horovod", "torchgpipe")


def _record_rank_error(run_dir: Path, ctx: DistContext, cfg, status: str, message: str, tb: str) -> None:
    err = {"rank": ctx.rank, "status": status, "error": message.strip().splitlines()[0][:500] if message.strip() else status,
           "traceback": tb, "time": time.time()}
    record = RunRecord(run_dir)
    record.write_rank_error(ctx.rank, err)
    if ctx.launcher != "local" and ctx.rank == 0:  # no launcher process of ours to write the outcome
        record.write_summary({"status": status, "run_id": run_dir.name, "error": err["error"], "failed_rank": ctx.rank,
                              **identity(cfg, ctx.world_size)})


def _agree_on_run_dir(cfg: BenchConfig, ctx: DistContext) -> Path:
    import torch.distributed as dist

    box = [None]
    if ctx.rank == 0:
        run_dir = make_run_dir(cfg, ctx.world_size)
        RunRecord(run_dir).create(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
        RunRecord(run_dir).write_summary({"status": "running", "run_id": run_dir.name, **identity(cfg, ctx.world_size)})
        box = [str(run_dir)]
        print(f"run {run_dir}: {cfg.adapter.name} x {cfg.workload.name}, {ctx.world_size} rank(s) via {ctx.launcher}", flush=True)
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()


def _print_summary(s: dict) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    metric = ("val_accuracy", s.get("val_accuracy")) if s.get("val_accuracy") is not None else ("val_perplexity", s.get("val_perplexity"))
    rows = [
        ("status", s["status"]),
        ("run", s.get("run_id")),
        ("adapter x workload", f"{s.get('adapter')} x {s.get('workload')} on {s.get('world_size')} rank(s)"),
        ("global batch", s.get("global_batch")),
        ("epochs / steps", f"{s.get('epochs_completed')} / {s.get('steps')}"),
        ("step time (mean, after warm-up)", f"{fmt(s.get('step_time_mean_s'), '.4f')} s"),
        ("throughput", f"{fmt(s.get('samples_per_s'), '.1f')} samples/s, {fmt(s.get('tokens_per_s'), '.0f')} tokens/s"),
        ("epoch time (mean)", f"{fmt(s.get('epoch_time_mean_s'), '.2f')} s"),
        ("final train / val loss", f"{fmt(s.get('train_loss'), '.4f')} / {fmt(s.get('val_loss'), '.4f')}"),
        (metric[0], fmt(metric[1], ".4f")),
        ("peak memory per rank (max)", f"{fmt((s.get('peak_memory_max') or 0) / 2**20, '.0f')} MiB"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
