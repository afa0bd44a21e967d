"""A report without Jupyter: every figure (PNG + SVG), the tidy tables as CSV, report.md (the answers first, then
the figures, then the summary tables) and report-details.md (per-run tables and ledgers), which report.md links.

python -m ptbench.analysis report RESULTS_DIR [--out DIR (default RESULTS_DIR/report)] [--baseline best|per-series|LABEL]
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pandas as pd

from ptbench.analysis import plots, records_io, safe_io
from ptbench.analysis.answers import (  # noqa: F401 - which_adapter: API
    _point,
    answers_lines,
    run_spread,
    which_adapter,
    which_adapter_lines,
)
from ptbench.analysis.at_scale import at_scale_lines
from ptbench.analysis.claims import claims, claims_lines
from ptbench.analysis.load import AnalysisError, load, load_comm, skipped
from ptbench.analysis.predicted import predicted_lines
from ptbench.analysis.safe_io import md_cell, md_text
from ptbench.analysis.stats import point_stats
from ptbench.analysis.tables import (
    EPOCH_TIME_SOURCES,
    IN_VERDICTS,
    PROFILE_PART_TEXT,
    Study,
    comm_table,
    layout_mixes,
    layout_table,
    marked,
    summary_table,
    time_to_target,  # noqa: F401 - ptbench.analysis.report.time_to_target, as before
    verdict_marks,
    without_contention,
)

FIGURES = {
    "epoch_time": "Epoch time vs devices (paper Fig. 5/6)",
    "speedup": "Speedup and scaling efficiency vs the baseline (Fig. 10)",
    "val_metric_vs_epoch": "Validation metric per epoch (Fig. 9)",
    "val_metric_vs_time": "Validation metric vs wall time (Fig. 11)",
    "memory": "Peak memory per rank vs devices, model states vs the rest (Fig. 12)",
    "breakdown": "Time per step by phase (Fig. 7)",
}
WARNING = "**Warning:**"
DETAILS = "report-details.md"
# report.md's sections, in the order it gives them to a folder with finished and unfinished runs: the answers,
# the figures, then the tables ("Predicted vs measured" joins before the unfinished runs where a record predicted)
SECTIONS = (
    "## Answers",
    "## Figures",
    "## Runs",
    "## Summary (finished runs)",
    "## Runs that did not finish",
    "## Paper claims",
)


def _gb(v) -> str:
    return _fmt(int(v) if isinstance(v, float) and v.is_integer() else v)


def batch_warnings(data: pd.DataFrame | Study) -> list[str]:
    """Warning lines where points that a figure sets side by side differ in global batch: runs of one
    series at one device count (their means mix batches), and the series of one workload at one
    device count (their epoch times compare different batches)."""
    r = Study.of(data).ok_runs
    if r.empty or "global_batch" not in r:
        return []
    r = r[r["global_batch"].notna()]
    lines = []
    for (wl, lab, d), sub in r.groupby(["workload", "label", "devices"]):
        gbs = sorted(set(sub["global_batch"]))
        if len(gbs) > 1:
            lines.append(
                f"{WARNING} {wl}, series `{lab}` at {int(d)} devices: its runs used different global batches "
                f"({', '.join(_gb(v) for v in gbs)}); the point averages them "
                f"(runs {', '.join(sorted(sub['run_id']))})."
            )
    for (wl, d), sub in r.groupby(["workload", "devices"]):
        per = sub.groupby("label")["global_batch"].agg(lambda v: ", ".join(_gb(x) for x in sorted(set(v))))
        if sub["global_batch"].nunique() > 1 and len(per) > 1:
            lines.append(
                f"{WARNING} {wl} at {int(d)} devices: the series differ in global batch "
                f"({'; '.join(f'`{lab}` {gb}' for lab, gb in per.items())}): their epoch times compare "
                "different batches (speedup is per training sample)."
            )
    return lines


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return md_cell(v)  # record text is data: no markup, no cell breaks (it came escaped: md_frame)


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub/pipe Markdown table (DataFrame.to_markdown, tabulate), each cell formatted by `_fmt`."""
    if df.empty:
        return "_none_\n"
    cells = df.astype(object).map(_fmt)
    cells.columns = [_fmt(c) for c in df.columns]
    return cells.to_markdown(index=False, tablefmt="pipe", disable_numparse=True, stralign="left") + "\n"


def _baseline_lines(sp: pd.DataFrame, baseline: str | None) -> list[str]:
    lines = []
    for wl, sub in sp.groupby("workload"):
        mode = sub["baseline_mode"].iloc[0]
        if mode == "per-series":
            lines.append(
                f"Speedup baseline for {wl}: **each series' own point at its fewest devices** (--baseline "
                "per-series): " + "; ".join(sorted(set(sub["baseline"]))) + "."
            )
            continue
        b = sub.iloc[0]
        why = (
            f"chosen with --baseline {baseline}"
            if mode == "series"
            else "the fastest single-device point of any series"
            if b["baseline_devices"] == 1
            else "no single-device run: the fastest point at the fewest devices"
        )
        lines.append(f"Speedup baseline for {wl}: **{b['baseline']}** ({why}).")
    return lines


def _epoch_time_lines(per_run: pd.DataFrame) -> list[str]:
    done = per_run[per_run["status"] == "ok"]
    used = done["epoch_time_source"].dropna().value_counts()
    lines = []
    if len(used):
        lines.append(
            "Epoch time used for the epoch-time and speedup figures: "
            + "; ".join(f"{src} ({n} run{'s' if n > 1 else ''})" for src, n in used.items())
            + ". Preference: the summary's "
            f"`epoch_time_steady_s` (complete epochs after the first), else the {EPOCH_TIME_SOURCES['after_first']} "
            "(two or more epochs), else the first epoch, which includes warm-up."
        )
    partial = per_run[per_run["partial_epochs"] > 0] if "partial_epochs" in per_run else per_run.iloc[:0]
    if len(partial):
        lines.append(
            f"Partial epochs (cut short by trainer.max_steps or preemption) are left out of every mean "
            f"unless all of a run's epochs are partial: {int(partial['partial_epochs'].sum())} in "
            + ", ".join(f"{r} ({n})" for r, n in zip(partial["run_id"], partial["partial_epochs"]))
            + "."
        )
    else:
        lines.append("No epoch is flagged partial; partial epochs would be left out of the means.")
    return lines


def _memory_lines(study: Study) -> list[str]:
    try:
        mem = study.memory
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
    df = study.epochs
    cpu = df[df["memory_metric"] == "peak_rss"] if "memory_metric" in df else df.iloc[:0]
    if "peak_rss" in metrics and len(cpu):
        lines.append("These CPU records carry no `peak_rss_delta`: the memory figure falls back to `peak_rss`.")
    off = mem[mem["offload"].notna()]
    for _, m in off.iterrows():
        lines.append(
            f"{m['workload']} `{m['label']}` x{int(m['devices'])}: {m['offload']} held in CPU memory "
            f"({m['host_mib']:.4g} MiB), not counted as device memory."
        )
    for note in sorted(set(mem["mem_note"].dropna())):
        lines.append(f"Memory note: {note}.")
    return lines


INTERVAL_COLUMNS = ("epoch_time_used", "samples_per_s", "step_time_median")
INTERVALS_HEAD = [
    "",
    "### Intervals over repeats",
    "",
    "Geometric mean over a point's repeats with a 95 % Student-t interval on the logs, back-transformed (`_lo`, "
    "`_hi`; one repeat: none); `step_time_median`: the same over the runs' median step times (the steps of one run "
    "are not independent samples); comparisons use these runs (ptbench.analysis.stats).",
    "",
]


def _has_intervals(ok_runs: pd.DataFrame) -> bool:
    steps = "step_times_s" in ok_runs and ok_runs["step_times_s"].map(lambda x: isinstance(x, list)).any()
    return not ok_runs.empty and (
        steps or ok_runs.groupby(["workload", "label", "devices"])["run_id"].count().max() > 1
    )


def interval_lines(ok_runs: pd.DataFrame, out: Path | None = None) -> list[str]:
    """With repeated points (`python -m ptbench.sweep run --repeats N`): per point, the geometric means over
    repeats of epoch time, throughput and the runs' median step times with 95 % log-scale intervals (*_lo / *_hi;
    intervals.csv, `ptbench.analysis.stats.point_stats`)."""
    if not _has_intervals(ok_runs):
        return []
    t = point_stats(ok_runs, ("workload", "label", "devices"))
    if out is not None:
        safe_io.to_csv(t, Path(out) / "intervals.csv")
    shown = [c for c in t.columns if c in ("workload", "label", "devices", "repeats") or c.startswith(INTERVAL_COLUMNS)]
    return [*INTERVALS_HEAD, markdown_table(t[shown]), ""]


def intervals_of(study: Study, used: Study, contended: list[str], out: Path | None) -> list[str]:
    """`interval_lines` over the runs the verdicts use, the points they leave out kept and marked `in verdicts`."""
    if not _has_intervals(study.ok_runs):
        return []
    keys = ("workload", "label", "devices")
    t = marked(
        point_stats(used.ok_runs, keys) if len(used.ok_runs) else pd.DataFrame(),
        point_stats(study.ok_runs, keys),
        verdict_marks(study, contended),
        after="repeats",
    )
    if out is not None:
        safe_io.to_csv(t, Path(out) / "intervals.csv")
    shown = [c for c in t.columns if c in (*keys, "repeats", IN_VERDICTS) or c.startswith(INTERVAL_COLUMNS)]
    return [*INTERVALS_HEAD, markdown_table(t[shown]), ""]


def estimate_lines(ok_epochs: pd.DataFrame) -> list[str]:
    """Epochs whose time is an ESTIMATE (trainer.timing_sample: measured until the step-time interval was narrow
    enough), each with its interval and the steps measured."""
    if "epoch_time_estimate_s" not in ok_epochs or ok_epochs["epoch_time_estimate_s"].isna().all():
        return []
    e = ok_epochs[ok_epochs["epoch_time_estimate_s"].notna()]
    rows = [
        f"- `{r.label}` x{int(r.devices)} epoch {int(r.epoch)}: **estimate** {r.epoch_time_estimate_s:.3g} s "
        f"[{r.epoch_time_estimate_lo_s:.3g}, {r.epoch_time_estimate_hi_s:.3g}] from {int(r.steps)} of "
        f"{int(r.epoch_time_estimate_steps_in_epoch)} steps ({r.run_id})"
        for r in e.itertuples()
    ]
    return [
        "",
        "### Estimated epoch times (sampled timing)",
        "",
        f"{len(e)} epoch(s) were measured only until the 95 % interval of the mean step time was narrow enough "
        "(`trainer.timing_sample`): their epoch times are estimates, not measurements; the tables use the "
        "measured part (time per sample).",
        "",
        *rows[:20],
        *([f"- ... and {len(rows) - 20} more"] if len(rows) > 20 else []),
        "",
    ]


def comm_lines(
    data: pd.DataFrame | Study, reports: list[dict], out: Path | None = None, contended: list[str] | None = None
) -> list[str]:
    """The "Communication" section: per point the measured step time, the phase(s) holding its
    collectives, the recorded volume per step and the time it takes at the measured bus bandwidth. With
    `contended` (the run ids the verdicts leave out), each point as the verdicts see it, marked `in verdicts`."""
    table = comm_table(data, reports)
    if contended is not None and not table.empty:
        used = without_contention(data)[0] if contended else Study.of(data)
        kept = comm_table(used, reports) if contended and len(used.ok_runs) else table if not contended else table[:0]
        table = marked(*(t.rename(columns={"series": "label"}) for t in (kept, table)),
                       verdict_marks(data, contended), after="runs").rename(columns={"label": "series"})  # fmt: skip
    if table.empty or table["comm MB/step"].isna().all():  # records from before `comm_volume`: no section
        return []
    if out is not None:
        safe_io.to_csv(table, out / "comm.csv")
    measured = ", ".join(f"{r['backend']} x{r['world_size']} ({Path(r['path']).name})" for r in reports) or "none"
    return [
        "## Communication per step",
        "",
        (
            "`comm MB/step`: bytes one rank moves per optimizer step (nccl-tests bus volume), from each record's "
            "`comm_volume` (bench/core/comm_volume/, formulas in `formula`). `at busbw (ms)`: that volume over "
            "the bus bandwidth `python -m ptbench.comm` measured (`<results>/<experiment>/comm/`; a sweep stores it) "
            "on the run's backend at the collective's group size, at the measured message size nearest to the "
            "collective's whole message (log scale; beyond the range, the end point), summed over collectives "
            "with no overlap; `not measured` when no such measurement is here. `phase (ms)`: the mean time of "
            "the phase(s) the adapter's collectives run in (`comm phase`, from its phase semantics), compute "
            "included: the exposed communication is part of it. `step (ms)`: mean step time, warm-up steps "
            f"excluded. Measurements found: {measured}."
        ),
        "",
        markdown_table(
            pd.concat(
                [
                    pd.DataFrame({"point": [_point(lab, d) for lab, d in zip(table["series"], table["devices"])]}),
                    table.drop(columns=["series", "devices"]),
                ],
                axis=1,
            )
        ),
        "",
    ]


def breakdown_caption(study: Study) -> list[str]:
    """How the breakdown figure's bars are made: phases, and for profiled points the measured split."""
    try:
        data = study.breakdown
    except AnalysisError:
        return []
    lines = [
        "Bars of points not profiled: mean time per step in each timed phase (means over ranks), `other` the rest "
        "of the slowest rank's step."
    ]
    if data.attrs.get("parts"):
        lines += [
            "",
            "Hatched bars, points profiled with `trainer.profile` (`(profiled)` under the bar): the profiled step "
            "(adapter.train_step inside the profiler window, its overhead included) split by what the traces "
            "measured, per rank from the record's `profile.ranks` (and `profile.bubble.per_stage`), then the mean "
            "over ranks and over the point's profiled runs; the parts add up to the profiled step:",
            "",
            *[f"- {PROFILE_PART_TEXT[p]}" for p in data.attrs["parts"]],
        ]
    return [*lines, ""]


def _why_run(run_dir, rows, reports, ledger, bubble, strag, diffs, flops, memory, conventions) -> None:
    """One run's part of the "Why" section, added to the lists and dicts it is given."""
    from ptbench.analysis.tables import comm_time

    path = Path(run_dir) / "summary.json"
    try:
        s = records_io.read_json(path)
    except (OSError, ValueError):
        return  # load() said why
    label = str(rows["label"].iloc[0]) if "label" in rows else str(s.get("adapter"))
    name = f"{label} ({s.get('run_id', Path(run_dir).name)})"
    if s.get("status") == "ok":
        point = _point_name(rows, label)
        _mfu_row(flops, conventions, point, s.get("flops_check"), rows)
        _memory_row(memory, point, s.get("memory_ledger"))
    prof = s.get("profile") or {}
    ranks = prof.get("ranks") or []
    if prof.get("ledger") and ranks:
        exposed = sum(r["exposed_comm_s"] for r in ranks) / len(ranks)
        step = sum(r["step_time_s"] for r in ranks) / len(ranks)
        formula = prof.get("formula") or {}
        for r in prof["ledger"]:
            if not r["measured_bytes"] and not r["formula_bytes"]:
                continue
            same = [c for c in formula.get("collectives", []) if c["op"] == r["kind"]]
            at_bw = comm_time(same, formula.get("backend"), reports or [])[0] if same else None
            ledger.append(
                {
                    "run": name,
                    "collective": r["kind"],
                    "formula MB": None if r["formula_bytes"] is None else r["formula_bytes"] / 1e6,
                    "measured MB": r["measured_bytes"] / 1e6,
                    "measured/formula": r["ratio"],
                    "time ms": 1e3 * r["time_s"],
                    "ms at measured busbw": None if at_bw is None else 1e3 * at_bw,
                    "exposed ms (all kinds)": 1e3 * exposed,
                    "exposed share of step": exposed / step if step else None,
                }
            )
        for d in (prof.get("formula") or {}).get("differences", []):
            diffs.setdefault(d, []).append(name)
    b = prof.get("bubble")
    if b:
        bubble.append(
            {
                "run": name,
                "stages": b["stages"],
                "m": b["microbatches"],
                "theory": b["theory"],
                "wall": b["mean"],
                "wall/theory": b.get("ratio"),
                # records before the steady figure have no steady_steps: left blank, not 0
                "steady steps": None if "steady_steps" not in b else f"{b['steady_steps']}/{b['steps']}",
                "steady/theory": b.get("steady_ratio"),
                "replayed": b.get("replayed_mean"),
                "replayed/theory": b.get("replayed_ratio"),
            }
        )
    try:
        evs = [e for _, e in records_io.read_jsonl(Path(run_dir) / "events.jsonl") if isinstance(e, dict)]
    except (OSError, ValueError):
        evs = []  # load() said why
    for e in evs:
        if e.get("slowest_rank") is None or e.get("rank_comm_wait_s") is None:
            continue
        strag.append(
            {
                "run": name,
                "epoch": e.get("epoch"),
                "slowest rank": e["slowest_rank"],
                "step time per rank (ms)": " ".join(f"{1e3 * v:.1f}" for v in e.get("rank_step_time_mean_s") or []),
                "collective wait per rank (ms/step)": " ".join(f"{1e3 * v:.1f}" for v in e["rank_comm_wait_s"]),
            }
        )


def why_lines(df: pd.DataFrame, reports: list[dict] | None = None) -> list[str]:
    """The "Why" section: from the records of runs profiled with trainer.profile, the communication
    ledger (formula vs measured bytes, with the framework differences that correct the formula), exposed
    communication, the pipeline bubble beside (p-1)/(m+p-1), and the slowest rank of each epoch; with
    `python -m ptbench.comm` reports, each kind's formula bytes at the measured bus bandwidth."""
    if df.empty or "run_dir" not in df:
        return []
    ledger, bubble, strag, diffs = [], [], [], {}
    flops, memory, conventions = {}, {}, {}  # per point (the first run's check; MFU: mean over its runs)
    for run_dir, rows in df.groupby("run_dir", sort=True):
        try:
            _why_run(run_dir, rows, reports, ledger, bubble, strag, diffs, flops, memory, conventions)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
            # a record holding what no run writes: one bad record, said in one line, never the whole report
            skipped(Path(run_dir) / "summary.json", f"its profile cannot be read ({type(e).__name__}: {e})")
    if not (ledger or bubble or strag or flops or memory):
        return []
    traced = bool(ledger or bubble or strag)
    lines = [
        "## Why (measured from traces, `trainer.profile`)" if traced else "## Why (counted FLOPs and saved bytes)",
        "",
    ]
    if traced:
        lines += [
            "Runs profiled with `trainer.profile=START:COUNT` (bench/runner/profiling.py) carry Chrome/Perfetto "
            "traces (`traces/` in the record) and what they measure. Bytes are per optimizer step in nccl-tests' bus "
            "volume, the busiest rank's; exposed communication is communication time not overlapped by compute on "
            "that rank. The breakdown figure splits these runs' profiled step into compute, exposed communication, "
            "pipeline bubble and other (see its caption under Figures).",
            "",
        ]
    if ledger:
        lines += ["### Communication ledger: formula vs measured", "", markdown_table(pd.DataFrame(ledger)), ""]
        if diffs:
            lines += ["Where the frameworks differ from the papers' formulas (the formula column is corrected):", ""]
            lines += [f"- {md_text(d)} ({len(runs)} run(s))" for d, runs in diffs.items()] + [""]
    if bubble:
        lines += [
            "### Pipeline bubble per step: measured beside (p-1)/(m+p-1)",
            "",
            markdown_table(pd.DataFrame(bubble)),
            "",
            "wall: idle share of the schedule's span as it ran (transfers, the loss and ranks sharing CPU cores "
            "included); steady: the wall figure over the profiled steps whose work items kept the theory's equal "
            "times (spread at most the record's steady_cv; chosen on item times, never on idle time); replayed: "
            "the measured work items re-timed with the schedule's dependencies, one device per stage.",
            "",
        ]
    if strag:
        lines += [
            "### Stragglers: who the others wait for",
            "",
            markdown_table(pd.DataFrame(strag)),
            "",
            "The slowest rank has the most step time outside collective waits: a straggler makes the others wait "
            "for it inside their collectives.",
            "",
        ]
    if flops:
        lines += [
            "### MFU both ways: the formula's FLOPs and the counted FLOPs (`flops_check`)",
            "",
            markdown_table(pd.DataFrame(flops.values()).drop(columns="_mfu")),
            "",
            "MFU (formula) is the runs' mean MFU, from the workload's analytic training FLOPs per sample; MFU "
            "(counted) is the same with torch's FlopCounterMode count (MFU x counted/formula); `-`: no MFU (the "
            "device's peak FLOP/s is not known, e.g. on CPU). A ratio more than 5 % from 1 is a warning. What the "
            "counter counts:",
            "",
        ]
        lines += [f"- {md_text(c)} ({len(points)} point(s))" for c, points in conventions.items()] + [""]
    if memory:
        lines += [
            "### Memory ledger: predicted vs counted saved-activation bytes (`memory_ledger`)",
            "",
            markdown_table(pd.DataFrame(memory.values())),
            "",
            "Predicted: the memory model's saved activations of the busiest rank (bench/core/memory_model/); "
            "counted: saved-tensor hooks around one training step, the peak bytes alive, the most any rank "
            "counted (each rank's in `counted MB per rank`). Step: the memory model's `step_transient` (the "
            "optimizer's temporaries; DeepSpeed's fp32 gradient partition and norms) beside the most any rank's "
            "optimizer phase held beyond its start in the last untimed step (`StepPeak`; `-`: not measured, e.g. "
            "with one untimed step, when the optimizer's state is still being made).",
            "",
        ]
    return lines


def _point_name(rows: pd.DataFrame, label: str) -> str:
    devices = rows["devices"].iloc[0] if "devices" in rows else None
    workload = rows["workload"].iloc[0] if "workload" in rows else None
    d = "" if devices is None or pd.isna(devices) else f" x{int(devices)}"
    return f"{workload}: {label}{d}" if workload else f"{label}{d}"


def _mfu_row(out: dict, conventions: dict, point: str, check, rows: pd.DataFrame) -> None:
    """The point's row of the MFU table, from a run's `flops_check`; its MFU joins the point's mean."""
    if not isinstance(check, dict):
        return
    mfu = pd.to_numeric(rows["mfu"], errors="coerce").mean() if "mfu" in rows else float("nan")
    row = out.get(point)
    if row is None:
        ratio = check.get("ratio")
        row = out[point] = {
            "point": point,
            "formula FLOP/sample": check.get("formula_train_flops_per_sample"),
            "counted FLOP/sample": check.get("counted_train_flops_per_sample"),
            "counted/formula": ratio,
            "MFU (formula)": None,
            "MFU (counted)": None,
            "warning": check.get("warning") or check.get("error") or "",
            "_mfu": [],
        }
        if check.get("convention"):
            conventions.setdefault(check["convention"], []).append(point)
    if not math.isnan(mfu):
        row["_mfu"].append(mfu)
        m = sum(row["_mfu"]) / len(row["_mfu"])
        row["MFU (formula)"] = m
        row["MFU (counted)"] = m * row["counted/formula"] if row["counted/formula"] is not None else None


def _memory_row(out: dict, point: str, led) -> None:
    """The point's row of the memory-ledger table, from a run's `memory_ledger` (its first run's)."""
    if not isinstance(led, dict) or point in out:
        return
    per_rank = led.get("counted_saved_bytes_per_rank") or []
    out[point] = {
        "point": point,
        "predicted saved MB": None if led.get("predicted_saved_bytes") is None else led["predicted_saved_bytes"] / 1e6,
        "counted saved MB": None if led.get("counted_saved_bytes") is None else led["counted_saved_bytes"] / 1e6,
        "predicted/counted": led.get("ratio"),
        "note": led.get("error") or "",
        "counted MB per rank": " ".join(f"{b / 1e6:.3g}" for b in per_rank if b is not None),
        "predicted step MB": None if led.get("predicted_step_bytes") is None else led["predicted_step_bytes"] / 1e6,
        "counted step MB": None if led.get("counted_step_bytes") is None else led["counted_step_bytes"] / 1e6,
        "step predicted/counted": led.get("step_ratio"),
    }


SUMMARY_COLUMNS = {
    "label": "series",
    "epoch_time_s": "epoch time (s)",
    "epoch_time_from": "epoch time from",
    "step_ms": "step (ms)",
    "samples_per_s": "samples/s",
    "final_val": "final val",
    "peak_mib": "peak MiB/rank",
    "states_mib": "model states MiB",
}
# columns code reads back as they are (folders to open, JSON to parse), never shown as record text
RAW_COLUMNS = ("run_dir", "comm_collectives")
SHOWN_NOT_FINISHED = 10  # report.md lists this many runs that did not finish; report-details.md every one


def _summary(study: Study, used: Study, contended: list[str], baseline: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the summary table as the verdicts see it, the speedup table its baseline lines describe): points the
    verdicts use from their runs, points they leave out from every run, each marked `in verdicts`."""
    every = summary_table(study, baseline)
    try:
        table = summary_table(used, baseline) if contended and len(used.ok_epochs) else every
        sp = used.speedup(baseline) if contended and len(used.ok_epochs) else study.speedup(baseline)
    except (ValueError, AnalysisError):  # the baseline's runs are all left out: every row from every run
        table, sp = every, study.speedup(baseline)
    return marked(table, every, verdict_marks(study, contended), after="runs"), sp


def summary_lines(study: Study, used: Study, contended: list[str], baseline: str, out: Path) -> list[str]:
    """The "Summary (finished runs)" section: per point the numbers behind the figures, marked as the verdicts
    treat its runs; the notes on epoch time and memory under it."""
    table, sp = _summary(study, used, contended, baseline)
    safe_io.to_csv(table, out / "summary.csv")
    lines = ["## Summary (finished runs)", "", *_baseline_lines(sp, baseline), ""]
    lines += [
        "Series labels come from each run's own record: adapter, settings, and `gb=` the global batch as its batch "
        "policy sets it (`gb=B/replica`: B per data-parallel replica; `gb=B/device`: B per device; `gb=B/microbatch`: "
        "B per micro-batch; `gb=B`: fixed). `in verdicts`: how the answers and verdicts treat the point's runs (`1 "
        "run: no interval`; runs that warn of contention are left out, and a point with none left keeps its numbers "
        "over every run and its speedup against the baseline over every run).",
        "",
    ]
    warn = batch_warnings(study)
    lines += [*warn, ""] if warn else []
    metrics = table["metric"].dropna().unique() if "metric" in table else []
    shown = table.drop(columns=["epoch_time_from"])  # said under the table, and in summary.csv
    if len(metrics) == 1:  # one metric: its name heads the column
        shown = shown.drop(columns="metric").rename(columns={"final_val": f"final {metrics[0]}"})
    lines += [markdown_table(shown.rename(columns=SUMMARY_COLUMNS)), ""]
    if (study.ok_epochs.groupby("workload")["samples_per_epoch"].nunique() > 1).any():
        lines += [
            "Epochs of one workload hold different numbers of samples (trainer.max_steps or a growing global batch): "
            "speedup is computed per training sample, so it stays comparable.",
            "",
        ]
    lines += [*_epoch_time_lines(study.runs), "Epoch time excludes validation.", ""]
    return lines + [*_memory_lines(study), ""]


def not_finished_lines(study: Study, cap: int | None = SHOWN_NOT_FINISHED) -> list[str]:
    """The "Runs that did not finish" section: the first `cap` runs (all with cap None)."""
    bad = study.not_finished
    lines = [
        "## Runs that did not finish",
        "",
        "Any status but `ok` (failed, oom, timeout, preempted, missing, skipped; `diverged`: the training loss became "
        "non-finite, at the step its error names; `damaged`: a record file cut short, the reason in its error): left "
        "out of the curves, speedup and efficiency, marked on every figure.",
        "",
    ]
    if bad.empty:
        return [*lines, "_none_", ""]
    cols = ["run_id", "label", "workload", "devices", "status", "error"]
    more = [] if cap is None or len(bad) <= cap else [f"... and {len(bad) - cap} more in [{DETAILS}]({DETAILS}).", ""]
    return [*lines, markdown_table(bad[cols].head(cap) if cap else bad[cols]), "", *more]


def layout_notes(study: Study, contended: list[str], out: Path | None = None) -> dict[str, list[str]]:
    """Per vision workload, the lines beside its answers and claims: each point that ran in two memory layouts
    with its step-time ratio and interval (layouts.csv), and one line where the series compared differ in layout
    (a layout difference is not a framework difference)."""
    notes: dict[str, list[str]] = {}
    table = layout_table(study, contended)
    if out is not None and len(table):
        safe_io.to_csv(table, out / "layouts.csv")
    for c in table.itertuples():
        n = f"n={c.n} vs {c.n_against}"
        ci = (
            f" [{c.lo:.3g}, {c.hi:.3g}] (95 %, {c.method}, {n})" if c.lo == c.lo else f" (no interval: {c.method}, {n})"
        )
        said = f"{c.ratio:.3g}{ci}" if c.n and c.n_against else f"not compared (left: {n})"
        left = f"; {c.left_out} contended run(s) left out" if c.left_out else ""
        notes.setdefault(c.workload, []).append(f"- **Layout** `{c.settings}` x{c.devices}: {c.layout} / {c.against} "
                                                f"median step time {said}{left} (runs {c.runs}).")  # fmt: skip
    for wl, per in layout_mixes(study, contended).items():
        each = "; ".join(f"`{lab}` {lay}" for lab, lay in per.items())
        mixed = any("+" in v for v in per.values())
        mixed = " A series whose runs ran in two layouts averages them here." if mixed else ""
        notes.setdefault(wl, []).append(f"- **Layouts differ** among the runs compared here ({each}): a time difference "
                                        f"includes the layout's, not only the framework's.{mixed} "
                                        "`workload.channels_last=false` runs every adapter in NCHW.")  # fmt: skip
    return notes


def beside_claims(lines: list[str], notes: dict[str, list[str]]) -> list[str]:
    """The answers with each workload's `notes` before its "Paper claims" line."""
    out, wl = [], None
    for ln in lines:
        wl = ln[4:] if ln.startswith("### ") else wl
        out += notes.get(wl, []) if ln.startswith("- **Paper claims**") else []
        out.append(ln)
    return out


def _short(text: str, n: int = 160) -> str:
    """A claim's numbers cut at a "; " before n characters (the whole text is in report-details.md)."""
    if len(text) <= n:
        return text
    cut = text[:n].rfind("; ")
    return (text[:cut] if cut > 0 else text[:n]) + " ..."


def claims_table_lines(found: dict, include_contended: bool, notes: dict | None = None) -> list[str]:
    """The "Paper claims" section of report.md: each check's verdict and its numbers, cut short (the whole
    table, with the runs, in report-details.md)."""
    lines = [
        "## Paper claims",
        "",
        "The findings of Lin et al. checked against these records (analysis/claims.py states each test): a claim "
        "holds when the 90 % interval of its ratio lies inside the paper's range, does not hold when wholly outside "
        "it, else (or without repeats) it is undecided; runs that warn of contention are "
        + ("kept (asked for)." if include_contended else "left out of the time claims (memory is not a timing: kept).")
        + f" Every number and run: [{DETAILS}]({DETAILS}).",
        "",
    ]
    if not found:
        return [*lines, "_no finished run the verdicts use_", ""]
    for wl, checks in found.items():
        rows = [(c["claim"], f"**{c['verdict']}**", _short(c["numbers"])) for c in checks]
        lines += [f"### {wl}", "", markdown_table(pd.DataFrame(rows, columns=["claim", "verdict", "numbers"])), ""]
        differ = [n for n in (notes or {}).get(wl, []) if n.startswith("- **Layouts differ**")]
        lines += [*differ, ""] if differ else []
    return lines


def figure_lines(study: Study, out: Path, baseline: str) -> list[str]:
    os.close(safe_io.own_dir(out / "figures"))  # refused in one line before any figure is drawn
    skipped = plots.save_all(study, out / "figures", baseline=baseline)
    lines = ["## Figures", ""]
    for key, title in FIGURES.items():
        if skipped.get(key) is None:
            lines += [f"### {title}", "", f"![{title}](figures/{key}.png) ([SVG](figures/{key}.svg))", ""]
            lines += breakdown_caption(study) if key == "breakdown" else []
        else:
            lines += [f"### {title}", "", f"_not drawn: {skipped.get(key)}_", ""]
    return lines


def _runs_lines(study: Study, contended: list[str], include_contended: bool) -> list[str]:
    counts = study.runs["status"].value_counts()
    said = ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({len(study.runs)} runs). "
    if contended:
        said += f"{len(contended)} warn of contention: left out of the verdicts, marked in the tables. "
    elif include_contended and "contention" in study.runs and study.runs["contention"].notna().any():
        said += f"{int(study.runs['contention'].notna().sum())} warn of contention, kept (--include-contended). "
    return [
        "## Runs",
        "",
        said + "Only `ok` runs make the curves; the others are marked with a red x on every figure and listed below.",
        "",
    ]


def _details_lines(study, used, contended, baseline, include_contended, target, out, results_dir, found) -> list[str]:
    """report-details.md: the per-run and per-point tables and the ledgers behind report.md."""
    reports = load_comm(results_dir)
    lines = [
        f"# Benchmark report details: {md_text(results_dir)}",
        "",
        "The tables behind [report.md](report.md): intervals, communication, ledgers, every claim and answer with "
        "its runs, every run that did not finish.",
        "",
    ]
    if len(study.ok_epochs):
        timing = [*intervals_of(study, used, contended, out), *estimate_lines(study.ok_epochs)]
        lines += ["## Timing per point", *timing] if timing else []
        lines += comm_lines(study, reports, out, contended)
        lines += why_lines(study.epochs, reports)
    lines += not_finished_lines(study, cap=None)
    lines += claims_lines(study.runs, include_contended, study.epochs, found)  # decided once, for both files
    noise = run_spread(results_dir)
    return lines + which_adapter_lines(study, baseline, include_contended, noise=noise, target=target)


def write_report(
    results_dir: str | Path,
    out: str | Path,
    baseline: str | None = "best",
    include_contended: bool = False,
    target: float | None = None,
) -> Path:
    """Figures into out/figures, tables into out/*.csv, out/report.md (answers, figures, the summary tables) and
    out/report-details.md (per-run tables and ledgers); returns report.md's path. `target`: the time-to-target
    metric value, fixed in advance (default: from the baseline point's runs)."""
    results_dir, out = Path(results_dir), Path(out)
    baseline = md_text(baseline or "best")  # a label as the escaped frame below spells it
    raw = load(results_dir)  # a missing results folder: said before any output folder is made
    if out.exists() and not out.is_dir():
        raise AnalysisError(f"--out {out} is a file, not a folder: name a folder (it is made if missing)")
    os.close(safe_io.own_dir(out))  # made by us, or checked as ours, before anything is written
    lines = [
        f"# Benchmark report: {md_text(results_dir)}",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m ptbench.analysis report`. Per-run tables and "
        f"ledgers: [{DETAILS}]({DETAILS}). CSV: `epochs.csv` (one row per run x epoch), `runs.csv` (one row per "
        "run), `summary.csv`.",
        "",
    ]
    path = out / "report.md"
    if raw.empty:
        print(f"note: no run records under {results_dir}: the report says so and holds nothing else", file=sys.stderr)
        safe_io.write_text(path, "\n".join([*lines[:2], "No run records found under this folder.", ""]))
        return path
    os.close(safe_io.own_dir(out / "figures"))  # all refusals before the first file is written
    safe_io.to_csv(raw.drop(columns=["step_times_s"], errors="ignore"), out / "epochs.csv")  # lists: not CSV
    safe_io.to_csv(Study(raw).runs.drop(columns=["step_times_s"], errors="ignore"), out / "runs.csv")
    # text from records is data: every sentence and table below is made from a copy with its text escaped
    df = safe_io.md_frame(raw, keep=RAW_COLUMNS)
    study = Study(df)  # every table below and every figure is computed once, from this
    used, contended = without_contention(study, include_contended)
    found = claims(study.runs, include_contended, study.epochs)
    notes = layout_notes(study, contended, out)  # beside the answers and the claims that compare vision runs
    lines += beside_claims(answers_lines(study, baseline, include_contended, target=target, claims=found), notes)
    lines += figure_lines(study, out, baseline)
    lines += _runs_lines(study, contended, include_contended)
    if len(study.ok_epochs):
        lines += summary_lines(study, used, contended, baseline, out)
    lines += predicted_lines(results_dir)
    lines += at_scale_lines(results_dir)
    lines += not_finished_lines(study)
    lines += claims_table_lines(found, include_contended, notes)
    details = _details_lines(study, used, contended, baseline, include_contended, target, out, results_dir, found)
    safe_io.write_text(out / DETAILS, "\n".join(details))
    safe_io.write_text(path, "\n".join(lines))
    return path
