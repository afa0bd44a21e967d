"""Sweep files: one benchmark point per line of Hydra overrides, run here or as a Slurm job array.

    python -m ptbench.sweep grid adapter=ddp,zero workload=gpt2_small launcher.nprocs=1,2,4 -o sweep.txt
    python -m ptbench.sweep run sweep.txt [--resume] [-- trainer.epochs=3 ...]   # here, one after another
    python -m ptbench.sweep submit sweep.txt [--resume] [--gpus-per-node 8] [--sbatch=--partition=gpu]  # job arrays
    python -m ptbench.sweep point sweep.txt 3 [--resume] [-- overrides]  # "RANKS GPUS_PER_RANK overrides" or "skip"
    python -m ptbench.sweep point sweep.txt 3 --oom-retry [-- overrides]  # its OOM retry's overrides, or "skip"

`grid` expands like `python -m ptbench -m` does (Hydra's own parser and cartesian product, so
`a,b`, `range(1,4)` and quoting mean the same). Point i is the i-th line that is neither blank
nor a comment, counted from 0 = SLURM_ARRAY_TASK_ID of `sbatch --array=0-N`.

A point is identified by `point_id`: a hash of the config its overrides resolve to plus its world
size, leaving out where records go, how ranks find each other and where the data lives (results.*,
hydra.*, launcher=..., master address and port, data paths), so the same line gives the same id
whether it runs here, in a job array or in a Hydra multirun, and a changed default or another rank
count is another point. Every record stores it as `point`; with `results.resume=true` (what `--resume` passes)
a run whose point already has an ok record under results.root/results.experiment is skipped, so
re-running a sweep re-runs only the points that failed, were preempted or never ran.

A point whose run ends `oom` is run once more with half its per-device batch, as its own point with
`extra.batch_reduced_from` (`oom_retry`): by `run` here, and inside the array task by slurm/array.sbatch
(`point --oom-retry`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ptbench.core.records import point_folders, point_records, results_folder
from ptbench.invoke import run_bench

REPO = Path(__file__).resolve().parents[1]  # a source checkout: slurm/ beside bench/

# Keys of the resolved config that do not change what is measured: where records go, how ranks find
# each other, where the data lives, progress bars.
_NOT_PART_OF_POINT = {"results": None, "hydra": None,
                      "launcher": ("name", "master_addr", "master_port"),
                      "data": ("root", "tokenizer_dir", "cache_dir"),
                      # how a run is resumed or stopped for tests is not what it measures
                      "trainer": ("progress", "resume", "checkpoint_every", "checkpoint_keep", "inject_stop")}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def point_id_of(cfg, env=os.environ) -> str:
    """Stable id of a point: sha1 of its *resolved* config (so a changed default is another point) and
    its world size (launcher.nprocs, or the srun task count under launcher=slurm), leaving out where
    records go, how ranks find each other and where the data lives (10 hex digits)."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(cfg, resolve=True)
    for group, keys in _NOT_PART_OF_POINT.items():
        if keys is None:
            d.pop(group, None)
        else:
            for k in keys:
                d.get(group, {}).pop(k, None)
    if (d.get("schedule") or {}).get("name") == "constant":  # the default: points keep their ids from before schedules
        d.pop("schedule")
    if cfg.launcher.name == "slurm" and env.get("SLURM_NTASKS"):
        d["launcher"]["nprocs"] = int(env["SLURM_NTASKS"])  # srun decides the world, not nprocs
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]


def point_id(overrides) -> str:
    """`point_id_of` the config these overrides compose to (Hydra's own parsing: quoting and order do
    not matter); overrides that do not compose are hashed as text (the run itself will be refused)."""
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose

    kept = [o for o in overrides if not _key(o).startswith(("hydra.", "hydra/"))]
    try:
        return point_id_of(compose(kept))
    except ConfigError:
        return hashlib.sha1("\n".join(sorted(kept)).encode()).hexdigest()[:10]


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of sweep overrides, exactly as Hydra's basic sweeper forms its jobs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


def read_points(path: Path) -> list[list[str]]:
    points = []
    for line in Path(path).read_text().splitlines():
        args = shlex.split(line, comments=True)
        if args:
            points.append(args)
    return points


def write_points(path: Path, points: list[list[str]], header: str) -> None:
    lines = [f"# {header}", f"# {len(points)} points; one line of Hydra overrides each (see bench/sweep.py)"]
    lines += [shlex.join(p) for p in points]
    Path(path).write_text("\n".join(lines) + "\n")


def layout(overrides: list[str]) -> tuple[int, int]:
    """(ranks, devices per rank) of a point given as overrides: what Slurm must allocate."""
    return layout_of(compose_point(overrides))


def compose_point(overrides: list[str]):
    """The config `python -m ptbench <overrides>` would run, with its point id (no torch import)."""
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose

    try:
        cfg = compose(list(overrides))
    except ConfigError as e:
        raise ConfigError(f"point `{shlex.join(overrides)}`: {e}") from None
    if cfg.results.point is None:
        cfg.results.point = point_id_of(cfg)
    return cfg


def run_name(overrides: list[str]) -> tuple[str, str, int]:
    """(adapter, workload, ranks) of a point, for its run id; a point that does not compose keeps a generic
    name (its run then fails with the composition error, recorded under that id)."""
    from ptbench.core.errors import ConfigError

    try:
        cfg = compose_point(overrides)
    except ConfigError:
        return "run", "point", 0
    return cfg.adapter.name, cfg.workload.name, layout_of(cfg)[0]


def layout_of(cfg) -> tuple[int, int]:
    from ptbench.adapters import get_adapter_class

    cls = get_adapter_class(cfg.adapter.name)
    return cls.processes(cfg), cls.devices_per_process(cfg)


def slurm_shape(ranks: int, devices: int, gpus_per_node: int | None) -> tuple[int, int, int | None]:
    """(nodes, tasks per node, GPUs per node) for one task per rank; no GPUs: one node."""
    if not gpus_per_node:
        return 1, ranks, None
    per_node = max(1, gpus_per_node // devices)
    nodes = -(-ranks // per_node)
    if ranks % nodes:
        from ptbench.core.errors import ConfigError

        raise ConfigError(f"{ranks} ranks do not split evenly over {nodes} nodes of {gpus_per_node} GPUs; "
                          "change gpus_per_node or the point's rank count")
    return nodes, ranks // nodes, ranks // nodes * devices


def ok_record(folders, point: str) -> Path | None:
    """The first run folder under `folders` whose summary says this point finished ok."""
    return next((path.parent for path, s in point_records(folders, point) if s.get("status") == "ok"), None)


def newest_status(cfg) -> str | None:
    """The status of the newest record of cfg's point under its results folder (None: no record)."""
    records = point_records(point_folders(cfg.results), cfg.results.point)
    return max(((path.stat().st_mtime, s.get("status")) for path, s in records), default=(0.0, None))[1]


def apply_hydra_context(cfg) -> None:
    """Inside `python -m ptbench`: name the point from its overrides; a multirun keeps its records in
    its sweep folder (hydra.sweep.dir), so every point of one sweep lands in one place."""
    from hydra.core.hydra_config import HydraConfig

    from ptbench.runner.compose import in_multirun

    if cfg.results.point is None:
        cfg.results.point = point_id_of(cfg)
    if in_multirun() and cfg.results.dir is None:
        cfg.results.dir = str(HydraConfig.get().sweep.dir)


def skip_if_done(cfg, out=None) -> bool:
    """results.resume=true and this point already has an ok record: say so and skip the run. Called
    before torch is imported, so skipped points of a sweep or job array cost little."""
    out = out or sys.stdout  # looked up at call time: pytest's capsys and redirections replace sys.stdout
    if not (cfg.results.resume and cfg.results.point):
        return False
    done = ok_record(point_folders(cfg.results), cfg.results.point)
    if done and os.environ.get("SLURM_PROCID", "0") == "0":  # one line per point, not per rank
        print(f"point {cfg.results.point} already ok in {done}: skipped (results.resume=true)", file=out, flush=True)
    return done is not None


# --- command line ----------------------------------------------------------------------------------
def _grid(args) -> int:
    points = expand_grid(args.overrides)
    header = "python -m ptbench.sweep grid " + shlex.join(args.overrides)
    if args.output == "-":
        print("\n".join(shlex.join(p) for p in points))
    else:
        write_points(Path(args.output), points, header)
        print(f"{len(points)} points -> {args.output}; run them here with `python -m ptbench.sweep run {args.output}`,"
              f" or on Slurm with `python -m ptbench.sweep submit {args.output}`")
    return 0


def _point(args) -> int:
    points = read_points(args.file)
    if not 0 <= args.index < len(points):
        print(f"error: {args.file} has {len(points)} points (0-{len(points) - 1}); there is no point {args.index}",
              file=sys.stderr)
        return 2
    cfg = compose_point([*points[args.index], *args.extra])
    if args.oom_retry:  # array.sbatch after a failed srun: the retry's own overrides, or "skip"
        retry = oom_retry([*points[args.index], *args.extra]) if newest_status(cfg) == "oom" else None
        if retry is None:
            print("skip")
            return 0
        print(*layout_of(compose_point(retry)), shlex.join(retry[-2:]))
        return 0
    if args.resume:
        cfg.results.resume = True
        if skip_if_done(cfg, out=sys.stderr):
            print("skip")  # array.sbatch: nothing to run, not even srun
            return 0
    ranks, devices = layout_of(cfg)
    print(ranks, devices, shlex.join(points[args.index]))
    return 0


def _run(args) -> int:
    points = read_points(args.file)
    if not points:
        print(f"error: {args.file} has no points", file=sys.stderr)
        return 2
    extra = [*args.extra, *(["results.resume=true"] if args.resume else [])]
    if not args.no_comm:  # the measured network, once per sweep and world size, beside the records
        measure_comm(points, args.extra, dry_run=args.dry_run, resume=args.resume)
    failed = []
    for i, point in enumerate(points):
        print(f"[{i + 1}/{len(points)}] point {point_id([*point, *args.extra])}: {shlex.join(point)}", flush=True)
        if args.dry_run:
            print("  " + shlex.join([sys.executable, "-m", "ptbench", *point, *extra]))
            continue
        name = run_name([*point, *extra])
        run = run_bench([*point, *extra], capture=False, run_name=name)  # a failed point does not stop the sweep
        retry = oom_retry([*point, *extra]) if run.status == "oom" else None
        if retry:  # the paper halved the per-GPU batch by hand where a point ran out of memory
            print(f"  point {i} ran out of memory: once more with trainer.batch_size={retry[-2].split('=')[1]}", flush=True)
            run = run_bench(retry, capture=False, run_name=name)
        if run.returncode:
            failed.append((i, run.returncode))
    for i, code in failed:
        print(f"point {i} ({shlex.join(points[i])}) exited {code}", file=sys.stderr)
    return 1 if failed else 0


# a short ptbench.comm: sizes 1K x 4^k up to its default maximum, fewer calls per size (~20 s for 2 CPU ranks)
COMM_ARGS = ("--factor", "4", "--iters", "10", "--warmup", "3")


def comm_targets(points: list[list[str]], extra: list[str]) -> list[tuple[Path, int, str]]:
    """(folder, ranks, backend) per distinct multi-rank world size of the sweep's points: where
    `python -m ptbench.comm --out` stores <backend>-<N>.json (the records' folder + /comm)."""
    from ptbench.core.errors import ConfigError

    out = []
    for point in points:
        try:
            cfg = compose_point([*point, *extra])
        except ConfigError:
            continue  # the point's own run says what is wrong
        ranks, _ = layout_of(cfg)
        folder = results_folder(cfg.results) / "comm"
        if ranks > 1 and (folder, ranks, cfg.launcher.backend) not in out:
            out.append((folder, ranks, cfg.launcher.backend))
    return out


def measure_comm(points: list[list[str]], extra: list[str], dry_run: bool = False, resume: bool = False) -> None:
    """`python -m ptbench.comm` once per world size of the sweep (bench/comm.py), before its points; a
    failed measurement is reported and the sweep goes on (the report then says "not measured")."""
    for folder, ranks, backend in comm_targets(points, extra):
        if resume and any(folder.glob(f"*-{ranks}.json")):
            print(f"comm: {folder} already holds a {ranks}-rank measurement: kept (--resume)", flush=True)
            continue
        cmd = [sys.executable, "-m", "ptbench.comm", "--world-size", str(ranks), "--backend", backend, *COMM_ARGS,
               "--out", str(folder)]
        print(f"comm: {shlex.join(cmd)}", flush=True)
        if not dry_run and subprocess.run(cmd).returncode:
            print(f"warning: ptbench.comm at {ranks} ranks failed; the report will say `not measured`", file=sys.stderr)


def submit_comm(file: Path, extra: list[str], *, gpus_per_node: int = 0, sbatch: list[str] = (), resume: bool = False,
                dry_run: bool = False, out=None) -> int:
    """`ptbench.sweep submit`'s network measurement: one small job per world size of the sweep running
    `srun python -m ptbench.comm --out <records>/comm` (under srun ptbench.comm is one rank per task)."""
    out = out or sys.stdout
    code = 0
    for folder, ranks, backend in comm_targets(read_points(file), extra):
        if resume and any(folder.glob(f"*-{ranks}.json")):
            print(f"comm: {folder} already holds a {ranks}-rank measurement: kept (--resume)", file=out, flush=True)
            continue
        nodes, per_node, gpus = slurm_shape(ranks, 1, gpus_per_node)
        inner = [sys.executable, "-m", "ptbench.comm", "--backend", backend, *COMM_ARGS, "--out", str(folder.absolute())]
        cmd = ["sbatch", "--parsable", "--job-name=bench-comm", f"--chdir={REPO}", "--time=00:20:00",
               f"--output={folder.absolute()}/slurm-%j.out", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
               *([f"--gpus-per-node={gpus}"] if gpus else []), *sbatch, f"--wrap=srun {shlex.join(inner)}"]
        print(shlex.join(cmd), file=out, flush=True)
        if dry_run:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout.strip() or proc.stderr.strip(), file=out, flush=True)
        code = code or proc.returncode
    return code


def oom_retry(overrides: list[str]) -> list[str] | None:
    """The overrides of the point once more with half its per-device batch, recorded as its own point
    (`extra.batch_reduced_from`); None when the batch cannot be halved."""
    b = compose_point(overrides).trainer.batch_size
    if b < 2:
        return None
    return [*overrides, f"trainer.batch_size={b // 2}", f"++extra.batch_reduced_from={b}"]


def submit_arrays(file: Path, extra: list[str], *, gpus_per_node: int = 0, sbatch: list[str] = (),
                  resume: bool = False, script: Path | None = None, dry_run: bool = False,
                  out=None) -> tuple[int, list[str]]:
    """sbatch slurm/array.sbatch once per allocation shape (Slurm gives every task of an array the same
    resources); returns (exit code, job ids). `sbatch` options such as --dependency=afterok:ID go to
    every array. Dry run: the commands are printed and the ids are placeholders."""
    out = out or sys.stdout
    points = read_points(file)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, point in enumerate(points):
        groups[layout([*point, *extra])].append(i)
    script = Path(script or REPO / "slurm" / "array.sbatch")
    # job logs under the results root, never in the folder sbatch was called from (a later
    # --sbatch=--output=... still wins: sbatch takes the last)
    root = next((o.split("=", 1)[1] for o in reversed(extra) if o.startswith("results.root=")),
                os.environ.get("RESULTS") or str(REPO / "results"))
    logs = Path(root).absolute() / "slurm"
    if not dry_run:
        logs.mkdir(parents=True, exist_ok=True)
    code, ids = 0, []
    for n, ((ranks, devices), indices) in enumerate(groups.items()):
        nodes, per_node, gpus = slurm_shape(ranks, devices, gpus_per_node)
        shape = [f"--nodes={nodes}", f"--ntasks-per-node={per_node}", *([f"--gpus-per-node={gpus}"] if gpus else [])]
        cmd = ["sbatch", "--parsable", f"--output={logs}/%x-%A_%a.out", f"--array={','.join(map(str, indices))}",
               *shape, *sbatch, str(script), str(file), *(["--resume"] if resume else []), *extra]
        print(shlex.join(cmd), file=out, flush=True)
        if dry_run:
            ids.append(f"<{Path(file).stem}-{n}>")
            continue
        # the job finds this checkout and interpreter even when submitted from elsewhere
        env = {"REPO": str(REPO), "PYTHON": sys.executable, **os.environ}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        print(proc.stdout.strip() or proc.stderr.strip(), file=out, flush=True)
        code = code or proc.returncode
        if proc.returncode == 0 and proc.stdout.strip():
            ids.append(proc.stdout.strip().split(";")[0])
    return code, ids


def _submit(args) -> int:
    if not args.dry_run and not shutil.which("sbatch"):
        print("error: sbatch not found: run this on a Slurm login node (or add --dry-run)", file=sys.stderr)
        return 2
    code, _ = submit_arrays(args.file, args.extra, gpus_per_node=args.gpus_per_node, sbatch=args.sbatch,
                            resume=args.resume, script=Path(args.script), dry_run=args.dry_run)
    if not args.no_comm:
        code = submit_comm(args.file, args.extra, gpus_per_node=args.gpus_per_node, sbatch=args.sbatch,
                           resume=args.resume, dry_run=args.dry_run) or code
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--grid"]:  # `python -m ptbench.sweep --grid ...` reads naturally too
        argv[0] = "grid"
    extra = []
    if "--" in argv:  # overrides after `--` go to every point
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(prog="python -m ptbench.sweep", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid", help="write the cartesian product of sweep overrides, one point per line")
    g.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. adapter=ddp,zero launcher.nprocs=1,2,4")
    g.add_argument("-o", "--output", default="-", help="sweep file to write (default: print)")
    r = sub.add_parser("run", help="run every point here, one after another (overrides after -- go to every point)")
    r.add_argument("file", type=Path)
    r.add_argument("--resume", action="store_true", help="skip points that already have an ok record")
    r.add_argument("--dry-run", action="store_true", help="print the commands only")
    r.add_argument("--no-comm", action="store_true", help="skip the per-sweep `python -m ptbench.comm` measurement "
                   "(stored in <results>/<experiment>/comm/ for the report)")
    s = sub.add_parser("submit", help="sbatch slurm/array.sbatch once per allocation shape (overrides after -- go to every point)")
    s.add_argument("file", type=Path)
    s.add_argument("--resume", action="store_true", help="array tasks skip points that already have an ok record")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node of your cluster (0: CPU, one node)")
    s.add_argument("--script", default=str(REPO / "slurm" / "array.sbatch"))
    s.add_argument("--sbatch", action="append", default=[], metavar="ARG",
                   help="an sbatch option for every array, e.g. --sbatch=--partition=gpu (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    s.add_argument("--no-comm", action="store_true", help="skip the one small `python -m ptbench.comm` job per world "
                   "size (stored in <results>/<experiment>/comm/ for the report)")
    p = sub.add_parser("point", help="print RANKS GPUS_PER_RANK OVERRIDES of point INDEX (used by array.sbatch);"
                                     " overrides after -- are the run's other overrides")
    p.add_argument("file", type=Path)
    p.add_argument("index", type=int)
    p.add_argument("--resume", action="store_true", help="print `skip` if the point already has an ok record")
    p.add_argument("--oom-retry", action="store_true",
                   help="after a failed run: RANKS GPUS_PER_RANK and the overrides that retry the point with half its "
                        "per-device batch if its newest record says oom (extra.batch_reduced_from), else `skip`")
    args = parser.parse_args(argv)
    from ptbench.core.errors import ConfigError

    try:
        return _dispatch(args, extra)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args, extra: list[str]) -> int:
    if args.cmd == "grid":
        return _grid(args)
    args.extra = extra
    return {"point": _point, "run": _run, "submit": _submit}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
