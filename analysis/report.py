"""A report without Jupyter: every figure (PNG + SVG), the tidy tables as CSV, and report.md.

    python -m analysis report RESULTS_DIR --out DIR [--baseline best|per-series|LABEL]
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd

from analysis import plots
from analysis.load import EPOCH_TIME_SOURCES, load, not_finished, ok, runs

FIGURES = {
    "epoch_time": "Epoch time vs devices (paper Fig. 5/6)",
    "speedup": "Speedup and scaling efficiency vs the baseline (Fig. 10)",
    "val_metric_vs_epoch": "Validation metric per epoch (Fig. 9)",
    "val_metric_vs_time": "Validation metric vs wall time (Fig. 11)",
    "memory": "Peak memory per rank vs devices, model states vs the rest (Fig. 12)",
    "breakdown": "Time per step by phase (Fig. 7)",
}
WARNING = "**Warning:**"


def summary_table(df: pd.DataFrame, baseline: str | None = "best") -> pd.DataFrame:
    """One row per (workload, series, devices) point of finished runs: the numbers behind the figures.
    `global_batch` lists every value its runs used ("8; 16" when they differ); `epoch time (s)` is the
    one speedup uses, `epoch time from` says where it came from."""
    r = runs(ok(df))
    if r.empty:
        return pd.DataFrame()
    g = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        runs=("run_id", "count"), global_batch=("global_batch", plots._join), epochs=("epochs", "max"),
        epoch_time_s=("epoch_time_used_s", "mean"), epoch_time_from=("epoch_time_source", plots._join),
        step_ms=("step_time_mean_s", "mean"), samples_per_s=("samples_per_s", "mean"),
        metric=("val_metric_name", "first"), final_val=("val_metric", "mean"))
    g["step_ms"] *= 1e3
    mem = plots.memory_table(df)[["workload", "label", "devices", "peak_mib", "states_mib"]]
    g["devices"] = g["devices"].astype(int)
    mem["devices"] = mem["devices"].astype(int)
    g = g.merge(mem, on=["workload", "label", "devices"], how="left")
    sp = plots.speedup_table(df, baseline)[["workload", "label", "devices", "speedup", "efficiency"]]
    sp["devices"] = sp["devices"].astype(int)
    return g.merge(sp, on=["workload", "label", "devices"], how="left")


def _gb(v) -> str:
    return _fmt(int(v) if isinstance(v, float) and v.is_integer() else v)


def batch_warnings(df: pd.DataFrame) -> list[str]:
    """Warning lines where points that a figure sets side by side differ in global batch: runs of one
    series at one device count (their means mix batches), and the series of one workload at one
    device count (their epoch times compare different batches)."""
    r = runs(ok(df))
    if r.empty or "global_batch" not in r:
        return []
    r = r[r["global_batch"].notna()]
    lines = []
    for (wl, lab, d), sub in r.groupby(["workload", "label", "devices"]):
        gbs = sorted(set(sub["global_batch"]))
        if len(gbs) > 1:
            lines.append(f"{WARNING} {wl}, series `{lab}` at {int(d)} devices: its runs used different global batches "
                         f"({', '.join(_gb(v) for v in gbs)}); the point averages them "
                         f"(runs {', '.join(sorted(sub['run_id']))}).")
    for (wl, d), sub in r.groupby(["workload", "devices"]):
        per = sub.groupby("label")["global_batch"].agg(lambda v: ", ".join(_gb(x) for x in sorted(set(v))))
        if sub["global_batch"].nunique() > 1 and len(per) > 1:
            lines.append(f"{WARNING} {wl} at {int(d)} devices: the series differ in global batch "
                         f"({'; '.join(f'`{lab}` {gb}' for lab, gb in per.items())}): their epoch times compare "
                         "different batches (speedup is per training sample).")
    return lines


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


def _baseline_lines(sp: pd.DataFrame, baseline: str | None) -> list[str]:
    lines = []
    for wl, sub in sp.groupby("workload"):
        mode = sub["baseline_mode"].iloc[0]
        if mode == "per-series":
            lines.append(f"Speedup baseline for {wl}: **each series' own point at its fewest devices** (--baseline "
                         "per-series): " + "; ".join(sorted(set(sub["baseline"]))) + ".")
            continue
        b = sub.iloc[0]
        why = (f"chosen with --baseline {baseline}" if mode == "series" else
               "the fastest single-device point of any series" if b["baseline_devices"] == 1 else
               "no single-device run: the fastest point at the fewest devices")
        lines.append(f"Speedup baseline for {wl}: **{b['baseline']}** ({why}).")
    return lines


def _epoch_time_lines(per_run: pd.DataFrame) -> list[str]:
    done = per_run[per_run["status"] == "ok"]
    used = done["epoch_time_source"].dropna().value_counts()
    lines = []
    if len(used):
        lines.append("Epoch time used for the epoch-time and speedup figures: " + "; ".join(
            f"{src} ({n} run{'s' if n > 1 else ''})" for src, n in used.items()) + ". Preference: the summary's "
            f"`epoch_time_steady_s` (complete epochs after the first), else the {EPOCH_TIME_SOURCES['after_first']} "
            "(two or more epochs), else the first epoch, which includes warm-up.")
    partial = per_run[per_run["partial_epochs"] > 0] if "partial_epochs" in per_run else per_run.iloc[:0]
    if len(partial):
        lines.append(f"Partial epochs (cut short by trainer.max_steps or preemption) are left out of every mean "
                     f"unless all of a run's epochs are partial: {int(partial['partial_epochs'].sum())} in "
                     + ", ".join(f"{r} ({n})" for r, n in zip(partial["run_id"], partial["partial_epochs"])) + ".")
    else:
        lines.append("No epoch is flagged partial; partial epochs would be left out of the means.")
    return lines


def _memory_lines(df: pd.DataFrame) -> list[str]:
    try:
        mem = plots.memory_table(df)
    except Exception:  # noqa: BLE001 - no finished run: nothing to say
        return []
    metrics = sorted({m for ms in mem["memory_metric"].dropna() for m in ms.split("; ")})
    text = {
        "peak_rss_delta": "`peak_rss_delta` (CPU: peak RSS minus RSS just before the first step, so the interpreter "
                          "and libraries are left out; parameters built before the first step are not in it)",
        "peak_rss": "`peak_rss` (CPU: process VmHWM, which includes the Python process and libraries)",
        "peak_allocated": "`peak_allocated` (CUDA: max allocated)",
    }
    lines = ["Memory metric: " + "; ".join(text.get(m, f"`{m}`") for m in metrics) + "."]
    cpu = df[df["memory_metric"] == "peak_rss"] if "memory_metric" in df else df.iloc[:0]
    if "peak_rss" in metrics and len(cpu):
        lines.append("These CPU records carry no `peak_rss_delta`: the memory figure falls back to `peak_rss`.")
    off = mem[mem["offload"].notna()]
    for _, m in off.iterrows():
        lines.append(f"{m['workload']} `{m['label']}` x{int(m['devices'])}: {m['offload']} held in CPU memory "
                     f"({m['host_mib']:.4g} MiB), not counted as device memory.")
    for note in sorted(set(mem["mem_note"].dropna())):
        lines.append(f"Memory note: {note}.")
    return lines


def write_report(results_dir: str | Path, out: str | Path, baseline: str | None = "best") -> Path:
    """Figures into out/figures, tables into out/*.csv, and out/report.md; returns report.md's path."""
    results_dir, out = Path(results_dir), Path(out)
    baseline = baseline or "best"
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
    lines += ["## Runs", "", (", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({len(per_run)} runs). "
                              "Only `ok` runs make the curves; the others are marked with a red x on every figure "
                              "and listed below."), ""]

    table = summary_table(df, baseline) if len(ok(df)) else pd.DataFrame()
    if not table.empty:
        table.to_csv(out / "summary.csv", index=False)
        sp = plots.speedup_table(df, baseline)
        lines += ["## Summary (finished runs)", ""]
        lines += _baseline_lines(sp, baseline)
        lines += ["", ("Series labels come from each run's own record: adapter, settings, and `gb=` the global batch "
                       "as its batch policy sets it (`gb=B/replica`: B per data-parallel replica; `gb=B/device`: B per "
                       "device; `gb=B/microbatch`: B per micro-batch; `gb=B`: fixed). The `global_batch` column gives "
                       "each point's actual value."), ""]
        warn = batch_warnings(df)
        if warn:
            lines += [*warn, ""]
        lines += ["", markdown_table(table.rename(columns={
            "label": "series", "epoch_time_s": "epoch time (s)", "epoch_time_from": "epoch time from",
            "step_ms": "step (ms)", "samples_per_s": "samples/s", "final_val": "final val",
            "peak_mib": "peak MiB/rank", "states_mib": "model states MiB"}))]
        capped = ok(df).groupby("workload")["samples_per_epoch"].nunique()
        if (capped > 1).any():
            lines += [("Epochs of one workload hold different numbers of samples (trainer.max_steps or a growing "
                       "global batch): speedup is computed per training sample, so it stays comparable."), ""]
        lines += [*_epoch_time_lines(per_run), "Epoch time excludes validation.", ""]
        lines += [*_memory_lines(df), ""]

    bad = not_finished(df)
    lines += ["## Runs that did not finish", "",
              ("Any status but `ok` (failed, oom, timeout, preempted, missing, skipped): left out of the curves, "
               "marked on every figure."), "",
              markdown_table(bad[["run_id", "label", "workload", "devices", "status", "error"]]) if len(bad)
              else "_none_\n", ""]

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
