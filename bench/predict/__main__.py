"""`python -m ptbench.predict RESULTS_DIR [--target OVERRIDES|FILE]` and `python -m ptbench.predict validate`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ptbench.predict.model import retarget
from ptbench.predict.points import Point, PredictError, load_comm, load_points
from ptbench.predict.table import held_out, leave_one_out, report, write_predictions

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


def target_points(t: dict, points: list[Point]) -> list[Point]:
    """The target as points: one per measured series that matches (adapter, and stage where given)."""
    match = [p for p in points if p.adapter == t["adapter"] and ("stage" not in t or f"stage={t['stage']}" in p.series)]
    if not match:
        have = sorted({p.adapter for p in points})
        raise PredictError(
            f"no measured run of adapter={t['adapter']} to take its compute from (measured: {', '.join(have)})"
        )
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


def run_predict(root: Path, target: str | None) -> int:
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
    targets = [tp for t in read_targets(target) for tp in target_points(t, points)]
    preds, skipped = held_out(points, targets, reports, str(root))
    for p in preds:
        t, mem = p.target, p.target.memory_bytes
        print(
            f"{t.label()}: step {p.step * 1e3:.1f} ms [{p.lo * 1e3:.1f}-{p.hi * 1e3:.1f}], epoch {p.epoch:.2f} s, "
            f"{p.throughput:.1f} samples/s (compute {p.compute * 1e3:.1f} ms + {p.exposed:.2f} x comm "
            f"{p.comm * 1e3:.1f} ms); memory model {f'{mem / 2**20:.1f} MiB/rank' if mem else 'n/a (other layout)'}"
        )
    if skipped and not preds:
        raise PredictError(skipped[0][1])
    for t, why in skipped:
        print(f"predict: {t.label()}: {why}", file=sys.stderr)
    write_predictions(root, "target", preds, measured=False)
    return 2 if skipped else 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ptbench.predict", description=__doc__)
    ap.add_argument("results_dir", help="a results folder (records and comm/ reports), or 'validate'")
    ap.add_argument(
        "--target",
        help="'adapter=NAME [adapter.stage=S] [ranks=N] [adapter.microbatches=M] [link=MBIT]' or a file of such lines",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["validate"]:
            from ptbench.predict.validate import main as validate

            return validate(argv[1:])
        args = parser().parse_args(argv)
        return run_predict(Path(args.results_dir), args.target)
    except PredictError as e:
        print(f"predict: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
