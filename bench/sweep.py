"""Sweep files: one benchmark point per line of Hydra overrides, run here or as a Slurm job array.

    python -m ptbench.sweep grid adapter=ddp,zero workload=gpt2_small launcher.nprocs=1,2,4 -o sweep.txt
    python -m ptbench.sweep run sweep.txt [--resume] [-- trainer.epochs=3 ...]   # here, one after another
    python -m ptbench.sweep run sweep.txt --repeats 3 [--no-vary-seed]  # 3 rounds ABC BCA CAB, seed + R
    python -m ptbench.sweep noise --repeats 5 [--b trainer.inject_fault=slow@0.15] -- overrides  # A/A noise floor
    python -m ptbench.sweep submit sweep.txt [--resume] [--gpus-per-node 8] [--sbatch=--partition=gpu]  # job arrays
    python -m ptbench.sweep submit sweep.txt --repeats 3 [--no-vary-seed]  # one array task per repeat, interleaved
    python -m ptbench.sweep point sweep.txt 3 [--resume] [-- overrides]  # "RANKS GPUS_PER_RANK overrides" or "skip"
    python -m ptbench.sweep point sweep.txt 3 --oom-retry [-- overrides]  # its OOM retry's overrides, or "skip"

A sweep file lists points, and often sits in a group folder others can write: a line that sets a hydra.* key
(callbacks, job.env_set), calls a resolver (${oc.env:...}), names a config by path or passes a Hydra option
(-cd, --experimental-rerun) is refused in one line unless the reader passes --trust-sweep-file (array tasks:
PTBENCH_TRUST_SWEEP_FILE=1 in sbatch's environment, which `submit --trust-sweep-file` sets).

This module is the command line only. Grids, sweep files, point ids, `--resume` and the OOM retry are
bench/runner/points.py; Slurm submission is bench/runner/slurm.py; each point runs as
`python -m ptbench <overrides>` (bench/run_point.py). `run` and `submit` also measure the network once per
world size of the sweep (`python -m ptbench.comm --out <records>/comm`, for the report).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ptbench.core.errors import ConfigError
from ptbench.run_point import run_bench
from ptbench.runner.points import (
    COMM_ARGS,
    _parse_line,
    _sweep_lines,
    comm_measured,
    comm_targets,
    compose_point,
    expand_grid,
    layout_of,
    newest_status,
    oom_retry,
    point_id,
    repeat_overrides,
    run_name,
    skip_if_done,
    write_points,
)
from ptbench.runner.slurm import script_path, submit_arrays, submit_comm, with_repeats

TRUST_FLAG = "--trust-sweep-file"
TRUST_ENV = "PTBENCH_TRUST_SWEEP_FILE"  # the flag for array tasks (sbatch passes the submitter's environment on)


# --- what a sweep line may say -----------------------------------------------------------------------
# `${name:...}`: an OmegaConf resolver call (oc.env reads the environment, oc.decode parses, others run code). A
# plain `${a.b}` has no colon: it copies a value the run's config already holds (and its record keeps), so stays.
_RESOLVER = re.compile(r"\$\{[^}]*:")
_RESOLVER_NAME = re.compile(r"\$\{\s*([^${}:\s]*)\s*:")  # the innermost call's name, for the message


def _untrusted(override: str, parser, groups: set[str]) -> str | None:
    """What one override of a sweep line reaches beyond the point it names, or None."""
    if override.startswith("-"):
        opt = override.split("=", 1)[0]
        return f"{opt}: a Hydra option, not an override (-cd/-cn load another config, --experimental-rerun a pickle)"
    key = re.split(r"[=@]", override.lstrip("~+"), maxsplit=1)[0]
    if _RESOLVER.search(override):
        name = (_RESOLVER_NAME.search(override) or [None, "?"])[1]
        return f"key {key}: its value calls the resolver {name} (resolvers read the environment or files)"
    try:
        o = parser.parse_override(override)
    except Exception:  # noqa: BLE001 - not an override at all: `python -m ptbench` refuses it before anything runs
        return None
    key, package = o.key_or_group, (o.package or "").removeprefix("_global_").lstrip(".")
    if key.split("/")[0].split(".")[0] == "hydra" or package.split(".")[0] == "hydra":
        at = f"@{o.package}" if o.package else ""
        return f"key {key}{at}: a hydra.* key (its callbacks, job.env_set and searchpath run code)"
    value = override.split("=", 1)[1] if "=" in override else ""
    if (key in groups or "/" in key) and re.search(r"[/\\$]", value):  # Hydra joins it to conf/<group>/: `..` leaves
        return f"key {key}: the config option {value} is a path, not a name in conf/{key}/"
    return None


def check_lines(where: list[tuple[str, list[str]]], trust: bool) -> None:
    """Refuse (one ConfigError naming the place, the key and the flag) a sweep line that sets more than a point:
    `where` is (place, overrides) per line, the place `FILE:LINE`."""
    if trust:
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ptbench.runner.compose import conf_dir

    parser, groups = OverridesParser.create(), {d.name for d in conf_dir().iterdir() if d.is_dir()}
    for place, overrides in where:
        for override in overrides:
            why = _untrusted(override, parser, groups)
            if why:
                raise ConfigError(
                    f"{place}: {why}; a sweep line names a point only: if you wrote this file and mean it, "
                    f"pass {TRUST_FLAG} (array tasks: {TRUST_ENV}=1)"
                )


def sweep_points(path: Path, trust: bool, index: int | None = None) -> tuple[list[list[str]], int]:
    """(the points of a sweep file, each line checked by `check_lines`; the file's number of points). `index`: only
    that point, or none if the file has no such point (an array task is not failed by another task's line)."""
    lines = _sweep_lines(path)
    wanted = lines if index is None else lines[index : index + 1] if 0 <= index < len(lines) else []
    points = [_parse_line(path, n, text) for n, text in wanted]
    check_lines([(f"{path}:{n}", p) for (n, _), p in zip(wanted, points)], trust)
    return points, len(lines)


# --- command line ----------------------------------------------------------------------------------
def _grid(args) -> int:
    check_lines([(f"sweep grid {shlex.quote(o)}", [o]) for o in args.overrides], args.trust)  # sweep run would refuse
    points = expand_grid(args.overrides)
    header = "python -m ptbench.sweep grid " + shlex.join(args.overrides)
    if args.output == "-":
        print("\n".join(shlex.join(p) for p in points))
    else:
        write_points(Path(args.output), points, header)
        print(
            f"{len(points)} points -> {args.output}; run them here with `python -m ptbench.sweep run {args.output}`,"
            f" or on Slurm with `python -m ptbench.sweep submit {args.output}`"
        )
    return 0


def _point(args) -> int:
    points, count = sweep_points(args.file, args.trust, args.index)  # this task's line: another's error is not ours
    point = points[0] if points else []
    if not point:
        print(
            f"error: {args.file} has {count} points (0-{count - 1}); there is no point {args.index}",
            file=sys.stderr,
        )
        return 2
    cfg = compose_point([*point, *args.extra])
    if args.oom_retry:  # array.sbatch after a failed srun: the retry's own overrides, or "skip"
        retry = oom_retry([*point, *args.extra]) if newest_status(cfg) == "oom" else None
        if retry is None:
            print("skip")
            return 0
        print(*layout_of(compose_point(retry)), shlex.join(retry[-2:]))
        return 0
    if args.resume:
        cfg.results.skip_done = True
        if skip_if_done(cfg, out=sys.stderr):
            print("skip")  # array.sbatch: nothing to run, not even srun
            return 0
    ranks, devices = layout_of(cfg)
    print(ranks, devices, shlex.join(point))
    return 0


def _run(args) -> int:
    points, _ = sweep_points(args.file, args.trust)
    if not points:
        print(f"error: {args.file} has no points", file=sys.stderr)
        return 2
    extra = [*args.extra, *(["results.skip_done=true"] if args.resume else [])]
    stop = StopRequest().install()  # from here: a stop signal ends the sweep after the point it is in
    if not args.no_comm:  # the measured network, once per sweep and world size, beside the records
        measure_comm(points, args.extra, dry_run=args.dry_run, resume=args.resume)
    failed, tally = [], Counter()
    repeats = max(1, args.repeats)
    order = sweep_order(len(points), repeats)
    if repeats > 1:
        _record_order(args, points, order)
    for n, (r, i) in enumerate(order):
        if stop.signal_name:
            return stop.report(args, order, n, tally)
        point = points[i]
        tag = f" repeat {r}" if repeats > 1 else ""
        print(f"[{n + 1}/{len(order)}] point {point_id([*point, *args.extra])}{tag}: {shlex.join(point)}", flush=True)
        if repeats > 1:
            point = repeat_overrides(point, r, args.vary_seed, extra=args.extra)
        if args.dry_run:
            print("  " + shlex.join([sys.executable, "-m", "ptbench", *point, *extra]))
            continue
        name = run_name([*point, *extra])
        run = run_bench([*point, *extra], capture=False, run_name=name)  # a failed point does not stop the sweep
        retry = oom_retry([*point, *extra]) if run.status == "oom" and not stop.signal_name else None
        if retry:  # the paper halved the per-GPU batch by hand where a point ran out of memory
            print(
                f"  point {i} ran out of memory: once more with trainer.batch_size={retry[-2].split('=')[1]}",
                flush=True,
            )
            run = run_bench(retry, capture=False, run_name=name)
        if run.returncode:
            failed.append((i, run.returncode))
        tally[outcome(run)] += 1
        stop.last = run
    if stop.signal_name:  # during the last point: nothing is left, its record is final all the same
        return stop.report(args, order, len(order), tally)
    stop.uninstall()
    for i, code in failed:
        print(f"point {i} ({shlex.join(points[i])}) exited {code}", file=sys.stderr)
    if not args.dry_run:
        print(f"sweep: {len(order)} run(s): {', '.join(f'{n} {k}' for k, n in sorted(tally.items()))}", flush=True)
    return 1 if failed else 0


def sweep_order(points: int, repeats: int) -> list[tuple[int, int]]:
    """(round, point) pairs: every point once per round (a drift of the machine spreads over all), each round
    starting one point later (ABC BCA CAB), so no point always runs first or after the same neighbour."""
    return [(r, (r + i) % points) for r in range(repeats) for i in range(points)]


def _record_order(args, points: list, order: list) -> None:
    """The order the runs will take, printed and (unless --dry-run) written beside the sweep file."""
    rounds = [[i for rr, i in order if rr == r] for r in sorted({r for r, _ in order})]
    print("sweep order (rotated per round): " + "; ".join(" ".join(map(str, r)) for r in rounds), flush=True)
    if args.dry_run:
        return
    import json
    import time

    path = Path(f"{args.file}.order-{time.strftime('%Y%m%d-%H%M%S')}.json")
    rows = [{"position": n, "round": r, "point": i, "overrides": points[i]} for n, (r, i) in enumerate(order)]
    path.write_text(json.dumps({"sweep": str(args.file), "order": rows}, indent=1) + "\n")
    print(f"sweep order: {path}", flush=True)


class StopRequest:
    """SIGINT (Ctrl-C) or SIGTERM (scancel) to `sweep run`: the running point gets the same signal (its launcher
    runs in a session of its own, so a terminal's Ctrl-C reaches only this process) and ends as it would alone,
    with a final record (interrupted, preempted); no further point starts. `--resume` then runs what is left."""

    def __init__(self):
        self.signal_name: str | None = None
        self.last = None  # the last point's run (its record)
        self._previous = {}

    def install(self) -> StopRequest:
        import signal

        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        # a handler for a blocked signal never runs: a parent that imported ptbench.__main__ (which blocks
        # SIGTERM until a launcher can honour it) passes its mask on to this process
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
        return self

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        import signal

        import psutil

        self.signal_name = self.signal_name or signal.Signals(signum).name
        for child in psutil.Process().children():  # the running point's launcher (it tells its ranks)
            try:
                child.send_signal(signum)
            except psutil.Error:
                pass

    def report(self, args, order: list, done: int, tally: Counter) -> int:
        """One line on what ran and what is left; exit 128 + the signal, as a shell reports it."""
        import signal

        self.uninstall()
        last = self.last
        record = (
            f"its record {last.run_dir} is final (status {last.status})"
            if last is not None and last.run_dir is not None
            else "no point had started"
        )
        left = len(order) - done
        ran = ", ".join(f"{v} {k}" for k, v in sorted(tally.items())) or "none"
        then = f"`python -m ptbench.sweep run {args.file} --resume` runs every point without an ok record"
        print(
            f"sweep stopped by {self.signal_name} after {done} of {len(order)} run(s) ({ran}); {record}; "
            f"{left} not started: {then}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(getattr(signal, self.signal_name))


def outcome(run) -> str:
    """A run's line in the closing tally: its record's final status, or `skipped` (results.skip_done found the
    point already ok, so no record was written)."""
    return "skipped" if run.returncode == 0 and not run.summary else run.status


def _run_step_time(run) -> float | None:
    """A finished run's typical step time: the median over its epochs of the epochs' median step time
    (events.jsonl step_time_p50_s; warm-up excluded), else the summary's mean step time."""
    import statistics

    from ptbench.core.readers import jsonl

    if not run.ok or run.run_dir is None:
        return None
    path = Path(run.run_dir) / "events.jsonl"
    p50 = []
    if path.exists():
        for _, e in jsonl(path):  # a line cut short is passed over
            if isinstance(e, dict) and e.get("type") == "epoch" and e.get("step_time_p50_s"):
                p50.append(e["step_time_p50_s"])
    return statistics.median(p50) if p50 else run.summary.get("step_time_mean_s")


def _noise(args) -> int:
    """A/A (or A/B with --b): the same point run 2 x --repeats times in ABBA order (A B, B A, A B, ...: a
    linear drift of the machine favours neither arm over each two pairs), and the paired ratio of B's step time
    to A's with its 95 % interval (`python -m ptbench.analysis noise FILE`), stored as JSON under
    <results>/<experiment>/noise/ for the report."""
    import json
    import time

    from ptbench.core.records import results_folder

    a = list(args.extra)
    b = [*a, *args.b]
    times: dict[str, list[float]] = {"A": [], "B": []}
    contended = 0  # runs whose record warns of contention (bench/runner/contention.py): the floor then is the load's
    order = [(r, arm) for r in range(args.repeats) for arm in ("AB" if r % 2 == 0 else "BA")]
    for n, (r, arm) in enumerate(order):
        overrides = a if arm == "A" else b
        point = [*overrides, f"results.repeat={r}"]
        print(f"[{n + 1}/{len(order)}] {arm} repeat {r}: {shlex.join(overrides)}", flush=True)
        run = run_bench(point, capture=True, run_name=run_name(point))
        t = _run_step_time(run)
        if t is None:
            print(f"error: {arm} repeat {r} ended {run.status}: {run.error_line}", file=sys.stderr)
            return 1
        times[arm].append(t)
        busy = any(str(w).startswith("contention:") for w in (run.summary or {}).get("warnings") or [])
        contended += busy
        print(f"  step time {t * 1e3:.2f} ms ({run.run_dir}){' contended' if busy else ''}", flush=True)
    folder = results_folder(compose_point(a).results) / "noise"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"noise-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {"kind": "A/B" if args.b else "A/A", "overrides": a, "b_overrides": args.b, "metric": "step_time_p50_s"}
    record["contended_runs"] = contended
    out.write_text(json.dumps({**record, "a": times["A"], "b": times["B"]}, indent=1) + "\n")
    # the statistics are the analysis package's (drivers do not import it): it adds them to the file and prints
    return subprocess.run([sys.executable, "-m", "ptbench.analysis", "noise", str(out)]).returncode


def measure_comm(points: list[list[str]], extra: list[str], dry_run: bool = False, resume: bool = False) -> None:
    """`python -m ptbench.comm` once per world size of the sweep (bench/comm.py), before its points; a
    failed measurement is reported and the sweep goes on (the report then says "not measured")."""
    for folder, ranks, backend in comm_targets(points, extra):
        if resume and comm_measured(folder, ranks):
            print(f"comm: {folder} already holds a {ranks}-rank measurement: kept (--resume)", flush=True)
            continue
        cmd = [
            sys.executable,
            "-m",
            "ptbench.comm",
            "--world-size",
            str(ranks),
            "--backend",
            backend,
            *COMM_ARGS,
            "--out",
            str(folder),
        ]
        print(f"comm: {shlex.join(cmd)}", flush=True)
        if not dry_run and subprocess.run(cmd).returncode:
            print(f"warning: ptbench.comm at {ranks} ranks failed; the report will say `not measured`", file=sys.stderr)


def _submit(args) -> int:
    if not args.dry_run and not shutil.which("sbatch"):
        print("error: sbatch not found: run this on a Slurm login node (or add --dry-run)", file=sys.stderr)
        return 2
    file, points = args.file, sweep_points(args.file, args.trust)[0]  # the lines checked are the lines submitted
    if args.trust:  # each array task reads its line again, and checks it unless this is in its environment
        os.environ[TRUST_ENV] = "1"
    if args.repeats > 1:  # one line (array task) per repeat, interleaved, in a sweep file beside the given one
        points = with_repeats(points, args.repeats, args.vary_seed, extra=args.extra)
        file = args.file.with_name(f"{args.file.stem}.repeats{args.repeats}{args.file.suffix or '.txt'}")
        if not args.dry_run:
            write_points(file, points, f"{args.file} x {args.repeats} repeats, interleaved (ptbench.sweep submit)")
        print(f"submit: {len(points)} array tasks ({args.repeats} repeats) from {file}")
    code, _ = submit_arrays(
        file,
        args.extra,
        gpus_per_node=args.gpus_per_node,
        sbatch=args.sbatch,
        resume=args.resume,
        script=Path(args.script),
        dry_run=args.dry_run,
        points=points,
    )
    if not args.no_comm:
        code = (
            submit_comm(
                args.file,
                args.extra,
                gpus_per_node=args.gpus_per_node,
                sbatch=args.sbatch,
                resume=args.resume,
                dry_run=args.dry_run,
                points=sweep_points(args.file, args.trust)[0],  # read and checked as the arrays were
            )
            or code
        )
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ptbench.sweep", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    each = (_grid_parser(sub), _run_parser(sub), _submit_parser(sub))
    _noise_parser(sub)
    for one in (*each, _point_parser(sub)):
        _trust_option(one)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--grid"]:  # `python -m ptbench.sweep --grid ...` reads naturally too
        argv[0] = "grid"
    extra = []
    if "--" in argv:  # overrides after `--` go to every point
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args, extra)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _grid_parser(sub) -> argparse.ArgumentParser:
    """`grid`: a sweep file from Hydra-style comma lists."""
    g = sub.add_parser("grid", help="write the cartesian product of sweep overrides, one point per line")
    g.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. adapter=ddp,zero launcher.nprocs=1,2,4")
    g.add_argument("-o", "--output", default="-", help="sweep file to write (default: print)")
    return g


def _run_parser(sub) -> argparse.ArgumentParser:
    """`run`: every point here, one after another."""
    r = sub.add_parser("run", help="run every point here, one after another (overrides after -- go to every point)")
    r.add_argument("file", type=Path)
    r.add_argument("--resume", action="store_true", help="skip points that already have an ok record")
    r.add_argument("--dry-run", action="store_true", help="print the commands only")
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each point N times, in rounds rotated ABC BCA CAB (the order written to FILE.order-*.json); "
        "results.repeat=R",
    )
    r.add_argument(
        "--vary-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --repeats: trainer.seed + R per repeat, one point id (the default: time to target needs 2 or "
        "more seeds per point; --no-vary-seed repeats one seed)",
    )
    r.add_argument(
        "--no-comm",
        action="store_true",
        help="skip the per-sweep `python -m ptbench.comm` measurement "
        "(stored in <results>/<experiment>/comm/ for the report)",
    )
    return r


def _submit_parser(sub) -> argparse.ArgumentParser:
    """`submit`: Slurm arrays, one per allocation shape."""
    s = sub.add_parser(
        "submit", help="sbatch slurm/array.sbatch once per allocation shape (overrides after -- go to every point)"
    )
    s.add_argument("file", type=Path)
    s.add_argument("--resume", action="store_true", help="array tasks skip points that already have an ok record")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node of your cluster (0: CPU, one node)")
    s.add_argument("--script", default=str(script_path("array.sbatch")))
    s.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="ARG",
        help="an sbatch option for every array, e.g. --sbatch=--partition=gpu (repeatable)",
    )
    s.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    s.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="each point N times, one array task per repeat, interleaved (ABCABC), in FILE.repeatsN.txt beside FILE",
    )
    s.add_argument(
        "--vary-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --repeats: trainer.seed + R per repeat (the default; --no-vary-seed repeats one seed)",
    )
    s.add_argument(
        "--no-comm",
        action="store_true",
        help="skip the one small `python -m ptbench.comm` job per world "
        "size (stored in <results>/<experiment>/comm/ for the report)",
    )
    return s


def _noise_parser(sub) -> argparse.ArgumentParser:
    """`noise`: the noise floor of one point (A/A or A/B)."""
    n = sub.add_parser(
        "noise",
        help="the noise floor: the point given after -- run 2 x --repeats times interleaved (A/A), or against "
        "itself plus --b overrides (A/B), and the paired step-time ratio with its 95 %% interval",
    )
    n.add_argument("--repeats", type=int, default=5, help="runs per arm (default 5)")
    n.add_argument(
        "--b",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="an override for arm B only, e.g. --b trainer.inject_fault=slow@0.15 (repeatable; none: A/A)",
    )
    return n


def _point_parser(sub) -> argparse.ArgumentParser:
    """`point`: one line of a sweep file, for array.sbatch."""
    p = sub.add_parser(
        "point",
        help="print RANKS GPUS_PER_RANK OVERRIDES of point INDEX (used by array.sbatch);"
        " overrides after -- are the run's other overrides",
    )
    p.add_argument("file", type=Path)
    p.add_argument("index", type=int)
    p.add_argument("--resume", action="store_true", help="print `skip` if the point already has an ok record")
    p.add_argument(
        "--oom-retry",
        action="store_true",
        help="after a failed run: RANKS GPUS_PER_RANK and the overrides that retry the point with half its "
        "per-device batch if its newest record says oom (extra.batch_reduced_from), else `skip`",
    )
    return p


def _trust_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        TRUST_FLAG,
        dest="trust",
        action="store_true",
        default=os.environ.get(TRUST_ENV) == "1",
        help=f"let sweep lines set hydra.* keys, call resolvers (${{oc.env:...}}), name configs by path and pass Hydra "
        f"options: only for a sweep file you wrote, in a folder no one else can write ({TRUST_ENV}=1: the same; "
        "submit passes it on to its array tasks)",
    )


def _dispatch(args, extra: list[str]) -> int:
    if args.cmd == "grid":
        return _grid(args)
    args.extra = extra
    return {"point": _point, "run": _run, "submit": _submit, "noise": _noise}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
