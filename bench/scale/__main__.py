"""`python -m ptbench.scale [overrides] --world-size W[,W...] [--rank R[,R...]] [--no-record]`: a dry run
(`--matrix [adapter=A,...] [workload=M,...] [overrides] [--world-size ...] [--jobs N] [--point-limit S] [--out FILE]`:
the whole matrix, or the adapters and workloads named, the other overrides given to every point; bench/scale/matrix.py).

For each W (and rank): the run plan at W with every check of a real run, then that rank's own setup and 2
training steps on torch's fake process group under FakeTensorMode (bench/scale/run.py), its collective
ledger and memory per category beside our comm formula and memory model. Prints a table per point and
ends each with `scale: adapter=A workload=M W=N comm_ratio=X memory_ratio_worst=Y seconds=S`; writes a
record per point (status dry_run, never a timing) unless --no-record. `--rank last` is the last rank.
"""

from __future__ import annotations

import argparse
import sys

from ptbench.core.errors import ConfigError

CANNOT_CHECK = (
    "a dry run cannot check time, overlap of compute and communication, NCCL's algorithms and its own "
    "buffers, losses (a fake collective returns its input), or allocator fragmentation and rounding"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ptbench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m ptbench")
    parser.add_argument("--world-size", help="W, or a comma-separated list (--matrix: default 8,64,256,1024)")
    parser.add_argument("--matrix", action="store_true", help="every adapter x workload (x W) in one table")
    parser.add_argument("--out", help="--matrix: also write its rows as JSON here")
    parser.add_argument(
        "--rank", help="R (0 <= R < W), 'last', or a comma-separated list (default 0; --matrix: 0,last)"
    )
    parser.add_argument("--no-record", action="store_true", help="print only; write no record")
    parser.add_argument(
        "--jobs", type=int, default=2, help="--matrix: points at once (default 2: this machine's cores)"
    )
    parser.add_argument(
        "--point-limit", type=float, default=120, help="--matrix: seconds a point may take (default 120)"
    )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    if args.world_size is None and not args.matrix:
        parser.error("--world-size is required (or --matrix)")
    try:
        worlds = [int(w) for w in args.world_size.split(",")] if args.world_size else None
    except ValueError:
        print(f"error: --world-size {args.world_size!r} is not a list of integers", file=sys.stderr)
        return 2
    if args.matrix:
        from ptbench.scale.matrix import WORLDS, run_matrix

        named = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in args.overrides if "=" in o}
        select = {f"{k}s": tuple(v.split(",")) for k, v in named.items() if k in ("adapter", "workload")}
        if args.rank:
            select["ranks"] = tuple(args.rank.split(","))
        extra = [o for o in args.overrides if o.split("=", 1)[0] not in ("adapter", "workload")]
        rows = run_matrix(
            worlds or WORLDS,
            out=args.out,
            run_point=_one,
            jobs=args.jobs,
            limit_s=args.point_limit,
            extra=extra,
            **select,
        )
        return 1 if any(r.get("kind") in ("failed", "over") or r.get("limit") for r in rows) else 0
    failed = 0
    for world in worlds:
        for rank in (args.rank or "0").split(","):
            failed += _one(args.overrides, world, rank, not args.no_record)
    return 1 if failed else 0


def _one(overrides: list[str], world: int, rank_arg: str, record: bool) -> int:
    from ptbench.scale.compare import summary_line, table
    from ptbench.scale.point import measure_point

    try:
        rank = world - 1 if rank_arg == "last" else int(rank_arg)
        point = measure_point(overrides, world, rank)
    except (ConfigError, ValueError) as e:
        print(f"scale: W={world} rank={rank_arg} not run: {e}", flush=True)
        return 1
    print(table(point))
    if record:
        print(f"  record: {write_record(point)}")
    print(summary_line(point), flush=True)
    return 0


def write_record(point: dict):
    """The point's record (results/<experiment>/<run_id>/summary.json): status dry_run, the plan's fields as a
    run's, the measurements under `dry_run`. Returns its folder."""
    from omegaconf import OmegaConf

    from ptbench.core import schema
    from ptbench.core.records import RunRecord, atomic_write, dumps, flag_nonfinite
    from ptbench.runner.plan import run_dir_of

    cfg, plan = point["cfg"], point["plan"]
    folder = run_dir_of(cfg, plan)
    summary = dict(
        run_id=folder.name,
        **plan.identity(),
        status="dry_run",
        # as a real run's record (bench/runner/meter.py): what the adapter's own describe() read from its framework
        **({"adapter_settings": point["adapter_settings"]} if "adapter_settings" in point else {}),
        plan=plan.describe(),
        layout=plan.layout.as_dict(),
        precision=plan.precision,
        predicted_memory=plan.predicted_memory,
        comm_volume=point["formula"],
        dry_run=dict(
            rank=point["rank"],
            steps=point["steps"],
            seconds=point["seconds"],
            standins=point["standins"],
            standin_reasons=point["standin_reasons"],
            ledger=point["ledger"][-1],
            comm=point["comm"],
            memory=point["memory"],
            tracker=point["tracker"],
            cannot_check=CANNOT_CHECK,
        ),
    )
    summary = flag_nonfinite(summary)
    schema.check(summary, schema.SUMMARY, "summary.json")
    # written here, not by RunWriter, whose statuses are a real run's (ptbench.core.records.STATUSES)
    RunRecord(folder).create(OmegaConf.to_yaml(cfg))
    atomic_write(folder / "summary.json", dumps(summary))
    return folder


if __name__ == "__main__":
    sys.exit(main())
