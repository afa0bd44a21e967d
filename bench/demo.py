"""`make demo` / `python -m ptbench.demo`: a small CPU sweep of the installed adapters, then its report.

Each point is one `python -m ptbench ...` subprocess, as a user would run it, on a tiny GPT-2 with
synthetic data: ddp at 1 and 2 ranks, every other installed adapter at 2 ranks (its
`smoke_overrides` applied, e.g. a pipeline's micro-batches). A point that fails, times out or is
refused before launch is recorded as such and the sweep goes on; the report shows it. Records go
to RESULTS/demo/<run_id>/ (the previous demo's are removed first unless --keep), the report to
RESULTS/demo/report/.

    python -m ptbench.demo                                  # the default sweep
    python -m ptbench.demo --points ddp:1,ddp:2,zero:2      # choose points (adapter:ranks)
    python -m ptbench.demo --adapters ddp,fsdp --ranks 1,2  # a grid
    python -m ptbench.demo --repeats 3                      # every point 3 times, interleaved (default 2)
    python -m ptbench.demo -- trainer.epochs=3              # extra overrides for every point
    python -m ptbench.demo --plan                           # what would run and what not, and stop

A point whose framework is not installed (Horovod, until `make horovod`) is not run: the first line says
so and why, and the counts are of the runs made.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ptbench.adapters import available, get_adapter_class
from ptbench.core.records import RunWriter, new_run_id
from ptbench.run_point import run_bench
from ptbench.smoke import framework_installed

# Small enough that the default sweep takes a few minutes on 2 cores; full epochs (no max_steps), so
# epoch time halves when 2 data-parallel ranks split the same data.
COMMON = (
    "workload=gpt2_tiny",
    "workload.seq_len=32",
    "workload.vocab_size=4096",
    "data=synthetic",
    "data.train_samples=96",
    "data.val_samples=32",
    "trainer.epochs=2",
    "trainer.batch_size=8",
    "trainer.untimed_steps=1",
    "trainer.progress=false",
)
EXPERIMENT = "demo"


def default_points() -> list[tuple[str, int]]:
    points = [("ddp", 1), ("ddp", 2)]
    return points + [(name, 2) for name in available() if name != "ddp"]


def parse_points(args) -> list[tuple[str, int]]:
    if args.points:
        out = []
        for item in args.points.split(","):
            name, _, ranks = item.strip().partition(":")
            if not ranks.isdigit():
                raise SystemExit(f"--points: '{item}' is not ADAPTER:RANKS (e.g. ddp:2)")
            out.append((name, int(ranks)))
        return out
    if args.adapters or args.ranks:
        names = args.adapters.split(",") if args.adapters else available()
        ranks = [int(r) for r in (args.ranks or "1,2").split(",")]
        return [(n, r) for n in names for r in ranks]
    return default_points()


def _record_not_run(root: Path, adapter: str, ranks: int, status: str, error: str, overrides: list[str]) -> None:
    """A point that never produced a record of its own (refused, not installed): write one, so the
    report lists it with the reason."""
    run_dir = root / EXPERIMENT / new_run_id(adapter, "gpt2_tiny", ranks)
    RunWriter(
        run_dir,
        {
            "experiment": EXPERIMENT,
            "adapter": adapter,
            "workload": "gpt2_tiny",
            "world_size": ranks,
            "overrides": overrides,
        },
    ).fail(status, error)


def run_point(
    root: Path, adapter: str, ranks: int, extra: list[str], timeout: float, repeat: int | None = None
) -> tuple[str, str]:
    overrides = [f"adapter={adapter}"]
    try:
        cls = get_adapter_class(adapter)
    except Exception as e:  # unknown name, or its module fails to import
        _record_not_run(root, adapter, ranks, "failed", f"{type(e).__name__}: {e}", overrides)
        return "failed", str(e)
    # the adapter's layout first, then the demo's sizes (later overrides win in Hydra)
    overrides += [*cls.smoke_overrides(ranks), *COMMON, *extra]
    if repeat is not None:  # outside the point id: the report's intervals and verdicts over a point's repeats
        overrides.append(f"results.repeat={repeat}")
    run = run_bench(
        overrides, root=root, experiment=EXPERIMENT, timeout=timeout, run_name=(adapter, "gpt2_tiny", ranks)
    )
    if run.run_dir is None:  # refused before launch (bad config for this adapter): one line on stderr
        _record_not_run(root, adapter, ranks, "failed", run.error_line, overrides)
        return "failed", run.error_line
    if not run.ok:
        return run.status, run.error_line
    s = run.summary
    return "ok", f"epoch {s.get('epoch_time_mean_s') or 0:.2f}s  step {s.get('step_time_mean_s') or 0:.4f}s"


def _install_hint(cls) -> str:
    return "`make horovod` builds it" if cls.extra == "horovod" else f"`pip install -e '.[{cls.extra}]'` installs it"


def split_points(points: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], dict[tuple[str, int], str]]:
    """(the points to run, {point: why not} for those whose framework is not installed). An unknown adapter
    stays in the first list: run_point records its failure, as for any other point that fails."""
    runnable, not_run = [], {}
    for adapter, ranks in points:
        try:
            cls = get_adapter_class(adapter)
        except Exception:  # unknown name, or its module fails to import: run_point records why
            runnable.append((adapter, ranks))
            continue
        if framework_installed(cls):
            runnable.append((adapter, ranks))
        else:
            not_run[(adapter, ranks)] = f"{cls.framework} is not installed ({_install_hint(cls)})"
    return runnable, not_run


def plan_lines(runnable, not_run, repeats: int, folder: Path) -> list[str]:
    lines = [
        f"demo: {len(runnable)} points x {repeats} repeat(s) = {len(runnable) * repeats} runs, interleaved, "
        f"into {folder}/ (each a `python -m ptbench` run)"
    ]
    lines += [f"  not run: {a} x{r}: {why}" for (a, r), why in not_run.items()]
    return lines


def _clear_previous(folder: Path) -> None:
    """Only the previous demo's runs (folders holding a record file); anything else a user saved under
    RESULTS/demo/ (a figure, notes) stays, and the report is written over."""
    for d in folder.iterdir():
        if d.is_dir() and any((d / f).is_file() for f in ("summary.json", "env.json", "config.yaml")):
            shutil.rmtree(d)


def _left(done: int, total: int, elapsed: float) -> str:
    """Time left at the mean pace of the runs so far (a point's repeats take about as long as its first)."""
    if not done or done >= total:
        return ""
    left = (total - done) * elapsed / done
    return f", about {left / 60:.0f} min left" if left >= 90 else f", about {left:.0f} s left"


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m ptbench.demo", description=__doc__.splitlines()[0])
    p.add_argument("--points", help="comma list ADAPTER:RANKS, e.g. ddp:1,ddp:2,zero:2")
    p.add_argument("--adapters", help="comma list of adapters (with --ranks: a grid)")
    p.add_argument("--ranks", help="comma list of rank counts for --adapters (default 1,2)")
    p.add_argument("--results", default="results", help="results root (records go to RESULTS/demo)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per point before it is ended")
    p.add_argument("--keep", action="store_true", help="keep the previous demo's records (they join the report)")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="run every point N times, interleaved (ABCABC): the report's 95 %% intervals and verdicts (default 2)",
    )
    p.add_argument("--plan", action="store_true", help="print what would run and what would not, run nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = parse_args(argv)
    root = Path(args.results)
    folder = root / EXPERIMENT
    repeats = max(1, args.repeats)
    runnable, not_run = split_points(parse_points(args))
    print("\n".join(plan_lines(runnable, not_run, repeats, folder)), flush=True)
    if args.plan:
        return 0
    if folder.exists() and not args.keep:
        _clear_previous(folder)
    for (adapter, ranks), why in not_run.items():  # the report lists them with the reason
        _record_not_run(root, adapter, ranks, "skipped", why, [f"adapter={adapter}"])
    t0, total = time.perf_counter(), len(runnable) * repeats
    results = []
    failed: set[tuple[str, int]] = set()  # refused or failed once: said once, not repeated
    for r in range(repeats):
        for adapter, ranks in runnable:
            if (adapter, ranks) in failed:
                continue
            t = time.perf_counter()
            status, detail = run_point(root, adapter, ranks, extra, args.timeout, r if repeats > 1 else None)
            results.append(status)
            if status != "ok":
                failed.add((adapter, ranks))
                total -= repeats - 1 - r  # its later repeats are not run
            tag = f" #{r}" if repeats > 1 else ""
            left = _left(len(results), total, time.perf_counter() - t0)
            print(
                f"  [{len(results)}/{total}] {adapter:<16} x{ranks}{tag:<3} {status:<8} {detail}  "
                f"({time.perf_counter() - t:.0f}s{left})",
                flush=True,
            )

    # the report reads the records only: analysis runs as its own command
    report = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(folder), "--out", str(folder / "report")]
    )
    ok = results.count("ok")
    not_run_names = ", ".join(f"{a} x{r}" for a, r in not_run)
    print(
        f"demo: {ok}/{len(results)} runs ok in {time.perf_counter() - t0:.0f}s"
        + (f"; not run: {not_run_names} (framework not installed)" if not_run else "")
    )
    return 0 if ok and report.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
