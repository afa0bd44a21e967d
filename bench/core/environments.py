"""Cluster environments: who started this process, and what its rank, world and address are.

As in Lightning Fabric's `ClusterEnvironment`, each way of starting ranks is a class with
`detect(env)` and `context(...)`; the runner asks them in order and the first that detects wins:
- `TorchrunEnvironment`: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the
  environment (honoured under `launcher=local` too, so `torchrun -m ptbench` just works).
- `SlurmEnvironment` (`launcher=slurm`: srun, one task per GPU): SLURM_PROCID / SLURM_NTASKS /
  SLURM_LOCALID; the address is the first host of the step's node list, the port derived from the
  job id.
- adapters add their framework's own (Horovod's `horovodrun` in adapters/horovod.py).
- `launcher=local` with none of these: the runner spawns `launcher.nprocs` ranks itself.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from typing import ClassVar

from ptbench.core.dist import DistContext, default_backend
from ptbench.core.errors import ConfigError


class ClusterEnvironment:
    """A launcher that started this process as one rank of a job."""

    name: ClassVar[str]

    @staticmethod
    def detect(env: Mapping[str, str], launcher: str) -> bool:
        raise NotImplementedError

    @staticmethod
    def context(env: Mapping[str, str], backend: str, master_port: int = 0) -> DistContext:
        raise NotImplementedError


class TorchrunEnvironment(ClusterEnvironment):
    name = "torchrun"

    @staticmethod
    def detect(env, launcher):
        return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))

    @staticmethod
    def context(env, backend, master_port=0):
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


class SlurmEnvironment(ClusterEnvironment):
    name = "slurm"

    @staticmethod
    def detect(env, launcher):
        # a task of a submitit Slurm job (hydra/launcher=submitit_slurm) is one srun-started rank
        return launcher == "slurm" or env.get("SUBMITIT_EXECUTOR") == "slurm"

    @staticmethod
    def context(env, backend, master_port=0):
        missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID") if k not in env]
        if missing:
            raise ConfigError(
                f"launcher=slurm but {', '.join(missing)} not set: start ranks with srun inside an allocation"
            )
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        local_world = int(re.match(r"\d+", tasks_per_node).group(0))  # '4(x2),3' -> 4; informative only
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


BUILTIN = (TorchrunEnvironment, SlurmEnvironment)


def detect(adapter_cls, launcher: str, env: Mapping[str, str] = os.environ) -> type[ClusterEnvironment] | None:
    """The environment that started this process (the adapter's own first), or None: we start the ranks.
    `adapter_cls` is read for its `environments` only (core imports no adapter)."""
    for environment in (*adapter_cls.environments, *BUILTIN):
        if environment.detect(env, launcher):
            return environment
    return None


def in_srun_step(env: Mapping[str, str] = os.environ) -> int:
    """Tasks of the srun step this process belongs to (0 outside one; a batch script is no step)."""
    try:
        return int(env.get("SLURM_STEP_NUM_TASKS", "0"))
    except ValueError:
        return 0


def expand_nodelist(nodelist: str) -> list[str]:
    """A Slurm hostlist ('gpu[001-004,010],rack[1-2]-n[01-02]') as host names, in Slurm's order, by
    python-hostlist (the parser of Slurm's hostlist syntax; no `scontrol` subprocess, which a container on
    a Slurm node often lacks, and no private submitit function). submitit's public
    `helpers.TorchDistributedEnvironment` does not serve here: it reads only os.environ (this takes the
    environment as a mapping, tested against recorded ones), needs SUBMITIT_EXECUTOR (absent under plain
    srun, slurm/run.sbatch), takes the job's node list rather than the step's, picks a random port per job
    (not per step: two sweep points in one job would collide) and assumes equal tasks per node."""
    import hostlist

    return hostlist.expand_hostlist(nodelist)


def slurm_port(job_id: str, step_id: str | None = None) -> int:
    """A port in 20000-32767 derived from the job (and step) id: concurrent array tasks on one node
    have different SLURM_JOB_IDs, so they get different ports. Below Linux's default ephemeral range
    (32768-60999), which the node's outgoing connections and srun's own I/O listeners take: a port
    derived there was at times already bound when rank 0 came to listen."""
    step = int(step_id) if step_id and step_id.isdigit() else 0
    return 20000 + (int(job_id) * 31 + step) % 12768


# --- a GPU host whose torch cannot see its GPUs ------------------------------------------------------
# (here, not in the GPU check's command module: the runner and the smoke ask too, and import no command)


def nvidia_smi_versions(run=None) -> tuple[str | None, str | None]:
    """(driver version, newest CUDA the driver supports) from nvidia-smi's header; (None, None) without it.
    `run() -> stdout` is injectable (tests feed recorded output)."""
    if run is None:
        if not shutil.which("nvidia-smi"):
            return None, None

        def run():
            return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout

    try:
        out = run()
    except (OSError, subprocess.SubprocessError):
        return None, None
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)"); [] without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def cuda_error_line(
    available: bool,
    torch_version: str,
    torch_cuda: str | None,
    driver: str | None,
    driver_cuda: str | None,
    head: str = "error: CUDA required but torch.cuda.is_available() is False",
) -> str | None:
    """None when torch sees a GPU, else the one line saying why not and the fix (`head` first)."""
    if available:
        return None
    head = f"{head} (torch {torch_version}"
    if torch_cuda is None:
        return f"{head}, a CPU-only build: torch.version.cuda is None); install a CUDA build of torch"
    if driver is None:
        return f"{head} built for CUDA {torch_cuda}): nvidia-smi finds no NVIDIA driver; run on a GPU node"
    if driver_cuda and _version(driver_cuda) < _version(torch_cuda):
        return (
            f"{head}): driver/CUDA mismatch: torch.version.cuda={torch_cuda} but driver {driver} supports CUDA "
            f"<= {driver_cuda}; install a torch build for CUDA <= {driver_cuda} or a driver for CUDA {torch_cuda}"
        )
    return (
        f"{head}, torch.version.cuda={torch_cuda}, driver {driver} supports CUDA {driver_cuda}): no device visible "
        "to torch; check CUDA_VISIBLE_DEVICES and the runner's GPU binding (docker --gpus)"
    )


def cuda_error() -> str | None:
    """`cuda_error_line` for this machine (nvidia-smi asked only when torch sees no GPU)."""
    import torch

    if torch.cuda.is_available():
        return None
    return cuda_error_line(False, torch.__version__, torch.version.cuda, *nvidia_smi_versions())


def unseen_gpus_line(env: Mapping[str, str] = os.environ) -> str | None:
    """One line (no "error: ") when nvidia-smi lists GPUs but torch sees none, so a run would quietly take
    CPU ranks instead: why (the driver/CUDA mismatch, a CPU-only torch, ...) and the fix. None when torch
    sees a GPU, when nvidia-smi lists none, or when CUDA_VISIBLE_DEVICES hides them on purpose ("" or -1)."""
    import torch

    if torch.cuda.is_available() or env.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return None
    gpus = nvidia_smi_gpus()
    if not gpus:
        return None
    head = (
        f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0].split(' (UUID')[0]}) but torch.cuda.is_available() is "
        "False, so this would run on CPU ranks"
    )
    line = cuda_error_line(False, torch.__version__, torch.version.cuda, *nvidia_smi_versions(), head=head)
    return f"{line} (CUDA_VISIBLE_DEVICES= runs on the CPU on purpose)"
