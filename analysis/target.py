"""Time to a target validation metric, with the target fixed before any run is ranked.

The target is given (`python -m ptbench.analysis report --target VALUE`), or by default taken from the
baseline series alone (the speedup baseline's point, or --baseline LABEL's point at its fewest devices): the
level each of its runs reaches halfway, in epochs, to its best (`slope_target`: the worst of those levels, so
every baseline run reaches it). A target a little short of the best lies in the plateau, where identical runs
cross epochs apart (the noise of the plateau, not the speed of training); halfway lies on the slope.
`default_target` (the worst best value, TARGET_SLACK looser) stays for epochs-to-target claims. A run's time to the target is linear interpolation of
wall time between the last epoch end before the crossing and the first one at or past it (the first epoch:
its end, the metric before it being unknown). A run that never reaches the target is `reached` False, with no
time: it is counted as not reached, never ranked on its best epoch.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

TARGET_SLACK = 0.01  # the default target: 1 % short of the baseline's worst best value


def _lower(metric: str) -> bool:
    return metric == "val_perplexity"


def default_target(e: pd.DataFrame, metric: str, label: str, devices: int) -> float:
    """The worst best value of the baseline point's runs, loosened by TARGET_SLACK (nan without them)."""
    base = e[(e["label"] == label) & (e["devices"].astype(int) == int(devices))]
    if base.empty:
        return float("nan")
    lower = _lower(metric)
    best = base.groupby("run_id")["val_metric"].agg("min" if lower else "max")
    return float(best.max() * (1 + TARGET_SLACK)) if lower else float(best.min() * (1 - TARGET_SLACK))


def _halfway(run: pd.DataFrame, lower: bool) -> float:
    """The metric one run reaches halfway, in epochs, to its best epoch (interpolated between epoch ends;
    before the first epoch's end the metric is unknown, so the first epoch's value at the earliest)."""
    r = run.sort_values("epoch")
    v, ep = r["val_metric"].to_numpy(float), r["epoch"].to_numpy(float) + 1
    best = int(np.argmin(v) if lower else np.argmax(v))
    return float(np.interp(max(ep[0], ep[best] / 2), ep, v))


def slope_target(e: pd.DataFrame, metric: str, label: str, devices: int) -> float:
    """The default target: the worst, over the baseline point's runs, of the level each reaches halfway in
    epochs to its best (`_halfway`); nan without them."""
    base = e[(e["label"] == label) & (e["devices"].astype(int) == int(devices))]
    if base.empty:
        return float("nan")
    lower = _lower(metric)
    half = [_halfway(run, lower) for _, run in base.groupby("run_id")]
    return float(max(half) if lower else min(half))


def crossing(run: pd.DataFrame, target: float, lower: bool) -> tuple[float, float]:
    """(wall time, fractional epoch count) when one run's metric first reaches `target`; (nan, nan) if never."""
    r = run.sort_values("epoch")
    v, t = r["val_metric"].to_numpy(float), r["wall_time_s"].to_numpy(float)
    ep = r["epoch"].to_numpy(float) + 1
    tol = 1e-9 * abs(target)
    hit = np.flatnonzero(v <= target + tol) if lower else np.flatnonzero(v >= target - tol)
    if not len(hit):
        return float("nan"), float("nan")
    k = int(hit[0])
    if k == 0 or v[k] == v[k - 1]:
        return float(t[k]), float(ep[k])
    f = (target - v[k - 1]) / (v[k] - v[k - 1])
    return float(t[k - 1] + f * (t[k] - t[k - 1])), float(ep[k - 1] + f * (ep[k] - ep[k - 1]))


def time_to_target_table(e: pd.DataFrame, bases: dict, target: float | None = None) -> pd.DataFrame:
    """One row per finished run with validation: workload, metric, target, target_from, run_id, label, devices,
    seed, time_s (interpolated; nan when not reached), epoch (fractional), reached, best. `bases`: workload ->
    (label, devices) of the baseline point the default target comes from."""
    if e.empty or "wall_time_s" not in e:
        return pd.DataFrame()
    e = e[e["val_metric"].notna()]
    parts = []
    for wl, sub in e.groupby("workload"):
        metric = sub["val_metric_name"].iloc[0]
        lower = _lower(metric)
        if target is not None:
            goal, source = float(target), "--target"
        elif wl in bases:
            goal, source = (
                slope_target(sub, metric, *bases[wl]),
                f"the runs of baseline `{bases[wl][0]}` x{bases[wl][1]}, halfway in epochs to their best",
            )
        else:
            continue
        if not np.isfinite(goal):
            continue
        rows = []
        for run_id, run in sub.groupby("run_id"):
            t, ep = crossing(run, goal, lower)
            first = run.iloc[0]
            rows.append(
                dict(
                    workload=wl, metric=metric, target=goal, target_from=source, run_id=run_id,
                    label=first["label"], devices=int(first["devices"]),
                    seed=first["seed"] if "seed" in run else np.nan, time_s=t, epoch=ep,
                    reached=bool(np.isfinite(t)),
                    best=run["val_metric"].min() if lower else run["val_metric"].max(),
                )
            )  # fmt: skip
        part = pd.DataFrame(rows)
        parts.append(part)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
