"""`python -m ptbench.predict RESULTS_DIR [--target OVERRIDES|FILE]` and `python -m ptbench.predict validate`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ptbench.predict.at_scale import describe, load_dry_runs, match, missing, overrides_of, size, with_dry_run
from ptbench.predict.model import retarget
from ptbench.predict.points import Point, PredictError, load_comm, load_points
from ptbench.predict.table import (
    behind,
    contended_mark,
    contention_line,
    held_out,
    leave_one_out,
    report,
    write_predictions,
)

# target keys the model varies (anything else changes compute it never measured)
TARGET_KEYS = {
    "adapter": "adapter",
    "adapter.stage": "stage",
    "launcher.nprocs": "ranks",
    "ranks": "ranks",
    "adapter.microbatches": "microbatches",
    "link": "link",
}


def parse_target(text: str) -> dict:
    out = {}
    for tok in shlex.split(text):
        key, eq, val = tok.partition("=")
        if not eq or key not in TARGET_KEYS:
            raise PredictError(
                f"cannot predict '{tok}': a target sets only {', '.join(sorted(TARGET_KEYS))} "
                "(other settings change compute that no record measured)"
            )
        out[TARGET_KEYS[key]] = val
    if "adapter" not in out:
        raise PredictError(f"target '{text}' names no adapter: add adapter=NAME")
    return out


def read_targets(arg: str) -> list[dict]:
    path = Path(arg)
    if path.is_file():
        lines = [ln.split("#")[0].strip() for ln in path.read_text().splitlines()]
        return [parse_target(ln) for ln in lines if ln]
    return [parse_target(arg)]


def _num(t: dict, key: str, cast, default):
    try:
        return cast(t[key]) if key in t else default
    except ValueError:
        raise PredictError(f"target {key}={t[key]!r} is not a number") from None


def unmatched(t: dict, points: list[Point], root: Path) -> str:
    """Why no measured run fits the target: its adapter was not measured, or not at its stage (then the command
    that measures it, from a run of that adapter in the folder)."""
    mine = [p for p in points if p.adapter == t["adapter"]]
    if not mine:
        have = ", ".join(sorted({p.adapter for p in points}))
        return f"no measured run of adapter={t['adapter']} to take its compute from (measured: {have})"
    if not any(tok.startswith("stage=") for p in mine for tok in p.series.split()):
        return (
            f"adapter={t['adapter']} has no stage setting (measured as: {'; '.join(sorted({p.series for p in mine}))}):"
            " drop adapter.stage"
        )
    base = mine[0]
    over = overrides_of(
        base.adapter, base.workload, base.run_dirs[0] if base.run_dirs else None, True, stage=t["stage"]
    )
    return (
        f"no measured run of adapter={t['adapter']} adapter.stage={t['stage']} to take its compute from: "
        f"{t['adapter']} was measured as {'; '.join(sorted({p.series for p in mine}))}, and a stage changes what a "
        f"rank computes; measure it: python -m ptbench {' '.join(over)} launcher.nprocs={base.world_size} "
        f"results.root={root}"
    )


def target_points(t: dict, points: list[Point], root: Path) -> list[Point]:
    """The target as points: one per measured series that matches (adapter, and stage where given)."""
    match = [
        p
        for p in points
        if p.adapter == t["adapter"] and ("stage" not in t or f"stage={t['stage']}" in p.series.split())
    ]
    if not match:
        raise PredictError(unmatched(t, points, root))
    world, m, link = (_num(t, k, cast, None) for k, cast in (("ranks", int), ("microbatches", int), ("link", float)))

    def nearest(p: Point) -> tuple:  # a measured point of the target's layout first, then the most ranks
        return (world is not None and p.world_size != world, m is not None and p.microbatches != m, -p.world_size)

    out = {}
    for base in sorted(match, key=nearest):  # one per series and workload
        if (base.series, base.workload) in out:
            continue
        if m is not None and m != base.microbatches and base.pp == 1:
            raise PredictError(
                f"{base.series} has no pipeline: adapter.microbatches={m} changes nothing it was measured at"
            )
        out[(base.series, base.workload)] = retarget(
            base,
            base.world_size if world is None else world,
            base.microbatches if m is None else m,
            base.link if link is None else link,
        )
    return list(out.values())


def run_predict(root: Path, target: str | None, dry_runs: Path | None = None) -> int:
    if not root.is_dir():
        raise PredictError(f"{root}: no such folder (give the results folder a sweep or make demo wrote)")
    points = load_points(root)
    if not points:
        raise PredictError(f"{root}: no finished run with a communication volume: run a sweep or make demo first")
    reports = load_comm(root)
    if target is None:
        preds, skipped = leave_one_out(points, reports, str(root))
        print(f"# leave-one-out over {len(points)} points in {root} (each predicted from the others)")
        print("\n".join(report(preds, skipped)))
        write_predictions(root, "leave_one_out", preds, measured=True)
        return 0
    if not reports:
        n = max(p.world_size for p in points)
        raise PredictError(
            f"no ptbench.comm measurement under {root}: run python -m ptbench.comm --world-size {n} --out {root}/comm"
        )
    return run_targets(root, points, reports, target, dry_runs or root)


def run_targets(root: Path, points: list[Point], reports: list, target: str, dry_runs: Path) -> int:
    """Each target's line (or the dry run's bytes and memory where its step is refused), the contention line, and
    one line per refusal on stderr."""
    targets = [tp for t in read_targets(target) for tp in target_points(t, points, root)]
    targets, dry, notes = at_w(targets, points, dry_runs, root)
    preds, skipped = held_out(points, targets, reports, str(root))
    measured = {p.key: p for p in points}
    for p in preds:
        print(target_line(p, measured.get(p.target.key)))
        if p.target.key in notes:
            print(f"predict: {p.target.label()}: {notes[p.target.key]}", file=sys.stderr)
    refused = []
    for t, why in skipped:
        if d := dry.get(t.key):  # what the dry run says at W stands without a step time
            print(f"{t.label()}: step time not predicted ({why.split(': run')[0]}); {describe(d)}")
        else:
            refused.append(f"{t.label()}: {why}" + (f"; and {notes[t.key]}" if t.key in notes else ""))
    if line := contention_line(behind(preds)):
        print(line)
    if refused and not preds and not dry:
        raise PredictError(refused[0])
    for line in refused:
        print(f"predict: {line}", file=sys.stderr)
    write_predictions(root, "target", preds, measured=False)
    return 2 if skipped else 0


def target_line(p, measured: Point | None) -> str:
    t, mem = p.target, p.target.memory_bytes
    if t.collectives_from.startswith("dry run"):
        memory = f"memory {size(mem)}/rank ({t.collectives_from}, tracker)" if mem else "memory n/a"
    else:
        memory = f"memory model {f'{mem / 2**20:.1f} MiB/rank' if mem else 'n/a (other layout)'}"
    seen = f"; measured {measured.step * 1e3:.1f} ms{contended_mark(measured)}" if measured else ""
    return (
        f"{t.label()}: step {p.step * 1e3:.1f} ms [{p.lo * 1e3:.1f}-{p.hi * 1e3:.1f}], epoch {p.epoch:.2f} s, "
        f"{p.throughput:.1f} samples/s (compute {p.compute * 1e3:.1f} ms + {p.exposed:.2f} x comm "
        f"{p.comm * 1e3:.1f} ms, collectives from {t.collectives_from}); {memory}{seen}"
    )


def at_w(targets: list[Point], points: list[Point], dry_root: Path, root: Path) -> tuple[list[Point], dict, dict]:
    """Targets at a device count no run of their series measured take a dry run's ledger and memory at that W
    (bench/predict/at_scale.py); without one, a note (one line) says so with the command that writes it."""
    dry = load_dry_runs(dry_root)
    worlds = {(p.series, p.workload, p.world_size) for p in points}
    out, used, notes = [], {}, {}
    for t in targets:
        if (t.series, t.workload, t.world_size) not in worlds and t.world_size > 1:  # one rank: no collectives
            if d := match(t, dry):
                t = with_dry_run(t, d)
                used[t.key] = d
            else:
                base = next((p for p in points if p.series == t.series and p.workload == t.workload), None)
                notes[t.key] = missing(t, dry, base.run_dirs[0] if base else None, root)
        out.append(t)
    return out, used, notes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ptbench.predict", description=__doc__)
    ap.add_argument("results_dir", help="a results folder (records and comm/ reports), or 'validate'")
    ap.add_argument(
        "--target",
        help="'adapter=NAME [adapter.stage=S] [ranks=N | launcher.nprocs=N] [adapter.microbatches=M] [link=MBIT]' "
        "or a file of such lines",
    )
    ap.add_argument(
        "--dry-runs",
        help="where python -m ptbench.scale wrote its records (default: RESULTS_DIR): a target at a device count "
        "no run measured takes the dry run's collectives and memory at that W",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["validate"]:
            from ptbench.predict.validate import main as validate

            return validate(argv[1:])
        args = parser().parse_args(argv)
        return run_predict(Path(args.results_dir), args.target, args.dry_runs and Path(args.dry_runs))
    except PredictError as e:
        print(f"predict: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
