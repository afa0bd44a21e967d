"""Benchmark points: sweep files, grid expansion and point identity, what `python -m ptbench` and every
sweep driver share (the runner's, so a run never imports a driver).

A sweep file holds one point per line of Hydra overrides; point i is the i-th line that is neither
blank nor a comment, counted from 0 = SLURM_ARRAY_TASK_ID of `sbatch --array=0-N`. `expand_grid`
expands like `python -m ptbench -m` does (Hydra's own parser and cartesian product, so `a,b`,
`range(1,4)` and quoting mean the same).

A point is identified by `point_id`: a hash of the config its overrides resolve to plus its world
size, leaving out where records go, how ranks find each other and where the data lives (results.*,
hydra.*, launcher=..., master address and port, data paths), so the same line gives the same id
whether it runs here, in a job array or in a Hydra multirun, and a changed default or another rank
count is another point. Every record stores it as `point`; with `results.skip_done=true` a run whose
point already has an ok record under results.root/results.experiment is skipped (`skip_if_done`).

A point whose run ends `oom` is run once more with half its per-device batch, as its own point with
`extra.batch_reduced_from` (`oom_retry`).

Repeats (`python -m ptbench.sweep run --repeats N`) run every point N times, interleaved (all
points once, then all again); each run carries `results.repeat` (not part of the point id) and, with
`--vary-seed`, trainer.seed + repeat under the same pinned point id (`repeat_overrides`); skip_done
skips only a repeat that already has an ok record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

from hydra.experimental.callback import Callback

from ptbench.core.errors import ConfigError
from ptbench.core.readers import point_records, read_record, read_yaml
from ptbench.core.records import point_folders, results_folder
from ptbench.runner.compose import compose, in_multirun

# Keys of the resolved config that do not change what is measured: where records go, how ranks find
# each other, where the data lives, progress bars.
_NOT_PART_OF_POINT = {
    "results": None,
    "hydra": None,
    "launcher": ("name", "master_addr", "master_port"),
    "data": ("root", "tokenizer_dir", "cache_dir"),
    # how a run is resumed or stopped for tests is not what it measures
    "trainer": ("progress", "log_every", "resume", "checkpoint_every", "checkpoint_keep", "inject_stop"),
}

# a short ptbench.comm: sizes 1K x 4^k up to its default maximum, fewer calls per size (~20 s for 2 CPU ranks)
COMM_ARGS = ("--factor", "4", "--iters", "10", "--warmup", "3")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# --- sweep files and grids -------------------------------------------------------------------------
def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of sweep overrides, as Hydra's basic sweeper forms its jobs (a key given twice: the
    last value wins; `a,b`, `range(..)`, quoting by Hydra's own parser), through Hydra's public override API
    (`Override.sweep_string_iterator`), not its private BasicSweeper."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise ConfigError(f"{key}: a {o.value_type.name} sweep has no list of points; write the values a,b,c")
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]  # a repeated key: its first position, its last value
    return [list(p) for p in itertools.product(*choices.values())]


def _sweep_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every point line of a sweep file: not blank, not a comment. One line
    (ConfigError) when the file cannot be read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"sweep file {path}: no such file (write one with `python -m ptbench.sweep grid ... -o {path}`)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"sweep file {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    return [
        (n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.lstrip().startswith("#")
    ]


def _parse_line(path: Path, number: int, line: str) -> list[str]:
    try:
        args = shlex.split(line, comments=True)
    except ValueError as e:  # shlex: "No closing quotation", "No escaped character"
        raise ConfigError(f"{path}:{number}: {str(e).lower()}: {line.strip()}") from None
    if not args:
        raise ConfigError(f"{path}:{number}: no overrides on this line: {line.strip()}")
    return args


def read_points(path: Path) -> list[list[str]]:
    """Every point of a sweep file, parsed up front: a bad line is one ConfigError naming file:line."""
    return [_parse_line(path, n, line) for n, line in _sweep_lines(path)]


def read_point(path: Path, index: int) -> tuple[list[str], int]:
    """(point `index` of a sweep file, the number of points): only that line is parsed (an array task
    is not failed by a bad line of another task)."""
    lines = _sweep_lines(path)
    if not 0 <= index < len(lines):
        return [], len(lines)
    return _parse_line(path, *lines[index]), len(lines)


def write_points(path: Path, points: list[list[str]], header: str) -> None:
    lines = [f"# {header}", f"# {len(points)} points; one line of Hydra overrides each (see bench/runner/points.py)"]
    lines += [shlex.join(p) for p in points]
    Path(path).write_text("\n".join(lines) + "\n")


# --- identity --------------------------------------------------------------------------------------
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
    if "lr_schedule" in d:  # hashed under its name before the rename (schedule=): ids stay as they were
        d["schedule"] = d.pop("lr_schedule")
    if (d.get("schedule") or {}).get("name") == "constant":  # the default: points keep their ids from before schedules
        d.pop("schedule")
    if cfg.launcher.name == "slurm" and env.get("SLURM_NTASKS"):
        d["launcher"]["nprocs"] = int(env["SLURM_NTASKS"])  # srun decides the world, not nprocs
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]


def point_id(overrides) -> str:
    """`point_id_of` the config these overrides compose to (Hydra's own parsing: quoting and order do
    not matter); overrides that do not compose are hashed as text (the run itself will be refused)."""
    kept = [o for o in overrides if not _key(o).startswith(("hydra.", "hydra/"))]
    try:
        return point_id_of(compose(kept))
    except ConfigError:
        return hashlib.sha1("\n".join(sorted(kept)).encode()).hexdigest()[:10]


def compose_point(overrides: list[str]):
    """The config `python -m ptbench <overrides>` would run, with its point id (no torch import)."""
    try:
        cfg = compose(list(overrides))
    except ConfigError as e:
        raise ConfigError(f"point `{shlex.join(overrides)}`: {e}") from None
    if cfg.results.point is None:
        cfg.results.point = point_id_of(cfg)
    return cfg


def layout_of(cfg) -> tuple[int, int]:
    """(ranks, devices per rank) of a composed point: what Slurm must allocate."""
    from ptbench.adapters import get_adapter_class

    cls = get_adapter_class(cfg.adapter.name)
    return cls.processes(cfg), cls.devices_per_process(cfg)


def layout(overrides: list[str]) -> tuple[int, int]:
    """`layout_of` a point given as overrides."""
    return layout_of(compose_point(overrides))


def run_name(overrides: list[str]) -> tuple[str, str, int]:
    """(adapter, workload, ranks) of a point, for its run id; a point that does not compose keeps a generic
    name (its run then fails with the composition error, recorded under that id)."""
    try:
        cfg = compose_point(overrides)
    except ConfigError:
        return "run", "point", 0
    return cfg.adapter.name, cfg.workload.name, layout_of(cfg)[0]


def apply_hydra_context(cfg) -> None:
    """Inside `python -m ptbench`: name the point from its overrides; a multirun keeps its records in
    its sweep folder (hydra.sweep.dir), so every point of one sweep lands in one place."""
    from hydra.core.hydra_config import HydraConfig

    if cfg.results.point is None:
        cfg.results.point = point_id_of(cfg)
    if in_multirun() and cfg.results.dir is None:
        cfg.results.dir = str(HydraConfig.get().sweep.dir)


# --- what was run already --------------------------------------------------------------------------
def record_repeat(run_dir: Path) -> int:
    """The repeat index a record ran as (results.repeat in its config.yaml; 0 when absent)."""
    import yaml

    try:  # bounded, and any shape: the record may be another user's (readers.read_yaml)
        cfg = read_yaml(Path(run_dir) / "config.yaml") or {}
        return int((cfg.get("results") or {}).get("repeat") or 0)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return 0


def ok_record(folders, point: str, repeat: int | None = None) -> Path | None:
    """The first run folder under `folders` whose summary says this point finished ok (and, given
    `repeat`, ran as that repeat: `--resume` of a sweep with --repeats counts repeats). Only this user's records
    count: a point id is a hash anyone can compute, and an `ok` record another user planted in a shared results
    folder would otherwise skip our run."""
    return next(
        (
            path.parent
            for path, s in point_records(folders, point)
            if s.get("status") == "ok" and _ours(path) and (repeat is None or record_repeat(path.parent) == repeat)
        ),
        None,
    )


def _ours(summary: Path) -> bool:
    try:
        return os.lstat(summary).st_uid == os.stat(summary.parent).st_uid == os.geteuid()
    except OSError:
        return False


def newest_status(cfg) -> str | None:
    """The status of the newest record of cfg's point under its results folder (None: no record)."""
    newest, status = 0.0, None
    for path, s in point_records(point_folders(cfg.results), cfg.results.point):
        try:
            mtime = path.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        if mtime >= newest:
            newest, status = mtime, s.get("status")
    return status


def skip_if_done(cfg, out=None) -> bool:
    """results.skip_done=true and this point already has an ok record: say so and skip the run. Called
    before torch is imported, so skipped points of a sweep or job array cost little."""
    out = out or sys.stdout  # looked up at call time: pytest's capsys and redirections replace sys.stdout
    if not (cfg.results.skip_done and cfg.results.point):
        return False
    repeat = cfg.results.get("repeat") or 0
    done = ok_record(point_folders(cfg.results), cfg.results.point, repeat)
    if done and os.environ.get("SLURM_PROCID", "0") == "0":  # one line per point, not per rank
        which = f"point {cfg.results.point}" + (f" repeat {repeat}" if repeat else "")
        print(f"{which} already ok in {done}: skipped (results.skip_done=true)", file=out, flush=True)
    return done is not None


def repeat_overrides(overrides: list[str], repeat: int, vary_seed: bool = False, extra=()) -> list[str]:
    """The overrides of repeat `repeat` of a point: `results.repeat=R` (outside the point's identity,
    as all of results.* is) and, with `vary_seed` (statistical-efficiency runs), trainer.seed = the point's
    seed + R, with results.point pinned to the point's id so every repeat stays one point."""
    out = [*overrides, f"results.repeat={repeat}"]
    if vary_seed and repeat:
        cfg = compose_point([*overrides, *extra])
        out += [f"trainer.seed={cfg.trainer.seed + repeat}", f"results.point={cfg.results.point}"]
    return out


def oom_retry(overrides: list[str]) -> list[str] | None:
    """The overrides of the point once more with half its per-device batch, recorded as its own point
    (`extra.batch_reduced_from`); None when the batch cannot be halved."""
    b = compose_point(overrides).trainer.batch_size
    if b < 2:
        return None
    return [*overrides, f"trainer.batch_size={b // 2}", f"++extra.batch_reduced_from={b}"]


# --- the measured network a sweep needs --------------------------------------------------------------
def comm_targets(points: list[list[str]], extra: list[str]) -> list[tuple[Path, int, str]]:
    """(folder, ranks, backend) per distinct multi-rank world size of the sweep's points: where
    `python -m ptbench.comm --out` stores <backend>-<N>.json (the records' folder + /comm)."""
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


def comm_measured(folder: Path, ranks: int) -> bool:
    """The folder already holds a measurement at this world size (what --resume keeps)."""
    return any(folder.glob(f"*-{ranks}.json"))


class MultirunTally(Callback):
    """A Hydra callback (conf/config.yaml hydra.callbacks): when a multirun ends, one line counting its points'
    records by final status. The records are read from the sweep folder, so it holds for every launcher, the
    jobs of submitit's run in other processes included; a point refused before launch writes no record."""

    def on_multirun_end(self, config, **kwargs) -> None:
        print(f"multirun: {tally(Path(str(config.hydra.sweep.dir)))}", flush=True)


def tally(folder: Path) -> str:
    """A sweep folder's records by final status, as "N record(s) in FOLDER: n1 STATUS1, n2 STATUS2"."""
    found = (read_record(p) for p in sorted(folder.glob("*/summary.json")))
    statuses = Counter(str(s.get("status", "?")) for s in found if s is not None)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items())) or "no record written"
    return f"{sum(statuses.values())} record(s) in {folder}: {counts}"
