"""One dry-run point: the run plan at W with a real run's checks, then rank R's own setup and 2 training steps
on the fake world (standins.py), measured (measure.py) and set beside the models (compare.py)."""

from __future__ import annotations

import time

import torch

from ptbench.core.errors import ConfigError

STEPS = 2  # the first makes the optimizer state; the second is a steady step (the one compared)

# adapters whose framework cannot run under FakeTensorMode on the fake backend, and why (measured on torch 2.14.1)
CANNOT_RUN = {
    "pipedream": "an asynchronous pipeline without flush: in 2 steps rank 0 only fills the pipeline (2 sends, no "
    "optimizer step; measured at W=4), so there is no steady step to compare",
    "gpipe": "torchgpipe drives several devices from one process; a dry run is one process per rank",
    "horovod": "Horovod runs its own runtime and collectives, not torch.distributed: the fake backend is not its",
}


def plan_at(overrides: list[str], world_size: int):
    """(cfg, plan) at `world_size` with every check of a real run: layout, batch policy, refusals (one line)."""
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import plan_run

    cfg = typed(compose([*overrides, f"launcher.nprocs={world_size}"]))
    if cfg.adapter.name in CANNOT_RUN:  # before the plan, whose refusal would name another cause
        raise ConfigError(f"adapter={cfg.adapter.name} cannot run on the fake backend: {CANNOT_RUN[cfg.adapter.name]}")
    plan, _ = plan_run(cfg, "dryrun", world_size, check=True, refuse=False, backend="fake")
    if plan.world_size != world_size:
        raise ConfigError(
            f"adapter={cfg.adapter.name} drives {plan.devices_per_process} devices from each process: a dry run "
            "is one process per rank"
        )
    return cfg, plan


def dry_run(overrides: list[str], world_size: int, rank: int = 0) -> dict:
    """Rank `rank` of `world_size` for 2 steps on the fake world: {plan, ledger per step, memory, standins,
    seconds}. Raises ConfigError (one line) for what the plan refuses or the fake world cannot run."""
    t0 = time.perf_counter()
    cfg, plan = plan_at(overrides, world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} is not a rank of {world_size}")
    from ptbench.scale.measure import CollectiveLedger, fake_mode, step_start_hook, tracker_snapshot
    from ptbench.scale.standins import fake_world, patched

    used: set[str] = set()
    ledger = CollectiveLedger()
    with fake_world(world_size, rank), patched(used, cfg.adapter.name), fake_mode():
        adapter, workload = _build(cfg, plan, rank, world_size)
        tracker = _tracker(adapter)
        step_start: dict = {}
        optimizer = torch_optimizer(adapter)
        hook = step_start_hook(tracker, optimizer, step_start) if optimizer is not None else None
        x, y = workload.example_batch(plan.local_batch, adapter.device)
        micro = [(x, y)] * cfg.trainer.grad_accum
        from ptbench.core.timing import PhaseTimer

        timer = PhaseTimer()
        with tracker:
            for _ in range(STEPS):
                ledger.new_step()
                with ledger:
                    timer.start_step()
                    adapter.train_step(micro, timer)
                    timer.end_step()
                tracker.reset_mod_stats()  # per-module stats of one step (FSDPMemTracker refuses a second)
        memory = tracker_snapshot(tracker, step_start if hook is not None else None)
        root = _root_shapes(adapter)
        state = _local_state(adapter)
        settings = _settings(adapter)
        adapter.close()
    return dict(
        cfg=cfg,
        plan=plan,
        rank=rank,
        ledger=[ledger.rows(i) for i in range(STEPS)],
        unknown_ops=sorted(ledger.unknown),
        memory=memory,
        state_bytes=state,
        adapter_settings=settings,
        standins=sorted(used),
        root_shapes=root,
        seconds=time.perf_counter() - t0,
    )


def _build(cfg, plan, rank: int, world_size: int):
    """The workload and the adapter exactly as a rank builds them (bench/runner/rank.py), on the fake world."""
    from ptbench.core.dist import DistContext
    from ptbench.workloads import build_workload

    torch.manual_seed(cfg.trainer.seed)
    workload = build_workload(cfg.workload, cfg.data)
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, backend="fake")
    adapter = plan.adapter_cls(cfg, workload, ctx)
    try:
        adapter.setup()
    except Exception as e:  # noqa: BLE001 - one line: the framework cannot run on the fake backend
        raise ConfigError(f"adapter={cfg.adapter.name} cannot run on the fake backend: {_first_line(e)}") from e
    return adapter, workload


def _tracker(adapter):
    """FSDPMemTracker for a fully_shard model (its categories: sharded / unsharded, all-gather buffers), else
    MemTracker over the adapter's modules and optimizer."""
    from torch.distributed.fsdp import FSDPModule

    from ptbench.scale.measure import tracker_class

    model = getattr(adapter, "model", None)
    optimizer = torch_optimizer(adapter)
    if isinstance(model, FSDPModule):
        # FSDP2's lazy init (else in the first forward) re-allocates a padded shard (a rank whose dim-0 chunk is
        # short); done first, the tracker sees those shards as sharded parameters, not as the forward's tensors
        model._get_fsdp_state()._lazy_init()
        return tracker_class(True)(model, optimizer)
    tracker = tracker_class(False)()
    tracker.track_external(*adapter.modules(), *([optimizer] if optimizer is not None else []))
    return tracker


def torch_optimizer(adapter):
    """The torch optimizer that holds the adapter's optimizer state: its own, or the one a framework's wraps
    (DeepSpeed's ZeRO optimizers keep torch's in `.optimizer`); None when there is none."""
    optimizer = getattr(adapter, "optimizer", None)
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


def _root_shapes(adapter) -> list[tuple] | None:
    """The parameter shapes of an FSDP2 root unit (those no shard unit owns; `adapter.units`), else None."""
    units = getattr(adapter, "units", None)
    if units is None or not hasattr(adapter, "model"):
        return None
    owned = {id(p) for u in units for p in u.parameters()}
    return [tuple(p.shape) for p in adapter.model.parameters() if id(p) not in owned]


def _local_state(adapter) -> dict:
    try:
        return {k: int(v) for k, v in adapter.state_bytes().items()}
    except Exception as e:  # noqa: BLE001 - a state count the fake world cannot make is stated, not fatal
        return {"error": _first_line(e)}


def _settings(adapter) -> dict:
    """The adapter's settings as a real run records them (`Adapter.describe`, read while the framework is up)."""
    try:
        return adapter.describe()
    except Exception as e:  # noqa: BLE001 - a setting the fake world cannot read is stated, not fatal
        return {"error": _first_line(e)}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
