"""The run plan: everything about a point that is known before any rank starts, computed once.

`make_plan` runs every check (generic, workload, adapter, data, results folder) and returns a
`RunPlan` that the launcher, every rank and the trainer share: the adapter class, its layout and cost
inputs (ptbench.core.layout), local and global batch, the point id and the workload's facts. The
record's identity fields come from here, so every summary (running, failed, ok) names a run alike.
`plan_run` adds the predictions (memory, comm volume) over one meta model: what the launcher records, what
`python -m ptbench --plan` prints, and what a rank started by an adapter's own launcher records.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from ptbench.adapters import get_adapter_class
from ptbench.core.config import BenchConfig
from ptbench.core.dist import default_backend
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.memory_model import ModelFacts
from ptbench.core.records import new_run_id, results_folder
from ptbench.runner.checks import check_config, check_devices, check_results_dir, rank_cpus, start_method
from ptbench.workloads import build_workload


@dataclass(frozen=True)
class RunPlan:
    adapter: str
    workload: str
    kind: str  # vision | language
    experiment: str
    point: str | None  # sweep point id (bench/runner/points.py): what --resume matches
    environment: str  # what starts the ranks: local | torchrun | slurm | horovodrun ...
    layout: Layout  # processes, devices, dp x tp x pp, micro-batches (the adapter's `layout`)
    cost: CostInputs  # what the memory and communication models need beyond the layout (`cost_inputs`)
    local_batch: int  # samples one replica loads per micro-step
    grad_accum: int
    batch_policy: str
    precision: str
    tokens_per_sample: int
    train_flops_per_sample: float
    adapter_cls: type = field(repr=False, compare=False)
    # the model's facts (Ψ, shapes, dimensions), counted once per launch from its meta-device build: what the
    # memory model and the comm volume both read (None: not counted, e.g. in a rank; each model counts them)
    facts: ModelFacts | None = field(default=None, repr=False, compare=False)
    # bench/core/memory_model's prediction for this run (launcher=local computes it before launch)
    predicted_memory: dict | None = field(default=None, repr=False, compare=False)
    # bench/core/comm_volume/'s bytes per optimizer step per rank (the launcher computes it before the
    # ranks start, for every launcher); recorded as `comm_volume`
    comm_volume: dict | None = field(default=None, repr=False, compare=False)
    # launcher=local: how the ranks were started (spawn | fork, ptbench.runner.checks.start_method); None
    # when another launcher (torchrun, srun, horovodrun) started them
    start_method: str | None = field(default=None, compare=False)
    # launcher=local: what makes this run's times suspect, found before launch (checks.contention_warnings);
    # recorded first in the summary's `warnings`
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # launcher=local with launcher.cpu_bind=cores: the CPUs each local rank is bound to (checks.rank_cpus);
    # None: not bound by us (cpu_bind=none, or ranks another launcher started)
    rank_cpus: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False)

    # the layout's numbers under the names the launcher, ranks and trainer use
    @property
    def world_size(self) -> int:
        return self.layout.world_size  # processes

    @property
    def devices_per_process(self) -> int:
        return self.layout.devices_per_process  # GPipe drives several devices from one process

    @property
    def dp_size(self) -> int:
        return self.layout.dp  # model replicas reading different data

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches  # per replica batch, inside one train_step (pipelines); 1 otherwise

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.grad_accum * self.dp_size

    def identity(self) -> dict:
        """The fields every summary of this run carries, whatever its status."""
        return {
            "experiment": self.experiment,
            "point": self.point,
            "adapter": self.adapter,
            "workload": self.workload,
            "world_size": self.world_size,
            "devices": self.devices,
        }

    def describe(self) -> dict:
        """The plan as the record states it (`summary["plan"]`): `layout` and `cost` as dicts, and the
        layout's numbers also under the plan's own names."""
        d = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("adapter_cls", "facts", "predicted_memory", "comm_volume", "layout", "cost")
        }
        d.update(
            layout=self.layout.as_dict(),
            cost=self.cost.as_dict(),
            world_size=self.world_size,
            devices_per_process=self.devices_per_process,
            dp_size=self.dp_size,
            microbatches=self.microbatches,
            devices=self.devices,
            global_batch=self.global_batch,
        )
        return d


def make_plan(
    cfg: BenchConfig, environment: str, world_size: int | None = None, check: bool = True, workload=None
) -> RunPlan:
    """The plan of `cfg` on `world_size` processes (None: as many as the adapter launches).

    check=True runs every check first; ranks started by the launcher (which checked) pass False."""
    cls = get_adapter_class(cfg.adapter.name)
    world = world_size if world_size is not None else cls.processes(cfg)
    if check:
        check_config(cfg)
    workload = workload or build_workload(cfg.workload, cfg.data)  # the launcher's own, built once
    if check:
        cls.validate(cfg, world)
    layout = cls.layout(cfg, world)  # validated once (ConfigError on dp x tp x pp != devices)
    local = cls.local_batch_size(cfg, world)  # raises on a batch the layout cannot split
    if check:
        workload.check_data()
        check_results_dir(Path(cfg.results.dir or cfg.results.root))
    return RunPlan(
        adapter=cfg.adapter.name,
        workload=cfg.workload.name,
        kind=cfg.workload.kind,
        experiment=cfg.results.experiment,
        point=cfg.results.point,
        environment=environment,
        layout=layout,
        cost=cls.cost_inputs(cfg),
        local_batch=local,
        grad_accum=cfg.trainer.grad_accum,
        batch_policy=cfg.adapter.batch_policy,
        precision=cfg.trainer.precision,
        tokens_per_sample=workload.tokens_per_sample(),
        train_flops_per_sample=workload.train_flops_per_sample(),
        adapter_cls=cls,
    )


def run_dir_of(cfg: BenchConfig, plan: RunPlan) -> Path:
    run_id = cfg.results.run_id or new_run_id(plan.adapter, plan.workload, plan.world_size)
    return results_folder(cfg.results) / run_id


# --- the plan with its predictions (memory, comm volume): the launcher's, `--plan`'s and a rank's ----------
def plan_run(
    cfg: BenchConfig,
    environment: str,
    world_size: int | None = None,
    *,
    check: bool = True,
    memory: bool = True,
    refuse: bool | None = None,
    backend: str | None = "auto",
    on_host: int | None = None,
    quiet: bool = False,
) -> tuple[RunPlan, dict | None]:
    """The plan of one launch with its predictions: what `launch` runs and `python -m ptbench --plan` prints,
    from this one function so the two cannot drift.

    `make_plan` (every check when `check`; environment local: the devices and the start method too), then the
    workload's model built ONCE on the meta device for both the memory prediction (`memory`; `refuse`: refuse
    a run that does not fit, None = trainer.memory_check) and the comm volume at `backend` ("auto": the launcher's
    choice; None: not computed). `on_host`: the ranks sharing this host (default: all); `quiet`: a rank that
    neither warns nor names a refusal (rank 0 does), it only ends. Returns the plan carrying both as record
    fields, and the memory model's full prediction (its formulas, for a table; None when not predicted or when
    the model failed)."""
    from ptbench.workloads import build_workload

    workload = build_workload(cfg.workload, cfg.data)
    plan = make_plan(cfg, environment, world_size, check=check, workload=workload)
    if environment == "local":
        import torch

        cuda = torch.cuda.is_available()
        if cuda and check:
            check_devices(plan.world_size, plan.devices_per_process, torch.cuda.device_count())
        plan = dataclasses.replace(
            plan,
            start_method=start_method(cfg.launcher.start_method, cuda),
            rank_cpus=rank_cpus(cfg.launcher.cpu_bind, plan.world_size),
        )
    if not memory and backend is None:
        return plan, None
    model = meta_model(workload)
    if not isinstance(model, Exception):  # the model's facts, counted once for both predictions
        from ptbench.core.memory_model import run_facts

        plan = dataclasses.replace(plan, facts=run_facts(cfg.workload, plan.cost, model))
    prediction = None
    if memory:
        record, prediction = predicted_memory(cfg, plan, model, refuse, on_host, quiet)
        plan = dataclasses.replace(plan, predicted_memory=record)
    if backend is not None:
        volume = comm_volume(cfg, plan, default_backend(cfg.launcher.backend if backend == "auto" else backend), model)
        plan = dataclasses.replace(plan, comm_volume=volume)
    return plan, prediction


def meta_model(workload):
    """The workload's model on the meta device (shapes only, nothing allocated), built once per launch for
    both predictions; the exception instead when it cannot be built (each prediction then records it)."""
    import torch

    try:
        with torch.device("meta"):
            return workload.build_model()
    except Exception as e:  # noqa: BLE001 - the predictions must never stop a run they cannot model
        return e


def _builder(model):
    """The no-argument model callable the memory and volume models take, over the one meta model."""

    def build():
        if isinstance(model, Exception):
            raise model
        return model

    return build


def predicted_memory(
    cfg, plan: RunPlan, model, refuse: bool | None = None, on_host: int | None = None, quiet: bool = False
) -> tuple[dict, dict | None]:
    """(record field, full prediction) of the memory model (bench/core/memory_model/, as its `plan_memory`):
    a run predicted not to fit the device is refused here, before launch, or warned about in one line with the
    numbers (`refuse` True / False = refuse / say nothing; None: trainer.memory_check, default warn). A
    prediction that fails otherwise is recorded, not fatal."""
    from ptbench.core.memory_model import check_fits, device_bytes, fits, memory_warning, predict_run, record_fields

    try:
        pred = predict_run(cfg, plan, _builder(model))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the prediction must never stop a run it cannot model
        return {"error": f"{type(e).__name__}: {e}"}, None
    cap, what = device_bytes(on_host or plan.world_size)
    mode = cfg.trainer.memory_check if refuse is None else ("refuse" if refuse else "off")
    if mode == "refuse":
        try:
            check_fits(pred, cap, what)
        except ConfigError:
            if quiet:
                raise SystemExit(2) from None
            raise
    elif mode == "warn" and not fits(pred["total"], cap) and not quiet:
        # flushed: under srun the batch log interleaves the ranks' output, this line must come before theirs
        print(memory_warning(pred, cap, what), file=sys.stderr, flush=True)
    record = {
        **record_fields(pred),
        "device_bytes": None if cap is None else int(cap),
        "device": what,
        "fits": fits(pred["total"], cap),
        "check": mode,  # trainer.memory_check as applied
    }
    return record, pred


def comm_volume(cfg, plan: RunPlan, backend: str, model=None) -> dict:
    """Bytes per optimizer step per rank by collective (bench/core/comm_volume/), with the backend the
    ranks use, so the report can set them against `python -m ptbench.comm` at that backend. `model`: the
    launch's meta model (None: built here). Never fatal."""
    from ptbench.core.comm_volume import record_fields, volume_run

    try:
        if model is None:
            from ptbench.workloads import build_workload

            model = meta_model(build_workload(cfg.workload, cfg.data))
        return record_fields(volume_run(cfg, plan, _builder(model)), backend)
    except Exception as e:  # noqa: BLE001 - a volume the model cannot compute must never stop a run
        return {"error": f"{type(e).__name__}: {e}", "backend": backend}
