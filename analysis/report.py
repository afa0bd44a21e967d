"""A report without Jupyter: every figure (PNG + SVG), the tidy tables as CSV, and report.md.

    python -m analysis report RESULTS_DIR --out DIR [--baseline LABEL]
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd

from analysis import plots
from analysis.load import load, ok, runs

FIGURES = {
    "epoch_time": "Epoch time vs devices (paper Fig. 5/6)",
    "speedup": "Speedup and scaling efficiency vs the baseline (Fig. 10)",
    "val_metric_vs_epoch": "Validation metric per epoch (Fig. 9)",
    "val_metric_vs_time": "Validation metric vs wall time (Fig. 11)",
    "memory": "Peak memory per rank vs devices, model states vs the rest (Fig. 12)",
    "breakdown": "Time per step by phase (Fig. 7)",
}


def summary_table(df: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """One row per (workload, series, devices) point of finished runs: the numbers behind the figures."""
    r = runs(ok(df))
    if r.empty:
        return pd.DataFrame()
    g = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        runs=("run_id", "count"), global_batch=("global_batch", "first"), epochs=("epochs", "max"),
        epoch_time_s=("epoch_time_s", "mean"), step_ms=("step_time_mean_s", "mean"),
        samples_per_s=("samples_per_s", "mean"), metric=("val_metric_name", "first"),
        final_val=("val_metric", "mean"), peak_mib=("peak_memory_max", "mean"), states_mib=("state_bytes", "mean"))
    g["step_ms"] *= 1e3
    g["peak_mib"] /= plots.MIB
    g["states_mib"] /= plots.MIB
    sp = plots.speedup_table(df, baseline)[["workload", "label", "devices", "speedup", "efficiency"]]
    g["devices"] = g["devices"].astype(int)
    sp["devices"] = sp["devices"].astype(int)
    return g.merge(sp, on=["workload", "label", "devices"], how="left")


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_none_\n"
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body]) + "\n"


def write_report(results_dir: str | Path, out: str | Path, baseline: str | None = None) -> Path:
    """Figures into out/figures, tables into out/*.csv, and out/report.md; returns report.md's path."""
    results_dir, out = Path(results_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    df = load(results_dir)
    lines = [f"# Benchmark report: {results_dir}", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m analysis report`. "
             f"Tables: `epochs.csv` (one row per run x epoch), `runs.csv` (one row per run), `summary.csv`.", ""]
    if df.empty:
        lines += ["No run records found under this folder.", ""]
        path = out / "report.md"
        path.write_text("\n".join(lines))
        return path
    df.to_csv(out / "epochs.csv", index=False)
    per_run = runs(df)
    per_run.to_csv(out / "runs.csv", index=False)

    counts = per_run["status"].value_counts()
    lines += ["## Runs", "", ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({len(per_run)} runs).", ""]

    table = summary_table(df, baseline) if len(ok(df)) else pd.DataFrame()
    if not table.empty:
        table.to_csv(out / "summary.csv", index=False)
        sp = plots.speedup_table(df, baseline)
        lines += ["## Summary (finished runs)", ""]
        for wl, b in sp.groupby("workload")[["baseline", "baseline_devices"]].first().iterrows():
            why = ("chosen with --baseline" if baseline else "the fastest single-device point of any series"
                   if b["baseline_devices"] == 1 else "no single-device run: the fastest point at the fewest devices")
            lines.append(f"Speedup baseline for {wl}: **{b['baseline']}** ({why}).")
        lines += ["", markdown_table(table.rename(columns={
            "label": "series", "epoch_time_s": "epoch time (s)", "step_ms": "step (ms)", "samples_per_s": "samples/s",
            "final_val": "final val", "peak_mib": "peak MiB/rank", "states_mib": "model states MiB"}))]
        capped = df.groupby("workload")["samples_per_epoch"].nunique()
        if (capped > 1).any():
            lines += ["Epochs of one workload hold different numbers of samples (trainer.max_steps or a growing "
                      "global batch): speedup is computed per training sample, so it stays comparable.", ""]
        mem = df["memory_metric"].dropna()
        if len(mem):
            lines += [f"Memory metric: `{mem.iloc[0]}` (CPU: process VmHWM, which includes the Python process and "
                      "libraries; CUDA: max allocated). Epoch time includes warm-up steps and excludes validation.", ""]

    bad = per_run[~per_run["status"].isin(["ok", "preempted"])]
    lines += ["## Runs that did not finish", "",
              markdown_table(bad[["run_id", "adapter", "workload", "devices", "status", "error"]]), ""]

    figs, skipped = plots.all_figures(df, out / "figures", baseline=baseline)
    lines += ["## Figures", ""]
    for key, title in FIGURES.items():
        if key in figs:
            lines += [f"### {title}", "", f"![{title}](figures/{key}.png)", "", f"[SVG](figures/{key}.svg)", ""]
        else:
            lines += [f"### {title}", "", f"_not drawn: {skipped.get(key)}_", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
