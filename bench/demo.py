"""`make demo` / `python -m bench.demo`: a small CPU sweep of the installed adapters, then its report.

Each point is one `python -m bench ...` subprocess, as a user would run it, on a tiny GPT-2 with
synthetic data: ddp at 1 and 2 ranks, every other installed adapter at 2 ranks (its
`smoke_overrides` applied, e.g. a pipeline's schedule). A point that fails, times out or is
refused before launch is recorded as such and the sweep goes on; the report shows it. Records go
to RESULTS/demo/<run_id>/ (the previous demo's are removed first unless --keep), the report to
RESULTS/demo/report/.

    python -m bench.demo                                  # the default sweep
    python -m bench.demo --points ddp:1,ddp:2,zero:2      # choose points (adapter:ranks)
    python -m bench.demo --adapters ddp,fsdp --ranks 1,2  # a grid
    python -m bench.demo -- trainer.epochs=3              # extra overrides for every point
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from adapters import available, get_adapter_class
from bench.records import RunRecord, new_run_id
from bench.smoke import framework_installed

# Small enough that the default sweep takes a few minutes on 2 cores; full epochs (no max_steps), so
# epoch time halves when 2 data-parallel ranks split the same data.
COMMON = (
    "workload=gpt2_tiny", "workload.seq_len=32", "workload.vocab_size=4096", "data=synthetic",
    "data.train_samples=96", "data.val_samples=32", "trainer.epochs=2", "trainer.batch_size=8",
    "trainer.warmup_steps=1", "trainer.progress=false",
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


def _record_not_run(root: Path, adapter: str, ranks: int, status: str, error: str, overrides: list[str]) -> Path:
    """A point that never produced a record of its own (refused, not installed): write one, so the
    report lists it with the reason."""
    run_dir = root / EXPERIMENT / new_run_id(adapter, "gpt2_tiny", ranks)
    run_dir.mkdir(parents=True, exist_ok=True)
    RunRecord(run_dir).write_summary({"status": status, "run_id": run_dir.name, "experiment": EXPERIMENT,
                                      "adapter": adapter, "workload": "gpt2_tiny", "world_size": ranks,
                                      "error": error, "overrides": overrides})
    return run_dir


def run_point(root: Path, adapter: str, ranks: int, extra: list[str], timeout: float) -> tuple[str, str]:
    overrides = [f"adapter={adapter}"]
    try:
        cls = get_adapter_class(adapter)
    except Exception as e:  # unknown name, or its module fails to import
        _record_not_run(root, adapter, ranks, "failed", f"{type(e).__name__}: {e}", overrides)
        return "failed", str(e)
    if not framework_installed(cls):
        msg = f"skipped: {cls.framework} is not installed"
        _record_not_run(root, adapter, ranks, "failed", msg, overrides)
        return "failed", msg
    # adapter needs first, then the demo's sizes and rank count (later overrides win in Hydra)
    overrides += [*getattr(cls, "smoke_overrides", ()), *COMMON, f"launcher.nprocs={ranks}", *extra]
    run_id = new_run_id(adapter, "gpt2_tiny", ranks)
    cmd = [sys.executable, "-m", "bench", *overrides, f"results.root={root}", f"results.experiment={EXPERIMENT}",
           f"results.run_id={run_id}"]
    run_dir = root / EXPERIMENT / run_id
    # own session: on timeout the whole tree (launcher + ranks) is ended, nothing else
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        msg = f"demo: point exceeded --timeout {timeout:.0f}s"
        record = RunRecord(run_dir)
        summary = record.summary()
        if summary is None:
            _record_not_run(root, adapter, ranks, "timeout", msg, overrides)
        elif summary.get("status") in ("running", "failed"):
            summary.update(status="timeout", error=msg)
            record.write_summary(summary)
        return "timeout", msg
    summary = RunRecord(run_dir).summary()
    if summary is None:  # refused before launch (bad config for this adapter): one line on stderr
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        msg = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else f"exit {proc.returncode}")
        _record_not_run(root, adapter, ranks, "failed", msg, overrides)
        return "failed", msg
    if summary.get("status") != "ok":
        return summary.get("status", "failed"), summary.get("error") or f"exit {proc.returncode}"
    return "ok", f"epoch {summary.get('epoch_time_mean_s', 0):.2f}s  step {summary.get('step_time_mean_s') or 0:.4f}s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.splitlines()[0])
    p.add_argument("--points", help="comma list ADAPTER:RANKS, e.g. ddp:1,ddp:2,zero:2")
    p.add_argument("--adapters", help="comma list of adapters (with --ranks: a grid)")
    p.add_argument("--ranks", help="comma list of rank counts for --adapters (default 1,2)")
    p.add_argument("--results", default="results", help="results root (records go to RESULTS/demo)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per point before it is ended")
    p.add_argument("--keep", action="store_true", help="keep the previous demo's records (they join the report)")
    args = p.parse_args(argv)

    root = Path(args.results)
    folder = root / EXPERIMENT
    if folder.exists() and not args.keep:
        shutil.rmtree(folder)
    points = parse_points(args)
    print(f"demo: {len(points)} points into {folder}/ (each a `python -m bench` run)", flush=True)
    t0 = time.perf_counter()
    results = []
    for adapter, ranks in points:
        t = time.perf_counter()
        status, detail = run_point(root, adapter, ranks, extra, args.timeout)
        results.append(status)
        print(f"  {adapter:<16} x{ranks}  {status:<8} {detail}  ({time.perf_counter() - t:.0f}s)", flush=True)

    from analysis.report import write_report

    report = write_report(folder, folder / "report")
    ok = results.count("ok")
    print(f"demo: {ok}/{len(points)} points ok in {time.perf_counter() - t0:.0f}s")
    print(f"report: {report.resolve()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
