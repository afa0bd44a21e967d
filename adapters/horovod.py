"""Horovod 0.28.1: `hvd.DistributedOptimizer` all-reduces gradients over Gloo (CPU) or NCCL (GPU).

The diff from a single-process loop, as in Horovod's PyTorch quickstart: `hvd.init()`, pin the
device to `hvd.local_rank()`, wrap the optimizer in `hvd.DistributedOptimizer(named_parameters=...)`,
broadcast rank 0's parameters, shard the data by `hvd.rank()` / `hvd.size()`.

How ranks start (install: `make horovod`):
- `launcher=local`: the launcher runs `horovodrun -np N -H localhost:N --gloo` for the user
  (`launch_command`); each rank then runs `python -m ptbench.runner.rank RUN_DIR`.
- a user's own `horovodrun -np N ... python -m ptbench adapter=horovod`: ranks read HOROVOD_RANK etc.
- `srun` / torchrun without horovodrun: a Gloo-only Horovod cannot read Slurm's environment (that
  needs an MPI build), so rank 0 runs Horovod's own rendezvous server (the one horovodrun starts)
  and the harness's process group tells every rank where it is. An MPI build under
  `srun --mpi=pmix` initializes from MPI instead.

Settings Horovod reads from the environment (fusion threshold, cycle time) are set from the config
before `hvd.init()` and read back into the record: their defaults changed across versions.

Each rank builds its model from seed `trainer.seed + rank`, as independent processes would, so the
broadcast from rank 0 is what makes the replicas equal (checked: `broadcast` in the record). Rank 0's
model is the one DDP builds; the global RNG stream (dropout, augmentation) continues from
`trainer.seed` on every rank.

horovod is imported only inside this module's functions, so `adapter=ddp` never loads it.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence

import torch

from ptbench.adapters.base import Adapter, Batch, load_rank0_state, save_rank0_state
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext, default_backend
from ptbench.core.environments import ClusterEnvironment
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs
from ptbench.core.optim import build_optimizer, optimizer_step
from ptbench.core.precision import autocast, grad_scaler
from ptbench.core.timing import PhaseTimer

INSTALL_HINT = "adapter=horovod needs Horovod: run `make horovod`"
COMPRESSIONS = ("none", "fp16")


def _import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as e:  # absent, or built against another torch (undefined symbols)
        raise ConfigError(f"{INSTALL_HINT} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    return hvd


class HorovodrunEnvironment(ClusterEnvironment):
    """A rank started by horovodrun: HOROVOD_RANK / HOROVOD_SIZE / HOROVOD_LOCAL_RANK. horovodrun (Gloo)
    gives no address for the harness's own process group: MASTER_ADDR/PORT if set (launcher=local
    passes them), else the rendezvous host and the next port."""

    name = "horovodrun"

    @staticmethod
    def detect(env, launcher):
        return all(k in env for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"))

    @staticmethod
    def context(env, backend, master_port=0):
        return DistContext(
            rank=int(env["HOROVOD_RANK"]),
            world_size=int(env["HOROVOD_SIZE"]),
            local_rank=int(env["HOROVOD_LOCAL_RANK"]),
            local_world_size=int(env.get("HOROVOD_LOCAL_SIZE", env["HOROVOD_SIZE"])),
            master_addr=env.get("MASTER_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"),
            master_port=int(
                env.get("MASTER_PORT") or master_port or int(env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 29499)) + 1
            ),
            backend=default_backend(backend),
            launcher="horovodrun",
        )


class HorovodAdapter(Adapter):
    name = "horovod"
    framework = "horovod"
    framework_module = "horovod"
    extra = "horovod"
    environments = (HorovodrunEnvironment,)
    checkpoint_format = "rank 0 torch.save of model and optimizer state_dict"
    # Horovod broadcasts and all-reduces contiguous tensors only: channels_last activations only
    channels_last_weights = False
    phase_semantics = {
        **Adapter.phase_semantics,
        "backward": "backward; gradient hooks only start Horovod's all-reduces (background thread)",
        "optimizer": "waits for the all-reduces (synchronize: the exposed communication is here, not in "
        "backward as for DDP), then unscale, clip, step",
    }

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> None:
        # every replica is equal (broadcast at start, averaged gradients), so rank 0 torch.saves the model and
        # the optimizer's state_dict; every rank loads that file
        return None

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig) -> CostInputs:
        # a fusion buffer of up to the threshold; the all-reduces are waited for in optimizer.step (synchronize)
        return CostInputs(fusion_buffer_bytes=int(cfg.adapter.fusion_threshold_mb * 2**20), grad_sync_phase="optimizer")

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        a = cfg.adapter
        if a.compression not in COMPRESSIONS:
            raise ConfigError(f"adapter.compression={a.compression}: choose none or fp16 (hvd.Compression)")
        if a.fusion_threshold_mb < 0:
            raise ConfigError(
                f"adapter.fusion_threshold_mb={a.fusion_threshold_mb} must be >= 0 (0 turns tensor fusion off)"
            )
        if a.cycle_time_ms <= 0:
            raise ConfigError(f"adapter.cycle_time_ms={a.cycle_time_ms} must be > 0")
        if a.backward_passes_per_step != cfg.trainer.grad_accum:
            # Horovod all-reduces after exactly this many backward passes; the trainer runs grad_accum
            raise ConfigError(
                f"adapter.backward_passes_per_step={a.backward_passes_per_step} must equal trainer.grad_accum="
                f"{cfg.trainer.grad_accum} (micro-batches per step); leave it unset to follow trainer.grad_accum"
            )
        hvd = _import_horovod()  # last: the import costs seconds
        if torch.cuda.is_available() and not hvd.nccl_built():
            # a Gloo-only build reduces GPU tensors through host memory, silently: not Horovod's GPU path
            raise ConfigError(
                "adapter=horovod on GPUs needs Horovod built with NCCL (this build has Gloo only); "
                "rebuild with `make horovod` where NCCL is installed (HOROVOD_GPU_OPERATIONS=NCCL)"
            )

    @classmethod
    def launch_command(cls, cfg: BenchConfig, world_size: int) -> list[str]:
        """launcher=local: Horovod's ranks are started by horovodrun (Gloo), on this machine."""
        return [
            sys.executable,
            "-m",
            "horovod.runner.launch",
            "-np",
            str(world_size),
            "-H",
            f"localhost:{world_size}",
            "--gloo",
        ]

    # --- on each rank ----------------------------------------------------------------------------
    def setup(self) -> None:
        hvd = _import_horovod()
        a, t = self.cfg.adapter, self.cfg.trainer
        # read by hvd.init(); horovodrun's --fusion-threshold-mb / --cycle-time-ms set the same variables
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(a.fusion_threshold_mb * 2**20))
        os.environ["HOROVOD_CYCLE_TIME"] = str(a.cycle_time_ms)
        self.rendezvous = self._join(hvd)
        if hvd.size() != self.ctx.world_size or hvd.rank() != self.ctx.rank:
            raise RuntimeError(
                f"Horovod sees rank {hvd.rank()} of {hvd.size()}, the launcher started rank "
                f"{self.ctx.rank} of {self.ctx.world_size}: start ranks with horovodrun or srun"
            )
        self.hvd = hvd

        devices = [self.device] if self.ctx.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(t.seed + hvd.rank())  # independent inits: the broadcast must fix them
            model = self.workload.build_model().to(self.device)
        self.model = model
        before = _checksum(model)
        # Horovod's quickstart: rank 0's weights (and buffers: BatchNorm statistics) to every rank
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        after = _checksum(model)
        sums = hvd.allgather_object((before, after))
        self.broadcast = {
            "init_differed": any(b != sums[0][0] for b, _ in sums),
            "equal_after": all(s == sums[0][1] for _, s in sums),
            "root_unchanged": sums[0][0] == sums[0][1],
        }
        if not (self.broadcast["equal_after"] and self.broadcast["root_unchanged"]):
            raise RuntimeError(f"hvd.broadcast_parameters left the replicas different: {self.broadcast}")

        optimizer = build_optimizer(model.parameters(), self.cfg.optimizer)
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[a.compression]
        self.optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=a.backward_passes_per_step,
            op=hvd.Average,
        )
        # A fresh optimizer is the same on every rank. Horovod's broadcast_optimizer_state would first
        # create its state with one zero-gradient step(): with AdamW that decays the weights once and
        # advances Adam's step count, so the run would no longer train like DDP. Broadcast only real state.
        self.optimizer_state_broadcast = bool(self.optimizer.state)
        if self.optimizer_state_broadcast:
            hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        self.scaler = grad_scaler(t.precision, self.device)

    def _join(self, hvd) -> str:
        """hvd.init() under whichever launcher started this rank; returns how the ranks found each other."""
        env = os.environ
        if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or self.ctx.world_size == 1:
            hvd.init()
            return "horovodrun" if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env else "single"
        if hvd.mpi_built() and any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
            hvd.init()  # an MPI build started by srun --mpi=... / mpirun
            return "mpi"
        self._server = _gloo_rendezvous(self.ctx)
        hvd.init()
        return "harness (Horovod's rendezvous server on rank 0)"

    def modules(self):
        return [self.model]

    @property
    def dp_rank(self) -> int:
        return self.hvd.rank()  # the data shard: Horovod's rank

    @property
    def dp_size(self) -> int:
        return self.hvd.size()

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        precision = self.cfg.trainer.precision
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            with timer.phase("forward"), autocast(precision, self.device):
                loss = self.workload.loss(self.model(x), y) / n
            with timer.phase("backward"):  # gradient hooks start the all-reduces after the last pass
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        with timer.phase("optimizer"):
            # Horovod's pattern for anything that reads gradients before step(): wait for the
            # all-reduces, unscale/clip the averaged gradients, then step without syncing again
            self.optimizer.synchronize()
            with self.optimizer.skip_synchronize():  # gradients were synchronized above
                optimizer_step(self.optimizer, self.model.parameters(), self.cfg.trainer.grad_clip, self.scaler)
            # keep the gradient buffers, as DDP does (state bytes then count them): Horovod's zero_grad()
            # takes no set_to_none and frees them
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        return total

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        with autocast(self.cfg.trainer.precision, self.device):
            out = self.model(inputs)
        return self.workload.eval_sums(out, targets, weight)

    def save_checkpoint(self, path) -> None:
        save_rank0_state(path, self.model, self.optimizer, self.scaler, self.hvd.rank())

    def load_checkpoint(self, path) -> None:
        load_rank0_state(path, self.model, self.optimizer, self.scaler)

    def describe(self) -> dict:
        import horovod

        a = self.cfg.adapter
        hvd = self.hvd
        return {
            "horovod_version": horovod.__version__,
            # what hvd.init() read (horovodrun flags or our config)
            "fusion_threshold_bytes": int(os.environ["HOROVOD_FUSION_THRESHOLD"]),
            "cycle_time_ms": float(os.environ["HOROVOD_CYCLE_TIME"]),
            "autotune": os.environ.get("HOROVOD_AUTOTUNE", "0") not in ("", "0"),
            "compression": a.compression,
            "backward_passes_per_step": a.backward_passes_per_step,
            "controller": "mpi" if hvd.mpi_enabled() else "gloo",
            "gpu_allreduce": "nccl" if (self.ctx.is_cuda and hvd.nccl_built()) else None,
            "rendezvous": self.rendezvous,
            "size": hvd.size(),
            "broadcast": self.broadcast,
            "optimizer_state_broadcast": self.optimizer_state_broadcast,
        }

    def close(self) -> None:
        hvd = getattr(self, "hvd", None)
        if hvd is not None and hvd.is_initialized():
            hvd.shutdown()
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()


def _checksum(model: torch.nn.Module) -> list[float]:
    """Exact per-tensor sums (float64) of parameters and buffers: equal lists = equal replicas."""
    return [float(t.detach().double().sum()) for t in model.state_dict().values() if t.is_floating_point()]


def _gloo_rendezvous(ctx):
    """Do what horovodrun does before starting ranks: run Horovod's rendezvous server (rank 0) with
    every rank's slot, then give each rank its HOROVOD_* variables. Returns the server on rank 0."""
    import torch.distributed as dist
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    hosts: list = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    local = [hosts[:r].count(h) for r, h in enumerate(hosts)]
    slots = []
    for r, h in enumerate(hosts):
        peers = [q for q in range(ctx.world_size) if local[q] == local[r]]  # same local rank, one per host
        slots.append(
            SlotInfo(
                hostname=h,
                rank=r,
                local_rank=local[r],
                cross_rank=peers.index(r),
                size=ctx.world_size,
                local_size=hosts.count(h),
                cross_size=len(peers),
            )
        )
    server, box = None, [None]
    if ctx.rank == 0:
        server = RendezvousServer()
        box = [server.start()]
        server.init(slots)
    dist.broadcast_object_list(box, src=0)
    me = slots[ctx.rank]
    os.environ.update(
        {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": ctx.master_addr,  # rank 0's host, as for the process group
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(box[0]),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_HOSTNAME": me.hostname,
            "HOROVOD_RANK": str(me.rank),
            "HOROVOD_SIZE": str(me.size),
            "HOROVOD_LOCAL_RANK": str(me.local_rank),
            "HOROVOD_LOCAL_SIZE": str(me.local_size),
            "HOROVOD_CROSS_RANK": str(me.cross_rank),
            "HOROVOD_CROSS_SIZE": str(me.cross_size),
        }
    )
    return server


ADAPTER = HorovodAdapter
