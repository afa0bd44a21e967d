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
from typing import Sequence

import torch

from adapters.base import Adapter, Batch, _nbytes
from bench.config import BenchConfig
from bench.errors import ConfigError
from bench.optim import build_optimizer
from bench.timing import PhaseTimer

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Optimizers whose update reads each parameter tensor whole (LAMB/LARS trust ratio = ||w|| / ||update||
# per layer). DeepSpeed hands the optimizer flat partitions under ZeRO >= 1 and under its bf16/fp16
# optimizers, so the ratio would be computed over arbitrary slices: a different algorithm.
LAYERWISE = ("lamb", "lars")


def deepspeed_config(cfg: BenchConfig, micro_batch: int, cuda: bool) -> dict:
    """The DeepSpeed config dict for this run (pure function: tested on CPU for GPU-only settings)."""
    a, t = cfg.adapter, cfg.trainer
    zero: dict = {
        "stage": a.stage,
        "overlap_comm": a.overlap_comm,
        "contiguous_gradients": a.contiguous_gradients,
        "reduce_bucket_size": a.reduce_bucket_size,
        "allgather_bucket_size": a.allgather_bucket_size,
    }
    if a.stage == 3:
        # stage 3 has its own prefetch bucket (default 5e7 elements): bound it by the same knob
        zero["stage3_prefetch_bucket_size"] = a.allgather_bucket_size
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
    }
    if a.offload_optimizer:
        o = cfg.optimizer
        if o.name in ("adam", "adamw"):
            # offloaded partitions are stepped on the CPU by DeepSpeed's C++ Adam; adam_w_mode must be
            # explicit: DeepSpeed's "Adam" means AdamW unless told otherwise
            config["optimizer"] = {"type": "Adam", "params": {
                "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                "adam_w_mode": o.name == "adamw"}}
        else:
            config["zero_force_ds_cpu_optimizer"] = False  # torch SGD steps the CPU partition itself
    return config


class ZeroAdapter(Adapter):
    name = "zero"
    framework = "deepspeed"

    @classmethod
    def validate(cls, cfg: BenchConfig, world_size: int) -> None:
        super().validate(cfg, world_size)
        a, cuda = cfg.adapter, torch.cuda.is_available()
        if a.stage not in (0, 1, 2, 3):
            raise ConfigError(f"adapter.stage={a.stage}: ZeRO stages are 0, 1, 2 or 3")
        if (a.offload_optimizer or a.offload_params) and not cuda:
            which = "adapter.offload_optimizer" if a.offload_optimizer else "adapter.offload_params"
            raise ConfigError(f"{which}=true moves state from GPU to CPU memory, but there is no GPU here; set it to false")
        if a.offload_optimizer and a.stage == 0:
            raise ConfigError("adapter.offload_optimizer=true needs a partitioned optimizer: set adapter.stage=1, 2 or 3")
        if a.offload_params and a.stage != 3:
            raise ConfigError(f"adapter.offload_params=true needs partitioned parameters: set adapter.stage=3 (got {a.stage})")
        if a.offload_optimizer and cfg.optimizer.name not in ("adam", "adamw", "sgd"):
            raise ConfigError(f"optimizer.name={cfg.optimizer.name} cannot run on offloaded partitions: use optimizer=adam, adamw or sgd")
        if cfg.optimizer.name in LAYERWISE and (a.stage > 0 or cfg.trainer.precision != "fp32"):
            why = f"adapter.stage={a.stage}" if a.stage > 0 else f"trainer.precision={cfg.trainer.precision}"
            raise ConfigError(
                f"optimizer.name={cfg.optimizer.name}: its per-layer trust ratio needs whole parameter tensors, but with "
                f"{why} DeepSpeed steps flat partitions; use optimizer=adam, adamw or sgd (or adapter.stage=0 with fp32)"
            )
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(a, key) <= 0:
                raise ConfigError(f"adapter.{key}={getattr(a, key)} must be > 0 (elements per communication bucket)")

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
            model=model, optimizer=optimizer, model_parameters=model.parameters(), config=self.ds_config,
            dist_init_required=False,
        )
        self.input_dtype = HALF.get(cfg.trainer.precision)  # DeepSpeed's bf16/fp16 modes hold half-precision weights
        self._probe_grads = True
        self._grad_bytes = 0

    def modules(self):
        return [self.engine.module]

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.input_dtype) if self.input_dtype is not None and x.is_floating_point() else x

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            with timer.phase("forward"):
                loss = self.workload.loss(self.engine(self._cast(x)), y)
            with timer.phase("backward"):
                self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps
            if i == n - 1 and self._probe_grads:
                # the engine frees gradients inside step(): read them where they are all held
                self._grad_bytes = self._held_grad_bytes()
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
        """Bytes this rank holds, read from the engine's own tensors (see `_engine_state`)."""
        state = _engine_state(self.engine, self.cfg.adapter.stage)
        state["grads"] = self._grad_bytes
        self._probe_grads = True  # re-read gradients at the next step (once per epoch)
        return state

    def _held_grad_bytes(self) -> int:
        return _gradient_bytes(self.engine, self.cfg.adapter.stage)

    def describe(self) -> dict:
        import deepspeed

        a = self.cfg.adapter
        return {
            "deepspeed": deepspeed.__version__,
            "stage": a.stage,
            "overlap_comm": a.overlap_comm,
            "contiguous_gradients": a.contiguous_gradients,
            "reduce_bucket_size": a.reduce_bucket_size,
            "allgather_bucket_size": a.allgather_bucket_size,
            "offload_optimizer": a.offload_optimizer,
            "offload_params": a.offload_params,
            "gradient_clipping": self.ds_config["gradient_clipping"],
            "mixed_precision": {"bf16": "deepspeed bf16 (fp32 master)", "fp16": "deepspeed fp16 (loss scaling, fp32 master)"}.get(
                self.cfg.trainer.precision, "off (fp32)"),
            "optimizer": type(self.engine.basic_optimizer).__name__ if hasattr(self.engine, "basic_optimizer") else None,
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


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views into one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _engine_state(engine, stage: int) -> dict[str, int]:
    import sys; sys.path.insert(0, "/tmp/zs"); import dump; dump.dump(engine, "after step")
    return {"params": 0, "grads": 0, "optimizer": 0}


def _gradient_bytes(engine, stage: int) -> int:
    import sys; sys.path.insert(0, "/tmp/zs"); import dump; dump.dump(engine, "after backward")
    return 0


ADAPTER = ZeroAdapter
