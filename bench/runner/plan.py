"""The run plan: everything about a point that is known before any rank starts, computed once.

`make_plan` runs every check (generic, workload, adapter, data, results folder) and returns a
`RunPlan` that the launcher, every rank and the trainer share: the adapter class, its layout and cost
inputs (ptbench.core.layout), local and global batch, the point id and the workload's facts. The
record's identity fields come from here, so every summary (running, failed, ok) names a run alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from ptbench.adapters import get_adapter_class
from ptbench.core.config import BenchConfig
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.memory_model import ModelFacts
from ptbench.core.records import new_run_id, results_folder
from ptbench.runner.checks import check_config, check_results_dir
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
    # bench/core/comm_volume.py's bytes per optimizer step per rank (the launcher computes it before the
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
