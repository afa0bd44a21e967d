"""The report's answers, each from one computation over the finished runs: the short "Answers" that open
report.md (`answers_lines`) and the "Which adapter" section of report-details.md with every comparison and run
(`which_adapter_lines`).

- Fastest per device count: points ranked by the geometric mean of their runs' time per training sample, with
  its 95 % interval; called fastest only when it beats every other point there (`ptbench.analysis.stats.rank`).
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

from pathlib import Path

import numpy as np
import pandas as pd

from ptbench.analysis.stats import (
    EQUIVALENT,
    FASTER,
    MARGIN,
    NOT_DISTINGUISHABLE,
    _pct,
    geo_interval,
    rank,
    repeats_for,
    resolve_text,
)
from ptbench.analysis.tables import Study, time_to_target, without_contention
from ptbench.core.readers import noise_files


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


def _plan(r: dict) -> str:
    """What would resolve a ranking that is not decided: repeats at its pooled spread (`resolve_text`)."""
    k = len(r["order"])
    return resolve_text(r["spread"], max(1, k * (k - 1) // 2))


def _versus(values: dict, margin: float = MARGIN) -> tuple[str, bool, str]:
    """(text, fastest, plan) of the point that ranks first against every other (`rank`): Holm-adjusted
    verdicts; `plan`: the repeats that would decide it, when it is not decided."""
    r = rank(values, margin)
    if len(r["order"]) < 2:
        return "", False, ""
    texts = "; ".join(v["text"] for v in r["versus"])
    fam = f"Holm over {r['family']} pair(s) with an interval"
    if r["fastest"]:
        return f"; faster than every other point ({fam}): {texts}", True, ""
    return f"; not shown faster than every other point ({fam}): {texts}", False, _plan(r)


def run_spread(results_dir: str | Path) -> float:
    """The newest A/A measurement's run-to-run spread under results_dir (`python -m ptbench.sweep noise`:
    */noise/*.json; `spread`, the sd of one run's log time), 0 when none was measured."""
    for _, rec in noise_files(results_dir):  # newest first
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
    short = [f"{_point(lab, d)} ({int(row['reached_runs'])} of {row['runs']})" for (lab, d), row in
             done[~done["every"]].iterrows()]  # fmt: skip
    if short:
        undecided.append(f"time to target: not every run reached it: {', '.join(short)}")
    ok = t[t.set_index(["label", "devices"]).index.isin(done[done["every"]].index)]
    if ok.empty:
        return None, undecided + ["time to target: no point reached the target in every run"]
    values = {_point(*k): g["time_s"].tolist() for k, g in ok.groupby(["label", "devices"])}
    versus, fastest, plan = _versus(values, margin)
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
        ranking=ranking, versus=versus, fastest=fastest, plan=plan, interval=geo_interval(w["time_s"]),
        scope=f"among points whose every run reached it; left out: {', '.join(short)}" if short else "",
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
              baseline=_baseline_name(b), runs=ids, baseline_runs=base_ids.tolist(),
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


def _baseline_name(b) -> str:
    """The speedup baseline named with how it was chosen: one picked as the fastest from these runs reads every
    speedup low (its own luck is in the denominator)."""
    if b.get("baseline_mode") == "best":
        return (f"`{b['baseline']}`, the fastest point at the fewest devices, picked from these runs (speedups read a little low; "
                "`--baseline LABEL` names one in advance)")  # fmt: skip
    return f"`{b['baseline']}`"


def _fastest_per_count(r: pd.DataFrame, margin: float) -> list[dict]:
    """Per device count: the point with the lowest geometric-mean time per training sample, with its 95 %
    interval; `fastest` only when it beats every other point there (`rank`: Welch on logs, Holm-adjusted)."""
    if "time_per_sample_used_s" not in r:
        return []
    have = r.assign(t=pd.to_numeric(r["time_per_sample_used_s"], errors="coerce")).dropna(subset=["t"])
    out = []
    for d, sub in have.groupby(have["devices"].astype(int)):
        values = {lab: g["t"].tolist() for lab, g in sub.groupby("label")}
        ranked = rank(values, margin)
        best = ranked["best"]
        out.append(dict(devices=int(d), label=best, time=geo_interval(values[best]), points=len(values),
                        fastest=ranked["fastest"], versus=ranked["versus"], plan=_plan(ranked),
                        runs=sorted(sub.loc[sub["label"] == best, "run_id"])))  # fmt: skip
    return out


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


def which_adapter(
    data: pd.DataFrame | Study,
    baseline: str | None = "best",
    include_contended: bool = False,
    noise: float = 0.0,
    target: float | None = None,
    margin: float = MARGIN,
) -> dict:
    """The "Which adapter" answers per workload: {workload: {"fastest": {...} | None, "memory": [...],
    "scaling": {...} | None, "per_count": [fastest per device count], "undecided": [reasons]}}. Runs whose
    record warns of contention are left out unless
    `include_contended`. `noise`: the A/A run-to-run spread, which plans repeats and moves no verdict;
    `target`: the time-to-target metric value (default: fixed from the baseline point's runs)."""
    out: dict = {}
    study, contended = without_contention(data, include_contended)
    per_run = study.ok_runs if len(study.ok_epochs) else pd.DataFrame()
    if per_run.empty:
        return out
    ttt = time_to_target(study, target, baseline)
    try:
        sp = study.speedup(baseline)
    except Exception:  # noqa: BLE001 - a baseline this workload lacks: scaling undecided below
        sp = pd.DataFrame()
    for wl, r in per_run.groupby("workload"):
        v: dict = {"fastest": None, "memory": [], "scaling": None, "undecided": [], "per_count": []}
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
        v["per_count"] = _fastest_per_count(r, margin)
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
        f"{len(runs)} run(s), crossing at epoch {f['epoch']:.2f}; runs {_ids(runs)})"
        + (f", {f['scope']}" if f.get("scope") else "")
        + f["versus"]
        + ". Wall time "
        "counts from the first epoch's start, includes validation, and is interpolated between epoch ends."
    )


def _per_count_detail(f: dict) -> str:
    """The fastest point at one device count with every comparison behind it (its Holm level each)."""
    iv, verdicts = f["time"], "; ".join(x["text"] for x in f["versus"])
    ci = f" [{1e3 * iv.lo:.3g}, {1e3 * iv.hi:.3g}]" if iv.finite else ""
    return (f"- **Fastest at {f['devices']} device(s)** (time per sample): **{_point(f['label'], f['devices'])}** "
            f"{1e3 * iv.value:.3g} ms/sample{ci} (runs {_ids(f['runs'])})" + (f"; {verdicts}" if verdicts else "") + ".")  # fmt: skip


def which_adapter_lines(
    data: pd.DataFrame | Study,
    baseline: str | None = "best",
    include_contended: bool = False,
    noise: float = 0.0,
    target: float | None = None,
) -> list[str]:
    """The report's closing "Which adapter" section (markdown lines)."""
    lines = ["## Which adapter", "", "Computed from the finished runs of this folder only; each answer names the runs "
             f"it came from. Speed verdicts: Welch's t on log times, Holm-adjusted over every pair with an interval, "
             "each printed at its Holm level (95 % for one comparison); equivalence "
             f"margin ±{100 * MARGIN:.0f} %, stated in advance.", ""]  # fmt: skip
    study = Study.of(data)
    verdicts = which_adapter(study, baseline, include_contended, noise, target)
    if noise:
        lines += [f"Run-to-run spread (A/A, `python -m ptbench.sweep noise`): {100 * noise:.1f} % (sd of log time); "
                  f"{repeats_for(noise)} runs per point find a {100 * MARGIN:.0f} % difference 80 % of the time. "
                  "It plans repeats; it does not move verdicts.", ""]  # fmt: skip
    if not verdicts and len(study.ok_runs):
        return lines + ["Every finished run warns of contention and is left out: nothing to compare "
                        "(`--include-contended` keeps them).", ""]  # fmt: skip
    if not verdicts:
        return lines + ["No finished run: nothing to compare.", ""]
    bad = study.not_finished
    for wl, v in verdicts.items():
        lines += [f"### {wl}", ""]
        lines += [_per_count_detail(f) for f in v["per_count"]]
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


# --- the short answers that open report.md ---------------------------------------------------------------
def _said(iv) -> str:
    """ "speed 1.04 [0.955, 1.14], 97.5 %, n=2": a comparison's interval with its level and runs."""
    return f"speed {iv.value:.3g} [{iv.lo:.3g}, {iv.hi:.3g}], {100 * iv.level:.3g} %, n={iv.n}"


def _compact_versus(best: str, versus: list[dict]) -> str:
    """The comparisons of the best point, grouped, each with its interval, level and n: not distinguishable
    from ..., equivalent to ..., faster than."""
    same = [
        f"`{v['b']}` ({_said(v['speed'])})" for v in versus if v["kind"] == NOT_DISTINGUISHABLE and v["speed"].finite
    ]
    bare = [f"`{v['b']}`" for v in versus if v["kind"] == NOT_DISTINGUISHABLE and not v["speed"].finite]
    equal = [f"`{v['b']}` ({_said(v['speed'])})" for v in versus if v["kind"] == EQUIVALENT]
    beaten = []
    for v in versus:
        if v["kind"] == FASTER and v["faster"] == best:
            s = v["speed"]
            beaten.append(
                f"`{v['b']}` by {_pct(s.value)} [{_pct(s.lo)}, {_pct(s.hi)}] ({100 * s.level:.3g} %, n={s.n})"
            )
        elif v["kind"] == FASTER:
            beaten.append(v["text"])
    parts = [f"not distinguishable from {', '.join(same)}"] if same else []
    parts += (
        [f"no interval against {', '.join(bare)} (one run, or runs that agree exactly: repeat points)"] if bare else []
    )
    parts += [f"equivalent within ±{100 * MARGIN:.0f} % to {', '.join(equal)}"] if equal else []
    parts += [f"faster than {'; '.join(beaten)}"] if beaten else []
    return "; ".join(parts)


def _per_count_line(f: dict) -> str:
    d, iv = f["devices"], f["time"]
    head = f"- **Fastest at {d} device{'s' if d > 1 else ''}**: "
    if f["points"] < 2:
        return head + f"only `{f['label']}` ran there, nothing to compare."
    ci = f" [{1e3 * iv.lo:.3g}, {1e3 * iv.hi:.3g}] (95 %, n={iv.n})" if iv.finite else " (no interval: one run)"
    said = "faster than every other point" if f["fastest"] else "not shown faster than every other point"
    plan = f"; to decide: {f['plan']}" if f.get("plan") and not f["fastest"] else ""
    return head + (f"**`{f['label']}`** {1e3 * iv.value:.3g} ms/sample{ci}; {said}: "
                   f"{_compact_versus(f['label'], f['versus'])}{plan}.")  # fmt: skip


def _memory_answer(memory: list[dict]) -> str:
    per = [f"{m['devices']} device{'s' if m['devices'] > 1 else ''} **`{m['label']}`** {m['mib']:.4g} MiB"
           + _runner_up(m["ranking"], True, " MiB") for m in memory]  # fmt: skip
    return f"- **Lowest memory per rank** (`{memory[0]['metric']}`, a ranking, no verdict): " + "; ".join(per) + "."


def _short_answers(v: dict) -> list[str]:
    lines = [_per_count_line(f) for f in v["per_count"]]
    sc = v["scaling"]
    if sc:
        ci = f" [{sc['efficiency_lo']:.3g}, {sc['efficiency_hi']:.3g}]" if np.isfinite(sc["efficiency_lo"]) else ""
        lines.append(f"- **Best scaling at {sc['devices']} devices**: **`{sc['label']}`** efficiency "
                     f"{sc['efficiency']:.3g}{ci} (speedup {sc['speedup']:.3g} against {sc['baseline']}).")  # fmt: skip
    if v["memory"]:
        lines.append(_memory_answer(v["memory"]))
    f = v["fastest"]
    if f:
        name = "perplexity ≤" if f["metric"] == "val_perplexity" else "accuracy ≥"
        said = "faster than every other point" if f["fastest"] else "not shown faster than every other point"
        said += f" {f['scope']}" if f.get("scope") else ""
        iv = f["interval"]
        ci = f" [{iv.lo:.4g}, {iv.hi:.4g}] (95 %, n={iv.n})" if iv.finite else f" (no interval: n={iv.n})"
        plan = f"; to decide: {f['plan']}" if f.get("plan") and not f["fastest"] else ""
        lines.append(f"- **Fastest to the target** (validation {name} {f['target']:.4g}): "
                     f"**{_point(f['label'], f['devices'])}** {f['time_s']:.4g} s of wall time{ci}; {said}{plan}.")  # fmt: skip
    return lines


def _on_cpu(runs: pd.DataFrame) -> bool:
    """CPU runs: their plotted memory is the process's RSS (GPU runs plot allocated bytes)."""
    m = runs["mem_plot_metric"] if "mem_plot_metric" in runs else pd.Series(dtype=object)
    return bool(m.dropna().astype(str).str.startswith("peak_rss").any())


CPU_CAVEAT = (" On CPU: the ranks share one machine's memory and cores, so these verdicts check the harness, "
              "not the paper's GPU findings.")  # fmt: skip


def _claim_counts(found: list[dict] | None, cpu: bool = False) -> str:
    if not found:
        return "- **Paper claims**: none checked (no finished run the verdicts use)."
    holds, fails, undecided, unmeasured = (
        sum(c["verdict"] == k for c in found) for k in ("holds", "does not hold", "undecided", "not measured")
    )
    if unmeasured == len(found):
        return "- **Paper claims**: none checked (no run measures one; `python -m ptbench.paper plan` makes them)."
    return (f"- **Paper claims**: {holds} hold{'s' if holds == 1 else ''}, {fails} do{'es' if fails == 1 else ''} "
            f"not hold, {undecided} undecided; {unmeasured} not measured (table under Paper claims)."
            + (CPU_CAVEAT if cpu else ""))  # fmt: skip


def _contention_note(study: Study, contended: list[str], include_contended: bool) -> list[str]:
    runs = study.ok_runs
    col = runs["contention"] if "contention" in runs else pd.Series(dtype=object)
    warned = col.dropna()
    if warned.empty:
        return []
    example = str(warned.iloc[0]).removeprefix("contention:").split(": times are not comparable")[0].strip()
    if include_contended:
        return [f"**{len(warned)} of {len(runs)} finished runs warn of contention** and are kept "
                f"(`--include-contended`): their times may not compare (e.g. {example}).", ""]  # fmt: skip
    return [f"**{len(contended)} of {len(runs)} finished runs warn of contention**: left out of every answer and "
            f"verdict, marked in the tables (e.g. {example}). `--include-contended` keeps them.", ""]  # fmt: skip


def _provisional(v: dict) -> list[str]:
    """What contended runs show, each answer labelled provisional, with the reason and what would decide it."""
    # the repeats a contended spread asks for say nothing of a quiet machine's: 3, then the report plans more
    # from the quiet runs' own spread
    head = ("- **Provisional** (every finished run warns of contention: other work shared the CPUs, so these "
            "times may not compare and no verdict below is decisive). To decide, rerun on a quiet machine, one "
            "point at a time: `python -m ptbench.sweep run SWEEP.txt --repeats 3`, then "
            "`python -m ptbench.analysis report RESULTS`, which plans any further repeats from the quiet "
            "runs' spread.")  # fmt: skip
    return [head] + [line.replace("- **", "- provisional: **", 1) for line in _short_answers(v)]


def answers_lines(
    data: pd.DataFrame | Study,
    baseline: str | None = "best",
    include_contended: bool = False,
    target: float | None = None,
    claims: dict | None = None,
) -> list[str]:
    """The "Answers" that open report.md: per workload the fastest point per device count with its interval or
    "not distinguishable", the best scaling, the lowest memory, the paper claims' verdicts counted (`claims`:
    workload -> checks) and what could not be decided, and why."""
    study = Study.of(data)
    used, contended = without_contention(study, include_contended)
    lines = ["## Answers", "", "From the finished runs of this folder (every comparison and its runs: "
             f"[report-details.md](report-details.md)). Speed: time per training sample, geometric mean with its 95 % "
             f"interval (ms/sample); each comparison Welch's t on log times, Holm-adjusted over every pair with an "
             f"interval and printed at its Holm level with its n; equivalence margin ±{100 * MARGIN:.0f} %.",
             ""]  # fmt: skip
    lines += _contention_note(study, contended, include_contended)
    verdicts = which_adapter(study, baseline, include_contended, target=target) if len(used.ok_epochs) else {}
    busy = {}  # workloads whose every run is contended: what the runs show, provisional
    if not include_contended and len(study.ok_epochs):
        busy = {wl: v for wl, v in which_adapter(study, baseline, True, target=target).items() if wl not in verdicts}
    bad = study.not_finished
    workloads = sorted({*study.ok_runs.get("workload", []), *bad.get("workload", [])})
    for wl in workloads:
        lines += [f"### {wl}", ""]
        v = verdicts.get(wl)
        wl_bad = bad[bad["workload"] == wl] if len(bad) else bad
        undecided = [u for u in (v or {}).get("undecided", []) if not u.startswith("left out for contention")]
        if v:
            lines += _short_answers(v)
        elif wl in busy:
            lines += _provisional(busy[wl])
            undecided.append("every finished run warns of contention, so no time compares; run the timing points "
                             "on a quiet machine, one at a time (or `--include-contended`)")  # fmt: skip
        else:
            undecided.append("no run finished")
        wl_runs = study.ok_runs[study.ok_runs["workload"] == wl] if "workload" in study.ok_runs else study.ok_runs
        lines.append(_claim_counts((claims or {}).get(wl), _on_cpu(wl_runs)))
        if len(wl_bad):
            undecided.append(f"{len(wl_bad)} run(s) did not finish (table under Runs that did not finish)")
        lines += ["- **Could not decide**: " + ("; ".join(undecided) if undecided else "nothing left open") + ".", ""]
    return lines
