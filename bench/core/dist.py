"""Where this process sits in the job (`DistContext`: rank, world, device) and the process group.

How a rank learns its place depends on what started it: see bench/core/environments.py.
"""

from __future__ import annotations

import datetime
import os
import socket
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"
    launcher: str = "local"

    @property
    def device(self) -> torch.device:
        # Choose by cuda availability, not torch.accelerator: that names cuda even without a GPU.
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def dist_timeout_s(trainer) -> int:
    """The process-group timeout: trainer.dist_timeout_s, else 60 s after the watchdog's, so the watchdog
    always fires first (30 min when the watchdog is off)."""
    if trainer.dist_timeout_s:
        return int(trainer.dist_timeout_s)
    return int(trainer.hang_timeout_s + 60) if trainer.hang_timeout_s > 0 else 1800


def cpu_threads(requested: int, env=os.environ) -> int:
    """launcher.threads_per_rank, else the CPUs Slurm gave the task, else 1."""
    return requested or int(env.get("SLURM_CPUS_PER_TASK") or 0) or 1


def set_cpu_threads(requested: int) -> int:
    """Intra-op threads of this rank on CPU (OMP_NUM_THREADS too, for libraries that read it later)."""
    n = cpu_threads(requested)
    if not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
    return n


def init_process_group(ctx: DistContext, timeout_s: int) -> None:
    os.environ.update(
        MASTER_ADDR=ctx.master_addr,
        MASTER_PORT=str(ctx.master_port),
        RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.world_size),
        LOCAL_RANK=str(ctx.local_rank),
        LOCAL_WORLD_SIZE=str(ctx.local_world_size),
    )
    if ctx.is_cuda:
        torch.cuda.set_device(ctx.device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=ctx.backend,
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=ctx.device if ctx.is_cuda else None,
        )
