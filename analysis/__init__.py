"""Analysis of run records: `load` (tidy DataFrame), `tables` (per run, per point), `plots` (the paper's
figures), `report` (CLI).

    from ptbench.analysis import load, plots
    df = load("results/demo")
    plots.speedup(df, out="figures")
"""

from ptbench.analysis.load import find_runs, load
from ptbench.analysis.tables import Study, not_finished, ok, runs

__all__ = ["Study", "find_runs", "load", "not_finished", "ok", "runs"]
