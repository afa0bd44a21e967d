"""Each adapter's config schema: Hydra's config-group schema pattern, one dataclass per adapter.

This module imports no framework (dataclasses and the base schema only), so Hydra can check a
config before any rank starts and before any framework is imported. Each schema is stored in the
ConfigStore as `adapter_<name>_schema` (no group: `--help` does not list it), and conf/adapter/<name>.yaml
names it first (`/adapter_<name>_schema@_here_`) in its
defaults list and holds only what differs from it. A key of another adapter
(`adapter=ddp adapter.stage=3`) is therefore refused by Hydra, naming the key.

Defaults are written here once; comments say where a value comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from ptbench.core.config import AdapterConfig


@dataclass
class DDPConfig(AdapterConfig):
    name: str = "ddp"
    bucket_cap_mb: float = 25.0  # torch DDP's default
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    sync_batchnorm: bool = False  # GPU only (SyncBatchNorm refuses CPU tensors)


@dataclass
class ZeroConfig(AdapterConfig):
    name: str = "zero"
    stage: int = 1  # 0-3; adapter=zero1..zero3 set it
    # None = DeepSpeed's own default (0.19: true at stage 3, false below); the value used is recorded
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    # elements; DeepSpeed's default 5e8 allocates ~2 GB per rank
    reduce_bucket_size: int = 5_000_000
    allgather_bucket_size: int = 5_000_000
    # stage 3: parameters with fewer elements stay whole on every rank (DeepSpeed's default 1e5); 0 = shard all
    param_persistence_threshold: int = 100_000
    offload_optimizer: bool = False  # GPU only
    offload_params: bool = False  # GPU only, stage 3


@dataclass
class FSDPConfig(AdapterConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True  # free each layer's gathered parameters after its forward (ZeRO-3 style)


@dataclass
class MegatronConfig(AdapterConfig):
    name: str = "megatron"
    batch_policy: str = "linear"  # the paper scales Megatron's global batch with the GPU count
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False  # needs tensor_parallel > 1
    schedule: str = "1f1b"  # megatron-core's pipeline schedule (pipeline_parallel > 1)
    microbatches: int = 0  # per replica batch; 0 = 1 without a pipeline, 4 x pipeline_parallel with one
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this x tensor_parallel (Megatron-LM)
    overlap_comm: bool = False  # GPU: overlap the gradient reduce with backward (Megatron DDP overlap_grad_reduce)
    reduce_bucket_size: int = 5_000_000  # elements per gradient bucket (Megatron DDP bucket_size)


@dataclass
class TensorParallelConfig(AdapterConfig):
    name: str = "tensor_parallel"
    # ranks per model replica; data-parallel replicas = ranks / tensor_parallel. batch_policy
    # per_device: trainer.batch_size per model replica (one TP group reads one batch)
    tensor_parallel: int = 2


@dataclass
class GPipeConfig(AdapterConfig):
    name: str = "gpipe"
    # the paper's policy: fixed micro-batch size (trainer.batch_size), micro-batches = 4 x partitions
    batch_policy: str = "per_microbatch"
    pipeline_parallel: int = 2  # partitions (devices driven by the one process)
    balance: list[int] | None = None  # layers per partition; None = torchgpipe's balance_by_time
    microbatches: int = 0  # chunks; 0 = 4 x partitions
    checkpoint: str = "except_last"  # always | except_last | never
    deferred_batch_norm: bool = True  # BatchNorm running statistics once per mini-batch


@dataclass
class PipelineConfig(AdapterConfig):
    name: str = "pipeline"
    batch_policy: str = "fixed"  # trainer.batch_size is the global mini-batch (PipeDream's fixed mini-batch)
    schedule: str = "1f1b"  # gpipe | 1f1b (PipeDream-Flush) | interleaved_1f1b
    pipeline_parallel: int = 0  # ranks per pipeline; 0 = every rank (no data parallelism)
    balance: list[int] | None = None  # layers per stage; None = an even split by layer count
    microbatches: int = 0  # 0 = 4 x pipeline ranks


@dataclass
class PipedreamConfig(AdapterConfig):
    name: str = "pipedream"
    batch_policy: str = "fixed"  # the paper's policy: trainer.batch_size is the mini-batch, whatever the stage count
    schedule: str = "pipedream"  # pipedream (weight stashing, SOSP 2019) | 2bw (PipeDream-2BW, ICML 2021)
    pipeline_parallel: int = 0  # stages; 0 = every rank (one stage per rank, no stage replication)
    balance: list[int] | None = None  # layers per stage; None = an even split by layer count
    microbatches: int = 0  # per mini-batch; 0 = 1 for pipedream (whole mini-batches), the stage count for 2bw
    flush_every: int = 0  # drain the pipeline every K mini-batches; 0 = only at each epoch's end


@dataclass
class HorovodConfig(AdapterConfig):
    name: str = "horovod"
    # Horovod 0.28.1's own defaults, written out (older releases used 64 MB, 5 ms) and recorded as read
    fusion_threshold_mb: float = 128.0  # HOROVOD_FUSION_THRESHOLD; 0 = no tensor fusion
    cycle_time_ms: float = 1.0  # HOROVOD_CYCLE_TIME
    compression: str = "none"  # none | fp16 (gradients cast to fp16 for the all-reduce)
    backward_passes_per_step: int = 1  # conf/adapter/horovod.yaml ties it to trainer.grad_accum


SCHEMAS: dict[str, type[AdapterConfig]] = {
    "ddp": DDPConfig,
    "zero": ZeroConfig,
    "fsdp": FSDPConfig,
    "megatron": MegatronConfig,
    "tensor_parallel": TensorParallelConfig,
    "gpipe": GPipeConfig,
    "pipeline": PipelineConfig,
    "pipedream": PipedreamConfig,
    "horovod": HorovodConfig,
}


def store_schemas(cs: ConfigStore) -> None:
    for name, schema in SCHEMAS.items():
        # outside the `adapter` group, so `--help` lists only adapters a user can choose
        cs.store(name=f"adapter_{name}_schema", node=schema)
