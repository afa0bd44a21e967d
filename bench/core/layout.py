"""How a run is laid out over devices, and what its adapter tells the cost models: two frozen records.

Each adapter returns both from one class method each (`Adapter.layout(cfg, world_size)`,
`Adapter.cost_inputs(cfg)`); the run plan carries them and the summary records the layout, so the
memory model (core/memory_model/), the communication volume (core/comm_volume.py) and analysis
read numbers, never adapter names. A new adapter states its own and touches no other module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ptbench.core.errors import ConfigError

# how the model states (parameters, gradients, optimizer state) are split over the data-parallel ranks
SHARDING = ("none", "distributed_optimizer", "zero0", "zero1", "zero2", "zero3", "fsdp")
RECOMPUTE = ("never", "except_last", "always")
SCHEDULES = ("none", "1f1b", "interleaved_1f1b", "gpipe")
# weight versions an asynchronous pipeline keeps beside the live weights (memory_model.stash_copies):
# weight_stashing (PipeDream: stage s of p keeps ceil((p-1-s)/m)), double_buffered (PipeDream-2BW: one per stage)
WEIGHT_STASH = ("none", "weight_stashing", "double_buffered")
# the attention kernel a language model calls: torch's scaled_dot_product_attention, Transformer Engine's fused
# attention, or one that keeps the [b, a, s, s] scores (memory_model.attention_keeps_scores reads it)
ATTENTION = ("sdpa", "te", "unfused")


@dataclass(frozen=True)
class Layout:
    """Processes, devices and the parallel dimensions of one run.

    dp x tp x pp = devices = world_size x devices_per_process: every device holds one (tp, pp) shard of
    one data-parallel replica. GPipe is one process driving pp devices (world_size 1, dp 1)."""

    world_size: int  # processes
    dp: int  # model replicas reading different data
    tp: int = 1  # tensor-parallel ranks per replica
    pp: int = 1  # pipeline stages (ranks or devices) per replica
    devices_per_process: int = 1
    microbatches: int = 1  # a replica's batch is cut into these inside one train_step (pipelines)

    def __post_init__(self) -> None:
        for key in ("world_size", "dp", "tp", "pp", "devices_per_process", "microbatches"):
            val = getattr(self, key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(
                    f"layout: {key}={val!r} must be an integer >= 1; check launcher.nprocs and the "
                    "adapter's parallel sizes"
                )
        if self.dp * self.tp * self.pp != self.devices:
            raise ConfigError(
                f"layout: dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.dp * self.tp * self.pp} "
                f"does not equal the {self.devices} device(s) ({self.world_size} process(es) x "
                f"{self.devices_per_process}); make launcher.nprocs a multiple of the adapter's "
                "tensor/pipeline sizes"
            )

    @property
    def devices(self) -> int:
        return self.world_size * self.devices_per_process

    def as_dict(self) -> dict:
        return {**asdict(self), "devices": self.devices}


@dataclass(frozen=True)
class CostInputs:
    """What an adapter's framework does that the memory and communication models cannot see in the layout."""

    sharding: str = "none"  # SHARDING; distributed_optimizer: Megatron's, optimizer state over dp on CUDA only
    half_states: bool = False  # bf16/fp16: parameters and gradients held in 2 bytes (DeepSpeed's bf16/fp16 mode)
    half_gather: bool = False  # bf16/fp16: parameters gathered in 2 bytes (DeepSpeed, FSDP2's param_dtype)
    half_activation_comm: bool = False  # bf16/fp16: tensor/pipeline-parallel activations sent in 2 bytes
    reshard_after_forward: bool = True  # zero3 / fsdp: parameters gathered again in backward
    padded_vocab: int = 0  # the vocabulary the model really holds (Megatron pads it); 0: the workload's
    schedule: str = "none"  # SCHEDULES: the pipeline schedule (what micro-batches stay alive)
    recompute: str = "never"  # RECOMPUTE: activation checkpointing of pipeline stages (torchgpipe's modes)
    sequence_parallel: bool = False
    attention: str = "sdpa"  # ATTENTION: the harness GPT-2 calls torch's SDPA (recorded; unread for vision)
    fusion_buffer_bytes: int = 0  # a gradient fusion buffer of up to this size (Horovod)
    grad_sync_phase: str = "backward"  # the timed phase the gradient all-reduce's exposed part shows in
    step_phase: str | None = None  # one timed phase holding every collective of the step (a pipeline schedule)
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state and fp32 master in host memory (zero1-3)
    offload_params: bool = False  # ZeRO-Infinity style: stage 3 parameters in host memory, gathered per unit
    # what the framework moves beside the papers' formulas (comm_volume.corrected; measured by ptbench.studies.ledger):
    grad_bucket_all_reduce: bool = False  # sharded gradients all-reduced in buckets, not reduce-scattered
    # stage 3: a model below this many parameters (DeepSpeed's stage3_max_reuse_distance) keeps them gathered for
    # backward; 0: re-gathered
    live_params_limit: int = 0
    vocab_parallel_loss: bool = False  # TP: embedding output, output-layer input grad and the loss all-reduced
    tied_embedding_stages: bool = False  # first and last pipeline stage share the tied embedding (grads all-reduced)
    root_unit_gathered: bool = False  # the root shard unit is not resharded after forward (no backward re-gather)
    # stage 3: DeepSpeed's stage3_param_persistence_threshold and stage3_prefetch_bucket_size (elements) as the
    # adapter passes them (stage3_max_reuse_distance is live_params_limit); None: not stated
    param_persistence_threshold: int | None = None
    prefetch_bucket_size: int | None = None
    stage_balance: tuple[int, ...] | None = None  # layers per pipeline stage as the adapter splits; None: even
    # fsdp under bf16/fp16: BatchNorm parameters kept whole on every rank (ignored_params), their gradients
    # all-reduced once a step
    whole_norm_params: bool = False
    weight_stash: str = "none"  # WEIGHT_STASH: the extra weight versions each pipeline stage keeps
    flush_every: int = 0  # an asynchronous pipeline drains every this many mini-batches (0: only at epoch ends)
    # parameter elements of each layer of the pipeline's sequential form, a tied copy left out (it is not
    # stashed): what one stashed version of a stage holds; None: not stated (the stash is then taken as Ψ/p)
    layer_params: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for key, val, allowed in (
            ("sharding", self.sharding, SHARDING),
            ("recompute", self.recompute, RECOMPUTE),
            ("schedule", self.schedule, SCHEDULES),
            ("attention", self.attention, ATTENTION),
            ("weight_stash", self.weight_stash, WEIGHT_STASH),
        ):
            if val not in allowed:
                raise ConfigError(f"cost inputs: {key}={val!r} is not one of {', '.join(allowed)}")
        if self.padded_vocab < 0 or self.fusion_buffer_bytes < 0 or self.flush_every < 0:
            raise ConfigError("cost inputs: padded_vocab, fusion_buffer_bytes and flush_every must be >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


def padded_elements(shapes, n: int) -> int:
    """Elements of `shapes` with each tensor's dim 0 padded to a multiple of n: what FSDP2 all-gathers and
    reduce-scatters (torch/distributed/fsdp/_fully_shard/_fsdp_param.py pads dim 0 to the world size so that
    every rank's chunk has one size; a 0-d tensor counts as one row)."""
    total = 0
    for s in shapes:
        rows = s[0] if len(s) else 1
        rest = math.prod(s[1:]) if len(s) > 1 else 1
        total += math.ceil(rows / n) * n * rest
    return total
