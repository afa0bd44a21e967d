"""Where this process sits in the job: rank, world, device, and the process group.

Three ways a rank is started, one result (`DistContext`):
- `launcher=local`: this machine spawns `nprocs` ranks; the parent picks a free port.
- torchrun: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT are in the environment
  (honoured under `launcher=local` too, so `torchrun -m bench` just works).
- horovodrun: HOROVOD_RANK / HOROVOD_SIZE / HOROVOD_LOCAL_RANK (adapter=horovod).
- `launcher=slurm` (srun, one task per GPU): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, the
  address is the first host of SLURM_JOB_NODELIST, the port is derived from the job id.
"""
from __future__ import annotations

import datetime
import os
import re
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


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist like 'gpu[001-004,010],cn7' into host names, in order.

    Same result as `scontrol show hostnames`, without needing Slurm's binaries in the rank.
    """
    hosts: list[str] = []
    # split on commas that are not inside brackets
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-")
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
            else:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts


def slurm_port(job_id: str, step_id: str | None = None) -> int:
    """A port in 20000-59999 derived from the job (and array task / step) id.

    Concurrent array tasks on one node have different SLURM_JOB_IDs, so they get different ports.
    """
    key = int(job_id) * 31 + int(step_id or 0)
    return 20000 + key % 40000


def torchrun_env(env=os.environ) -> bool:
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def horovodrun_env(env=os.environ) -> bool:
    return all(k in env for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"))


def context_from_env(launcher: str, backend: str = "auto", env=os.environ, master_port: int = 0) -> DistContext:
    """Build the context of a rank started by torchrun, horovodrun or srun (not by our own spawner)."""
    if torchrun_env(env):
        return DistContext(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            backend=default_backend(backend),
            launcher="torchrun",
        )
    if horovodrun_env(env):
        # horovodrun (Gloo) sets ranks but no address for our own process group: MASTER_ADDR/PORT if
        # given (launcher=local passes them), else the rendezvous host and the next port
        return DistContext(
            rank=int(env["HOROVOD_RANK"]),
            world_size=int(env["HOROVOD_SIZE"]),
            local_rank=int(env["HOROVOD_LOCAL_RANK"]),
            local_world_size=int(env.get("HOROVOD_LOCAL_SIZE", env["HOROVOD_SIZE"])),
            master_addr=env.get("MASTER_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT") or master_port or int(env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 29499)) + 1),
            backend=default_backend(backend),
            launcher="horovodrun",
        )
    if launcher == "slurm":
        missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID") if k not in env]
        if missing:
            from bench.errors import ConfigError

            raise ConfigError(
                f"launcher=slurm but {', '.join(missing)} not set: start ranks with srun inside an allocation"
            )
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        # e.g. '4(x2),3' -> first count; local world is informative only
        local_world = int(re.match(r"\d+", tasks_per_node).group(0))
        port = master_port or slurm_port(env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID"))
        return DistContext(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=int(env.get("MASTER_PORT") or port),
            backend=default_backend(backend),
            launcher="slurm",
        )
    return DistContext(backend=default_backend(backend), launcher="single")


def set_cpu_threads(n: int) -> None:
    """One thread per rank on CPU: ranks share 2 cores here, and more threads thrash."""
    if not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)


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


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
