"""The report's closing "Which adapter" section: the answers, each from one computation over the finished runs.

- Fastest to the target: points (series x device count) ranked by the geometric mean of their runs' time to a
  target fixed in advance (ptbench.analysis.target), interpolated between epoch ends; the headline names the
  point that ranks first, and it is called faster than every other point only when Welch's test on logs,
  Holm-adjusted over those comparisons, says so (`ptbench.analysis.stats.rank`). A point whose runs share one
  seed, or that some run never brought to the target, is not ranked as if it had a verdict.
- Lowest memory per rank, per device count: the points' mean peaks (a ranking, no verdict).
- Best scaling efficiency at the largest device count, with its interval (ptbench.analysis.tables speedup),
  and the same ranking of time per sample.
An A/A measurement (`python -m ptbench.sweep noise`) gives the run-to-run spread, which plans repeats; it
never moves a verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ptbench.analysis.stats import MARGIN, geo_interval, rank, repeats_for
from ptbench.analysis.tables import Study, time_to_target


def _point(label, devices) -> str:
    return f"`{label}` x{int(devices)}"


def _ids(ids) -> str:
    ids = sorted(set(ids))
    return ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")


def _runner_up(values: list[tuple[float, str]], lower_is_better: bool, unit: str, fmt=lambda v: f"{v:.4g}") -> str:
    """ "; next X v, N % behind" from [(value, name)] sorted best first: a ranking, not a verdict."""
    if len(values) < 2:
        return ""
    (best, _), (nxt, who) = values[0], values[1]
    gap = (nxt - best) / best if lower_is_better and best else (best - nxt) / nxt if nxt else float("inf")
    return f"; next {who} {fmt(nxt)}{unit}, {100 * gap:.1f} % behind"


def _versus(values: dict, margin: float = MARGIN) -> tuple[str, bool]:
    """(text, fastest) of the point that ranks first against every other (`rank`): Holm-adjusted verdicts."""
    r = rank(values, margin)
    if len(r["order"]) < 2:
        return "", False
    texts = "; ".join(v["text"] for v in r["versus"])
    if r["fastest"]:
        return f"; faster than every other point ({len(r['versus'])} comparison(s), Holm-adjusted): {texts}", True
    return f"; not shown faster than every other point: {texts}", False


def run_spread(results_dir: str | Path) -> float:
    """The newest A/A measurement's run-to-run spread under results_dir (`python -m ptbench.sweep noise`:
    */noise/*.json; `spread`, the sd of one run's log time), 0 when none was measured."""
    found = sorted(Path(results_dir).rglob("noise/noise-*.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(found):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("kind") == "A/A" and rec.get("spread") is not None:
            return float(rec["spread"])
    return 0.0


def _shared_seeds(t: pd.DataFrame) -> list[str]:
    """Points with two or more runs that all share one seed (repeats of one training trajectory)."""
    if "seed" not in t or t["seed"].isna().all():
        return []
    g = t.groupby(["label", "devices"])
    return [_point(*k) for k, s in g if len(s) >= 2 and s["seed"].nunique(dropna=False) < 2]


def _fastest_to_target(t: pd.DataFrame, margin: float) -> tuple[dict | None, list[str]]:
    undecided = []
    done = t.groupby(["label", "devices"]).agg(
        every=("reached", "all"), reached_runs=("reached", "sum"), runs=("reached", "count")
    )
    for (lab, d), row in done[~done["every"]].iterrows():
        undecided.append(
            f"time to target: {_point(lab, d)} reached it in {int(row['reached_runs'])} of {row['runs']} runs"
        )
    ok = t[t.set_index(["label", "devices"]).index.isin(done[done["every"]].index)]
    if ok.empty:
        return None, undecided + ["time to target: no point reached the target in every run"]
    values = {_point(*k): g["time_s"].tolist() for k, g in ok.groupby(["label", "devices"])}
    versus, fastest = _versus(values, margin)
    shared = _shared_seeds(ok)
    if shared:
        fastest = False
        versus = f"; undecided: the repeats of {', '.join(shared)} share a seed{versus}"
        undecided.append(
            f"time to target needs at least 2 seeds per point; {', '.join(shared)} repeat one seed "
            "(`python -m ptbench.sweep run --repeats N --vary-seed`)"
        )
    best = min(values, key=lambda k: (geo_interval(values[k]).value, k))
    w = ok[ok.apply(lambda x: _point(x.label, x.devices) == best, axis=1)]
    ranking = sorted((geo_interval(v).value, k, len(v)) for k, v in values.items())
    first = t.iloc[0]
    return dict(
        metric=first["metric"], target=float(first["target"]), target_from=first["target_from"],
        label=w["label"].iloc[0], devices=int(w["devices"].iloc[0]), time_s=geo_interval(w["time_s"]).value,
        epoch=float(np.median(w["epoch"])), runs=sorted(w["run_id"]), run_id=sorted(w["run_id"])[0],
        ranking=ranking, versus=versus, fastest=fastest,
    ), undecided  # fmt: skip


def _lowest_memory(r: pd.DataFrame) -> tuple[list[dict], list[str]]:
    mem, undecided = r.copy(), []
    nan = pd.Series(np.nan, index=mem.index)
    mem["mem"] = pd.to_numeric(mem["mem_plot_bytes"], errors="coerce") if "mem_plot_bytes" in mem else nan
    if "peak_memory_max" in mem:
        mem["mem"] = mem["mem"].fillna(pd.to_numeric(mem["peak_memory_max"], errors="coerce"))
    mem = mem[mem["mem"].notna()]
    if mem.empty:
        return [], ["memory per rank: no run recorded a memory peak"]
    metrics = mem["mem_plot_metric"] if "mem_plot_metric" in mem else pd.Series("?", index=mem.index)
    if "memory_metric" in mem:
        metrics = metrics.fillna(mem["memory_metric"])
    mem["metric"] = metrics.fillna("?")
    common = mem["metric"].value_counts().index[0]
    if mem["metric"].nunique() > 1:
        undecided.append(
            f"memory: the runs measured different peaks ({', '.join(sorted(mem['metric'].unique()))}); "
            f"only `{common}` runs are compared"
        )
        mem = mem[mem["metric"] == common]
    mem["states"] = pd.to_numeric(mem["state_bytes_max"], errors="coerce") if "state_bytes_max" in mem else np.nan
    pts = mem.groupby(["label", "devices"], as_index=False).agg(
        mem=("mem", "mean"), states=("states", "mean"), runs=("run_id", list)
    )
    out = []
    for d, sub in pts.groupby("devices"):
        sub = sub.sort_values(["mem", "label"])
        best = sub.iloc[0]
        out.append(dict(devices=int(d), label=best["label"], mib=best["mem"] / 2**20,
                        states_mib=best["states"] / 2**20 if pd.notna(best["states"]) else None, metric=common,
                        runs=best["runs"], ranking=[(x.mem / 2**20, _point(x.label, x.devices)) for x in sub.itertuples()]))  # fmt: skip
    return out, undecided


def _best_scaling(r: pd.DataFrame, sp: pd.DataFrame, wl, margin: float) -> tuple[dict | None, list[str]]:
    devices = sorted(int(d) for d in r["devices"].dropna().unique())
    if len(devices) < 2:
        n = devices[0] if devices else "?"
        return None, [f"scaling efficiency: only {n} device(s) measured, so no speedup to compare"]
    if sp.empty or not (sp["workload"] == wl).any():
        return None, ["scaling efficiency: no speedup could be computed (baseline missing)"]
    s = sp[(sp["workload"] == wl) & (sp["devices"] == devices[-1])].sort_values(
        ["efficiency", "label"], ascending=[False, True]
    )
    s = s[s["efficiency"].notna()]
    if s.empty:
        return None, [f"scaling efficiency: no finished point at {devices[-1]} devices"]
    b = s.iloc[0]
    ids = r[(r["label"] == b["label"]) & (r["devices"] == devices[-1])]["run_id"].tolist()
    base_ids = r[(r["label"] == b["baseline_label"]) & (r["devices"] == b["baseline_devices"])]["run_id"]
    sc = dict(devices=devices[-1], label=b["label"], efficiency=float(b["efficiency"]), speedup=float(b["speedup"]),
              efficiency_lo=float(b.get("efficiency_lo", np.nan)), efficiency_hi=float(b.get("efficiency_hi", np.nan)),
              baseline=b["baseline"], runs=ids, baseline_runs=base_ids.tolist(),
              ranking=[(float(x.efficiency), _point(x.label, x.devices)) for x in s.itertuples()])  # fmt: skip
    if "time_per_sample_used_s" in r and s["baseline"].nunique() == 1:
        # one baseline: efficiencies at one device count rank as the inverse of time per sample
        at = r[(r["devices"] == devices[-1]) & r["label"].isin(s["label"])]
        values = {_point(k, devices[-1]): g["time_per_sample_used_s"].dropna().tolist() for k, g in at.groupby("label")}
        sc["versus"] = _versus(values, margin)[0]
    missing = sorted(set(r["label"]) - set(s["label"]))
    said = [f"scaling at {devices[-1]} devices leaves out series not measured there: "
            + ", ".join(f"`{m}`" for m in missing)] if missing else []  # fmt: skip
    return sc, said


def _spread_notes(r: pd.DataFrame) -> list[str]:
    out = []
    gbs = sorted(
        {int(g) for g in pd.to_numeric(r.get("global_batch", pd.Series(dtype=float)), errors="coerce").dropna()}
    )
    if len(gbs) > 1:
        out.append(
            f"the ranked runs differ in global batch ({', '.join(map(str, gbs))}): time to target "
            "and memory compare different batches (and optimizer steps per epoch)"
        )
    counts = r.groupby(["label", "devices"])["run_id"].count()
    if (counts == 1).all():
        out.append(
            "spread: every point is a single run, so differences smaller than run-to-run "
            "variation (not measured here) cannot be told apart; repeat points to see it"
        )
    elif (counts == 1).any():
        out.append(f"spread: {int((counts == 1).sum())} of {len(counts)} points are single runs")
    return out


def _without_contention(study: Study, include_contended: bool) -> tuple[Study, list[str]]:
    if include_contended or "contention" not in study.epochs or study.epochs["contention"].isna().all():
        return study, []
    bad = study.epochs["contention"].notna()
    return Study(study.epochs[~bad]), sorted(set(study.epochs.loc[bad, "run_id"]))


def which_adapter(
    data: pd.DataFrame | Study,
    baseline: str | None = "best",
    include_contended: bool = False,
    noise: float = 0.0,
    target: float | None = None,
    margin: float = MARGIN,
) -> dict:
    """The "Which adapter" answers per workload: {workload: {"fastest": {...} | None, "memory": [...],
    "scaling": {...} | None, "undecided": [reasons]}}. Runs whose record warns of contention are left out unless
    `include_contended`. `noise`: the A/A run-to-run spread, which plans repeats and moves no verdict;
    `target`: the time-to-target metric value (default: fixed from the baseline point's runs)."""
    out: dict = {}
    study, contended = _without_contention(Study.of(data), include_contended)
    per_run = study.ok_runs if len(study.ok_epochs) else pd.DataFrame()
    if per_run.empty:
        return out
    ttt = time_to_target(study, target, baseline)
    try:
        sp = study.speedup(baseline)
    except Exception:  # noqa: BLE001 - a baseline this workload lacks: scaling undecided below
        sp = pd.DataFrame()
    for wl, r in per_run.groupby("workload"):
        v: dict = {"fastest": None, "memory": [], "scaling": None, "undecided": []}
        if contended:
            v["undecided"].append(
                f"left out for contention (their records warn of shared CPUs or other runs): {_ids(contended)}"
            )
        t = ttt[ttt["workload"] == wl] if len(ttt) else pd.DataFrame()
        if t.empty:
            v["undecided"].append(
                "time to a target metric: no finished run recorded a validation metric "
                "(trainer.eval_every_epoch=false?)"
            )
        else:
            v["fastest"], said = _fastest_to_target(t, margin)
            v["undecided"] += said
            without = sorted(set(r["run_id"]) - set(t["run_id"]))
            if without:
                v["undecided"].append(f"time to target leaves out runs without a validation metric: {_ids(without)}")
        v["memory"], said = _lowest_memory(r)
        v["undecided"] += said
        v["scaling"], said = _best_scaling(r, sp, wl, margin)
        v["undecided"] += said + _spread_notes(r)
        out[wl] = v
    return out


def _fastest_line(f: dict) -> str:
    name = "perplexity" if f["metric"] == "val_perplexity" else "accuracy"
    rel = "≤" if name == "perplexity" else "≥"
    runs = f["runs"]
    return (
        f"- **Fastest to the target**: validation {name} {rel} {f['target']:.4g} (fixed from {f['target_from']}): "
        f"**{_point(f['label'], f['devices'])}** after {f['time_s']:.4g} s of wall time (geometric mean of "
        f"{len(runs)} run(s), crossing at epoch {f['epoch']:.2f}; runs {_ids(runs)})" + f["versus"] + ". Wall time "
        "counts from the first epoch's start, includes validation, and is interpolated between epoch ends."
    )


def which_adapter_lines(
    data: pd.DataFrame | Study,
    baseline: str | None = "best",
    include_contended: bool = False,
    noise: float = 0.0,
    target: float | None = None,
) -> list[str]:
    """The report's closing "Which adapter" section (markdown lines)."""
    lines = ["## Which adapter", "", "Computed from the finished runs of this folder only; each answer names the runs "
             f"it came from. Speed verdicts: Welch's t on log times, 95 %, Holm-adjusted per answer; equivalence "
             f"margin ±{100 * MARGIN:.0f} %, stated in advance.", ""]  # fmt: skip
    study = Study.of(data)
    verdicts = which_adapter(study, baseline, include_contended, noise, target)
    if noise:
        lines += [f"Run-to-run spread (A/A, `python -m ptbench.sweep noise`): {100 * noise:.1f} % (sd of log time); "
                  f"{repeats_for(noise)} runs per point find a {100 * MARGIN:.0f} % difference 80 % of the time. "
                  "It plans repeats; it does not move verdicts.", ""]  # fmt: skip
    if not verdicts:
        return lines + ["No finished run: nothing to compare.", ""]
    bad = study.not_finished
    for wl, v in verdicts.items():
        lines += [f"### {wl}", ""]
        if v["fastest"]:
            lines.append(_fastest_line(v["fastest"]))
        for m in v["memory"]:
            states = f", model states {m['states_mib']:.4g} MiB" if m["states_mib"] is not None else ""
            lines.append(
                f"- **Lowest memory per rank at {m['devices']} device{'s' if m['devices'] > 1 else ''}** "
                f"(`{m['metric']}`, busiest rank): **{_point(m['label'], m['devices'])}** "
                f"{m['mib']:.4g} MiB{states} (run {_ids(m['runs'])})" + _runner_up(m["ranking"], True, " MiB") + "."
            )
        sc = v["scaling"]
        if sc:
            ci = f" [{sc['efficiency_lo']:.3g}, {sc['efficiency_hi']:.3g}]" if np.isfinite(sc["efficiency_lo"]) else ""
            lines.append(
                f"- **Best scaling efficiency at {sc['devices']} devices**: **{_point(sc['label'], sc['devices'])}** "
                f"efficiency {sc['efficiency']:.3g}{ci} (speedup {sc['speedup']:.3g} against {sc['baseline']}; "
                f"runs {_ids(sc['runs'])}, baseline {_ids(sc['baseline_runs'])})"
                + (sc.get("versus") or _runner_up(sc["ranking"], False, "", fmt=lambda x: f"{x:.3g}"))
                + "."
            )
        wl_bad = bad[bad["workload"] == wl] if len(bad) and "workload" in bad else bad.iloc[:0]
        undecided = list(v["undecided"])
        if len(wl_bad):
            undecided.append(
                f"{len(wl_bad)} run(s) did not finish and are not ranked: "
                + ", ".join(f"{_point(x.label, x.devices)} {x.status}" for x in wl_bad.itertuples())
            )
        lines.append("- **Could not decide**: " + ("; ".join(undecided) if undecided else "nothing left open") + ".")
        lines.append("")
    return lines
