"""Slurm submission of a sweep file: one job array per allocation shape (slurm/array.sbatch), and one
small `python -m ptbench.comm` job per world size of the sweep.

Each array task asks `python -m ptbench.sweep point FILE INDEX` for its point and runs it under srun
(launcher=slurm, one rank per task); see slurm/README.md. The Hydra launcher plugin bench_slurm
sizes its jobs with the same `slurm_shape`.
"""

from __future__ import annotations

import importlib.resources
import os
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ptbench.core.errors import ConfigError
from ptbench.runner.points import COMM_ARGS, comm_measured, comm_targets, layout, read_points, repeat_overrides

_HERE = Path(__file__).resolve().parents[2]
# A source checkout (slurm/ beside bench/): jobs run from it; an installed copy (pip install ptbench) has
# none, so jobs run from, and results default under, the folder the command was started in.
CHECKOUT = _HERE if (_HERE / "bench" / "__main__.py").is_file() and (_HERE / "slurm").is_dir() else None
REPO = CHECKOUT or Path.cwd()


def script_path(name: str) -> Path:
    """A file of the shipped slurm/ folder (array.sbatch, run.sbatch, stage_data.sh, local_cluster.sh): the
    package `ptbench.slurm` itself, not a folder under `ptbench`: pip's default editable install maps ptbench to
    bench/ and ptbench.slurm to slurm/, a wheel and the strict editable install put both in one tree."""
    return Path(str(importlib.resources.files("ptbench.slurm") / name)).resolve()  # a checkout: its slurm/


def slurm_shape(ranks: int, devices: int, gpus_per_node: int | None) -> tuple[int, int, int | None]:
    """(nodes, tasks per node, GPUs per node) for one task per rank; no GPUs: one node."""
    if not gpus_per_node:
        return 1, ranks, None
    per_node = max(1, gpus_per_node // devices)
    nodes = -(-ranks // per_node)
    if ranks % nodes:
        raise ConfigError(
            f"{ranks} ranks do not split evenly over {nodes} nodes of {gpus_per_node} GPUs; "
            "change gpus_per_node or the point's rank count"
        )
    return nodes, ranks // nodes, ranks // nodes * devices


def with_repeats(points: list[list[str]], repeats: int, vary_seed: bool = False, extra=()) -> list[list[str]]:
    """Each point `repeats` times, interleaved (ABCABC: a drift of the machine spreads over all points), every
    line its repeat's overrides (`results.repeat=R`, outside the point id; `vary_seed`: trainer.seed + R): one
    array task per repeat. repeats <= 1: the points as they are."""
    if repeats <= 1:
        return [list(p) for p in points]
    return [repeat_overrides(p, r, vary_seed, extra=extra) for r in range(repeats) for p in points]


def submit_arrays(
    file: Path,
    extra: list[str],
    *,
    gpus_per_node: int = 0,
    sbatch: list[str] = (),
    resume: bool = False,
    script: Path | None = None,
    dry_run: bool = False,
    out=None,
    points: list[list[str]] | None = None,
) -> tuple[int, list[str]]:
    """sbatch slurm/array.sbatch once per allocation shape (Slurm gives every task of an array the same
    resources); returns (exit code, job ids). `sbatch` options such as --dependency=afterok:ID go to
    every array. Dry run: the commands are printed and the ids are placeholders (`points`: the file's points
    when it is not written, as in `ptbench.paper plan --dry-run`)."""
    out = out or sys.stdout
    points = read_points(file) if points is None else points
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, point in enumerate(points):
        groups[layout([*point, *extra])].append(i)
    script = Path(script or script_path("array.sbatch"))
    # job logs under the results root, never in the folder sbatch was called from (a later
    # --sbatch=--output=... still wins: sbatch takes the last)
    root = next(
        (o.split("=", 1)[1] for o in reversed(extra) if o.startswith("results.root=")),
        os.environ.get("RESULTS") or str(REPO / "results"),
    )
    logs = Path(root).absolute() / "slurm"
    if not dry_run:
        logs.mkdir(parents=True, exist_ok=True)
    code, ids = 0, []
    for n, ((ranks, devices), indices) in enumerate(groups.items()):
        nodes, per_node, gpus = slurm_shape(ranks, devices, gpus_per_node)
        shape = [f"--nodes={nodes}", f"--ntasks-per-node={per_node}", *([f"--gpus-per-node={gpus}"] if gpus else [])]
        cmd = [
            "sbatch",
            "--parsable",
            f"--output={logs}/%x-%A_%a.out",
            f"--array={','.join(map(str, indices))}",
            *shape,
            *sbatch,
            str(script),
            str(file),
            *(["--resume"] if resume else []),
            *extra,
        ]
        print(shlex.join(cmd), file=out, flush=True)
        if dry_run:
            ids.append(f"<{Path(file).stem}-{n}>")
            continue
        # the job finds this checkout and interpreter even when submitted from elsewhere
        env = {
            "REPO": str(REPO),
            "PYTHON": sys.executable,
            "SCRIPTS": str(script_path("stage_data.sh").parent),
            **os.environ,
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        print(proc.stdout.strip() or proc.stderr.strip(), file=out, flush=True)
        code = code or proc.returncode
        if proc.returncode == 0 and proc.stdout.strip():
            ids.append(proc.stdout.strip().split(";")[0])
    return code, ids


def submit_comm(
    file: Path,
    extra: list[str],
    *,
    gpus_per_node: int = 0,
    sbatch: list[str] = (),
    resume: bool = False,
    dry_run: bool = False,
    out=None,
    points: list[list[str]] | None = None,
) -> int:
    """The sweep's network measurement: one small job per world size of the sweep running
    `srun python -m ptbench.comm --out <records>/comm` (under srun ptbench.comm is one rank per task).
    `points`: the file's lines as the caller checked them (else read from `file`)."""
    out = out or sys.stdout
    code = 0
    for folder, ranks, backend in comm_targets(read_points(file) if points is None else points, extra):
        if resume and comm_measured(folder, ranks):
            print(f"comm: {folder} already holds a {ranks}-rank measurement: kept (--resume)", file=out, flush=True)
            continue
        nodes, per_node, gpus = slurm_shape(ranks, 1, gpus_per_node)
        inner = [
            sys.executable,
            "-m",
            "ptbench.comm",
            "--backend",
            backend,
            *COMM_ARGS,
            "--out",
            str(folder.absolute()),
        ]
        cmd = [
            "sbatch",
            "--parsable",
            "--job-name=bench-comm",
            f"--chdir={REPO}",
            "--time=00:20:00",
            f"--output={folder.absolute()}/slurm-%j.out",
            f"--nodes={nodes}",
            f"--ntasks-per-node={per_node}",
            *([f"--gpus-per-node={gpus}"] if gpus else []),
            *sbatch,
            f"--wrap=srun {shlex.join(inner)}",
        ]
        print(shlex.join(cmd), file=out, flush=True)
        if dry_run:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout.strip() or proc.stderr.strip(), file=out, flush=True)
        code = code or proc.returncode
    return code
