"""`python -m ptbench.studies.ledger`: the communication ledger and the pipeline bubble, measured from traces.

Runs, at 2 ranks on CPU (tiny GPT-2, a few steps, `trainer.profile` over the last steps): ddp, zero stages
1-3, fsdp, megatron TP=2 (without and with adapter.sequence_parallel), a 2-stage torch pipeline and megatron
PP=2; at 4 ranks megatron TP=2 x PP=2 (without and with sequence parallelism); and prints per collective kind
the bytes by the corrected formula (bench/core/comm_volume/ `corrected`) beside the bytes measured from the
traces' c10d operators (goal: within 2 %), the measured time and the exposed (non-overlapped) communication.
Before those runs it measures the bus bandwidth of the same collectives at 2 ranks (`python -m ptbench.comm`,
stored in <root>/ledger/comm/ as a sweep stores it), so that `python -m ptbench.analysis report <root>` sets
each kind's bytes beside the time they take at that bandwidth (report-details.md, "Why", column `ms at measured
busbw`; --no-comm skips the measurement).
Then the pipeline bubble of torch's GPipe and 1F1B schedules and megatron-core's 1F1B at 2 and 4 stages and
m = 4, 8 micro-batches beside the theory (p-1)/(m+p-1) (goal: within 20 %).

    python -m ptbench.studies.ledger                 # both tables
    python -m ptbench.studies.ledger --only bytes    # the ledger only (--only bubble: the bubble only)
    python -m ptbench.studies.ledger --only bubble --bubble-adapters megatron   # megatron's pipeline only (or: pipeline)
    python -m ptbench.studies.ledger --only bubble --repeats 2   # every bubble case twice, interleaved (--stages 2: 2 only)
    python -m ptbench.studies.ledger --json out.json # also write every row
    python -m ptbench.analysis report <root> # the report: the ledger with the time at the measured busbw

The default command is 23 runs (11 ledger, 12 bubble) and the bus-bandwidth measurement (how long it took:
bench/MEASUREMENTS.md). Each finished run prints a line with the time spent and
the time left at the runs' mean pace so far.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ptbench.core.records import command_root
from ptbench.run_point import run_bench
from ptbench.runner.points import COMM_ARGS
from ptbench.studies.tally import Tally, clock, progress
from ptbench.studies.variants import overrides

BASE = [
    "workload=gpt2_tiny",
    "workload.vocab_size=1024",
    "workload.seq_len=32",
    "data.train_samples=512",
    "data.val_samples=32",
    "trainer.max_eval_batches=1",
    "trainer.eval_every_epoch=false",
    "trainer.progress=false",
    "trainer.epochs=1",
    "results.mllog=false",
]
# the ledger's runs: rows of ptbench.studies.variants at 2 ranks (TP=2 x PP=2: 4), with the batch each needs
LEDGER_RUNS = {
    "ddp": overrides("ddp"),
    "zero1": overrides("zero1"),
    "zero2": overrides("zero2"),
    "zero3": overrides("zero3"),
    "fsdp": overrides("fsdp"),
    "megatron_tp2": overrides("megatron", 2),
    "megatron-sp": overrides("megatron-sp", 2),
    # the pipeline's trainer.batch_size is its global batch: 8 = its default 4 x 2 micro-batches of 1
    "pipeline_pp2": [*overrides("pipeline-1f1b"), "trainer.batch_size=8"],
    "megatron_pp2": [*overrides("megatron-pp", 2), "trainer.batch_size=8"],
    # tensor x pipeline parallel at 4 ranks (dp 1): the vocab-parallel collectives split over the first and the
    # last stage, each kind counted on its busiest
    "megatron_tp2pp2": [*overrides("megatron-tp2pp2"), "trainer.batch_size=8", "launcher.nprocs=4"],
    "megatron_tp2pp2-sp": [*overrides("megatron-tp2pp2-sp"), "trainer.batch_size=8", "launcher.nprocs=4"],
}


# the collectives the ledger's runs make (recv: the pipeline's receive half of send_recv, no bytes of its own)
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def measure_busbw(root: Path, timeout: float = 600) -> Path | None:
    """`python -m ptbench.comm` at the ledger's 2 ranks on gloo over COMM_OPS into <root>/ledger/comm/ (where the
    report looks for it, as for a sweep: analysis/load.py `load_comm`); the report's path, None if it failed. A
    measurement already there is kept, never overwritten."""
    folder = root / "ledger" / "comm"
    path = folder / "gloo-2.json"
    if path.exists():
        print(f"bus bandwidth: kept the measurement already in {path} (move it away to measure again)", flush=True)
        return path
    print(f"bus bandwidth: python -m ptbench.comm at 2 ranks into {folder}/ first", flush=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "ptbench.comm", "--world-size", "2", "--backend", "gloo", *COMM_ARGS]
    cmd += ["--ops", ",".join(COMM_OPS), "--out", str(folder)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        why = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        failed = proc.returncode or not path.exists()
    except subprocess.TimeoutExpired:
        why, failed = [f"no result in {timeout:.0f} s"], True
    if failed:
        print(
            f"warning: ptbench.comm at 2 ranks failed ({why[0]}); the report will say `not measured`", file=sys.stderr
        )
        return None
    print(f"bus bandwidth: measured in {clock(time.perf_counter() - t0)}", flush=True)
    return path


def ledger_todo(names=None) -> list[tuple[str, list[str]]]:
    return [(name, over) for name, over in LEDGER_RUNS.items() if not names or name in names]


def ledger_runs(root: Path, names=None, timeout: float = 600, tally: Tally | None = None) -> list[dict]:
    rows = []
    todo = ledger_todo(names)
    for n, (name, over) in enumerate(todo, 1):
        nprocs = next((int(o.split("=")[1]) for o in over if o.startswith("launcher.nprocs=")), 2)
        run = run_bench(
            [*BASE, "launcher.nprocs=2", "trainer.batch_size=4", "trainer.max_steps=5", "trainer.profile=3:2", *over],
            root=root,
            experiment="ledger",
            timeout=timeout,
            run_name=(name, "gpt2_tiny", nprocs),
        )
        prof = run.summary.get("profile") or {}
        progress("ledger", n, len(todo), name, run, tally)
        if not run.ok or not prof.get("ledger"):
            rows.append(dict(run=name, error=run.summary.get("error") or run.stderr.strip()[-300:] or run.status))
            continue
        ranks = prof["ranks"]
        rows.append(
            dict(
                run=name,
                ledger=prof["ledger"],
                differences=(prof.get("formula") or {}).get("differences", []),
                exposed_s=sum(r["exposed_comm_s"] for r in ranks) / len(ranks),
                comm_s=sum(r["comm_time_s"] for r in ranks) / len(ranks),
                step_s=sum(r["step_time_s"] for r in ranks) / len(ranks),
                record=str(run.run_dir),
            )
        )
    return rows


# the bubble table's pipelines: adapter -> (the table's label, the schedules it runs)
BUBBLE_ADAPTERS = {"pipeline": ("torch", ("gpipe", "1f1b")), "megatron": ("megatron", ("1f1b",))}


def _bubble_overrides(adapter: str, schedule: str, p: int, m: int) -> list[str]:
    """One pipeline of the bubble table: p stages, m micro-batches of 4 sequences (one replica)."""
    if adapter == "pipeline":
        # 10 sequential layers (embedding, 8 blocks, head): the embedding and the head with the end stages' blocks
        return [
            "adapter=pipeline",
            f"adapter.schedule={schedule}",
            "adapter.balance=[3,2,2,3]" if p == 4 else "adapter.balance=[5,5]",
            f"adapter.microbatches={m}",
            f"trainer.batch_size={4 * m}",  # batch_policy fixed: the global batch
        ]
    # megatron-core gives every stage n_layer / p blocks, the embedding with the first, the final norm, the
    # (tied) output layer and the loss with the last: the same split as the torch balance above.
    # batch_policy linear: the global batch is trainer.batch_size x p ranks
    return [
        "adapter=megatron",
        f"adapter.pipeline_parallel={p}",
        f"adapter.schedule={schedule}",
        f"adapter.microbatches={m}",
        f"trainer.batch_size={4 * m // p}",
    ]


def bubble_cases(adapters=tuple(BUBBLE_ADAPTERS), stages=(2, 4)) -> list[tuple]:
    """(stages, adapter, schedule, m) of the bubble table, in its order."""
    return [
        (p, adapter, schedule, m)
        for p in stages
        for adapter in adapters
        for schedule in BUBBLE_ADAPTERS[adapter][1]
        for m in (4, 8)
    ]


def bubble_runs(
    root: Path,
    timeout: float = 600,
    adapters=tuple(BUBBLE_ADAPTERS),
    repeats: int = 1,
    stages=(2, 4),
    tally: Tally | None = None,
) -> list[dict]:
    """Every case of the table, `repeats` times, interleaved (case after case, then again), so that a slow spell
    of a shared machine spreads over the cases instead of falling on one."""
    runs = []  # (case, repeat, row): the table's order is case by case, its repeats together
    cases = bubble_cases(adapters, stages)
    for rep in range(repeats):
        for case, (p, adapter, schedule, m) in enumerate(cases):
            label = f"{BUBBLE_ADAPTERS[adapter][0]} {schedule}"
            run = run_bench(
                [
                    *BASE,
                    # equal stages, as the theory assumes: 8 blocks, a small vocabulary so that the head costs about
                    # nothing. Items heavy enough (512 wide, 64 tokens, 4 sequences per micro-batch: ~0.1-0.2 s
                    # each on one CPU core) that the schedule's Python (~1-3 ms per item) and the p2p copies are
                    # small beside them, as they are beside a GPU's kernels
                    "workload.n_layer=8",
                    "workload.vocab_size=256",
                    "workload.n_embd=512",
                    "workload.seq_len=64",
                    *_bubble_overrides(adapter, schedule, p, m),
                    f"launcher.nprocs={p}",
                    # a stage per CPU, as a stage per device on a cluster (more stages than CPUs: they share)
                    "launcher.cpu_bind=cores",
                    # 5 profiled steps after 2 untimed: the steady ones (the theory's equal items held) are
                    # averaged beside all of them
                    "trainer.max_steps=7",
                    "trainer.profile=2:5",
                ],
                root=root,
                experiment="bubble",
                timeout=timeout,
                run_name=(f"{adapter}-{schedule}-m{m}", "gpt2_tiny", p),
            )
            b = (run.summary.get("profile") or {}).get("bubble")
            n = rep * len(cases) + case + 1
            progress("bubble", n, repeats * len(cases), f"{label} p={p} m={m}", run, tally)
            if not run.ok or not b:
                err = run.summary.get("error") or run.stderr[-300:]
                runs.append((case, rep, dict(stages=p, schedule=label, m=m, repeat=rep, error=err)))
                continue
            runs.append((case, rep, dict(b, schedule=label, m=m, repeat=rep, record=str(run.run_dir))))
    return [row for _, _, row in sorted(runs, key=lambda t: t[:2])]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:9.3f}"


def print_ledger(rows: list[dict]) -> None:
    print(
        "communication ledger per optimizer step, 2 ranks (megatron_tp2pp2: 4), CPU gloo "
        "(bytes: nccl-tests bus volume, each kind's busiest rank)"
    )
    print(
        f"{'run':18} {'collective':15} {'formula MB':>10} {'measured MB':>11} {'ratio':>6} {'calls':>5} "
        f"{'time ms':>8} {'exposed ms':>10}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:18} error: {r['error']}")
            continue
        for i, row in enumerate(r["ledger"]):
            ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
            exposed = f"{1e3 * r['exposed_s']:10.2f}" if i == 0 else ""
            print(
                f"{r['run'] if i == 0 else '':18} {row['kind']:15} {_mb(row['formula_bytes']):>10} "
                f"{_mb(row['measured_bytes']):>11} {ratio:>6} {row['calls']:5.0f} {1e3 * row['time_s']:8.2f} {exposed}"
            )
        for d in r["differences"]:
            print(f"{'':18} corrected: {d}")


def _spread(v: list[float]) -> str:
    """median (lowest-highest), N runs"""
    if not v:
        return "-, 0 runs"
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}), {len(v)} run{'s' if len(v) > 1 else ''}"


def print_bubble(rows: list[dict]) -> None:
    print("pipeline bubble (torch.distributed.pipelining, megatron-core, CPU): idle share of the schedule's span")
    print("  wall: as it ran (p2p, loss and CPU sharing included); replayed: the measured work items re-timed")
    print("  with the schedule's dependencies, one device per stage (ptbench.core.trace_ledger.bubble);")
    print("  marked: every micro-batch's forward and backward marked once on every stage (else the counts);")
    print(
        "  per step: the lowest and highest profiled step's wall ratio; rows of one case: its --repeats, interleaved;"
    )
    print("  item cv: fwd/bwd work items' duration spread (std/mean) over stages and steps; the theory assumes 0;")
    print("  steady: the wall ratio over the profiled steps whose items kept the theory's equal times (each item over")
    print("  its stage's median, spread at most trace_ledger.STEADY_CV), with how many of the steps; chosen on the")
    print("  items' times only, never on the idle time")
    print(
        f"{'stages':>6} {'schedule':14} {'m':>3} {'theory':>7} {'wall':>7} {'ratio':>6} {'per step':>9} "
        f"{'steady':>6} {'of':>3} {'replayed':>8} {'ratio':>6} {'marked':>6} {'item cv':>9}  replayed per stage"
    )
    from ptbench.runner.checks import affinity_cpus

    cpus = affinity_cpus()
    for r in rows:
        if "error" in r:
            print(f"{r['stages']:6} {r['schedule']:14} {r['m']:3} error: {r['error']}")
            continue
        rp = r.get("replayed_per_stage") or []
        rm, rr = r.get("replayed_mean"), r.get("replayed_ratio")
        marked = "once" if r.get("marked_once") else str(r.get("marks"))
        steps = [v / r["theory"] for v in r.get("per_step") or []]
        spread = f"{min(steps):.2f}-{max(steps):.2f}" if steps else "-"
        cv = r.get("item_cv") or {}
        cvs = "/".join("-" if cv.get(t) is None else f"{cv[t]:.2f}" for t in ("fwd", "bwd"))
        sr = r.get("steady_ratio")
        of = f"{r.get('steady_steps', 0)}/{r.get('steps', 0)}"
        print(
            f"{r['stages']:6} {r['schedule']:14} {r['m']:3} {r['theory']:7.3f} {r['mean']:7.3f} {r['ratio']:6.2f} "
            f"{spread:>9} {'-' if sr is None else f'{sr:.2f}':>6} {of:>3} "
            f"{'-' if rm is None else f'{rm:.3f}':>8} {'-' if rr is None else f'{rr:.2f}':>6} {marked:>6} {cvs:>9}  "
            + " ".join(f"{v:.3f}" for v in rp)
            + ("  (wall: more stages than CPUs)" if r["stages"] > cpus else "")
        )
    cases: dict = {}
    for r in rows:
        if "error" not in r:
            cases.setdefault((r["stages"], r["schedule"], r["m"]), []).append(r)
    if any(len(v) > 1 for v in cases.values()):
        print("  per case over its repeats: median (lowest-highest) of the wall ratio; of the steady ratio (runs with")
        print("  a steady step)")
        for (p, sc, m), v in cases.items():
            print(f"  {p:4} {sc:14} {m:3}  wall {_spread([r['ratio'] for r in v])}; steady ", end="")
            print(_spread([r["steady_ratio"] for r in v if r.get("steady_ratio") is not None]))
    if any("error" not in r and r["stages"] > cpus for r in rows):
        print(
            f"  wall with more stages than CPUs ({cpus} here): the stages take turns on the cores, which stretches "
            "their work and their idle time alike; the theory assumes a device per stage, which only the replayed "
            "figure (an estimate) models"
        )


def _positive(text: str) -> int:
    """argparse type: a count of 1 or more"""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: give 1 or more")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptbench.studies.ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("bytes", "bubble"), help="run one of the two tables")
    ap.add_argument("--runs", nargs="*", choices=list(LEDGER_RUNS), help="ledger runs to do (default: all)")
    ap.add_argument(
        "--bubble-adapters",
        nargs="+",
        choices=list(BUBBLE_ADAPTERS),
        default=list(BUBBLE_ADAPTERS),
        help="pipelines of the bubble table: pipeline (torch's GPipe and 1F1B), megatron (megatron-core's 1F1B); "
        "default both",
    )
    ap.add_argument(
        "--stages", nargs="+", type=int, choices=(2, 4), default=[2, 4], help="bubble table: pipeline depths (2 4)"
    )
    ap.add_argument(
        "--repeats",
        type=_positive,
        default=1,
        help="bubble table: run every case this many times, interleaved (case after case, then again); default 1",
    )
    ap.add_argument(
        "--no-comm",
        action="store_true",
        help="ledger: skip the bus-bandwidth measurement (python -m ptbench.comm into <root>/ledger/comm/)",
    )
    ap.add_argument("--root", type=Path, help="results root (default: results/ledger-<time>/)")
    ap.add_argument("--json", type=Path, help="write every row to this file")
    args = ap.parse_args(argv)
    root = args.root or command_root("ledger")
    n_bytes = len(ledger_todo(args.runs)) if args.only in (None, "bytes") else 0
    n_bubble = args.repeats * len(bubble_cases(args.bubble_adapters, args.stages)) if args.only != "bytes" else 0
    print(
        f"ledger: {n_bytes + n_bubble} runs ({n_bytes} ledger, {n_bubble} bubble), each a line as it ends; "
        f"records under {root}/",
        flush=True,
    )
    out: dict = {}
    tally = None
    if args.only in (None, "bytes"):
        busbw = None if args.no_comm else measure_busbw(root)
        tally = Tally(n_bytes + n_bubble)  # after the measurement: the pace is the runs'
        out["ledger"] = ledger_runs(root, args.runs, tally=tally)
        print_ledger(out["ledger"])
        if busbw:
            print(f"bus bandwidth measured at 2 ranks: {busbw.with_suffix('.txt')}")
            print(
                f"each kind's time at that bandwidth: python -m ptbench.analysis report {root}  (report-details.md, Why)"
            )
    if args.only in (None, "bubble"):
        tally = tally or Tally(n_bubble)
        out["bubble"] = bubble_runs(
            root,
            adapters=args.bubble_adapters,
            repeats=args.repeats,
            stages=args.stages,
            tally=tally,
        )
        print_bubble(out["bubble"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if tally:
        print(f"ledger: {tally.done} runs in {tally.spent()}")
    print(f"records under {root}")
    bad = [r for rows in out.values() for r in rows if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
