"""`python -m ptbench.analysis report RESULTS_DIR [--out DIR]`: all figures, tables and report.md, no Jupyter
(into RESULTS_DIR/report unless --out names another folder).
`python -m ptbench.analysis noise FILE`: the statistics of a `python -m ptbench.sweep noise` measurement.
`python -m ptbench.analysis errors [--trials N]`: the simulated error rates and power of the verdicts."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.analysis")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="figures (PNG+SVG), CSV tables and report.md from a tree of run records")
    r.add_argument("results", help="folder holding run records (searched recursively)")
    r.add_argument(
        "--out", default=None, help="folder for report.md, figures/ and the CSV tables (default: RESULTS/report)"
    )
    r.add_argument(
        "--baseline",
        default="best",
        metavar="best|per-series|LABEL",
        help="speedup baseline: best = the fastest single-device point of any series for the workload "
        "(as the paper; default); per-series = each series' own point at its fewest devices; "
        "or one series' label (as in the report) for every series",
    )
    r.add_argument(
        "--include-contended",
        action="store_true",
        help="keep runs whose record warns of contention in the verdicts (left out by default)",
    )
    r.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="VALUE",
        help="time to target: the validation metric value to reach, fixed in advance (default: the level the "
        "baseline point's runs reach halfway, in epochs, to their best: on the curve's slope, not its plateau)",
    )
    n = sub.add_parser("noise", help="B/A step-time ratio with its interval of a noise file (ptbench.sweep noise)")
    n.add_argument("file", help="<results>/<experiment>/noise/noise-*.json")
    e = sub.add_parser("errors", help="simulated error rates and power of the report's verdicts (a table)")
    e.add_argument("--trials", type=int, default=1000, help="simulated studies per row (default 1000)")
    e.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.command == "errors":
        from ptbench.analysis.stats import error_lines, error_table

        print("\n".join(error_lines(error_table(args.trials, args.seed), args.trials)))
        return 0
    if args.command == "noise":
        from ptbench.analysis.stats import _main as noise_main

        return noise_main(["noise", args.file])

    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    from ptbench.analysis.load import AnalysisError
    from ptbench.analysis.report import write_report

    try:
        from pathlib import Path

        out = args.out if args.out is not None else Path(args.results) / "report"
        path = write_report(
            args.results, out, baseline=args.baseline, include_contended=args.include_contended, target=args.target
        )
    except (FileNotFoundError, AnalysisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
