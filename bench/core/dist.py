"""Where this process sits in the job (`DistContext`: rank, world, device) and the process group.

How a rank learns its place depends on what started it: see bench/core/environments.py.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
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
            return torch.device("cuda", device_index(self.local_rank, torch.cuda.device_count()))
        return torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def visible_device_count(env: Mapping[str, str] = os.environ) -> int:
    """GPUs this process may use: the entries of CUDA_VISIBLE_DEVICES when set (Slurm's --gpus-per-task /
    --gpu-bind bind one per task), else every GPU torch sees."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return torch.cuda.device_count()


def device_index(local_rank: int, device_count: int) -> int:
    """This rank's device among the visible ones: the node-local rank when each rank sees every GPU, 0 when
    the scheduler bound one GPU to each task; the node-local rank again when there is no GPU."""
    return local_rank % device_count if device_count > 0 else local_rank


def exported_local_rank(local_rank: int, env: Mapping[str, str] = os.environ) -> int:
    """LOCAL_RANK as exported to frameworks: the index of the rank's device among the visible devices, since
    DeepSpeed (and torch's own convention) calls set_device(LOCAL_RANK). With one GPU bound per Slurm task,
    SLURM_LOCALID 3 is cuda:0, and LOCAL_RANK=3 would ask for an ordinal that does not exist."""
    return device_index(local_rank, visible_device_count(env))


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
    """Intra-op threads of this rank (OMP_NUM_THREADS too, for libraries that read it later), on GPU as on
    CPU: GPU ranks run host work too (ZeRO-Offload's CPU Adam, data transforms), and the record's
    cpu_threads_per_rank is what torch.get_num_threads() then reports."""
    n = cpu_threads(requested)
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return torch.get_num_threads()


def init_process_group(ctx: DistContext, timeout_s: int, store: dist.Store | None = None) -> None:
    """The default process group; `store`: one the ranks met on already (None: MASTER_ADDR/PORT's own)."""
    os.environ.update(
        MASTER_ADDR=ctx.master_addr,
        MASTER_PORT=str(ctx.master_port),
        RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.world_size),
        # the device's index among the visible GPUs (device_index: exported_local_rank's rule), not SLURM_LOCALID
        LOCAL_RANK=str(ctx.device.index if ctx.is_cuda else ctx.local_rank),
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
            store=store,
        )
