"""The paper's findings as checks computed from the records ("How to Train Your Neural Network", Lin
et al.), for the report's "Paper claims" section.

Each check takes the finished runs (`ptbench.analysis.tables.runs` of `ok` records) of one workload and returns
a verdict: holds, does not hold, or not measured (with what is missing), the numbers it compared and
the runs it used. Per-GPU memory is each run's `mem_plot_bytes` (the busiest rank's peak: CUDA
max allocated; on CPU the peak RSS growth over the run, `peak_rss_delta`); epoch time is
`time_per_sample_used_s` (steady epochs, per training sample, so capped epochs compare). Where a
series has several runs at one GPU count, their mean is used.

- ZeRO per-GPU memory is 42-66 % of DDP's at the same GPU count (every ZeRO series, every shared count);
- ZeRO per-GPU memory falls with GPU count while DDP's stays flat (within 10 % of its mean);
- ZeRO epoch time is within 15 % of DDP's (the paper: 10-15 % slower);
- pipeline (gpipe, pipeline) memory per GPU falls, then plateaus: the first step down > 10 %, the last
  step's change < 10 % (needs 3 GPU counts);
- Megatron's per-GPU memory is U-shaped: its lowest point lies strictly inside the measured range;
- the fastest framework per workload and GPU count (a measurement, no expected answer).
With records of `python -m ptbench.paper`, memory checks read its memory phase (paper-memory-*) and time
checks its epoch-time phase (paper-epoch-*); other records are used as they are.
Also listed: every point that was retried with a smaller batch after running out of memory
(`extra.batch_reduced_from`, bench/runner/points.py `oom_retry`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from ptbench.analysis.load import read_yaml
from ptbench.analysis.stats import ratio_interval, verdict

HOLDS, FAILS, NOT_MEASURED, MEASURED = "holds", "does not hold", "not measured", "measured"
ZERO_MEMORY_SHARE = (0.42, 0.66)
ZERO_TIME_TOLERANCE = 0.15
FLAT = 0.10  # DDP memory "flat": every count within 10 % of the series' mean; pipeline plateau: last step < 10 %
PIPELINES = ("gpipe", "pipeline")


def _versus(sub: pd.DataFrame, a: str, b: str, column: str = "time_per_sample_used_s") -> str:
    """The verdict of series `a` against `b` over their runs' `column` (issue 29): `a is x % ± y % faster
    than b` or `not distinguishable` (ptbench.analysis.stats.verdict); single runs: no interval."""
    t = {k: pd.to_numeric(sub.loc[sub["label"] == k, column], errors="coerce").dropna().tolist() for k in (a, b)}
    if min(len(t[a]), len(t[b])) < 2:
        return "not distinguishable without repeats (single runs)"
    return verdict(a, t[a], b, t[b], paired=False)


def _series(runs: pd.DataFrame, column: str) -> dict[str, pd.Series]:
    """label -> column's mean per device count (sorted), over runs with a value."""
    have = runs[pd.to_numeric(runs[column], errors="coerce").notna()]
    return {
        label: pd.to_numeric(sub[column]).groupby(sub["devices"].astype(int)).mean().sort_index()
        for label, sub in have.groupby("label")
    }


def _ids(runs: pd.DataFrame) -> list[str]:
    return sorted(runs["run_id"].astype(str))


def _mib(v: float) -> str:
    return f"{v / 2**20:.1f} MiB"


def _claim(name: str, verdict: str, numbers: str, used: pd.DataFrame | None = None) -> dict:
    return {"claim": name, "verdict": verdict, "numbers": numbers, "runs": _ids(used) if used is not None else []}


def _of(runs: pd.DataFrame, adapters) -> pd.DataFrame:
    return runs[runs["adapter"].isin(adapters)]


def zero_memory_share(runs: pd.DataFrame) -> dict:
    name = "ZeRO per-GPU memory is 42-66 % of DDP's"
    ddp, zero = _of(runs, ["ddp"]), _of(runs, ["zero"])
    d = next(iter(_series(ddp, "mem_plot_bytes").values()), None) if len(ddp) else None
    pairs = []
    for label, z in _series(zero, "mem_plot_bytes").items():
        for n in z.index.intersection(d.index) if d is not None else []:
            pairs.append((label, n, z[n] / d[n]))
    if not pairs:
        return _claim(name, NOT_MEASURED, "needs DDP and ZeRO memory at one GPU count")
    lo, hi = ZERO_MEMORY_SHARE
    ok = all(lo <= r <= hi for _, _, r in pairs)
    used = pd.concat([ddp, zero])
    return _claim(name, HOLDS if ok else FAILS, "; ".join(f"{lab} x{n}: {100 * r:.0f} %" for lab, n, r in pairs), used)


def zero_memory_falls_ddp_flat(runs: pd.DataFrame) -> dict:
    name = "ZeRO per-GPU memory falls with GPU count while DDP's stays flat"
    ddp_all = _series(_of(runs, ["ddp"]), "mem_plot_bytes")
    zeros = _series(_of(runs, ["zero"]), "mem_plot_bytes")
    d = next(iter(ddp_all.values()), pd.Series(dtype=float))
    zeros = {k: v for k, v in zeros.items() if len(v) >= 2}
    if len(d) < 2 or not zeros:
        return _claim(name, NOT_MEASURED, "needs DDP and a ZeRO series at 2 or more GPU counts")
    flat = bool((abs(d / d.mean() - 1) <= FLAT).all())
    falls = {k: bool((np.diff(v.to_numpy()) < 0).all()) for k, v in zeros.items()}
    text = [
        (
            f"DDP {', '.join(f'x{n}: {_mib(v)}' for n, v in d.items())} "
            f"({'flat: within' if flat else 'not flat: beyond'} {100 * FLAT:.0f} % of its mean)"
        )
    ]
    text += [
        f"{k} {', '.join(f'x{n}: {_mib(v)}' for n, v in zeros[k].items())} ({'falls' if f else 'does not fall'})"
        for k, f in falls.items()
    ]
    return _claim(name, HOLDS if flat and all(falls.values()) else FAILS, "; ".join(text), _of(runs, ["ddp", "zero"]))


def _ratio_ci(zero: pd.DataFrame, label: str, ddp: pd.DataFrame, n: int, column="time_per_sample_used_s") -> str:
    """ " [lo, hi]": the 95 % interval of a ZeRO series' time over DDP's at n GPUs, where both have repeats."""
    z = zero[(zero["label"] == label) & (zero["devices"].astype(int) == n)][column]
    d = ddp[ddp["devices"].astype(int) == n][column]
    iv = ratio_interval(pd.to_numeric(z, errors="coerce"), pd.to_numeric(d, errors="coerce"), paired=False)
    return f" [{iv.lo:.2f}, {iv.hi:.2f}] (95 %, {iv.n} repeats)" if np.isfinite(iv.lo) else ""


def zero_time_close_to_ddp(runs: pd.DataFrame) -> dict:
    name = f"ZeRO epoch time within {100 * ZERO_TIME_TOLERANCE:.0f} % of DDP's"
    ddp, zero = _of(runs, ["ddp"]), _of(runs, ["zero"])
    d = next(iter(_series(ddp, "time_per_sample_used_s").values()), None) if len(ddp) else None
    pairs = [
        (label, n, z[n] / d[n])
        for label, z in _series(zero, "time_per_sample_used_s").items()
        for n in (z.index.intersection(d.index) if d is not None else [])
    ]
    if not pairs:
        return _claim(name, NOT_MEASURED, "needs DDP and ZeRO epoch times at one GPU count")
    ok = all(abs(r - 1) <= ZERO_TIME_TOLERANCE for _, _, r in pairs)
    return _claim(
        name,
        HOLDS if ok else FAILS,
        "; ".join(f"{lab} x{n}: {r:.2f}x DDP{_ratio_ci(zero, lab, ddp, n)}" for lab, n, r in pairs),
        pd.concat([ddp, zero]),
    )


def pipeline_memory_plateaus(runs: pd.DataFrame) -> dict:
    name = "pipeline memory per GPU falls, then plateaus"
    series = {k: v for k, v in _series(_of(runs, PIPELINES), "mem_plot_bytes").items() if len(v) >= 3}
    if not series:
        return _claim(name, NOT_MEASURED, "needs a pipeline series (gpipe, pipeline) at 3 or more GPU counts")
    verdicts, text = [], []
    for label, v in series.items():
        steps = v.to_numpy()[1:] / v.to_numpy()[:-1] - 1  # relative change per step up in GPU count
        ok = steps[0] < -FLAT and abs(steps[-1]) < FLAT
        verdicts.append(ok)
        text.append(
            f"{label} {', '.join(f'x{n}: {_mib(m)}' for n, m in v.items())} (first step {100 * steps[0]:+.0f} %, "
            f"last {100 * steps[-1]:+.0f} %)"
        )
    return _claim(name, HOLDS if all(verdicts) else FAILS, "; ".join(text), _of(runs, PIPELINES))


def megatron_memory_u_shape(runs: pd.DataFrame) -> dict:
    name = "Megatron per-GPU memory is U-shaped"
    series = {k: v for k, v in _series(_of(runs, ["megatron"]), "mem_plot_bytes").items() if len(v) >= 3}
    if not series:
        return _claim(name, NOT_MEASURED, "needs a Megatron series at 3 or more GPU counts")
    verdicts, text = [], []
    for label, v in series.items():
        low = int(np.argmin(v.to_numpy()))
        verdicts.append(0 < low < len(v) - 1)
        text.append(f"{label} {', '.join(f'x{n}: {_mib(m)}' for n, m in v.items())} (lowest at x{v.index[low]})")
    return _claim(name, HOLDS if all(verdicts) else FAILS, "; ".join(text), _of(runs, ["megatron"]))


def fastest(runs: pd.DataFrame) -> list[dict]:
    """Per GPU count: the series with the lowest time per training sample, and the runner-up."""
    out = []
    have = runs[pd.to_numeric(runs["time_per_sample_used_s"], errors="coerce").notna()]
    for n, sub in have.groupby(have["devices"].astype(int)):
        t = pd.to_numeric(sub["time_per_sample_used_s"]).groupby(sub["label"]).mean().sort_values()
        if len(t) < 2:
            out.append(_claim(f"fastest framework at x{n}", NOT_MEASURED, f"only {t.index[0]} ran at x{n}", sub))
            continue
        out.append(
            _claim(
                f"fastest framework at x{n}",
                MEASURED,
                f"**{t.index[0]}** {1e3 * t.iloc[0]:.3g} ms/sample; next {t.index[1]} "
                f"{t.iloc[1] / t.iloc[0]:.2f}x slower; {_versus(sub, t.index[0], t.index[1])}",
                sub,
            )
        )
    return out


MEMORY_CHECKS = (zero_memory_share, zero_memory_falls_ddp_flat, pipeline_memory_plateaus, megatron_memory_u_shape)
TIME_CHECKS = (zero_time_close_to_ddp, fastest)


def _phase(runs: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """The runs of one phase of `python -m ptbench.paper` (experiment paper-epoch-* / paper-memory-*) when
    the records hold that phase; otherwise every run."""
    mine = runs[runs["experiment"].astype(str).str.startswith(prefix)] if "experiment" in runs else runs.iloc[:0]
    return mine if len(mine) else runs


def claims(per_run: pd.DataFrame, include_contended: bool = False) -> dict[str, list[dict]]:
    """workload -> the checks over its finished runs (rows of `ptbench.analysis.tables.runs` with status ok):
    memory checks on the paper's memory phase, time checks on its epoch-time phase, where present."""
    done = per_run[(per_run["status"] == "ok")] if len(per_run) else per_run
    if not include_contended and "contention" in done:  # records that warn of contention: out of the verdicts
        done = done[done["contention"].isna()]
    if "mem_plot_bytes" not in done:
        done = done.assign(mem_plot_bytes=np.nan)
    out = {}
    for w, sub in done.groupby("workload"):
        memory, timed = _phase(sub, "paper-memory-"), _phase(sub, "paper-epoch-")
        found = [check(memory) for check in MEMORY_CHECKS[:2]] + [zero_time_close_to_ddp(timed)]
        out[w] = found + [check(memory) for check in MEMORY_CHECKS[2:]] + fastest(timed)
    return out


def oom_retried(per_run: pd.DataFrame) -> pd.DataFrame:
    """Runs of points retried with a smaller per-device batch after an OOM: the `batch_reduced_from`
    column when the frame has it (`load` reads it from config.yaml), else extra.batch_reduced_from in
    each run's config.yaml."""
    if "batch_reduced_from" in per_run:
        reduced = pd.to_numeric(per_run["batch_reduced_from"], errors="coerce")
    else:
        reduced = pd.Series([_reduced_from(d) for d in per_run["run_dir"]], index=per_run.index, dtype=float)
    out = per_run[reduced.notna()].assign(batch_reduced_from=reduced[reduced.notna()])
    return out[["run_id", "workload", "label", "devices", "status", "batch_reduced_from", "batch_size"]]


def _reduced_from(run_dir) -> float:
    path = Path(str(run_dir)) / "config.yaml"
    try:
        extra = (read_yaml(path) or {}).get("extra") if path.exists() else None
    except yaml.YAMLError:
        return np.nan
    v = extra.get("batch_reduced_from") if isinstance(extra, dict) else None
    return float(v) if v is not None else np.nan


def claims_lines(per_run: pd.DataFrame, include_contended: bool = False) -> list[str]:
    """The report's "Paper claims" section."""
    lines = [
        "## Paper claims",
        "",
        (
            "The findings of Lin et al. checked against these records (analysis/claims.py states each test). "
            "Memory is the busiest rank's peak (`mem_plot_bytes`), time is per training sample over steady epochs; "
            "CPU ranks share one machine's memory and cores, so CPU verdicts check the harness, not the paper. "
            "Speed comparisons give `A is x % ± y % faster than B` (95 %) or `not distinguishable`; runs whose "
            "record warns of contention are " + ("kept (asked for)." if include_contended else "left out.")
        ),
        "",
    ]
    for workload, found in claims(per_run, include_contended).items():
        table = pd.DataFrame(
            [(c["claim"], f"**{c['verdict']}**", c["numbers"], ", ".join(c["runs"]) or "-") for c in found],
            columns=["claim", "verdict", "numbers", "runs"],
        )
        lines += [f"### {workload}", "", table.to_markdown(index=False, tablefmt="pipe", disable_numparse=True), ""]
    retried = oom_retried(per_run) if len(per_run) else pd.DataFrame()
    lines += ["### Points retried after running out of memory", ""]
    if len(retried):
        lines += [
            f"- `{r.run_id}` {r.workload} {r.label} x{r.devices}: per-device batch {int(r.batch_reduced_from)} "
            f"ran out of memory, retried with {r.batch_size} ({r.status})"
            for r in retried.itertuples()
        ]
    else:
        lines.append("_none_")
    return lines + [""]
