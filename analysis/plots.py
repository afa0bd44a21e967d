"""The paper's figures from the tidy frame of `analysis.load.load`.

Each function takes that frame (one row per run x epoch; failed runs are left out of the curves
and marked where it helps), returns a matplotlib Figure, and, given `out`, saves it there as PNG
and SVG. The table each figure draws is attached as `fig.bench_data`, so a notebook or a test can
check the picture against the numbers.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot state): the CLI needs no
display and no figure is left open; Jupyter still renders a returned Figure inline.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

from analysis.load import AnalysisError, ok, runs

PHASES = ("data", "forward", "forward_backward", "backward", "optimizer")  # stacking order, bottom up
MIB = 2**20


def save(fig: Figure, out: str | Path | None, name: str) -> Figure:
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for ext in ("png", "svg"):
            fig.savefig(out / f"{name}.{ext}", dpi=120, bbox_inches="tight")
    return fig


def _palette(labels) -> dict:
    labels = sorted(set(labels))
    return dict(zip(labels, sns.color_palette("colorblind", max(len(labels), 1))))


def _ok_runs(df: pd.DataFrame) -> pd.DataFrame:
    r = runs(ok(df))
    if r.empty:
        raise AnalysisError("no finished run with epoch records in this frame: nothing to plot")
    r = r.copy()
    r["devices"] = r["devices"].astype(int)
    return r


def _log2_devices(ax, devices) -> None:
    ticks = sorted(set(int(d) for d in devices))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    lo, hi = min(ticks), max(ticks)
    ax.set_xlim(lo / 1.4, hi * 1.4)
    ax.set_xlabel("devices")


def _grid(n_rows: int, n_cols: int, w: float = 5.0, h: float = 3.6, sharey: bool = False):
    fig = Figure(figsize=(w * n_cols, h * n_rows), layout="constrained")
    axes = np.atleast_2d(fig.subplots(n_rows, n_cols, squeeze=False, sharey="row" if sharey else False))
    return fig, axes


def _lines(ax, data: pd.DataFrame, x: str, y: str, by: str, colors: dict, sd: str | None = None) -> None:
    """One labelled line per `by` value (its label is the series name, so tests and legends find it)."""
    for name, sub in data.groupby(by, sort=True):
        sub = sub.sort_values(x)
        ax.plot(sub[x], sub[y], marker="o", color=colors[name], label=name)
        if sd is not None and sub[sd].notna().any():
            ax.errorbar(sub[x], sub[y], yerr=sub[sd].fillna(0), fmt="none", ecolor=colors[name], capsize=3)


def _legend(ax, **kw) -> None:
    """Inside the axes when short, outside on the right when it would cover the data."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # repeats of one series share one entry
    labels, handles = list(unique), list(unique.values())
    if len(labels) > 4:
        kw.update(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    ax.legend(handles, labels, fontsize=8, **kw)


def _mark_failed(ax, df: pd.DataFrame, workload: str) -> list[int]:
    """A red x at the bottom of the axes for every point that did not finish (oom, failed, ...);
    returns their device counts."""
    r = runs(df)
    bad = r[(r["workload"] == workload) & ~r["status"].isin(["ok", "preempted"]) & r["devices"].notna()]
    if bad.empty:
        return []
    for _, b in bad.iterrows():
        ax.plot([int(b["devices"])], [0.02], transform=ax.get_xaxis_transform(), marker="x", color="crimson",
                markersize=9, linestyle="none", clip_on=False)
    ax.plot([], [], marker="x", color="crimson", linestyle="none", label="not finished (see report)")
    return [int(d) for d in bad["devices"]]


# --- Fig 5/6: epoch time vs devices ----------------------------------------------------------------
def epoch_time(df: pd.DataFrame, out=None, name: str = "epoch_time") -> Figure:
    """Mean epoch time per run vs number of devices (log2 axis), one line per adapter series."""
    r = _ok_runs(df)
    data = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        epoch_time_s=("epoch_time_s", "mean"), epoch_time_sd=("epoch_time_s", "std"), runs=("run_id", "count"),
        samples_per_epoch=("samples_per_epoch", "mean"))
    workloads = sorted(data["workload"].unique())
    fig, axes = _grid(1, len(workloads))
    colors = _palette(data["label"])
    for ax, wl in zip(axes[0], workloads):
        sub = data[data["workload"] == wl]
        _lines(ax, sub, "devices", "epoch_time_s", "label", colors, sd="epoch_time_sd")  # bars: sd over repeats
        failed = _mark_failed(ax, df, wl)
        _log2_devices(ax, [*sub["devices"], *failed])
        ax.set_ylim(bottom=0)
        ax.set_ylabel("epoch time (s)")
        ax.set_title(f"{wl}: epoch time")
        _legend(ax)
    fig.bench_data = data
    return save(fig, out, name)


# --- Fig 10: speedup and scaling efficiency ----------------------------------------------------------
def speedup_table(df: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """Speedup and scaling efficiency of every (workload, series, devices) point.

    Time is per training sample (epoch time / samples in the epoch), which is the epoch-time ratio
    when epochs hold the same samples and stays fair when trainer.max_steps caps them. Baseline per
    workload: by default the fastest single-device point of any series, as the paper does; else the
    named series (`label`) at its fewest devices. Without a single-device point the fastest point at
    the fewest devices is used, and efficiency is relative to that device count.
    """
    r = _ok_runs(df)
    pts = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        time_per_sample_s=("time_per_sample_s", "mean"), epoch_time_s=("epoch_time_s", "mean"))
    parts = []
    for wl, sub in pts.groupby("workload"):
        if baseline is None:
            fewest = sub[sub["devices"] == sub["devices"].min()]
            base = fewest.loc[fewest["time_per_sample_s"].idxmin()]
        else:
            mine = sub[sub["label"] == baseline]
            if mine.empty:
                raise AnalysisError(f"baseline '{baseline}' has no finished run for workload {wl}; "
                                 f"choose one of: {', '.join(sorted(sub['label'].unique()))}")
            base = mine.loc[mine["devices"].idxmin()]
        sub = sub.copy()
        sub["speedup"] = base["time_per_sample_s"] / sub["time_per_sample_s"]
        sub["efficiency"] = sub["speedup"] * base["devices"] / sub["devices"]
        sub["baseline"] = f"{base['label']} on {int(base['devices'])} device{'s' if base['devices'] > 1 else ''}"
        sub["baseline_label"] = base["label"]
        sub["baseline_devices"] = int(base["devices"])
        sub["baseline_epoch_time_s"] = base["epoch_time_s"]
        parts.append(sub)
    return pd.concat(parts, ignore_index=True)


def speedup(df: pd.DataFrame, out=None, baseline: str | None = None, name: str = "speedup") -> Figure:
    """Speedup (left) and scaling efficiency (right) vs devices against the named baseline."""
    data = speedup_table(df, baseline)
    workloads = sorted(data["workload"].unique())
    fig, axes = _grid(len(workloads), 2)
    colors = _palette(data["label"])
    for row, wl in zip(axes, workloads):
        sub = data[data["workload"] == wl]
        devs = sorted(sub["devices"].unique())
        b0 = sub["baseline_devices"].iloc[0]
        for ax, col, ideal in ((row[0], "speedup", [d / b0 for d in devs]), (row[1], "efficiency", [1.0] * len(devs))):
            ax.plot(devs, ideal, color="grey", linestyle="--", linewidth=1, label="ideal")
            _lines(ax, sub, "devices", col, "label", colors)
            _log2_devices(ax, devs)
            ax.set_ylim(bottom=0)
            _legend(ax)
        row[0].set_ylabel("speedup")
        row[1].set_ylabel("scaling efficiency")
        base = sub["baseline"].iloc[0]
        row[0].set_title(f"{wl}: speedup vs {base}\n({sub['baseline_epoch_time_s'].iloc[0]:.3g} s/epoch)", fontsize=10)
        row[1].set_title(f"{wl}: efficiency vs {base}", fontsize=10)
    fig.bench_data = data
    return save(fig, out, name)


# --- Fig 9 / Fig 11: validation metric vs epoch and vs wall time -------------------------------------
def val_metric(df: pd.DataFrame, out=None, x: str = "epoch", name: str | None = None) -> Figure:
    """Validation accuracy (vision) or perplexity (language) per epoch (`x="epoch"`, Fig 9) or
    against wall time since the run started (`x="wall_time_s"`, Fig 11), one line per run."""
    if x not in ("epoch", "wall_time_s"):
        raise AnalysisError(f"x={x!r}: choose 'epoch' or 'wall_time_s'")
    d = ok(df)
    d = d[d["val_metric"].notna()].copy()
    if d.empty:
        raise AnalysisError("no validation metric in this frame (trainer.eval_every_epoch=false?): nothing to plot")
    d["devices"] = d["devices"].astype(int)
    d["epoch"] = d["epoch"].astype(int) + 1  # epochs completed
    d["series"] = d["label"] + " x" + d["devices"].astype(str)
    workloads = sorted(d["workload"].unique())
    fig, axes = _grid(1, len(workloads))
    colors = _palette(d["series"])
    for ax, wl in zip(axes[0], workloads):
        sub = d[d["workload"] == wl]
        for (series, _), run in sub.groupby(["series", "run_id"], sort=True):  # one line per run, repeats share a colour
            run = run.sort_values("epoch")
            ax.plot(run[x], run["val_metric"], marker="o", color=colors[series], label=series)

        metric = sub["val_metric_name"].iloc[0]
        if metric == "val_perplexity":
            ax.set_yscale("log")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_xlabel("epoch" if x == "epoch" else "wall time since start (s)")
        if x == "epoch":
            ax.xaxis.set_major_locator(FixedLocator(sorted(sub["epoch"].unique())))
        ax.set_title(f"{wl}: {metric.replace('val_', 'validation ')} vs {'epoch' if x == 'epoch' else 'time'}")
        _legend(ax, title="series x devices", title_fontsize=8)
    fig.bench_data = d[["workload", "label", "devices", "run_id", "epoch", "wall_time_s", "val_metric", "val_metric_name"]]
    return save(fig, out, name or f"val_metric_vs_{'epoch' if x == 'epoch' else 'time'}")


# --- Fig 12: memory per rank vs devices --------------------------------------------------------------
def memory_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: the highest per-rank peak memory, split into model states (params, grads, optimizer
    of that rank) and the rest (activations, buffers, and on CPU the process itself), in MiB."""
    r = _ok_runs(df)
    cols = ["peak_memory_max", "state_params", "state_grads", "state_optimizer"]
    for c in cols:
        if c not in r:
            r[c] = np.nan
    data = r.groupby(["workload", "label", "devices"], as_index=False)[cols].mean()
    data["peak_mib"] = data["peak_memory_max"] / MIB
    for part in ("params", "grads", "optimizer"):
        data[f"{part}_mib"] = data[f"state_{part}"] / MIB
    states = data[["params_mib", "grads_mib", "optimizer_mib"]].sum(axis=1, min_count=1)
    data["states_mib"] = states
    data["other_mib"] = (data["peak_mib"] - states.fillna(0)).clip(lower=0)
    metric = r["memory_metric"].dropna()
    data["memory_metric"] = metric.iloc[0] if len(metric) else None
    return data


def memory(df: pd.DataFrame, out=None, name: str = "memory", max_cols: int = 4) -> Figure:
    """Stacked bars per series: peak memory of the busiest rank vs devices, model states vs the rest.
    One panel per (workload, series), `max_cols` to a row; panels of one workload share the y axis."""
    data = memory_table(df)
    panels = [(wl, lab) for wl in sorted(data["workload"].unique())
              for lab in sorted(data.loc[data["workload"] == wl, "label"].unique())]
    rows = []  # workloads start on a new row
    for wl in sorted(data["workload"].unique()):
        mine = [p for p in panels if p[0] == wl]
        rows += [mine[i:i + max_cols] for i in range(0, len(mine), max_cols)]
    n_cols = max(len(r) for r in rows)
    fig, axes = _grid(len(rows), n_cols, w=3.4, h=3.2)
    parts = [("params_mib", "parameters"), ("grads_mib", "gradients"), ("optimizer_mib", "optimizer state"),
             ("other_mib", "rest of peak")]
    colors = dict(zip([p for p, _ in parts], sns.color_palette("muted", 4)))
    metric = {"peak_rss": "peak RSS per process (MiB)", "peak_allocated": "peak allocated per GPU (MiB)"}.get(
        data["memory_metric"].iloc[0], "peak memory per rank (MiB)")
    first_of = {}
    for ax_row, row in zip(axes, rows):
        for ax in ax_row[len(row):]:
            ax.set_axis_off()
        for ax, (wl, lab) in zip(ax_row, row):
            if wl in first_of:
                ax.sharey(first_of[wl])
            first_of.setdefault(wl, ax)
            sub = data[(data["workload"] == wl) & (data["label"] == lab)].sort_values("devices")
            ax.set_title(f"{wl}: {lab}", fontsize=10)
            xs = [str(d) for d in sub["devices"]]
            bottom = np.zeros(len(sub))
            for col, text in parts:  # without recorded states the whole peak is "rest"
                vals = sub[col].fillna(0).to_numpy()
                ax.bar(xs, vals, bottom=bottom, color=colors[col], label=text, width=0.6)
                bottom = bottom + vals
            # on CPU the process itself dwarfs the model states: state the split in numbers too
            for x, st, top in zip(xs, sub["states_mib"], bottom):
                if not np.isnan(st):
                    ax.annotate(f"states {st:.3g}", (x, top), ha="center", va="bottom", fontsize=7,
                                xytext=(0, 2), textcoords="offset points")
            ax.margins(y=0.1)
            ax.set_xlabel("devices")
            ax.set_ylabel(metric, fontsize=8)
    handles, texts = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, texts, loc="outside right upper", fontsize=8)
    fig.bench_data = data
    return save(fig, out, name)


# --- Fig 7: time breakdown ---------------------------------------------------------------------------
def breakdown_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: mean time per step in each phase (means over ranks), and the rest of the slowest
    rank's step time ("other": waiting on other ranks, unattributed work), in milliseconds."""
    r = _ok_runs(df)
    phases = [p for p in PHASES if f"{p}_time_mean_s" in r]
    cols = [f"{p}_time_mean_s" for p in phases] + ["step_time_mean_s"]
    data = r.groupby(["workload", "label", "devices"], as_index=False)[cols].mean()
    for p in phases:
        data[f"{p}_ms"] = data[f"{p}_time_mean_s"] * 1e3
    data["step_ms"] = data["step_time_mean_s"] * 1e3
    data["other_ms"] = (data["step_ms"] - data[[f"{p}_ms" for p in phases]].fillna(0).sum(axis=1)).clip(lower=0)
    data["point"] = data["label"] + " x" + data["devices"].astype(str)
    data.attrs["phases"] = phases
    return data


def breakdown(df: pd.DataFrame, out=None, name: str = "breakdown") -> Figure:
    """Stacked bars: data / forward / backward / optimizer (and other) time per step, per point."""
    data = breakdown_table(df)
    phases = data.attrs["phases"] + ["other"]
    workloads = sorted(data["workload"].unique())
    n = max(len(data[data["workload"] == w]) for w in workloads)
    fig, axes = _grid(1, len(workloads), w=max(4.0, 0.9 * n + 2), h=3.8)
    colors = dict(zip(phases, sns.color_palette("deep", len(phases))))
    for ax, wl in zip(axes[0], workloads):
        sub = data[data["workload"] == wl].sort_values(["label", "devices"])
        bottom = np.zeros(len(sub))
        for p in phases:
            vals = sub[f"{p}_ms"].fillna(0).to_numpy()
            if not vals.any():
                continue
            ax.bar(sub["point"], vals, bottom=bottom, color=colors[p], label=p, width=0.6)
            bottom = bottom + vals
        ax.set_ylabel("time per step (ms)")
        ax.set_title(f"{wl}: time per step by phase")
        ax.tick_params(axis="x", labelrotation=30)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
        _legend(ax)
    fig.bench_data = data
    return save(fig, out, name)


def all_figures(df: pd.DataFrame, out, baseline: str | None = None) -> tuple[dict[str, Figure], dict[str, str]]:
    """Every figure above, and {name: reason} for those whose data are absent (skipped)."""
    makers = {
        "epoch_time": lambda: epoch_time(df, out),
        "speedup": lambda: speedup(df, out, baseline=baseline),
        "val_metric_vs_epoch": lambda: val_metric(df, out, x="epoch"),
        "val_metric_vs_time": lambda: val_metric(df, out, x="wall_time_s"),
        "memory": lambda: memory(df, out),
        "breakdown": lambda: breakdown(df, out),
    }
    figs, skipped = {}, {}
    for key, make in makers.items():
        try:
            figs[key] = make()
        except AnalysisError as e:
            skipped[key] = str(e)
    return figs, skipped
