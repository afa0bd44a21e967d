"""DeepSpeed ZeRO stages 0-3: `deepspeed.initialize` around the workload's model and optimizer.

The diff from a single-process loop, as in DeepSpeed's quickstart: build a config dict, call
`deepspeed.initialize(model, optimizer, config)`, then `engine(x)`, `engine.backward(loss)`,
`engine.step()` per micro-batch (the engine counts micro-batches and steps the optimizer at the
accumulation boundary, scaling the loss by 1/accumulation itself).

Settings that DeepSpeed would otherwise choose for us are always written out, because its
defaults changed across versions and change results: `gradient_clipping` (now 1.0 by default)
comes from trainer.grad_clip, 0 meaning off; bucket sizes come from the adapter config (the
default 5e8 elements allocates ~2 GB per rank).

deepspeed is imported only inside this module's functions, so validation in the parent stays cheap.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from ptbench.adapters.base import Adapter, Batch, local_tensor
from ptbench.core.config import BenchConfig
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs
from ptbench.core.optim import LAYERWISE, build_optimizer
from ptbench.core.precision import HALF_DTYPES
from ptbench.core.timing import PhaseTimer

# LAYERWISE (bench/core/optim.py): DeepSpeed hands the optimizer flat partitions under ZeRO >= 1 and
# under its bf16/fp16 optimizers, so a LAMB/LARS trust ratio would be computed over arbitrary slices.


def deepspeed_config(cfg: BenchConfig, micro_batch: int, cuda: bool) -> dict:
    """The DeepSpeed config dict for this run (pure function: tested on CPU for GPU-only settings)."""
    a, t = cfg.adapter, cfg.trainer
    zero: dict = {
        "stage": a.stage,
        "contiguous_gradients": a.contiguous_gradients,
        "reduce_bucket_size": a.reduce_bucket_size,
        "allgather_bucket_size": a.allgather_bucket_size,
    }
    if a.overlap_comm is not None:  # else DeepSpeed's default for the stage (recorded from the engine)
        zero["overlap_comm"] = a.overlap_comm
    if a.stage == 3:
        # stage 3 has its own prefetch bucket (default 5e7 elements): bound it by the same knob
        zero["stage3_prefetch_bucket_size"] = a.allgather_bucket_size
        zero["stage3_param_persistence_threshold"] = a.param_persistence_threshold
    if a.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if a.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": float(t.grad_clip),  # explicit: DeepSpeed's default clips at 1.0
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 16},
        # torch SGD is not on DeepSpeed's list of tested ZeRO optimizers; its update is elementwise, so
        # it is correct on a flat partition (unlike LAMB/LARS, refused in validate)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and synchronizes the device twice per micro-batch
        # (start and stop) from the first step: off, the harness times every adapter itself
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if a.offload_optimizer:
        o = cfg.optimizer
        if o.name in ("adam", "adamw"):
            # offloaded partitions are stepped on the CPU by DeepSpeed's C++ Adam; adam_w_mode must be
            # explicit: DeepSpeed's "Adam" means AdamW unless told otherwise
            config["optimizer"] = {
                "type": "Adam",
                "params": {
                    "lr": o.lr,
                    "betas": list(o.betas),
                    "eps": o.eps,
                    "weight_decay": o.weight_decay,
                    "adam_w_mode": o.name == "adamw",
                },
            }
        else:
            config["zero_force_ds_cpu_optimizer"] = False  # torch SGD steps the CPU partition itself
    return config


class ZeroAdapter(Adapter):
    name = "zero"
    framework = "deepspeed"
    framework_module = "deepspeed"
    extra = "deepspeed"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward": "engine forward; stage 3 all-gathers each layer's parameters here (prefetched)",
        "backward": "engine.backward: stage 3 re-gathers parameters; gradients are reduced (stage 0-1: "
        "all-reduce, 2-3: reduce-scatter into partitions), overlapped per overlap_comm. DeepSpeed's own host "
        "syncs here: stages 1-2 with overlap_comm wait for the whole device at the end of backward "
        "(independent_gradient_partition_epilogue); stage 3 waits for its reduce stream there, and for the "
        "oldest reduce event when too many are in flight",
        "optimizer": "engine.step: clip, step the partition; stages 1-2 all-gather the updated parameters here. "
        "DeepSpeed's own host syncs here, every step: the gradient norm's validity (is_invalid_grad_norm, the "
        "bool of a device tensor: stage 0 in bf16, stages 1-2 in fp16 or with bf16 check_grad_overflow, "
        "DeepSpeed's default true, stage 3 always), and stages 1-2's overflow check in fp16 and bf16 (an "
        "all-reduced flag read with .item(); stage 3: fp16 only)",
    }
    checkpoint_format = "deepspeed engine.save_checkpoint/load_checkpoint"
    compile_how = "deepspeed engine.compile(backend=trainer.compile_backend)"
    # DeepSpeed flattens parameters into contiguous buffers: channels_last activations only
    channels_last_weights = False
    precision_semantics = "DeepSpeed bf16/fp16 mode: bf16/fp16 model weights and gradients, fp32 master partition"

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> None:
        # DeepSpeed's own engine.save_checkpoint / load_checkpoint (module states, every rank's ZeRO partitions
        # of the fp32 master and optimizer state, loss scaler), tag "deepspeed"
        return None

    @classmethod
    def compile_refusal(cls, cfg: BenchConfig) -> None:
        return None  # DeepSpeed's own engine.compile(backend): its ZeRO hooks kept out of the graphs

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig) -> CostInputs:
        # bf16/fp16 mode: 2-byte weights and gradients (gathered and reduced as such), an fp32 master
        # partition; stage 3 gathers parameters again in backward
        a = cfg.adapter
        return CostInputs(
            sharding=f"zero{a.stage}",
            half_states=True,
            half_gather=True,
            offload_optimizer=bool(a.offload_optimizer),
            offload_params=bool(a.offload_params),
            # DeepSpeed 0.19: zero_optimization.use_multi_rank_bucket_allreduce (default true) all-reduces ZeRO-1/2's
            # gradient buckets; stage3_max_reuse_distance (default 1e9 elements, not set here): a model within it
            # keeps the parameters gathered in forward for backward (no backward re-gather)
            grad_bucket_all_reduce=a.stage in (1, 2),
            live_params_limit=1_000_000_000 if a.stage == 3 else 0,
            # stage 3's own rules as passed to DeepSpeed (zero_config): the memory model's gathered parameters
            param_persistence_threshold=a.param_persistence_threshold if a.stage == 3 else None,
            prefetch_bucket_size=a.allgather_bucket_size if a.stage == 3 else None,
        )

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        a, cuda = cfg.adapter, torch.cuda.is_available()
        if a.stage not in (0, 1, 2, 3):
            raise ConfigError(f"adapter.stage={a.stage}: ZeRO stages are 0, 1, 2 or 3")
        if (a.offload_optimizer or a.offload_params) and not cuda:
            which = "adapter.offload_optimizer" if a.offload_optimizer else "adapter.offload_params"
            raise ConfigError(
                f"{which}=true moves state from GPU to CPU memory, but there is no GPU here; set it to false"
            )
        if a.offload_optimizer and a.stage == 0:
            raise ConfigError(
                "adapter.offload_optimizer=true needs a partitioned optimizer: set adapter.stage=1, 2 or 3"
            )
        if a.offload_params and a.stage != 3:
            raise ConfigError(
                f"adapter.offload_params=true needs partitioned parameters: set adapter.stage=3 (got {a.stage})"
            )
        if a.offload_optimizer and cfg.optimizer.name not in ("adam", "adamw", "sgd"):
            raise ConfigError(
                f"optimizer.name={cfg.optimizer.name} cannot run on offloaded partitions: use optimizer=adam, adamw or sgd"
            )
        if cfg.optimizer.name in LAYERWISE and (a.stage > 0 or cfg.trainer.precision != "fp32"):
            why = f"adapter.stage={a.stage}" if a.stage > 0 else f"trainer.precision={cfg.trainer.precision}"
            raise ConfigError(
                f"optimizer.name={cfg.optimizer.name}: its per-layer trust ratio needs whole parameter tensors, but with "
                f"{why} DeepSpeed steps flat partitions; use optimizer=adam, adamw or sgd (or adapter.stage=0 with fp32)"
            )
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(a, key) <= 0:
                raise ConfigError(f"adapter.{key}={getattr(a, key)} must be > 0 (elements per communication bucket)")
        if a.param_persistence_threshold < 0:
            raise ConfigError(
                f"adapter.param_persistence_threshold={a.param_persistence_threshold} must be >= 0 (0 = shard every parameter)"
            )

    # --- on each rank ----------------------------------------------------------------------------
    def setup(self) -> None:
        deepspeed = _import_deepspeed()
        cfg = self.cfg
        model = self.workload.build_model().to(self.device)
        micro = self.local_batch_size(cfg, self.ctx.world_size)
        self.ds_config = deepspeed_config(cfg, micro, self.ctx.is_cuda)
        # client optimizer: the same torch optimizer DDP uses, unless DeepSpeed's CPU Adam steps offloaded state
        optimizer = None if "optimizer" in self.ds_config else build_optimizer(model.parameters(), cfg.optimizer)
        # the process group is the spine's (gloo on CPU, nccl on GPU); DeepSpeed wraps it, never makes its own
        deepspeed.init_distributed(dist_backend=self.ctx.backend, dist_init_required=False)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model.parameters(),
            config=self.ds_config,
            dist_init_required=False,
        )
        if cfg.trainer.compile:
            self.engine.compile(backend=cfg.trainer.compile_backend)
        self.input_dtype = HALF_DTYPES.get(
            cfg.trainer.precision
        )  # DeepSpeed's bf16/fp16 modes hold half-precision weights
        self._probe_grads = True
        self._grad_bytes = (0, 0)  # (when the optimizer step begins, most at once during backward)

    def modules(self):
        return [self.engine.module]

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.input_dtype) if self.input_dtype is not None and x.is_floating_point() else x

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        # the first step of the run (a warm-up step) measures gradient memory; it does not change after
        probe = _GradientProbe(self.engine) if self._probe_grads else None
        for i, (x, y) in enumerate(micro_batches):
            with timer.phase("forward"):
                loss = self.workload.loss(self.engine(self._cast(x)), y)
            with timer.phase("backward"):
                self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps
            if probe is not None and i == n - 1:
                self._grad_bytes = probe.close()  # before step(), which frees the gradients
                self._probe_grads = False
            with timer.phase("optimizer"):
                self.engine.step()  # steps the optimizer only at the accumulation boundary
            total += loss.detach().float() / n
        return total

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        out = self.engine(self._cast(inputs))  # through the engine: stage 3 gathers parameters in its hooks
        return self.workload.eval_sums(out, targets, weight)

    # --- model-state accounting --------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, read from the engine's own tensors.

        params, optimizer (moments + DeepSpeed's fp32 master partition): held now, after a step.
        grads: gradient bytes held when the optimizer step begins (after the engine's post-backward
        reduction; step() frees them), read on the first step of the run. grads_peak_backward: the
        most held at once during that backward, in-flight full-size gradients included (ZeRO-1 holds
        every full gradient until its post-backward reduction; ZeRO-2/3 one tensor or bucket at a
        time). Communication buckets are buffers, not model state, and are left out of both.
        """
        state = _engine_state(self.engine)
        state["grads"], state["grads_peak_backward"] = self._grad_bytes
        return state

    def save_checkpoint(self, path) -> None:
        # a collective: every rank writes its partitions under PATH/deepspeed/
        self.engine.save_checkpoint(str(path), tag="deepspeed", save_latest=False)

    def checkpoint_safe_globals(self) -> list:
        # what DeepSpeed's optimizer-state files hold beside tensors (it loads them with weights_only=False)
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    def load_checkpoint(self, path) -> None:
        loaded, _ = self.engine.load_checkpoint(
            str(path), tag="deepspeed", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path}/deepspeed")

    def describe(self) -> dict:
        import deepspeed

        a = self.cfg.adapter
        return {
            "deepspeed": deepspeed.__version__,
            "stage": a.stage,
            "overlap_comm": self.engine.zero_overlap_comm(),  # as DeepSpeed resolved it
            "overlap_comm_source": "deepspeed default" if a.overlap_comm is None else "adapter.overlap_comm",
            "contiguous_gradients": a.contiguous_gradients,
            "reduce_bucket_size": a.reduce_bucket_size,
            "allgather_bucket_size": a.allgather_bucket_size,
            "offload_optimizer": a.offload_optimizer,
            "offload_params": a.offload_params,
            "gradient_clipping": self.ds_config["gradient_clipping"],
            # as the engine resolved them: no device synchronization of DeepSpeed's own in the timed steps
            "throughput_timer": self.engine.tput_timer.config.enabled,
            "wall_clock_breakdown": self.engine.wall_clock_breakdown(),
            "mixed_precision": {
                "bf16": "deepspeed bf16 (fp32 master)",
                "fp16": "deepspeed fp16 (loss scaling, fp32 master)",
            }.get(self.cfg.trainer.precision, "off (fp32)"),
            "optimizer": type(self.engine.basic_optimizer).__name__
            if hasattr(self.engine, "basic_optimizer")
            else None,
            "zero_optimizer": type(self.optimizer).__name__,
        }

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()


def _import_deepspeed():
    if not torch.cuda.is_available():
        # CPU: say which accelerator we mean (else DeepSpeed warns), and skip the shared-memory
        # all-reduce op, which DeepSpeed would JIT-compile for ~4 minutes at first use; gloo does the work
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def _tensors(obj):
    """Tensors in an attribute that may be a tensor, a list/tuple of them, or a dict of either."""
    if obj is None:
        return
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storages(tensors, exclude: frozenset = frozenset()) -> dict[int, int]:
    """{storage address: bytes} behind `tensors`: views into one flat buffer count once."""
    out: dict[int, int] = {}
    for t in tensors:
        t = local_tensor(t)
        if t.numel() == 0 or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            out[s.data_ptr()] = max(out.get(s.data_ptr(), 0), s.nbytes())
    return out


# Where DeepSpeed keeps each kind of state (attribute names of its optimizer wrappers, 0.19):
#   stage 1/2 DeepSpeedZeroOptimizer: parameters are views into `bit16_groups_flat`; fp32 master of this
#     rank's partition `single_partition_of_fp32_groups`; gradients in `grads_in_partition` (contiguous)
#     or per-parameter `.grad` / `.grad_accum`, listed in `averaged_gradients`
#   stage 3 DeepSpeedZeroOptimizer_Stage3: each parameter's partition `ds_tensor` (views into
#     `fp16_partitioned_groups_flat`); fp32 master `fp32_partitioned_groups_flat`; gradient partitions in
#     `grad_partitions_flat_buffer`
#   stage 0 with bf16: BF16_Optimizer, fp32 master `fp32_groups_flat_partition`, gradients
#     `fp32_groups_gradients_flat`; with fp16: FP16_Optimizer, master `fp32_groups_flat`
MASTER_ATTRS = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
    "fp32_groups_flat",
)
GRAD_ATTRS = (
    "grads_in_partition",
    "averaged_gradients",
    "all_grad_tensors",
    "grad_partitions_flat_buffer",
    "fp32_groups_gradients_flat",
)


def _param_storages(engine) -> dict[int, int]:
    tensors = []
    for p in engine.module.parameters():
        tensors.append(p.data)  # stage 3: empty unless persistent or currently gathered
        if torch.is_tensor(getattr(p, "ds_tensor", None)):
            tensors.append(p.ds_tensor)  # stage 3: this rank's partition
    return _storages(tensors)


def _engine_state(engine) -> dict[str, int]:
    """Parameter and optimizer bytes held now (after a step); gradients are read by `_gradient_bytes`."""
    params = _param_storages(engine)
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO/bf16 wrappers keep the torch optimizer inside
    state = [v for st in getattr(inner, "state", {}).values() for v in st.values() if torch.is_tensor(v)]
    master = [t for a in MASTER_ATTRS for t in _tensors(getattr(opt, a, None))]
    optimizer = _storages(state + master, exclude=frozenset(params))
    return {"params": sum(params.values()), "optimizer": sum(optimizer.values())}


def _comm_buffers(opt) -> frozenset:
    """Storages of the reduce buckets (`ipg_buckets[dtype].buffer`): gradients pass through them."""
    tensors = []
    for name, v in vars(opt).items():
        if "ipg_bucket" in name:
            values = v.values() if isinstance(v, dict) else [v]
            tensors += _tensors([getattr(b, "buffer", b) for b in values])
    return frozenset(_storages(tensors))


def _gradient_bytes(engine) -> int:
    """Gradient bytes held now, wherever the engine keeps them (buckets and parameters excluded)."""
    opt = engine.optimizer
    params = _param_storages(engine)
    tensors = [t for a in GRAD_ATTRS for t in _tensors(getattr(opt, a, None))]
    # stage 3 keeps a name-mangled map param id -> gradient partition (views into the flat buffer)
    tensors += _tensors(getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None))
    for p in engine.module.parameters():
        tensors += [t for t in (p.grad, getattr(p, "grad_accum", None)) if torch.is_tensor(t)]
    return sum(_storages(tensors, exclude=frozenset(params) | _comm_buffers(opt)).values())


class _GradientProbe:
    """Peak gradient bytes over one step's backward: read at every parameter's gradient hook.

    Costs O(parameters^2) tensor visits, so it runs on one step per epoch only.
    """

    def __init__(self, engine):
        self.engine = engine
        self.peak = 0
        self.handles = [
            p.register_post_accumulate_grad_hook(self._read) for p in engine.module.parameters() if p.requires_grad
        ]

    def _read(self, _param) -> None:
        self.peak = max(self.peak, _gradient_bytes(self.engine))

    def close(self) -> tuple[int, int]:
        """(bytes held now, after the engine's post-backward reduction; the peak during backward)."""
        for h in self.handles:
            h.remove()
        now = _gradient_bytes(self.engine)
        return now, max(self.peak, now)


ADAPTER = ZeroAdapter
