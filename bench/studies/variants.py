"""Which adapter variants the studies run: one table, and each study a selection of its rows.

A row is the overrides that make the variant; `{n}` stands for the run's rank count where the layout follows
it (tensor parallel over all ranks, a partition per rank). What a study runs the variant with (rank count,
batch size, steps, workload) is the study's own, beside its selection: ptbench.studies.ledger (LEDGER_RUNS),
ptbench.studies.memory_ledger (ADAPTERS), ptbench.studies.memory_points (the memory study's variants).
"""

from __future__ import annotations

VARIANTS: dict[str, tuple[str, ...]] = {
    "ddp": ("adapter=ddp",),
    "zero0": ("adapter=zero", "adapter.stage=0"),
    "zero1": ("adapter=zero", "adapter.stage=1"),
    "zero2": ("adapter=zero", "adapter.stage=2"),
    "zero3": ("adapter=zero", "adapter.stage=3"),
    # every parameter sharded: DeepSpeed's default keeps tensors under 1e5 elements whole on every rank, which on
    # the tiny CPU models is nearly all of them (the memory study compares the bytes with the Ψ/N formulas)
    "zero3-all": ("adapter=zero", "adapter.stage=3", "adapter.param_persistence_threshold=0"),
    "fsdp": ("adapter=fsdp",),
    "tensor_parallel": ("adapter=tensor_parallel", "adapter.tensor_parallel={n}"),
    "megatron": ("adapter=megatron", "adapter.tensor_parallel={n}"),
    "megatron-sp": ("adapter=megatron", "adapter.tensor_parallel={n}", "adapter.sequence_parallel=true"),
    "megatron-pp": ("adapter=megatron", "adapter.pipeline_parallel={n}"),
    "megatron-tp2pp2": ("adapter=megatron", "adapter.tensor_parallel=2", "adapter.pipeline_parallel=2"),
    "megatron-tp2pp2-sp": (
        "adapter=megatron",
        "adapter.tensor_parallel=2",
        "adapter.pipeline_parallel=2",
        "adapter.sequence_parallel=true",
    ),
    # a stage per rank; 4 micro-batches
    "pipeline": ("adapter=pipeline", "adapter.microbatches=4"),
    # a stage per rank; the default micro-batches (4 x stages)
    "pipeline-1f1b": ("adapter=pipeline", "adapter.schedule=1f1b"),
    # one process driving {n} partitions (adapters/gpipe.py: launcher.nprocs does not apply)
    "gpipe": ("adapter=gpipe", "adapter.pipeline_parallel={n}", "adapter.microbatches=4"),
    "horovod": ("adapter=horovod",),
}


def overrides(name: str, ranks: int = 2) -> list[str]:
    """The overrides of row `name` at `ranks` ranks."""
    if name not in VARIANTS:
        raise KeyError(f"no variant {name!r} in ptbench.studies.variants; known: {', '.join(VARIANTS)}")
    return [o.replace("{n}", str(ranks)) for o in VARIANTS[name]]
