"""Run records under results/<experiment>/<run_id>/, written atomically.

    config.yaml    the resolved config
    env.json       versions, host, devices, git sha, Slurm ids
    events.jsonl   one line per epoch (appended; each append rewrites the file via temp + rename)
    summary.json   status (ok / failed / oom / timeout / preempted / running) and the run's totals

Every key of those files is listed in bench/core/schema.py; a key it does not list is refused here.

A crash at any point leaves every file either in its previous state or its new one, never half.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import secrets
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ptbench.core import schema

# versions every record states; the runner adds each adapter's framework (from the adapter registry)
BASE_PACKAGES = ("torch", "torchvision", "hydra-core", "nvtx")
# skipped: a driver never ran the point (its framework is not installed); the rest are a run's own outcomes
STATUSES = ("running", "ok", "failed", "oom", "timeout", "preempted", "skipped")


def atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def results_folder(results) -> Path:
    """The folder a run's record folder goes in (`results`: the config's results group): results.dir
    (a sweep's folder) or else results.root/results.experiment."""
    return Path(results.dir or Path(results.root) / results.experiment)


def point_folders(results) -> set[Path]:
    """Where earlier records of a point may be (`results`: the config's results group):
    results.root/results.experiment, and results.dir (a sweep's folder) or else results.root."""
    return {Path(results.root) / results.experiment, Path(results.dir or results.root)}


def point_records(folders, point: str):
    """(summary.json path, summary) of every record of `point` under `folders`: each record folder
    once (the folders may nest), in path order; a summary being written (unreadable) is passed over."""
    seen = set()
    for root in map(Path, folders):
        for path in sorted(root.rglob("summary.json")) if root.is_dir() else []:
            run_dir = path.parent.resolve()
            if run_dir in seen:
                continue
            seen.add(run_dir)
            try:
                s = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if s.get("point") == point:
                yield path, s


def new_run_id(adapter: str, workload: str, world_size: int) -> str:
    """Unique across array tasks, requeues and Slurm restarts: time + host + random, never the job id alone."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    slurm = f"-j{job}" + (f"_{task}" if task else "") if job else ""
    return f"{stamp}-{adapter}-{workload}-w{world_size}{slurm}-{secrets.token_hex(3)}"


class RunRecord:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)

    def create(self, config_yaml: str, packages: tuple[str, ...] = ()) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / "config.yaml", config_yaml)
        write_json(self.dir / "env.json", environment(packages))

    def append_event(self, event: dict) -> None:
        schema.check(event, schema.EPOCH_EVENT, "events.jsonl")
        path = self.dir / "events.jsonl"
        old = path.read_text() if path.exists() else ""
        atomic_write(path, old + json.dumps(event, sort_keys=True, default=str) + "\n")

    def events(self) -> list[dict]:
        path = self.dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def summary(self) -> dict | None:
        path = self.dir / "summary.json"
        return read_json(path) if path.exists() else None

    def write_summary(self, summary: dict) -> None:
        assert summary.get("status") in STATUSES, summary.get("status")
        schema.check(summary, schema.SUMMARY, "summary.json")
        write_json(self.dir / "summary.json", summary)

    def write_rank_error(self, rank: int, error: dict) -> None:
        write_json(self.dir / f"error-rank{rank}.json", error)

    def rank_errors(self) -> list[dict]:
        return [read_json(p) for p in sorted(self.dir.glob("error-rank*.json"))]


class RunWriter:
    """The one writer of a run's summary.json: `start` (status running), `fail`, `finish`. Every summary
    carries the run's identity (RunPlan.identity()) and run_id, whatever its status."""

    def __init__(self, run_dir: Path, identity: dict):
        self.record = RunRecord(run_dir)
        self.identity = {"run_id": Path(run_dir).name, **identity}

    @property
    def dir(self) -> Path:
        return self.record.dir

    def start(self, config_yaml: str, packages: tuple[str, ...] = ()) -> None:
        self.record.create(config_yaml, packages)
        self.record.write_summary({"status": "running", **self.identity})

    def fail(self, status: str, error: str, failed_rank: int | None = None, **extra) -> None:
        """A failed outcome; the first word wins: an outcome already written (by rank 0) is kept."""
        current = self.record.summary() or {}
        if current.get("status") not in (None, "running"):
            return
        self.record.write_summary(
            {**current, **self.identity, "status": status, "error": error, "failed_rank": failed_rank, **extra}
        )

    def finish(self, summary: dict) -> None:
        self.record.write_summary({**summary, **self.identity})


def _git_sha() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(packages: tuple[str, ...] = ()) -> dict:
    versions = {}
    for name in dict.fromkeys((*BASE_PACKAGES, *packages)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env = {
        "python": platform.python_version(),
        "versions": versions,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "git_sha": _git_sha(),
        "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k in SLURM_KEYS},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env.update(gpu_environment(torch))
    except ImportError:
        pass
    return schema.check(env, schema.ENV, "env.json")


def gpu_environment(torch) -> dict:
    """What a GPU user needs to compare runs: versions (driver, CUDA, cuDNN, NCCL), the GPUs (name,
    memory, count), the topology (`nvidia-smi topo -m`), NCCL_* / CUDA_* variables, TF32 flags."""
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    out = {
        "gpus": [p.name for p in props],
        "gpu_count": len(props),
        "gpu_memory_bytes": [int(p.total_memory) for p in props],
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "gpu_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "CUDA_"))},
    }
    out.update(nvidia_smi())
    return out


def nvidia_smi(run=None) -> dict:
    """Driver version and GPU list from `nvidia-smi --query-gpu`, and the `topo -m` matrix (text), when
    nvidia-smi is on PATH. `run(args) -> stdout` is injectable (tests feed recorded output)."""
    import shutil

    if run is None:
        if not shutil.which("nvidia-smi"):
            return {}

        def run(args):
            return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout

    out: dict = {}
    try:
        rows = [
            r.split(", ")
            for r in run(["--query-gpu=driver_version,name,memory.total,pci.bus_id", "--format=csv,noheader"])
            .strip()
            .splitlines()
            if r.strip()
        ]
        if rows:
            out["driver"] = rows[0][0]
            out["nvidia_smi_gpus"] = [{"name": r[1], "memory": r[2], "bus_id": r[3]} for r in rows if len(r) >= 4]
        topo = run(["topo", "-m"]).strip()
        if topo:
            out["topology"] = topo
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return out


SLURM_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)
