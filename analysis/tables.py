"""The derived tables of the report, from the tidy frame of `ptbench.analysis.load.load`: one row per
run (`runs`), per (workload, series, devices) point (speedup, memory, time breakdown, communication,
summary), and time to a target metric.

A report computes each of them once: `Study` holds the epoch frame and builds every table on first
use, so the figures (ptbench.analysis.plots) and the report's sections share one per-run aggregation
instead of recomputing it per figure and per panel. Every table function takes an epoch frame or a
`Study` (`Study.of`), so a notebook may call it with `load(...)`'s frame as before.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ptbench.analysis import records_io
from ptbench.analysis.load import PROFILE_COLS, PROFILE_PARTS, AnalysisError, _missing, series_labels
from ptbench.analysis.stats import geo_interval, ratio_interval
from ptbench.analysis.target import time_to_target_table

PHASES = ("data", "forward", "forward_backward", "backward", "optimizer")  # stacking order, bottom up
MIB = 2**20


class Study:
    """One epoch frame and every table derived from it, each computed on first use and kept."""

    def __init__(self, epochs: pd.DataFrame):
        self.epochs = epochs
        self._speedup: dict = {}
        self._ttt: dict = {}

    @classmethod
    def of(cls, data: pd.DataFrame | Study) -> Study:
        """`data` itself when it is a Study, else a new one over that epoch frame."""
        return data if isinstance(data, Study) else cls(data)

    @cached_property
    def ok_epochs(self) -> pd.DataFrame:
        return ok(self.epochs)

    @cached_property
    def runs(self) -> pd.DataFrame:
        """One row per run, every status (`runs`)."""
        return runs(self.epochs)

    @cached_property
    def ok_runs(self) -> pd.DataFrame:
        """One row per finished run with epochs (`runs` of `ok` rows)."""
        return runs(self.ok_epochs)

    @cached_property
    def finished_runs(self) -> pd.DataFrame:
        """`ok_runs` for the figures: devices as int; AnalysisError when there is none."""
        r = self.ok_runs
        if r.empty:
            raise AnalysisError("no finished run with epoch records in this frame: nothing to plot")
        r = r.copy()
        r["devices"] = r["devices"].astype(int)
        return r

    @cached_property
    def not_finished(self) -> pd.DataFrame:
        return _not_finished(self.runs) if len(self.epochs) else self.epochs

    def speedup(self, baseline: str | None = "best") -> pd.DataFrame:
        key = "best" if baseline in (None, "best") else baseline
        if key not in self._speedup:
            self._speedup[key] = _speedup_table(self, key)
        return self._speedup[key]

    @cached_property
    def memory(self) -> pd.DataFrame:
        return _memory_table(self)

    @cached_property
    def breakdown(self) -> pd.DataFrame:
        return _breakdown_table(self)

    @cached_property
    def epoch_time(self) -> pd.DataFrame:
        return _epoch_time_table(self)

    @cached_property
    def layouts(self) -> pd.DataFrame:
        return _layout_runs(self)

    def time_to_target(self, target: float | None = None, baseline: str | None = "best") -> pd.DataFrame:
        key = (target, baseline or "best")
        if key not in self._ttt:
            self._ttt[key] = _time_to_target(self, target, baseline or "best")
        return self._ttt[key]


# --- per run --------------------------------------------------------------------------------------
EPOCH_TIME_SOURCES = {
    "steady": "summary epoch_time_steady_s",
    "after_first": "mean of the epochs after the first",
    "first": "the first epoch only (includes warm-up)",
}


def _timing(df: pd.DataFrame, partial: pd.Series) -> pd.DataFrame:
    """Per run (index run_dir): the epoch time its speedup uses, the samples it covers, and where it
    came from: the summary's `epoch_time_steady_s` when present, else the mean over the epochs after
    the first when there are two or more, else the first epoch. Partial epochs are left out unless
    every epoch is partial (all capped by trainer.max_steps: time per sample still compares).
    `df` is sorted by epoch; one vectorized pass over all runs (no per-run frame)."""
    run = df["run_dir"]
    measured = df["epoch"].notna()
    pool = measured & (~partial | ~(measured & ~partial).groupby(run).transform("any"))
    first_epoch = df["epoch"].where(measured).groupby(run).transform("min")
    after = pool & (df["epoch"] > first_epoch)
    t = pd.to_numeric(df["epoch_time_s"], errors="coerce")
    s = pd.to_numeric(df["samples_per_epoch"], errors="coerce")
    steady_col = df["epoch_time_steady_s"] if "epoch_time_steady_s" in df else pd.Series(np.nan, index=df.index)
    g = pd.DataFrame(
        {
            "n_pool": pool,
            "n_after": after,
            "t_after": t.where(after),
            "s_after": s.where(after),
            "s_pool": s.where(pool),
            "steady": pd.to_numeric(steady_col, errors="coerce"),
            "all_partial": ~(measured & ~partial),
        }
    ).groupby(run, sort=False)
    agg = g.agg(
        n_pool=("n_pool", "sum"),
        n_after=("n_after", "sum"),
        t_after=("t_after", "mean"),
        s_after=("s_after", "mean"),
        s_pool=("s_pool", "mean"),
        steady=("steady", "first"),
        all_partial=("all_partial", "all"),
    )
    first = pd.DataFrame({"t": t, "s": s, "run": run})[pool].drop_duplicates("run").set_index("run")
    agg["t_first"], agg["s_first"] = first["t"].reindex(agg.index), first["s"].reindex(agg.index)
    has_steady = agg["steady"].notna()
    use_after = ~has_steady & (agg["n_pool"] >= 2) & (agg["n_after"] > 0)
    time = agg["steady"].where(has_steady, agg["t_after"].where(use_after, agg["t_first"]))
    samples = agg["s_first"].where(~use_after, agg["s_after"])
    samples = samples.where(~has_steady, agg["s_after"].where(agg["n_after"] > 0, agg["s_pool"]))
    source = pd.Series(EPOCH_TIME_SOURCES["first"], index=agg.index, dtype=object)
    source[has_steady] = EPOCH_TIME_SOURCES["steady"]
    source[use_after] = EPOCH_TIME_SOURCES["after_first"]
    source = source + np.where(agg["all_partial"], ", every epoch partial", "")
    none = agg["n_pool"] == 0
    out = pd.DataFrame(
        {
            "epoch_time_used_s": time.where(~none),
            "samples_per_epoch_used": samples.where(~none),
            "time_per_sample_used_s": (time / samples.where(samples != 0)).where(~none),
            "epoch_time_source": source.where(~none, None),
        }
    )
    return out


def runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: means over its complete epochs (partial ones are left out unless all are)
    for times and rates, the last epoch for metrics and memory state, the highest per-rank peak
    memory over epochs; plus the epoch time speedup uses (`epoch_time_used_s`,
    `time_per_sample_used_s`, `epoch_time_source`, see `_timing`) and `partial_epochs`."""
    if df.empty:
        return df
    keys = ["run_dir"]
    mean_cols = [
        c
        for c in df.columns
        if c.endswith("_time_mean_s")
        or c
        in (
            "epoch_time_s",
            "step_time_mean_s",
            "step_time_p50_s",
            "step_time_p95_s",
            "samples_per_s",
            "epoch_samples_per_s",
            "tokens_per_s",
            "flops_per_s",
            "mfu",
            "val_time_s",
            "time_per_sample_s",
        )
    ]
    last_cols = [c for c in df.columns if c not in mean_cols and c not in keys]
    df = df.sort_values("epoch")
    partial = df["partial"] if "partial" in df else pd.Series(False, index=df.index)
    measured = df["epoch"].notna()
    has_complete = (measured & ~partial).groupby(df["run_dir"]).transform("any")
    use = measured & (~partial | ~has_complete)
    g = df.groupby(keys, sort=False, dropna=False)
    out = g[last_cols].last()  # last non-null per column: the final epoch's metrics and the run's identity
    nums = df[mean_cols].apply(pd.to_numeric, errors="coerce").where(use, np.nan)  # all-None columns are object
    out[mean_cols] = nums.groupby(df["run_dir"], sort=False).mean()
    for col in ("peak_memory_max", "mem_plot_bytes"):
        if col in df:
            out[col] = pd.to_numeric(df[col], errors="coerce").groupby(df["run_dir"], sort=False).max()
    if "step_times_s" in df:  # every used epoch's timed step times, joined (analysis/stats.py point_stats)
        lists = df["step_times_s"].where(use, None)
        out["step_times_s"] = lists.groupby(df["run_dir"], sort=False).agg(
            lambda ls: [t for x in ls if isinstance(x, list) for t in x] or None
        )
    out["epochs"] = g["epoch"].count()
    out["partial_epochs"] = (partial & measured).groupby(df["run_dir"], sort=False).sum().astype(int)
    if "partial" in out:
        out = out.drop(columns="partial")
    timing = _timing(df, partial.astype(bool))
    for col in timing.columns:
        out[col] = timing[col].reindex(out.index)
    out = out.reset_index()
    return out.sort_values(["workload", "label", "devices", "run_id"]).reset_index(drop=True)


def ok(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of finished runs (status ok; preempted, failed, oom, timeout, ... are not) with measurements."""
    if df.empty:
        return df
    return df[(df["status"] == "ok") & df["epoch"].notna()]


def not_finished(data: pd.DataFrame | Study) -> pd.DataFrame:
    """One row per run that did not finish (any status but ok: failed, oom, timeout, preempted,
    missing, ...), with what a figure needs to mark it: workload, label, devices, status."""
    return Study.of(data).not_finished


def _not_finished(r: pd.DataFrame) -> pd.DataFrame:
    bad = r[r["status"] != "ok"]
    cols = [
        c for c in ("workload", "label", "adapter", "devices", "status", "run_id", "error", "global_batch") if c in bad
    ]
    return bad[cols].reset_index(drop=True)


def _join(values) -> str | None:
    """The distinct values of a group, as one string ("a; b"), None if none."""
    vals = {v for v in values if v is not None and v is not pd.NA and not (isinstance(v, float) and np.isnan(v))}
    nums = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in vals)
    text = [str(int(v)) if nums and float(v).is_integer() else str(v) for v in (sorted(vals) if nums else vals)]
    return "; ".join(text if nums else sorted(text)) if text else None


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    parts = [p for p in parts if len(p)]
    return (
        pd.concat(parts, ignore_index=True)
        if parts
        else pd.DataFrame(columns=["workload", "label", "devices", "status", "run_id", "x"])
    )


# --- Fig 10: speedup and scaling efficiency ----------------------------------------------------------
BASELINES = ("best", "per-series")


def speedup_table(data: pd.DataFrame | Study, baseline: str | None = "best") -> pd.DataFrame:
    """Speedup and scaling efficiency of every (workload, series, devices) point.

    Time is per training sample (the run's epoch time / the samples in that epoch), which is the
    epoch-time ratio when epochs hold the same samples and stays fair when trainer.max_steps caps
    them or the global batch grows with the devices. The epoch time is the run's steady one
    (`epoch_time_used_s`, see `runs`; `epoch_time_source` says which was used).

    baseline: "best" (or None): per workload the fastest single-device point of any series, as the
    paper does (without a single-device point: the fastest point at the fewest devices, and
    efficiency is relative to that device count); "per-series": each series against its own point
    at its fewest devices; any other string: that series (`label`) at its fewest devices, for every
    series of the workload.
    """
    return Study.of(data).speedup(baseline)


def _epoch_time_table(study: Study) -> pd.DataFrame:
    """Per point: the geometric mean over repeats of the epoch time speedup uses with its 95 % interval on the
    log scale (epoch_time_lo / _hi, `ptbench.analysis.stats.geo_interval`; one run: none), runs, samples per
    epoch."""
    t = study.finished_runs.groupby(["workload", "label", "devices"], as_index=False).agg(
        epoch_time_s=("epoch_time_used_s", lambda v: geo_interval(v).value),
        runs=("run_id", "count"),
        samples_per_epoch=("samples_per_epoch_used", "mean"),
        epoch_time_source=("epoch_time_source", _join),
    )
    ivs = [
        geo_interval(g["epoch_time_used_s"]) for _, g in study.finished_runs.groupby(["workload", "label", "devices"])
    ]
    t["epoch_time_lo"], t["epoch_time_hi"] = [iv.lo for iv in ivs], [iv.hi for iv in ivs]
    return t


def _speedup_table(study: Study, mode: str) -> pd.DataFrame:
    r = study.finished_runs
    geo = lambda v: geo_interval(v).value  # noqa: E731 - times: geometric means (their ratio is Welch's)
    pts = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        time_per_sample_s=("time_per_sample_used_s", geo),
        epoch_time_s=("epoch_time_used_s", geo),
        global_batch=("global_batch", _join),
        epoch_time_source=("epoch_time_source", _join),
    )
    parts = []
    for wl, sub in pts.groupby("workload"):
        sub = sub.copy()
        if mode == "per-series":
            bases = {lab: s.loc[s["devices"].idxmin()] for lab, s in sub.groupby("label")}
        else:
            if mode == "best":
                fewest = sub[sub["devices"] == sub["devices"].min()]
                base = fewest.loc[fewest["time_per_sample_s"].idxmin()]
            else:
                mine = sub[sub["label"] == mode]
                if mine.empty:
                    raise AnalysisError(
                        f"baseline '{mode}' has no finished run for workload {wl}; choose "
                        f"{' or '.join(BASELINES)}, or a series: {', '.join(sorted(sub['label'].unique()))}"
                    )
                base = mine.loc[mine["devices"].idxmin()]
            bases = {lab: base for lab in sub["label"].unique()}
        b = pd.DataFrame([bases[lab] for lab in sub["label"]], index=sub.index)
        sub["speedup"] = b["time_per_sample_s"] / sub["time_per_sample_s"]
        sub["efficiency"] = sub["speedup"] * b["devices"] / sub["devices"]
        _speedup_intervals(sub, b, r)
        sub["baseline"] = [
            f"{lab} on {int(d)} device{'s' if d > 1 else ''}" for lab, d in zip(b["label"], b["devices"])
        ]
        sub["baseline_mode"] = mode if mode in BASELINES else "series"
        sub["baseline_label"] = b["label"]
        sub["baseline_devices"] = b["devices"].astype(int)
        sub["baseline_epoch_time_s"] = b["epoch_time_s"]
        sub["baseline_time_per_sample_s"] = b["time_per_sample_s"]
        parts.append(sub)
    return pd.concat(parts, ignore_index=True)


def _speedup_intervals(sub: pd.DataFrame, b: pd.DataFrame, r: pd.DataFrame) -> None:
    """speedup_lo / _hi and efficiency_lo / _hi: the 95 % Welch interval on the logs of the baseline's runs'
    time per sample over the point's (`ptbench.analysis.stats.ratio_interval`); the baseline itself: exactly 1."""
    runs = {k: g["time_per_sample_used_s"].tolist() for k, g in r.groupby(["workload", "label", "devices"])}
    lo, hi = [], []
    for (_, row), (_, base) in zip(sub.iterrows(), b.iterrows()):
        mine, theirs = (
            (row["workload"], row["label"], row["devices"]),
            (row["workload"], base["label"], base["devices"]),
        )
        iv = ratio_interval(runs.get(theirs), runs.get(mine)) if mine != theirs else None
        lo.append(1.0 if iv is None else iv.lo)
        hi.append(1.0 if iv is None else iv.hi)
    scale = b["devices"].to_numpy() / sub["devices"].to_numpy()
    sub["speedup_lo"], sub["speedup_hi"] = lo, hi
    sub["efficiency_lo"], sub["efficiency_hi"] = np.asarray(lo) * scale, np.asarray(hi) * scale


# --- Fig 12: memory per rank vs devices --------------------------------------------------------------
MEMORY_METRICS = {
    "peak_rss_delta": "peak RSS - RSS before step 1, per process (MiB)",
    "peak_rss": "peak RSS per process (MiB)",
    "peak_allocated": "peak allocated per GPU (MiB)",
}


def memory_table(data: pd.DataFrame | Study) -> pd.DataFrame:
    """Per point: the highest per-rank (per-device for gpipe) peak memory, split into the model states
    held on that device (params, grads, optimizer of that rank) and the rest (activations, buffers,
    and with CPU `peak_rss` the process itself), in MiB. The peak is `mem_plot_metric`: on CPU
    `peak_rss_delta` when the records have it, else `peak_rss`. States held in host memory on a GPU
    run (ZeRO offload) are not device memory: `host_mib` and `offload`, not in the stack."""
    return Study.of(data).memory


def _memory_table(study: Study) -> pd.DataFrame:
    r = study.finished_runs.copy()
    cols = [
        "peak_memory_max",
        "mem_plot_bytes",
        "state_params",
        "state_grads",
        "state_optimizer",
        "dev_state_params",
        "dev_state_grads",
        "dev_state_optimizer",
        "host_state_bytes",
    ]
    for c in cols:
        r[c] = pd.to_numeric(r[c], errors="coerce") if c in r else np.nan
    for c in ("mem_plot_metric", "host_state_parts", "mem_note", "memory_metric"):
        if c not in r:
            r[c] = None
    peak = r["mem_plot_bytes"].fillna(r["peak_memory_max"])
    r["peak_used"] = peak
    # records before the plotted-metric field: the event's own metric
    r["mem_plot_metric"] = r["mem_plot_metric"].where(r["mem_plot_metric"].notna(), r["memory_metric"])
    for part in ("params", "grads", "optimizer"):
        r[f"dev_state_{part}"] = r[f"dev_state_{part}"].fillna(r[f"state_{part}"])
    keys = ["workload", "label", "devices"]
    g = r.groupby(keys, as_index=False)
    data = g[
        [
            "peak_memory_max",
            "peak_used",
            "dev_state_params",
            "dev_state_grads",
            "dev_state_optimizer",
            "host_state_bytes",
        ]
    ].mean()
    text = g.agg(
        memory_metric=("mem_plot_metric", _join), offload=("host_state_parts", _join), mem_note=("mem_note", _join)
    )
    data = data.merge(text, on=keys)
    data["peak_mib"] = data["peak_used"] / MIB
    for part in ("params", "grads", "optimizer"):
        data[f"{part}_mib"] = data[f"dev_state_{part}"] / MIB
    states = data[["params_mib", "grads_mib", "optimizer_mib"]].sum(axis=1, min_count=1)
    data["states_mib"] = states
    data["other_mib"] = (data["peak_mib"] - states.fillna(0)).clip(lower=0)
    data["host_mib"] = data["host_state_bytes"] / MIB
    return data.drop(columns=["peak_used"])


# --- Fig 7: time breakdown ---------------------------------------------------------------------------
def breakdown_table(data: pd.DataFrame | Study) -> pd.DataFrame:
    """Per point: mean time per step in each phase (means over ranks), and the rest of the slowest
    rank's step time ("other": waiting on other ranks, unattributed work), in milliseconds.

    Points with runs profiled with trainer.profile (`split` True) are also split by what their traces
    measured, per profiled step (means over ranks and over the point's profiled runs; each part's rule in
    `PROFILE_PART_TEXT`, per rank in ptbench.analysis.load `_profile_fields`): `profiled_compute_ms`,
    `profiled_exposed_comm_ms`, `profiled_bubble_ms`, `profiled_other_ms`, which add up to `profiled_step_ms`
    (a profiled step: the profiler's overhead included, so it may exceed `step_ms`)."""
    return Study.of(data).breakdown


PROFILE_PART_TEXT = {
    "compute": "compute: operators running on the rank (union of aten operator intervals on CPU, kernels on CUDA)",
    "exposed_comm": "exposed communication: collective time not covered by compute on the rank, less the part "
    "inside the pipeline bubble",
    "bubble": "bubble (pipelines): the stage's measured idle share of the schedule's span x its step time "
    "(waiting for the other stages, its p2p receives included)",
    "other": "other: the rest of the profiled step (Python between operators, work outside the operators)",
}


def _breakdown_table(study: Study) -> pd.DataFrame:
    r = study.finished_runs
    phases = [p for p in PHASES if f"{p}_time_mean_s" in r]
    cols = [f"{p}_time_mean_s" for p in phases] + ["step_time_mean_s"]
    data = r.groupby(["workload", "label", "devices"], as_index=False)[cols].mean()
    for p in phases:
        data[f"{p}_ms"] = data[f"{p}_time_mean_s"] * 1e3
    data["step_ms"] = data["step_time_mean_s"] * 1e3
    data["other_ms"] = (data["step_ms"] - data[[f"{p}_ms" for p in phases]].fillna(0).sum(axis=1)).clip(lower=0)
    data["point"] = data["label"] + " x" + data["devices"].astype(str)
    data["split"] = False
    parts = []
    prof = [c for c in PROFILE_COLS if c in r]
    if len(prof) == len(PROFILE_COLS) and r["profile_step_s"].notna().any():
        keys = ["workload", "label", "devices"]
        num = r[prof].apply(pd.to_numeric, errors="coerce")
        got = pd.concat([r[keys], num], axis=1)
        # the point's profiled runs only (a run without a profile is left out of these means, not counted as 0)
        g = got[got["profile_step_s"].notna()].groupby(keys, as_index=False)[prof].mean()
        data = data.merge(g, on=keys, how="left")
        data["split"] = data["profile_step_s"].notna()
        data["profiled_step_ms"] = data["profile_step_s"] * 1e3
        for p in PROFILE_PARTS:
            data[f"profiled_{p}_ms"] = data[f"profile_{p}_s"] * 1e3
        data = data.drop(columns=prof)
        parts = list(PROFILE_PARTS)
    data.attrs["phases"] = phases  # set last: a merge does not keep them
    data.attrs["parts"] = parts
    return data


# --- the report's summary ----------------------------------------------------------------------------
def summary_table(data: pd.DataFrame | Study, baseline: str | None = "best") -> pd.DataFrame:
    """One row per (workload, series, devices) point of finished runs: the numbers behind the figures.
    `global_batch` lists every value its runs used ("8; 16" when they differ); `epoch time (s)` is the
    one speedup uses, `epoch time from` says where it came from."""
    study = Study.of(data)
    r = study.ok_runs
    if r.empty:
        return pd.DataFrame()
    g = r.groupby(["workload", "label", "devices"], as_index=False).agg(
        runs=("run_id", "count"),
        global_batch=("global_batch", _join),
        epochs=("epochs", "max"),
        epoch_time_s=("epoch_time_used_s", "mean"),
        epoch_time_from=("epoch_time_source", _join),
        step_ms=("step_time_mean_s", "mean"),
        samples_per_s=("samples_per_s", "mean"),
        metric=("val_metric_name", "first"),
        final_val=("val_metric", "mean"),
    )
    g["step_ms"] *= 1e3
    mem = study.memory[["workload", "label", "devices", "peak_mib", "states_mib"]]
    g["devices"] = g["devices"].astype(int)
    mem["devices"] = mem["devices"].astype(int)
    g = g.merge(mem, on=["workload", "label", "devices"], how="left")
    sp = study.speedup(baseline)[["workload", "label", "devices", "speedup", "efficiency"]]
    sp["devices"] = sp["devices"].astype(int)
    return g.merge(sp, on=["workload", "label", "devices"], how="left")


# --- time to target ----------------------------------------------------------------------------------
def time_to_target(data: pd.DataFrame | Study, target: float | None = None, baseline: str | None = "best"):
    """Per run with validation: the time its metric first reached the target, interpolated between epoch ends
    (ptbench.analysis.target: the target given, else fixed from the baseline point's runs alone; runs that never
    reach it: `reached` False). Columns: workload, metric, target, target_from, run_id, label, devices, seed,
    time_s, epoch (fractional), reached, best."""
    return Study.of(data).time_to_target(target, baseline)


def _time_to_target(study: Study, target: float | None, baseline: str) -> pd.DataFrame:
    e = study.ok_epochs
    if e.empty or "wall_time_s" not in e or e["val_metric"].isna().all():
        return pd.DataFrame()
    bases = {}
    if target is None:
        sp = study.speedup("best" if baseline == "per-series" else baseline)
        bases = {
            wl: (g["baseline_label"].iloc[0], int(g["baseline_devices"].iloc[0])) for wl, g in sp.groupby("workload")
        }
    return time_to_target_table(e, bases, target)


# --- communication -----------------------------------------------------------------------------------
def busbw_at(report: dict, op: str, message_bytes: float) -> tuple[float, int] | None:
    """(busbw GB/s, size measured) of `op` at the measured size nearest to `message_bytes` on a log
    scale (a tie goes to the larger size; beyond the range, the end point), or None when the report
    has no measured `op`."""
    rows = [r for r in report.get("results", []) if r.get("op") == op and r.get("busbw_GBps")]
    if not rows:
        return None
    target = max(float(message_bytes), 1.0)
    best = min(rows, key=lambda r: (abs(np.log(r["bytes"] / target)), -r["bytes"]))
    return float(best["busbw_GBps"]), int(best["bytes"])


def _matching_report(reports: list[dict], backend, op: str, group_size: int) -> dict | None:
    """The measurement for a collective over `group_size` ranks on `backend`: one taken at that many
    ranks (send/recv, which is pairwise: any measurement at 2 or more ranks, the nearest count first)."""
    same = [r for r in reports if r.get("backend") == backend]
    exact = [r for r in same if r.get("world_size") == group_size]
    if exact:
        return exact[-1]
    if op == "send_recv":
        pairs = sorted(
            (r for r in same if (r.get("world_size") or 0) >= 2), key=lambda r: abs(r["world_size"] - group_size)
        )
        return pairs[0] if pairs else None
    return None


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def comm_time(collectives: list[dict], backend, reports: list[dict]) -> tuple[float | None, str]:
    """Seconds the per-step volume takes at the measured bus bandwidth (sum over collectives of
    bytes / busbw at the nearest measured size, no overlap), and how each busbw was chosen; None
    with the reason when a collective has no matching measurement."""
    total, used = 0.0, []
    for c in collectives:
        rep = _matching_report(reports, backend, c["op"], int(c["group_size"]))
        hit = busbw_at(rep, c["op"], c["message_bytes"]) if rep else None
        if hit is None:
            return None, f"not measured: no {c['op']} at {c['group_size']} ranks on {backend}"
        bw, size = hit
        total += float(c["bytes"]) / (bw * 1e9)
        used.append(f"{c['op']} {bw:.3g} GB/s at {_size(size)}")
    return total, "; ".join(dict.fromkeys(used))


def comm_table(data: pd.DataFrame | Study, reports: list[dict]) -> pd.DataFrame:
    """One row per (workload, series, devices) of finished runs: measured step time, the time of the
    phase(s) the adapter's collectives run in (from the records' phase breakdown; the exposed
    communication is inside them), the recorded communication volume per step, and the time that
    volume takes at the measured bus bandwidth (`comm_time`; "not measured" without a matching
    `python -m ptbench.comm` report)."""
    return _comm_table(Study.of(data).ok_runs, reports)


def _comm_table(r: pd.DataFrame, reports: list[dict]) -> pd.DataFrame:
    if r.empty or "comm_bytes_per_step" not in r:
        return pd.DataFrame()
    rows = []

    def text(v) -> str:  # a string column's value; NaN / None (no volume recorded) -> ""
        return v if isinstance(v, str) else ""

    for (wl, lab, d), sub in r.groupby(["workload", "label", "devices"]):
        first = sub.iloc[0]
        phases = [p for p in text(first.get("comm_phases")).split(",") if p]
        phase_s = None
        if phases and all(f"{p}_time_mean_s" in sub for p in phases):
            phase_s = float(sum(pd.to_numeric(sub[f"{p}_time_mean_s"], errors="coerce").mean() for p in phases))
        vol = first.get("comm_bytes_per_step")
        cols = json.loads(first["comm_collectives"]) if text(first.get("comm_collectives")) else None
        if cols is None:
            err = text(first.get("comm_error"))
            t, how = None, f"no volume in the record{': ' + err if err else ''}"
        elif not cols:
            t, how = 0.0, "no collectives"
        else:
            t, how = comm_time(cols, first.get("comm_backend"), reports)
        step = pd.to_numeric(sub["step_time_mean_s"], errors="coerce").mean() if "step_time_mean_s" in sub else np.nan
        rows.append(
            {
                "workload": wl,
                "series": lab,
                "devices": int(d),
                "runs": len(sub),
                "step (ms)": step * 1e3,
                "comm phase": "+".join(phases) or "-",
                "phase (ms)": phase_s * 1e3 if phase_s is not None else np.nan,
                "comm MB/step": vol / 1e6 if vol is not None and not _missing(vol) else np.nan,
                "at busbw (ms)": t * 1e3 if t is not None else "not measured",
                "busbw used": how,
                "formula": text(first.get("comm_formula")) or "-",
            }
        )
    return pd.DataFrame(rows)


# --- the runs the verdicts use -----------------------------------------------------------------------
POINT = ["workload", "label", "devices"]
IN_VERDICTS = "in verdicts"


def without_contention(data: pd.DataFrame | Study, include_contended: bool = False) -> tuple[Study, list[str]]:
    """(the runs the verdicts use, the run ids left out): every run with `include_contended`, else those whose
    record does not warn of contention (a busy machine makes times incomparable)."""
    study = Study.of(data)
    e = study.epochs
    if include_contended or "contention" not in e or e["contention"].isna().all():
        return study, []
    bad = e["contention"].notna()
    return Study(e[~bad]), sorted(set(e.loc[bad, "run_id"]))


def _mark(n: int, left_out: int) -> str:
    used = n - left_out
    if used == 0:
        return f"no: {left_out} contended run{'s' if left_out > 1 else ''}"
    text = "yes" if not left_out else f"{used} of {n} runs: {left_out} contended"
    return text if used > 1 else ("1 run: no interval" if not left_out else f"{text}; no interval")


def verdict_marks(data: pd.DataFrame | Study, contended: list[str]) -> pd.DataFrame:
    """Per finished point (workload, label, devices): its runs, those the verdicts use, and `in verdicts`, how
    they treat it: `yes`, `1 run: no interval`, `k of n runs: m contended` or `no: m contended runs`."""
    r = Study.of(data).ok_runs
    if r.empty:
        return pd.DataFrame(columns=[*POINT, "n", "used", IN_VERDICTS])
    r = r.assign(devices=r["devices"].astype(int), _out=r["run_id"].isin(contended))
    g = r.groupby(POINT, as_index=False).agg(n=("run_id", "count"), left_out=("_out", "sum"))
    g["used"] = g["n"] - g["left_out"]
    g[IN_VERDICTS] = [_mark(int(n), int(k)) for n, k in zip(g["n"], g["left_out"])]
    return g.drop(columns="left_out")


def marked(used: pd.DataFrame, every: pd.DataFrame, marks: pd.DataFrame, after: str) -> pd.DataFrame:
    """A per-point table as the verdicts see it: `used`'s rows (computed over the runs they use) for points they
    use, `every`'s rows (over every run) for points they leave out, each with its `in verdicts` mark after
    column `after`."""
    parts = []
    for t, which in ((used, marks["used"] > 0), (every, marks["used"] == 0)):
        if len(t) and which.any():
            t = t.assign(devices=t["devices"].astype(int))
            parts.append(t.merge(marks.loc[which, [*POINT, IN_VERDICTS]], on=POINT))
    if not parts:
        return pd.DataFrame()
    out = pd.concat(parts, ignore_index=True).sort_values(POINT, kind="stable").reset_index(drop=True)
    cols = [c for c in out.columns if c != IN_VERDICTS]
    at = cols.index(after) + 1 if after in cols else len(cols)
    return out[[*cols[:at], IN_VERDICTS, *cols[at:]]]


# --- vision memory layout (workload.channels_last) ---------------------------------------------------------
# (channels_last, channels_last_weights) as a run's record says it ran -> its name; compared in this order
LAYOUTS = {(False, False): "NCHW", (True, False): "NCHW weights / NHWC activations", (True, True): "NHWC"}


def run_layout(run_dir) -> str | None:
    """A vision run's memory layout from its summary's `data_pipeline` (`channels_last`; `channels_last_weights`
    false where the adapter keeps NCHW weights: zero, fsdp, horovod); None where the record does not say."""
    try:
        s = records_io.read_json(Path(run_dir) / "summary.json")
    except (OSError, ValueError):
        return None  # load() said why
    dp = s.get("data_pipeline") if isinstance(s, dict) else None
    cl = dp.get("channels_last") if isinstance(dp, dict) else None
    if not isinstance(cl, bool):
        return None
    return LAYOUTS[(cl, cl and dp.get("channels_last_weights", True) is not False)]  # older records: weights too


def _layout_runs(study: Study) -> pd.DataFrame:
    """The finished vision runs whose record names their layout, with `layout`, `step_s` (the run's median timed
    step: of its step times, else its epochs' p50) and `settings` (the series label from its settings alone, a
    `results.label` left out: runs that differ only in layout share it)."""
    r = study.ok_runs
    if r.empty or "kind" not in r or "run_dir" not in r:
        return pd.DataFrame(columns=["workload", "devices", "settings", "label", "layout", "run_id", "step_s"])
    r = r[r["kind"] == "vision"]
    r = r.assign(layout=[run_layout(d) for d in r["run_dir"]]).dropna(subset=["layout"])
    p50 = pd.to_numeric(r["step_time_p50_s"], errors="coerce") if "step_time_p50_s" in r else np.nan
    lists = r["step_times_s"] if "step_times_s" in r else pd.Series(None, index=r.index, dtype=object)
    med = lists.map(lambda x: float(np.median(x)) if isinstance(x, list) and x else np.nan)
    settings = series_labels(r.drop(columns="record_label", errors="ignore")) if len(r) else []
    return r.assign(step_s=med.fillna(p50), settings=settings, devices=r["devices"].astype(int))


def layout_table(data: pd.DataFrame | Study, contended=()) -> pd.DataFrame:
    """Per point (workload, devices, settings) whose finished vision runs ran in two layouts: the later layout's
    step time over the earlier's (`LAYOUTS` order; below 1: the later is faster), the ratio of the geometric means
    of the runs' median steps with its 95 % interval (`ratio_interval`, Welch's t on the logs), over the runs the
    verdicts use: runs in `contended` are left out, counted in `left_out`."""
    r, order, rows = Study.of(data).layouts, list(LAYOUTS.values()), []
    for (wl, d, settings), g in r.groupby(["workload", "devices", "settings"]) if len(r) else ():
        names = sorted(set(g["layout"]), key=order.index)
        out = g["run_id"].isin(list(contended))
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                tb, ta = (g.loc[~out & (g["layout"] == x), "step_s"].dropna() for x in (b, a))
                iv = ratio_interval(tb, ta)
                both = g["layout"].isin((a, b))
                rows.append({"workload": wl, "devices": d, "settings": settings, "layout": b, "against": a,
                             "ratio": iv.value, "lo": iv.lo, "hi": iv.hi, "n": len(tb), "n_against": len(ta),
                             "method": iv.method, "left_out": int((both & out).sum()),
                             "runs": _join(g.loc[both, "run_id"])})  # fmt: skip
    return pd.DataFrame(rows)


def layout_mixes(data: pd.DataFrame | Study, contended=()) -> dict[str, dict[str, str]]:
    """Per vision workload whose answered comparisons (series against series, points against the speedup
    baseline) hold more than one layout, over the runs the verdicts use (every run when all are contended):
    {workload: {series label: its layouts, joined " + " when its runs ran in several}}."""
    r = Study.of(data).layouts
    used = r[~r["run_id"].isin(list(contended))] if len(r) else r
    out = {}
    for wl, g in (used if len(used) else r).groupby("workload"):
        per = g.groupby("label")["layout"].agg(lambda v: " + ".join(sorted(set(v), key=list(LAYOUTS.values()).index)))
        if g["layout"].nunique() > 1:
            out[wl] = per.to_dict()
    return out
