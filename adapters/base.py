"""The adapter interface: what a parallel-training framework must do for the one training loop.

An adapter wraps the workload's model and an optimizer for its framework and then answers four
calls from the trainer: `train_step`, `eval_step`, `state_bytes`, and who it shares data with
(`dp_rank`, `dp_size`). Everything else (loop, timers, memory, records) lives in bench/.

Class-level hooks run before any rank starts, so bad input fails in the parent with one line:
  - `check(cfg, world_size)`: refuse what this adapter cannot do (raise ConfigError); the base
    `validate` runs the checks every adapter needs and then this one, so none is skipped
  - `processes(cfg)`: how many processes to launch (GPipe drives several devices from one)
  - `layout(cfg, world_size)`: dp x tp x pp, devices per process, micro-batches (ptbench.core.layout.Layout)
  - `paper_layout(gpus, gpus_per_node, layers)`: how `python -m ptbench.paper` places it on a GPU count
  - `cost_inputs(cfg)`: what the memory and communication models need beyond the layout (CostInputs):
    they read these, never the adapter's name, so a new adapter touches its own file only
  - `launch_command(cfg, world_size)`: a framework launcher that must start the ranks (horovodrun)
  - `local_batch_size(cfg, world_size)`: the batch one data-parallel replica loads per step
  - `checkpoint_refusal(cfg)` / `compile_refusal(cfg)`: None where this adapter checkpoints / compiles
    correctly, else why not (the run is refused before launch)

Checkpoints (bench/core/checkpoint.py; the trainer decides when): `save_checkpoint(path)` and
`load_checkpoint(path)` write and read this rank's part of the model and optimizer state into a
folder every rank shares. The default is torch.distributed.checkpoint (DCP) through
`get_state_dict`/`set_state_dict` on `checkpoint_module()` and `self.optimizer`: it handles DDP
wrappers, FSDP2 and tensor-parallel DTensors (each rank writes its shards, replicated tensors once).
Adapters whose framework has its own API override both (DeepSpeed, Horovod, GPipe). Loading runs under an
allowlisting unpickler (bench/core/checkpoint_load.py): a framework whose files hold its own record types
names them in `checkpoint_safe_globals()`. An adapter
declares that its state is checkpointed correctly by overriding `checkpoint_refusal` to return None;
the default is a reason, so a new adapter never writes a checkpoint nobody has checked.
"""

from __future__ import annotations

import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.environments import ClusterEnvironment
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.timing import PhaseTimer
from ptbench.workloads.base import Workload

Batch = tuple[torch.Tensor, torch.Tensor]

# extras whose framework a plain `pip install -e '.[EXTRA]'` cannot bring working
INSTALL_NOTES = {
    "horovod": "build it against this torch: `make horovod` in a checkout, or "
    f"`bash {Path(__file__).with_name('horovod_build.sh')} {sys.executable}` (pip install -e '.[horovod]' "
    "alone fails to build on torch 2.14)",
}


def framework_importable(module: str) -> bool:
    """`module` (dotted names too) can be imported here, without importing it (its parent package is)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module set to None in sys.modules
        return False


class Adapter(ABC):
    name: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]] = ("vision", "language")  # workload kinds supported
    framework: ClassVar[str] = "torch"  # distribution name whose version the record states
    framework_module: ClassVar[str] = "torch"  # its import name (checked by `make smoke`, listed in the record)
    # the pip extra that installs the framework (pyproject.toml): "" = torch alone; when the framework is
    # missing, validate refuses in one line naming it (pip install -e '.[EXTRA]')
    extra: ClassVar[str] = ""
    # What each timed phase holds for this adapter (recorded as `phase_semantics`; the breakdown figure
    # shows it): frameworks put communication and pipeline bubbles in different phases.
    phase_semantics: ClassVar[dict[str, str]] = {
        "data": "host loading of the step's micro-batches and their copy to the device",
        "forward": "forward of each micro-batch under autocast, loss included",
        "backward": "backward of each micro-batch; the gradient all-reduce overlaps it and its exposed "
        "remainder ends this phase",
        "optimizer": "unscale (fp16), clip over the global norm, optimizer step, zero the gradients",
    }
    # What trainer.precision=bf16/fp16 means for this adapter (recorded as `precision_semantics`)
    precision_semantics: ClassVar[str] = (
        "autocast: fp32 weights, gradients and optimizer state; matmuls and activations in bf16/fp16"
    )
    # ways of starting ranks that only this framework has (bench/core/environments.py), e.g. horovodrun
    environments: ClassVar[tuple[type[ClusterEnvironment], ...]] = ()
    checkpoint_format: ClassVar[str] = "torch.distributed.checkpoint (get_state_dict/set_state_dict)"
    compile_how: ClassVar[str] = ""  # what is compiled (recorded as compile.how)
    # why this framework builds Triton kernels on CUDA whatever trainer.compile says ("" = it does not): the
    # pre-launch check then asks for the host's C compiler and Python headers (runner/checks.py)
    compiles_on_cuda: ClassVar[str] = ""
    # workload.channels_last: False where the framework needs contiguous parameters (it flattens, shards or
    # broadcasts them as flat buffers): the vision workload then makes the activations channels_last only
    channels_last_weights: ClassVar[bool] = True

    # --- before launch (class methods: no process group yet) ------------------------------------
    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        """`make smoke` / `make demo`: overrides (after experiment=smoke) for a small run on `devices` devices."""
        return [f"launcher.nprocs={devices}"]

    @classmethod
    def validate(cls, cfg: BenchConfig, world_size: int) -> None:
        """Every check before launch: the workload kind and the checkpoint fields, then this adapter's
        own `check`. Adapters override `check`, never this, so the common checks always run."""
        why = cls.framework_refusal()
        if why:
            raise ConfigError(why)
        if cfg.workload.kind not in cls.kinds:
            raise ConfigError(
                f"adapter={cls.name} does not support {cfg.workload.kind} workloads "
                f"(workload={cfg.workload.name}); it supports: {', '.join(cls.kinds)}"
            )
        cls.check_checkpointing(cfg)
        cls.check(cfg, world_size)

    @classmethod
    def framework_refusal(cls) -> str | None:
        """None when this adapter's framework can be imported (torch-only adapters always), else the one line
        naming the extra that installs it."""
        if not cls.extra or framework_importable(cls.framework_module):
            return None
        # ptbench is installed from its checkout (it is not on the package index): the extra is the checkout's
        how = INSTALL_NOTES.get(cls.extra, f"pip install -e '.[{cls.extra}]' in the ptbench checkout")
        return f"adapter={cls.name} needs {cls.framework}, which is not installed: {how}"

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        """This adapter's own refusals (raise ConfigError with one line naming the problem and the fix)."""

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> str | None:
        """None: save_checkpoint/load_checkpoint restore this adapter's full training state (checked by
        tests/test_checkpoint.py); else why not, and trainer.checkpoint_every > 0 is refused before launch."""
        return "no checkpoint support written and tested for this adapter"

    @classmethod
    def compile_refusal(cls, cfg: BenchConfig) -> str | None:
        """None: trainer.compile=true compiles this adapter's model (`compile_module`) and was checked to
        train; else why not, and trainer.compile=true is refused before launch (bench/runner/checks.py)."""
        return "torch.compile is not wired into this adapter or not shown to work"

    @classmethod
    def check_checkpointing(cls, cfg: BenchConfig) -> None:
        """The trainer's checkpoint fields, and checkpoint_every > 0 refused where this adapter cannot."""
        from ptbench.core.checkpoint import check_config

        check_config(cfg, cls.name, cls.checkpoint_refusal(cfg))

    @classmethod
    def processes(cls, cfg: BenchConfig) -> int:
        return cfg.launcher.nprocs

    @classmethod
    def rank_environment(cls, cfg: BenchConfig) -> dict[str, str]:
        """Environment variables CUDA reads when it starts, which each rank must have from its start, e.g.
        Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor parallelism: the local launcher puts them in its ranks'
        environment, slurm/run.sbatch exports them (`python -m ptbench.runner.launch --rank-env`), torchrun users
        export them; a rank started without them sets them (late, with a warning on CUDA). The record's
        `rank_environment` holds them and what rank 0 started with."""
        return {}

    @classmethod
    def launch_command(cls, cfg: BenchConfig, world_size: int) -> list[str] | None:
        """launcher=local: the framework's own launcher that starts the ranks (e.g. horovodrun), to which
        the launcher appends `python -m ptbench.runner.rank RUN_DIR`; None = the launcher spawns them itself."""
        return None

    @classmethod
    def layout(cls, cfg: BenchConfig, world_size: int) -> Layout:
        """How `world_size` processes split the work; default: every process one data-parallel replica."""
        return Layout(world_size=world_size, dp=world_size)

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig) -> CostInputs:
        """What this framework does that the cost models cannot see in the layout; default: replicated fp32
        states under autocast, gradients all-reduced in backward."""
        return CostInputs()

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str] | str:
        """`python -m ptbench.paper`: the overrides that put this adapter on `gpus` devices (`gpus_per_node` per
        node, 0: CPU ranks on one node; `layers`: the workload's layer count), or why it cannot run there (a str).
        Default: one data-parallel rank per device."""
        return [f"launcher.nprocs={gpus}"]

    @classmethod
    def paper_companions(cls, point: list[str]) -> list[list[str]]:
        """`python -m ptbench.paper`'s statistical-efficiency phase: points to train beside this adapter's chosen
        `point` (its overrides) so that a claim compares like with like; default none."""
        return []

    @classmethod
    def devices_per_process(cls, cfg: BenchConfig) -> int:
        """The layout's devices per process at `processes(cfg)` (what Slurm allocates per task). A layout that
        cannot split is the point's own run's error (make_plan says it), not this question's: 1 then."""
        try:
            return cls.layout(cfg, cls.processes(cfg)).devices_per_process
        except ConfigError:
            return 1

    @classmethod
    def local_batch_size(cls, cfg: BenchConfig, world_size: int) -> int:
        """Samples one replica loads per micro-step, from trainer.batch_size (per device) and the policy.

        per_device: each replica loads batch_size (DDP/ZeRO: global batch = batch_size x replicas);
        linear: the global batch is batch_size x devices whatever the parallel layout (Megatron);
        fixed: the global batch is batch_size whatever the device count (PipeDream-style);
        per_microbatch: batch_size is the micro-batch size, a replica loads batch_size x microbatches
        (GPipe as in the paper: fixed micro-batch size, micro-batches = 4 x partitions).
        """
        policy = cfg.adapter.batch_policy
        layout = cls.layout(cfg, world_size)
        dp = layout.dp
        b = cfg.trainer.batch_size
        if policy == "per_device":
            return b
        if policy == "per_microbatch":
            return b * layout.microbatches
        total = b * layout.devices if policy == "linear" else b
        if total % dp:
            raise ConfigError(
                f"adapter.batch_policy={policy}: global batch {total} is not divisible by "
                f"{dp} data-parallel replicas; change trainer.batch_size"
            )
        return total // dp

    # --- on each rank -------------------------------------------------------------------------
    def __init__(self, cfg: BenchConfig, workload: Workload, ctx: DistContext):
        self.cfg = cfg
        self.workload = workload
        workload.channels_last_weights = self.channels_last_weights  # before any build_model
        self.ctx = ctx
        self.device = ctx.device

    @abstractmethod
    def setup(self) -> None:
        """Build (or wrap) the model and optimizer on this rank. Called after the process group exists."""

    @abstractmethod
    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer) -> torch.Tensor | None:
        """One optimizer step over the micro-batches; phases timed with `timer.phase(...)`.

        Returns the mean loss over this replica's micro-batches (a detached tensor; no host sync),
        or None on ranks that do not see the loss (e.g. non-final pipeline stages).
        """

    @abstractmethod
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Validation sums [loss_sum, correct_sum, count] (workload.eval_sums); zeros where not reported."""

    def train(self) -> None:
        for m in self.modules():
            m.train()

    def eval(self) -> None:
        for m in self.modules():
            m.eval()

    def end_epoch(self) -> None:
        """Called on every rank after an epoch's last training step, before validation, inside the epoch's
        time: an adapter that keeps work in flight across steps (pipedream's pipeline) finishes it here."""

    @abstractmethod
    def modules(self) -> list[nn.Module]:
        """The modules this rank holds (for train/eval mode and parameter accounting)."""

    def devices(self) -> list[torch.device]:
        """Every device this process computes on (GPipe: one per partition); memory is read on each."""
        return [self.device]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index (which shard of the data it reads)."""
        return self.ctx.rank

    @property
    def dp_size(self) -> int:
        return self.layout(self.cfg, self.ctx.world_size).dp

    @property
    def reports_metrics(self) -> bool:
        """True on exactly one rank per data-parallel replica: its loss and eval sums are counted."""
        return True

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank really holds.

        Default: the unique tensors of `modules()` and `self.optimizer` on this rank. Adapters whose
        framework keeps extra copies (e.g. an fp32 master partition) override this.
        """
        return tensor_bytes(self.modules(), getattr(self, "optimizer", None))

    def describe(self) -> dict:
        """Settings worth stating in the record (framework defaults change across versions)."""
        return {}

    # --- checkpoints (every rank calls these with the same folder) ---------------------------------
    def checkpoint_module(self) -> nn.Module:
        """The module whose state a checkpoint holds (DDP: the wrapper; get_state_dict strips it)."""
        return self.model

    def save_checkpoint(self, path: Path) -> None:
        """Write this rank's part of the model and optimizer state into folder `path` (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.checkpoint_module(), self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        if getattr(self, "scaler", None) is not None:
            state["scaler"] = self.scaler.state_dict()
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))

    def checkpoint_safe_globals(self) -> list:
        """Types beyond tensors, containers and numbers that this adapter's checkpoint files hold (loading
        refuses any other: a planted pickle is never run)."""
        return []

    def load_checkpoint(self, path: Path) -> None:
        """Read what `save_checkpoint` wrote into this rank's model and optimizer (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        module = self.checkpoint_module()
        model_state, optim_state = get_state_dict(module, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        scaler = getattr(self, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))  # in place, into this rank's shards
        set_state_dict(module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        """Release framework resources before the process group is destroyed."""

    def compile_module(self, module: nn.Module) -> nn.Module:
        """trainer.compile: `module.compile()` in place (nn.Module.compile: its parameters, state-dict keys and
        hooks stay as they are, so checkpoints and wrappers do not notice); returns `module`."""
        if self.cfg.trainer.compile:
            module.compile(backend=self.cfg.trainer.compile_backend)
        return module


def compile_stats() -> dict:
    """torch._dynamo's own counters so far in this process: frames compiled (every recompile is one
    more), graphs, and seconds spent compiling (forward, and backward graphs compiled at first use)."""
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing compiled: do not import dynamo for nothing
        return {"frames": 0, "graphs": 0, "time_s": 0.0}
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    times = dict(zip(names, (float(v) for v in values)))
    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "time_s": times.get("_compile.compile_inner", 0.0) + times.get("backward._backward_impl", 0.0),
    }


def save_rank0_state(path: Path, model, optimizer, scaler=None, rank: int = 0) -> None:
    """Replicated state (Horovod, one-process GPipe): rank 0 torch.saves model + optimizer (+ scaler)."""
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        torch.save(state, Path(path) / "state.pt")


def load_rank0_state(path: Path, model, optimizer, scaler=None) -> None:
    """Every rank reads rank 0's file (the record folder is on a file system all ranks share)."""
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # moves the state to the parameters' devices
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])


def tensor_bytes(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    seen: set[int] = set()
    params = grads = 0
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += _nbytes(p)
            if p.grad is not None:
                grads += _nbytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    opt += _nbytes(v)
    return {"params": params, "grads": grads, "optimizer": opt}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's (FSDP2, tensor parallel) local shard, else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()
