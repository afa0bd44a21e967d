"""The paper's figures, drawn from the tables of `ptbench.analysis.tables`.

Each function takes a `Study` (the epoch frame and its tables, computed once and shared by every
figure of a report) or the tidy frame of `ptbench.analysis.load.load` (one row per run x epoch; a
Study is made of it), returns a matplotlib Figure, and, given `out`, saves it there as PNG and SVG.
Figures compute nothing but their layout. Only finished runs (status ok) make the curves and bars; every
point that did not finish (failed, oom, timeout, preempted, missing, ...) is marked on every figure
with a red x and its status. The table each figure draws is attached as `fig.bench_data` and the
points it marks as not finished as `fig.bench_failed`, so a notebook or a test can check the picture
against the numbers.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot state): the CLI needs no
display and no figure is left open; Jupyter still renders a returned Figure inline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib as mpl
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

from ptbench.analysis import safe_io
from ptbench.analysis.load import AnalysisError
from ptbench.analysis.tables import MEMORY_METRICS, Study, _concat, _join

DPI = 120


def save(fig: Figure, out: str | Path | None, name: str) -> Figure:
    """PNG and SVG, cropped to the drawing ("tight"). The layout and the crop are worked out once for both
    files (savefig would redo the constrained layout and a crop pass per file: 4 layouts, 4 draws). Written
    as every report file is (safe_io: into a folder checked as ours, never through a link)."""
    if out is not None:
        out = Path(out)
        os.close(safe_io.own_dir(out))  # made or checked before the drawing, refused in one line
        for text in fig.findobj(Text):  # labels are record text: a `$` in one is a dollar sign, not maths
            text.set_parse_math(False)
        fig.set_dpi(DPI)
        fig.draw_without_rendering()  # runs the constrained layout
        bbox = fig.get_tightbbox().padded(mpl.rcParams["savefig.pad_inches"])
        engine = fig.get_layout_engine()
        fig.set_layout_engine("none")  # keep the positions just computed
        try:
            for ext in ("png", "svg"):
                safe_io.write_with(
                    out / f"{name}.{ext}",
                    lambda f, ext=ext: fig.savefig(f, format=ext, dpi=DPI, bbox_inches=bbox),
                    binary=True,
                )
        finally:
            fig.set_layout_engine(engine)
    return fig


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
DASHES = ("-", "--", ":", "-.")


def _palette(labels) -> dict:
    """Series -> line style: a colour, a marker shape and a dash pattern of its own, so series stay apart
    in print, in grey and where they overplot (open markers of different shapes show through each other)."""
    labels = sorted(set(labels))
    colors = sns.color_palette("colorblind", max(len(labels), 1))
    return {
        lab: {"color": colors[i % len(colors)], "marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % 4]}
        for i, lab in enumerate(labels)
    }


def _coinciding(curves: dict) -> dict:
    """{series: the earlier series it lies on} for series whose (x, y) points equal another's (relative
    1e-3: closer than a line's width), e.g. adapters doing the same maths on one validation curve."""
    on, seen = {}, []
    for name, (xs, ys) in curves.items():
        xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
        for other, (ox, oy) in seen:
            if len(xs) == len(ox) and len(xs) and np.allclose(xs, ox, rtol=1e-3, equal_nan=True):
                if np.allclose(ys, oy, rtol=1e-3, equal_nan=True):
                    on[name] = on.get(other, other)
                    break
        else:
            seen.append((name, (xs, ys)))
    return on


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


def _plot(ax, xs, ys, style: dict, label: str):
    return ax.plot(xs, ys, **style, label=label, markerfacecolor="none", markeredgewidth=1.4, markersize=7)


DODGE_OCTAVES = 0.3  # the dodged series of one x spread over this part of an octave on the log2 axis


def dodge_factors(names, octaves: float = DODGE_OCTAVES) -> dict:
    """{series: x factor} that sets the series side by side around each x on a log axis (the middle one
    unmoved, the rest at most `octaves` / 2 either way), so points and error bars at one device count do
    not stack; one series stays where it is."""
    names = sorted(set(names))
    if len(names) < 2:
        return {n: 1.0 for n in names}
    step = octaves / (len(names) - 1)
    return {n: 2 ** ((i - (len(names) - 1) / 2) * step) for i, n in enumerate(names)}


def _lines(
    ax,
    data: pd.DataFrame,
    x: str,
    y: str,
    by: str,
    colors: dict,
    band: tuple[str, str] | None = None,
    dodge: dict | None = None,
) -> None:
    """One labelled line per `by` value (its label is the series name, so tests and legends find it); `band`:
    the (lo, hi) columns of an interval, drawn as asymmetric error bars (log-scale intervals are not symmetric);
    `dodge`: {series: factor} multiplying its x (`dodge_factors`)."""
    for name, sub in data.groupby(by, sort=True):
        sub = sub.sort_values(x)
        xs = sub[x] * (dodge or {}).get(name, 1.0)
        _plot(ax, xs, sub[y], colors[name], name)
        if band is not None and sub[band[0]].notna().any():
            err = [(sub[y] - sub[band[0]]).fillna(0), (sub[band[1]] - sub[y]).fillna(0)]
            ax.errorbar(xs, sub[y], yerr=err, fmt="none", ecolor=colors[name]["color"], capsize=3)


MIN_RUNS_FOR_BARS = 3  # fewer runs: the runs themselves are drawn, not their interval


def _contended(runs: pd.DataFrame) -> pd.Series:
    return runs["contention"].notna() if "contention" in runs else pd.Series(False, index=runs.index)


def _draw_runs(ax, study: Study, wl: str, col: str, colors: dict, dodge: dict) -> int:
    """Each finished run as a dot beside its point (`x`: its record warns of contention); the contended count."""
    r = study.finished_runs
    r = r[r["workload"] == wl]
    busy = _contended(r)
    for lab, g in r.groupby("label"):
        xs, ys, hot = g["devices"].astype(float) * dodge.get(lab, 1.0), g[col], busy[g.index]
        ax.plot(xs[~hot], ys[~hot], linestyle="none", marker=".", color=colors[lab]["color"], label="_runs")
        if hot.any():
            ax.plot(xs[hot], ys[hot], linestyle="none", marker="x", color=colors[lab]["color"], label="_contended")
    return int(busy.sum())


def _mark_contended_points(ax, study: Study, sub: pd.DataFrame, col: str) -> int:
    """An `x` over each point computed from a run whose record warns of contention; the count of such runs."""
    r = study.finished_runs
    r = r[r["workload"].isin(sub["workload"])]
    hot = r[_contended(r)]
    pts = sub[sub.set_index(["label", "devices"]).index.isin(hot.set_index(["label", "devices"]).index)]
    if len(pts):
        ax.plot(pts["devices"], pts[col], linestyle="none", marker="x", markersize=9, color="black", label="_contended")
    return len(hot)


def _note_runs(ax, contended: int, bars: bool) -> None:
    """The figure says what its marks are: runs, intervals only from 3 runs, and contended runs."""
    said = [f"dots: runs; bars: 95 % interval where >= {MIN_RUNS_FOR_BARS} runs"] if bars else []
    if contended:
        said.append(f"x: {contended} contended run(s), left out of the verdicts")
    if said:
        ax.text(0.01, 0.01, "\n".join(said), transform=ax.transAxes, fontsize=7, va="bottom", color="dimgrey")


COINCIDE_NOTE = "= X: same values as series X, drawn on top of it"


def _legend(fig: Figure, loc: str = "outside lower center", on: dict | None = None, **kw) -> None:
    """One legend for the whole figure, outside the axes (constrained layout makes room for it, so the
    axes keep their size): entries of every axes, each once, the red x's entry last. `on`
    ({series: series it lies on}) adds "= X" to a coinciding series' entry and a note to the title."""
    unique = {}
    for ax in fig.axes:
        for h, t in zip(*ax.get_legend_handles_labels()):
            unique.setdefault(t, h)  # repeats of one series share one entry
    labels = sorted(unique, key=lambda t: t == FAILED_LEGEND or t.endswith("(not finished)"))
    if not labels:
        return
    texts = [f"{t}  = {on[t]}" if on and t in on else t for t in labels]
    if on:
        kw["title"] = (kw.get("title", "") + "\n" if kw.get("title") else "") + COINCIDE_NOTE
    if loc.endswith("center"):  # below: as many columns as the figure's width holds, the figure taller by its rows
        width_pt = fig.get_figwidth() * 72
        kw.setdefault("ncols", max(1, min(len(texts), int(width_pt // (5.2 * max(map(len, texts)) + 40)))))
        rows = -(-len(texts) // kw["ncols"]) + (kw.get("title") or "").count("\n") + bool(kw.get("title"))
        fig.set_figheight(fig.get_figheight() + rows * 8 * 1.5 / 72 + 0.15)
    fig.legend(
        [unique[t] for t in labels], texts, loc=loc, fontsize=8, title_fontsize=8, frameon=False, alignment="left", **kw
    )


FAILED_LEGEND = "not finished (see report)"


def _failed_points(study: Study, workload: str, label: str | None = None) -> pd.DataFrame:
    """The runs of `workload` (and series `label`) that did not finish and have a device count
    (`skipped` points, whose framework is not installed, were never attempted: the report lists them)."""
    bad = study.not_finished
    if bad.empty:
        return bad
    bad = bad[(bad["workload"] == workload) & bad["devices"].notna() & (bad["status"] != "skipped")]
    if label is not None:
        bad = bad[bad["label"] == label]
    return bad


def _mark_failed(ax, study: Study, workload: str, label: str | None = None, x_of=None) -> pd.DataFrame:
    """A red x at the bottom of the axes for every point that did not finish (oom, failed, timeout,
    preempted, ...), at its device count (`x_of(label, devices)` gives the x where the axis is not
    the device count), with its status written above it; returns the points marked."""
    bad = _failed_points(study, workload, label)
    if bad.empty:
        return bad.assign(x=[])
    bad = bad.assign(x=[int(d) if x_of is None else x_of(lab, int(d)) for lab, d in zip(bad["label"], bad["devices"])])
    for x, grp in bad.groupby("x", sort=True):
        ax.plot(
            [x],
            [0.02],
            transform=ax.get_xaxis_transform(),
            marker="x",
            color="crimson",
            markersize=9,
            linestyle="none",
            clip_on=False,
        )
        text = "\n".join(sorted(set(grp["status"].astype(str))))
        ax.annotate(
            text,
            (x, 0.02),
            xycoords=ax.get_xaxis_transform(),
            xytext=(0, 7),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
            color="crimson",
        )
    ax.plot([], [], marker="x", color="crimson", linestyle="none", label=FAILED_LEGEND)
    return bad


def _list_failed(ax, study: Study, workload: str) -> pd.DataFrame:
    """For axes whose x is not the device count: one legend entry (a red x) per point that did not
    finish, "series xN: status"."""
    bad = _failed_points(study, workload)
    for _, b in bad.iterrows():
        ax.plot(
            [],
            [],
            marker="x",
            color="crimson",
            linestyle="none",
            label=f"{b['label']} x{int(b['devices'])}: {b['status']} (not finished)",
        )
    return bad


# --- Fig 5/6: epoch time vs devices ----------------------------------------------------------------
def epoch_time(data: pd.DataFrame | Study, out=None, name: str = "epoch_time") -> Figure:
    """Epoch time per run vs number of devices (log2 axis), one line per series: the epoch time
    speedup uses (`epoch_time_used_s`: the summary's steady epoch time, else the mean of the complete
    epochs after the first, else the first epoch; partial epochs left out), bars = 95 % interval over repeats.
    The series are dodged: each drawn at its device count times a factor of its own (`fig.bench_dodge`: workload -> series -> factor), so
    points at one device count sit side by side; the ticks stay at the device counts."""
    study = Study.of(data)
    data = study.epoch_time
    workloads = sorted(data["workload"].unique())
    fig, axes = _grid(1, len(workloads))
    colors = _palette(data["label"])
    failed, dodge = [], {}
    for ax, wl in zip(axes[0], workloads):
        sub = data[data["workload"] == wl]
        dodge[wl] = dodge_factors(sub["label"])
        band = ("epoch_time_lo", "epoch_time_hi")  # 95 %
        few = sub["runs"] < MIN_RUNS_FOR_BARS  # a t interval of 2 runs (t = 12.7) would swamp the data
        sub = sub.assign(epoch_time_lo=sub["epoch_time_lo"].mask(few), epoch_time_hi=sub["epoch_time_hi"].mask(few))
        _lines(ax, sub, "devices", "epoch_time_s", "label", colors, band=band, dodge=dodge[wl])
        _note_runs(ax, _draw_runs(ax, study, wl, "epoch_time_used_s", colors, dodge[wl]), bars=True)
        bad = _mark_failed(ax, study, wl)
        failed.append(bad)
        _log2_devices(ax, [*sub["devices"], *bad["devices"]])
        ax.set_ylim(bottom=0)
        ax.set_ylabel("epoch time (s), steady")
        ax.set_title(f"{wl}: epoch time")
    _legend(fig)
    fig.bench_data = data
    fig.bench_dodge = dodge
    fig.bench_failed = _concat(failed)
    return save(fig, out, name)


# --- Fig 10: speedup and scaling efficiency ----------------------------------------------------------
def speedup(data: pd.DataFrame | Study, out=None, baseline: str | None = "best", name: str = "speedup") -> Figure:
    """Speedup (left) and scaling efficiency (right) vs devices against the baseline (see
    `ptbench.analysis.tables.speedup_table`); points that did not finish are marked on both."""
    study = Study.of(data)
    data = study.speedup(baseline)
    workloads = sorted(data["workload"].unique())
    fig, axes = _grid(len(workloads), 2)
    colors = _palette(data["label"])
    failed = []
    for row, wl in zip(axes, workloads):
        sub = data[data["workload"] == wl]
        per_series = (sub["baseline_mode"] == "per-series").all()
        for ax, col in ((row[0], "speedup"), (row[1], "efficiency")):
            bad = _mark_failed(ax, study, wl)
            devs = sorted({*sub["devices"], *bad["devices"].astype(int)})
            for b0 in sorted(sub["baseline_devices"].unique()):  # one ideal line per baseline device count
                mine = [d for d in devs if d >= b0]
                ax.plot(
                    mine,
                    [d / b0 for d in mine] if col == "speedup" else [1.0] * len(mine),
                    color="grey",
                    linestyle=(0, (1, 1)),
                    linewidth=1,
                    label="ideal",
                )
            _lines(ax, sub, "devices", col, "label", colors)
            _note_runs(ax, _mark_contended_points(ax, study, sub, col), bars=False)
            _log2_devices(ax, devs)
            ax.set_ylim(bottom=0)
        failed.append(bad)
        row[0].set_ylabel("speedup")
        row[1].set_ylabel("scaling efficiency")
        if per_series:
            row[0].set_title(f"{wl}: speedup vs each series' fewest-device point", fontsize=10)
            row[1].set_title(f"{wl}: efficiency vs each series' fewest-device point", fontsize=10)
        else:
            base = sub["baseline"].iloc[0]
            row[0].set_title(
                f"{wl}: speedup vs {base}\n({sub['baseline_epoch_time_s'].iloc[0]:.3g} s/epoch)", fontsize=10
            )
            row[1].set_title(f"{wl}: efficiency vs {base}", fontsize=10)
    _legend(fig)
    fig.bench_data = data
    fig.bench_failed = _concat(failed)
    return save(fig, out, name)


# --- Fig 9 / Fig 11: validation metric vs epoch and vs wall time -------------------------------------
def val_metric(data: pd.DataFrame | Study, out=None, x: str = "epoch", name: str | None = None) -> Figure:
    """Validation accuracy (vision) or perplexity (language) per epoch (`x="epoch"`, Fig 9) or
    against wall time since the run started (`x="wall_time_s"`, Fig 11), one line per run."""
    if x not in ("epoch", "wall_time_s"):
        raise AnalysisError(f"x={x!r}: choose 'epoch' or 'wall_time_s'")
    study = Study.of(data)
    d = study.ok_epochs
    d = d[d["val_metric"].notna()].copy()
    if d.empty:
        raise AnalysisError("no validation metric in this frame (trainer.eval_every_epoch=false?): nothing to plot")
    d["devices"] = d["devices"].astype(int)
    d["epoch"] = d["epoch"].astype(int) + 1  # epochs completed
    d["series"] = d["label"] + " x" + d["devices"].astype(str)
    workloads = sorted(d["workload"].unique())
    fig, axes = _grid(1, len(workloads))
    colors = _palette(d["series"])
    failed, on = [], {}
    for ax, wl in zip(axes[0], workloads):
        sub = d[d["workload"] == wl]
        # one line per run, repeats share a colour: a series' runs are one Line2D broken by NaN between runs
        # (drawn the same as a line each, at a fraction of the artists a study of thousands of runs needs)
        curves = {}
        for series, runs_of in sub.sort_values(["run_id", "epoch"]).groupby("series", sort=True):
            xs, ys = _broken(runs_of, x), _broken(runs_of, "val_metric")
            _plot(ax, xs, ys, colors[series], series)
            curves[series] = (xs, ys)
        on.update(_coinciding(curves))
        failed.append(_list_failed(ax, study, wl))  # x here is not the device count: a legend entry each
        metric = sub["val_metric_name"].iloc[0]
        if metric == "val_perplexity":
            ax.set_yscale("log")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_xlabel("epoch" if x == "epoch" else "wall time since start (s)")
        if x == "epoch":
            ax.xaxis.set_major_locator(FixedLocator(sorted(sub["epoch"].unique())))
        ax.set_title(f"{wl}: {metric.replace('val_', 'validation ')} vs {'epoch' if x == 'epoch' else 'time'}")
    _legend(fig, on=on, title="series x devices")
    fig.bench_coincide = on
    fig.bench_data = d[
        ["workload", "label", "devices", "run_id", "epoch", "wall_time_s", "val_metric", "val_metric_name"]
    ]
    fig.bench_failed = _concat(failed)
    return save(fig, out, name or f"val_metric_vs_{'epoch' if x == 'epoch' else 'time'}")


def _broken(runs_of: pd.DataFrame, col: str) -> np.ndarray:
    """`col` of consecutive runs (rows sorted by run, then epoch) with a NaN between runs."""
    ids = runs_of["run_id"].to_numpy()
    new_run = np.flatnonzero(ids[1:] != ids[:-1]) + 1  # the first row of each run but the first
    values = runs_of[col].to_numpy(dtype=float)
    return np.insert(values, new_run, np.nan)


# --- Fig 12: memory per rank vs devices --------------------------------------------------------------
MEMORY_PARTS = [
    ("params_mib", "parameters"),
    ("grads_mib", "gradients"),
    ("optimizer_mib", "optimizer state"),
    ("other_mib", "rest of peak"),
]


def _memory_rows(study: Study, data: pd.DataFrame, max_cols: int) -> list[list[tuple[str, str]]]:
    """The panels (workload, series), `max_cols` to a row, each workload starting a new row; a series whose runs
    all failed gets a panel too."""
    panels = []
    for wl in sorted(data["workload"].unique()):
        drawn = sorted(data.loc[data["workload"] == wl, "label"].unique())
        only_failed = sorted(set(_failed_points(study, wl)["label"]) - set(drawn)) if len(study.not_finished) else []
        panels += [(wl, lab) for lab in [*drawn, *only_failed]]
    rows = []
    for wl in sorted(data["workload"].unique()):
        mine = [p for p in panels if p[0] == wl]
        rows += [mine[i : i + max_cols] for i in range(0, len(mine), max_cols)]
    return rows


def _memory_ylabel(data: pd.DataFrame) -> str:
    metrics = sorted({m for ms in data["memory_metric"].dropna() for m in ms.split("; ")})
    if len(metrics) == 1:
        return MEMORY_METRICS.get(metrics[0], "peak memory per rank (MiB)")
    return "peak memory per rank (MiB): " + ", ".join(metrics)


def _memory_stack(ax, sub: pd.DataFrame, xs: list[int], colors: dict) -> None:
    """One panel's stacked bars, each bar's states (and CPU-held bytes) in numbers, the measured peak marked."""
    bottom = np.zeros(len(sub))
    for col, text in MEMORY_PARTS:  # without recorded states the whole peak is "rest"
        vals = sub[col].fillna(0).to_numpy()
        ax.bar(xs, vals, bottom=bottom, color=colors[col], label=text, width=0.6)
        bottom = bottom + vals
    # on CPU the process itself dwarfs the model states: state the split in numbers too
    for x, st, top, host in zip(xs, sub["states_mib"], bottom, sub["host_mib"]):
        note = [] if np.isnan(st) else [f"states {st:.3g}"]
        if not np.isnan(host):
            note.append(f"+{host:.3g} on CPU")
        if note:
            ax.annotate(
                "\n".join(note),
                (x, top),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
    if len(sub):  # the stack's top is the peak unless the states exceed it (a CPU delta without params)
        ax.plot(
            xs,
            sub["peak_mib"],
            marker="_",
            markersize=22,
            markeredgewidth=1.5,
            color="black",
            linestyle="none",
            label="measured peak",
        )


def _memory_panel(ax, study: Study, data: pd.DataFrame, wl: str, lab: str, colors: dict) -> pd.DataFrame:
    """One (workload, series) panel; returns its failed points (marked red x)."""
    sub = data[(data["workload"] == wl) & (data["label"] == lab)].sort_values("devices")
    bad = _failed_points(study, wl, lab) if len(study.not_finished) else pd.DataFrame(columns=["devices"])
    devs = sorted({*sub["devices"].astype(int), *bad["devices"].astype(int)})
    pos = {d: i for i, d in enumerate(devs)}
    offload = _join(sub["offload"])
    title = textwrap.fill(f"{wl}: {lab}", 30)  # long series names wrap instead of running into the next panel
    ax.set_title(title + (f"\n[{offload} held on CPU: not in the bars]" if offload else ""), fontsize=9)
    _memory_stack(ax, sub, [pos[int(d)] for d in sub["devices"]], colors)
    failed = _mark_failed(ax, study, wl, lab, x_of=lambda _lab, d, pos=pos: pos[d]) if len(bad) else bad
    ax.set_xticks(range(len(devs)), [str(d) for d in devs])
    ax.set_xlim(-0.6, len(devs) - 0.4)
    ax.margins(y=0.1)
    ax.set_xlabel("devices")
    return failed


def memory(data: pd.DataFrame | Study, out=None, name: str = "memory", max_cols: int = 4) -> Figure:
    """Stacked bars per series: peak memory of the busiest rank vs devices, model states vs the rest.
    One panel per (workload, series), `max_cols` to a row; panels of one workload share the y axis.
    A series whose runs all failed gets a panel too, holding its red x marks."""
    study = Study.of(data)
    data = study.memory
    rows = _memory_rows(study, data, max_cols)
    fig, axes = _grid(len(rows), max(len(r) for r in rows), w=3.4, h=3.2)
    colors = dict(zip([p for p, _ in MEMORY_PARTS], sns.color_palette("muted", 4)))
    ylabel = _memory_ylabel(data)
    first_of, failed = {}, []
    for ax_row, row in zip(axes, rows):
        for ax in ax_row[len(row) :]:
            ax.set_axis_off()
        ax_row[0].set_ylabel(textwrap.fill(ylabel, 40), fontsize=8)  # once per row, not beside every panel
        for ax, (wl, lab) in zip(ax_row, row):
            if wl in first_of:
                ax.sharey(first_of[wl])
            first_of.setdefault(wl, ax)
            failed.append(_memory_panel(ax, study, data, wl, lab, colors))
    handles = {}
    for ax in axes.flat:
        for h, t in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(t, h)
    order = [t for _, t in MEMORY_PARTS] + ["measured peak", FAILED_LEGEND]  # the stack's parts bottom up, then marks
    texts = sorted(handles, key=lambda t: order.index(t) if t in order else len(order))
    fig.legend(
        [handles[t] for t in texts], texts, loc="outside lower center", ncols=len(texts), fontsize=8, frameon=False
    )
    fig.bench_data = data
    fig.bench_failed = _concat(failed)
    return save(fig, out, name)


# --- Fig 7: time breakdown ---------------------------------------------------------------------------
def breakdown(data: pd.DataFrame | Study, out=None, name: str = "breakdown") -> Figure:
    """Stacked bars per point. A point with runs profiled with trainer.profile is split by what the traces
    measured: compute / exposed communication / pipeline bubble / other, adding up to the profiled step
    (ptbench.analysis.tables PROFILE_PART_TEXT; hatched, so the two kinds of bar stay apart in grey);
    any other point keeps its phases: data / forward / backward / optimizer (and other). Points that
    did not finish get a place of their own with a red x and their status."""
    study = Study.of(data)
    data = study.breakdown
    phases = data.attrs["phases"] + ["other"]
    parts = data.attrs.get("parts") or []
    workloads = sorted(data["workload"].unique())
    bad_all = study.not_finished
    n = max(len(data[data["workload"] == w]) for w in workloads) + (len(bad_all) if len(bad_all) else 0)
    fig, axes = _grid(1, len(workloads), w=min(max(4.0, 0.9 * n + 2), 30), h=4.8)
    palette = sns.color_palette("deep", len(phases) + len(parts))
    colors = dict(zip(phases, palette))
    series = [(f"{p}_ms", p, colors[p], None) for p in phases]  # (column, legend label, colour, hatch)
    part_colors = dict(zip(parts, palette[len(phases) :]))
    series += [(f"profiled_{p}_ms", PART_LABELS[p], part_colors[p], "//") for p in parts]
    failed = []
    for ax, wl in zip(axes[0], workloads):
        sub = data[data["workload"] == wl].sort_values(["label", "devices"])
        split = sub["split"].to_numpy(dtype=bool)
        bad = _failed_points(study, wl) if len(bad_all) else pd.DataFrame(columns=["label", "devices"])
        points = sorted(
            {*zip(sub["label"], sub["devices"].astype(int)), *zip(bad["label"], bad["devices"].astype(int))}
        )
        pos = {p: i for i, p in enumerate(points)}
        xs = [pos[(lab, int(d))] for lab, d in zip(sub["label"], sub["devices"])]
        bottom = np.zeros(len(sub))
        for col, label, color, hatch in series:
            vals = sub[col].fillna(0).to_numpy() if col in sub else np.zeros(len(sub))
            vals = np.where(split, vals, 0.0) if hatch else np.where(split, 0.0, vals)
            if not vals.any():
                continue
            kw = dict(hatch=hatch, edgecolor="white", linewidth=0) if hatch else {}
            ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.6, **kw)
            bottom = bottom + vals
        if len(bad):
            failed.append(_mark_failed(ax, study, wl, x_of=lambda lab, d, pos=pos: pos[(lab, d)]))
        names = {(lab, int(d)): s for lab, d, s in zip(sub["label"], sub["devices"], split)}
        ax.set_xticks(
            range(len(points)), [f"{lab} x{d}" + ("\n(profiled)" if names.get((lab, d)) else "") for lab, d in points]
        )
        ax.set_xlim(-0.6, len(points) - 0.4)
        ax.set_ylabel("time per step (ms)")
        ax.set_title(
            f"{wl}: time per step by phase" + ("; profiled: compute, exposed comm, bubble" if split.any() else "")
        )
        ax.tick_params(axis="x", labelrotation=30)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
    _legend(fig)
    fig.bench_data = data
    fig.bench_failed = _concat(failed)
    return save(fig, out, name)


PART_LABELS = {
    "compute": "profiled: compute",
    "exposed_comm": "profiled: exposed communication",
    "bubble": "profiled: pipeline bubble",
    "other": "profiled: other",
}


FIGURES = ("epoch_time", "speedup", "val_metric_vs_epoch", "val_metric_vs_time", "memory", "breakdown")


def _draw(key: str, study: Study, out, baseline: str | None) -> Figure:
    if key == "speedup":
        return speedup(study, out, baseline=baseline)
    if key.startswith("val_metric"):
        return val_metric(study, out, x="epoch" if key == "val_metric_vs_epoch" else "wall_time_s")
    return {"epoch_time": epoch_time, "memory": memory, "breakdown": breakdown}[key](study, out)


def all_figures(
    data: pd.DataFrame | Study, out, baseline: str | None = "best"
) -> tuple[dict[str, Figure], dict[str, str]]:
    """Every figure above, and {name: reason} for those whose data are absent (skipped)."""
    study = Study.of(data)
    figs, skipped = {}, {}
    for key in FIGURES:
        try:
            figs[key] = _draw(key, study, out, baseline)
        except AnalysisError as e:
            skipped[key] = str(e)
    return figs, skipped


_STUDY: Study | None = None  # the study a forked worker of `save_all` draws from (inherited, not pickled)
SLOWEST_FIRST = ("memory", "val_metric_vs_epoch", "val_metric_vs_time", "breakdown", "speedup", "epoch_time")


def _save_one(key: str, out, baseline: str | None, study: Study | None = None) -> str | None:
    try:
        _draw(key, study or _STUDY, out, baseline).clear()
        return None
    except AnalysisError as e:
        return str(e)


def save_all(data: pd.DataFrame | Study, out, baseline: str | None = "best", workers: int | None = None) -> dict:
    """Every figure saved under `out`: {name: None when drawn, else the reason it was skipped}. Drawing is
    most of a report's time and the figures are independent: with more than one CPU they are drawn in
    forked worker processes (`workers`, default one per CPU) that share the tables computed here once."""
    global _STUDY
    study = Study.of(data)
    workers = min(len(FIGURES), workers or len(os.sched_getaffinity(0)))
    if workers < 2 or "fork" not in mp.get_all_start_methods():
        return {key: _save_one(key, out, baseline, study) for key in FIGURES}
    try:  # the tables every figure reads, once, before the fork
        study.not_finished, study.memory, study.breakdown, study.epoch_time, study.speedup(baseline)
    except AnalysisError:
        pass  # no finished run (or no such baseline): each figure says so itself
    _STUDY = study
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            jobs = {key: pool.submit(_save_one, key, out, baseline) for key in SLOWEST_FIRST}
            return {key: jobs[key].result() for key in FIGURES}
    finally:
        _STUDY = None
