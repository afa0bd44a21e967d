"""The paper's findings as checks computed from the records ("How to Train Your Neural Network", Lin
et al.), for the report's "Paper claims" section.

Each check takes the finished runs (`ptbench.analysis.tables.runs` of `ok` records) of one workload and returns
a verdict: holds, does not hold, undecided, or not measured (with what is missing), the numbers it compared
and the runs it used. Per-GPU memory is each run's `mem_plot_bytes` (the busiest rank's peak: CUDA max
allocated; on CPU the peak RSS growth over the run, `peak_rss_delta`); epoch time is `time_per_sample_used_s`
(steady epochs, per training sample, so capped epochs compare).

Method: every check is a ratio of two points' runs with its 90 % interval, Welch's t on the logs
(`ptbench.analysis.stats.ratio_interval`, level CLAIM_LEVEL), read against the paper's range: an interval inside
the range holds, one wholly outside it does not hold, one straddling it is undecided; so is a point without
repeats (no interval). A check over several series or counts holds when each part holds and does not hold when
any part does not. ZeRO is compared with the DDP point of the same device count and global batch.
- ZeRO per-GPU memory is 42-66 % of DDP's;
- DDP's per-GPU memory stays flat (each count within ±10 % of its fewest count's) while ZeRO's falls (each
  step up in GPU count a ratio below 1);
- ZeRO epoch time at most 15 % above DDP's (the paper: 10-15 % slower; ZERO_TIME_RANGE);
- pipeline (gpipe, pipeline) memory per GPU falls by more than 10 % at its first step, then plateaus (the last
  step within ±10 %; needs 3 GPU counts);
- Megatron's per-GPU memory is U-shaped: some inner count lies more than SHAPE_MARGIN below both ends;
- PipeDream (adapter pipedream, weight stashing or 2BW) needs more epochs to a validation target than a flushing
  pipeline (gpipe, pipeline 1f1b/gpipe) or DDP at the same global batch and learning rate: the 90 % interval of
  the ratio of epochs to a validation target lies above 1 (holds), below 1 (does not hold), else undecided. The
  target is fixed from the comparator's runs alone before any run is ranked (its worst best value, loosened by
  1 %: `ptbench.analysis.target.default_target`), so each of them reaches it. A PipeDream run that never does
  counts at its epoch count, a lower bound: then the check holds (none reached it in as many epochs as every
  comparator run needed, or the interval lies above 1) or is undecided, never fails. PipeDream at one stage (no
  staleness) and runs with fewer than 2 validated epochs are not compared;
- PipeDream's weight stash costs memory: every stage's stash counted in the record (`state_bytes.stash`) beside
  the memory model's prediction, and its share of the stage's model states; holds where every point counts the
  stash it predicts to be non-zero, fails where one counts none;
- the fastest framework per workload and GPU count: `ptbench.analysis.stats.rank` (a measurement).
A claim whose runs were left out (contention, a failed or killed run) names them and why beside its numbers.
With records of `python -m ptbench.paper`, memory checks read its memory phase (paper-memory-*), time checks its
epoch-time phase (paper-epoch-*) and the epochs-to-target check its statistical-efficiency phase
(paper-stateff-*); other records are used as they are.
Also listed: every point that was retried with a smaller batch after running out of memory
(`extra.batch_reduced_from`, bench/runner/points.py `oom_retry`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from ptbench.analysis import records_io
from ptbench.analysis.load import load, read_yaml
from ptbench.analysis.stats import CLAIM_LEVEL, Interval, geo_interval, rank, ratio_interval
from ptbench.analysis.target import crossing, default_target

HOLDS, FAILS, UNDECIDED, NOT_MEASURED, MEASURED = "holds", "does not hold", "undecided", "not measured", "measured"
ZERO_MEMORY_SHARE = (0.42, 0.66)
ZERO_TIME_RANGE = (0.0, 1.15)  # ZeRO time / DDP's: at most 15 % slower (one-sided; faster is not against it)
FLAT = 0.10  # DDP memory "flat" and the pipeline's plateau: within ±10 %; the pipeline's first fall: > 10 %
SHAPE_MARGIN = 0.05  # U-shape: an inner point more than 5 % below both ends
PIPELINES = ("gpipe", "pipeline")
ASYNC_PIPELINES = ("pipedream",)  # no flush: weight staleness (PipeDream's weight stashing, 2BW)
SYNCHRONOUS = (*PIPELINES, "ddp")  # what the staleness claim compares against: flushing pipelines, data parallel


def _num(s) -> pd.Series:
    return pd.to_numeric(s, errors="coerce").dropna()


def _at(runs: pd.DataFrame, label: str, n: int, column: str) -> pd.Series:
    return _num(runs.loc[(runs["label"] == label) & (runs["devices"].astype(int) == n), column])


BYTES_TOLERANCE = 0.01  # deterministic allocator bytes compare exactly, within ±1 % (allocator rounding)
DETERMINISTIC = ("peak_allocated",)  # CUDA's allocated bytes repeat run to run; RSS does not


def _ratio(num: pd.Series, den: pd.Series, exact: bool = False) -> Interval:
    """The ratio's 90 % interval; `exact` (deterministic bytes whose runs agree within BYTES_TOLERANCE): the
    ratio of the values, widened by the tolerance, from one run a side as well as from many."""
    if exact and len(num) and len(den) and _agree(num) and _agree(den):
        r = float(num.mean() / den.mean())
        t = 1 + BYTES_TOLERANCE
        return Interval(r, r / t, r * t, min(len(num), len(den)), f"exact bytes ±{100 * BYTES_TOLERANCE:g} %",
                        level=CLAIM_LEVEL)  # fmt: skip
    return ratio_interval(num.tolist(), den.tolist(), level=CLAIM_LEVEL)


def _agree(v: pd.Series) -> bool:
    return bool(v.max() <= v.min() * (1 + BYTES_TOLERANCE))


def _exact(runs: pd.DataFrame) -> bool:
    """Memory compared as exact bytes: every run's plotted peak is a deterministic one (`DETERMINISTIC`)."""
    m = runs["mem_plot_metric"] if "mem_plot_metric" in runs else pd.Series(dtype=object)
    return bool(len(m)) and bool(m.isin(DETERMINISTIC).all())


def _against(iv: Interval, lo: float, hi: float) -> str:
    """holds: the interval inside [lo, hi]; does not hold: wholly outside; else (or no interval) undecided."""
    if not iv.finite:
        return UNDECIDED
    if lo <= iv.lo and iv.hi <= hi:
        return HOLDS
    return FAILS if iv.hi < lo or iv.lo > hi else UNDECIDED


def _all(verdicts) -> str:
    verdicts = list(verdicts)
    return FAILS if FAILS in verdicts else HOLDS if verdicts and all(v == HOLDS for v in verdicts) else UNDECIDED


def _ci(iv: Interval, pct: bool = False) -> str:
    if not iv.finite:
        return f" (n={iv.n}: no interval without repeats)"
    f = (lambda v: f"{100 * v:.0f}") if pct else (lambda v: f"{v:.2f}")
    how = f"{iv.method}, " if iv.method.startswith("exact") else f"{100 * iv.level:.0f} %, "
    return f" [{f(iv.lo)}, {f(iv.hi)}] ({how}n={iv.n})"


def _series(runs: pd.DataFrame, column: str) -> dict[str, pd.Series]:
    """label -> column's geometric mean per device count (sorted), over runs with a value."""
    have = runs[pd.to_numeric(runs[column], errors="coerce").notna()]
    return {
        label: pd.to_numeric(sub[column]).groupby(sub["devices"].astype(int)).agg(lambda v: geo_interval(v).value)
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


def _matched(zero: pd.DataFrame, ddp: pd.DataFrame, column: str):
    """(ZeRO label, devices, ZeRO values, DDP label, DDP values) per ZeRO point at 2 or more devices (at one,
    ZeRO shards nothing: the paper's claims are about sharding) with a DDP point of the same device count and
    global batch (the global batch is not compared where a frame has none)."""
    out = []
    gb = "global_batch" in zero and "global_batch" in ddp
    zero = zero[zero["devices"].astype(int) >= 2]
    for (label, n), z in zero.groupby(["label", zero["devices"].astype(int)]):
        d = ddp[ddp["devices"].astype(int) == n]
        if gb:
            d = d[pd.to_numeric(d["global_batch"], errors="coerce").isin(_num(z["global_batch"]))]
        for dl, dd in d.groupby("label"):
            zv, dv = _num(z[column]), _num(dd[column])
            if len(zv) and len(dv):
                out.append((label, int(n), zv, dl, dv))
    return out


def zero_memory_share(runs: pd.DataFrame) -> dict:
    name = "ZeRO per-GPU memory is 42-66 % of DDP's"
    pairs = _matched(_of(runs, ["zero"]), _of(runs, ["ddp"]), "mem_plot_bytes")
    if not pairs:
        return _claim(name, NOT_MEASURED, "needs DDP and ZeRO memory at one count of 2 or more GPUs and global batch")
    exact = _exact(_of(runs, ["ddp", "zero"]))
    found = [(z, n, dl, _ratio(zv, dv, exact)) for z, n, zv, dl, dv in pairs]
    text = "; ".join(f"{z} x{n} / {dl}: {100 * iv.value:.0f} %{_ci(iv, pct=True)}" for z, n, dl, iv in found)
    verdict = _all(_against(iv, *ZERO_MEMORY_SHARE) for *_, iv in found)
    return _claim(name, verdict, text, _of(runs, ["ddp", "zero"]))


def _steps(runs: pd.DataFrame, label: str, column: str = "mem_plot_bytes") -> list[tuple[int, int, Interval]]:
    """(from count, to count, 90 % interval of the ratio) for each step up in GPU count of one series."""
    counts = sorted(runs.loc[runs["label"] == label, "devices"].astype(int).unique())
    return [
        (a, b, _ratio(_at(runs, label, b, column), _at(runs, label, a, column), _exact(runs)))
        for a, b in zip(counts, counts[1:])
    ]


def zero_memory_falls_ddp_flat(runs: pd.DataFrame) -> dict:
    name = "ZeRO per-GPU memory falls with GPU count while DDP's stays flat"
    ddp, zero = _of(runs, ["ddp"]), _of(runs, ["zero"])
    ddps = [k for k, v in _series(ddp, "mem_plot_bytes").items() if len(v) >= 2]
    zeros = [k for k, v in _series(zero, "mem_plot_bytes").items() if len(v) >= 2]
    if not ddps or not zeros:
        return _claim(name, NOT_MEASURED, "needs DDP and a ZeRO series at 2 or more GPU counts")
    verdicts, text = [], []
    for k in ddps:
        counts = sorted(ddp.loc[ddp["label"] == k, "devices"].astype(int).unique())
        base = _at(ddp, k, counts[0], "mem_plot_bytes")
        ivs = [(n, _ratio(_at(ddp, k, n, "mem_plot_bytes"), base, _exact(ddp))) for n in counts[1:]]
        verdicts += [_against(iv, 1 - FLAT, 1 + FLAT) for _, iv in ivs]
        text.append(f"{k} against x{counts[0]}: " + ", ".join(f"x{n} {iv.value:.2f}{_ci(iv)}" for n, iv in ivs))
    for k in zeros:
        steps = _steps(zero, k)
        verdicts += [_against(iv, 0.0, 1.0) for *_, iv in steps]  # falls: the ratio's interval below 1
        text.append(f"{k}: " + ", ".join(f"x{a}->x{b} {iv.value:.2f}{_ci(iv)}" for a, b, iv in steps))
    return _claim(name, _all(verdicts), f"flat within ±{100 * FLAT:.0f} %, falls below 1: " + "; ".join(text),
                  _of(runs, ["ddp", "zero"]))  # fmt: skip


def zero_time_close_to_ddp(runs: pd.DataFrame) -> dict:
    lo, hi = ZERO_TIME_RANGE
    name = f"ZeRO epoch time within {100 * (hi - 1):.0f} % of DDP's"
    pairs = _matched(_of(runs, ["zero"]), _of(runs, ["ddp"]), "time_per_sample_used_s")
    if not pairs:
        return _claim(name, NOT_MEASURED, "needs DDP and ZeRO epoch times at one count of 2 or more GPUs and "
                      "global batch")  # fmt: skip
    found = [(z, n, dl, _ratio(zv, dv)) for z, n, zv, dl, dv in pairs]
    text = "; ".join(f"{z} x{n}: {iv.value:.2f}x {dl}{_ci(iv)}" for z, n, dl, iv in found)
    verdict = _all(_against(iv, lo, hi) for *_, iv in found)
    return _claim(
        name, verdict, f"{text} (range: at most {hi:.2f}x)", pd.concat([_of(runs, ["ddp"]), _of(runs, ["zero"])])
    )


def pipeline_memory_plateaus(runs: pd.DataFrame) -> dict:
    name = "pipeline memory per GPU falls, then plateaus"
    pipes = _of(runs, PIPELINES)
    series = [k for k, v in _series(pipes, "mem_plot_bytes").items() if len(v) >= 3]
    if not series:
        return _claim(name, NOT_MEASURED, "needs a pipeline series (gpipe, pipeline) at 3 or more GPU counts")
    verdicts, text = [], []
    for label in series:
        steps = _steps(pipes, label)
        (a0, b0, first), (a1, b1, last) = steps[0], steps[-1]
        verdicts.append(_all([_against(first, 0.0, 1 - FLAT), _against(last, 1 - FLAT, 1 + FLAT)]))
        text.append(f"{label} first x{a0}->x{b0} {first.value:.2f}{_ci(first)}, last x{a1}->x{b1} "
                    f"{last.value:.2f}{_ci(last)}")  # fmt: skip
    return _claim(name, _all(verdicts), f"falls below {1 - FLAT:.2f}, then within ±{100 * FLAT:.0f} %: "
                  + "; ".join(text), pipes)  # fmt: skip


def _u_shaped(runs: pd.DataFrame, label: str) -> tuple[str, str]:
    counts = sorted(runs.loc[runs["label"] == label, "devices"].astype(int).unique())
    ends = [_at(runs, label, counts[0], "mem_plot_bytes"), _at(runs, label, counts[-1], "mem_plot_bytes")]
    inner, text = [], []
    for n in counts[1:-1]:
        mid = _at(runs, label, n, "mem_plot_bytes")
        ivs = [_ratio(mid, e) for e in ends]
        inner.append(_all(_against(iv, 0.0, 1 - SHAPE_MARGIN) for iv in ivs))
        text.append(f"x{n} / x{counts[0]} {ivs[0].value:.2f}{_ci(ivs[0])}, / x{counts[-1]} {ivs[1].value:.2f}"
                    f"{_ci(ivs[1])}")  # fmt: skip
    verdict = HOLDS if HOLDS in inner else FAILS if all(v == FAILS for v in inner) else UNDECIDED
    return verdict, f"{label}: " + "; ".join(text)


def megatron_memory_u_shape(runs: pd.DataFrame) -> dict:
    name = "Megatron per-GPU memory is U-shaped"
    meg = _of(runs, ["megatron"])
    series = [k for k, v in _series(meg, "mem_plot_bytes").items() if len(v) >= 3]
    if not series:
        return _claim(name, NOT_MEASURED, "needs a Megatron series at 3 or more GPU counts")
    found = [_u_shaped(meg, k) for k in series]
    head = f"an inner count below both ends by more than {100 * SHAPE_MARGIN:.0f} %: "
    return _claim(name, _all(v for v, _ in found), head + "; ".join(t for _, t in found), meg)


def _epochs_of(runs: pd.DataFrame, epochs: pd.DataFrame | None) -> pd.DataFrame:
    """Per-epoch rows (validation metric, epoch) of `runs`: from `epochs` when given, else read from their folders."""
    if epochs is None:
        dirs = [d for d in runs["run_dir"].dropna().astype(str) if Path(d).is_dir()] if "run_dir" in runs else []
        epochs = load(*dirs) if dirs else pd.DataFrame()
    if epochs.empty or "val_metric" not in epochs:
        return pd.DataFrame()
    e = epochs[epochs["run_id"].astype(str).isin(runs["run_id"].astype(str)) & epochs["val_metric"].notna()]
    e = e.assign(run_id=e["run_id"].astype(str))
    # a curve needs two validated epochs: one epoch's best is its only value, and a common target from it says
    # nothing about how fast the curves fall
    return e[e.groupby("run_id")["epoch"].transform("nunique") >= 2]


def _epochs_to(e: pd.DataFrame, ids, target: float, lower: bool) -> tuple[list[float], list[float]]:
    """(the fractional epochs each run that reached `target` needed, the epoch counts of those that never did)."""
    reached, missed = [], []
    for rid in ids:
        run = e[e["run_id"] == rid]
        ep = crossing(run, target, lower)[1]
        (reached if np.isfinite(ep) else missed).append(ep if np.isfinite(ep) else float(run["epoch"].max()) + 1)
    return reached, missed


def _same_setup(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """The runs of `b` at a global batch (and learning rate, where both record one) that `a` ran at."""
    for col in ("global_batch", "lr"):
        if col in a and col in b and _num(a[col]).size and _num(b[col]).size:
            b = b[pd.to_numeric(b[col], errors="coerce").isin(_num(a[col]))]
    return b


def _stale_verdict(ea: list[float], missed: list[float], ec: list[float]) -> tuple[str, Interval]:
    """PipeDream's epochs (`ea` reached, `missed`: the epoch counts of runs that never reached, lower bounds) over
    the comparator's (`ec`, every run reached): above 1 holds, below 1 does not hold; lower bounds can only hold."""
    iv = _ratio(pd.Series(ea + missed, dtype=float), pd.Series(ec, dtype=float))
    if missed and not ea:  # no PipeDream run got there in as many epochs as every comparator run needed
        return (HOLDS if min(missed) >= max(ec) else UNDECIDED), iv
    if not iv.finite:
        return UNDECIDED, iv
    if iv.lo > 1:
        return HOLDS, iv
    return (FAILS if iv.hi < 1 and not missed else UNDECIDED), iv


def _stale_pair(e: pd.DataFrame, a: pd.DataFrame, c: pd.DataFrame) -> tuple[str, str]:
    """(verdict, text) of one PipeDream point `a` against one synchronous point `c`, the target fixed from `c`'s
    runs alone (`ptbench.analysis.target.default_target`: every one of them reaches it)."""
    metric = e["val_metric_name"].iloc[0]
    (a_label, a_n), (c_label, c_n) = ((f["label"].iloc[0], int(f["devices"].iloc[0])) for f in (a, c))
    target, lower = default_target(e, metric, c_label, c_n), metric == "val_perplexity"
    ea, missed = _epochs_to(e, a["run_id"].astype(str).tolist(), target, lower)
    ec, _ = _epochs_to(e, c["run_id"].astype(str).tolist(), target, lower)
    verdict, iv = _stale_verdict(ea, missed, ec)
    gb = _num(a["global_batch"]) if "global_batch" in a else pd.Series(dtype=float)
    text = f"{a_label} x{a_n} / {c_label} x{c_n}" + (f" (global batch {gb.iloc[0]:.0f})" if len(gb) else "")
    text += f", to {metric} {target:.4g}: "
    pd_said = f"{geo_interval(ea).value:.2f}" if ea else "none"
    if missed:
        pd_said += f", {len(missed)} of {len(ea) + len(missed)} never in {max(missed):.0f} epochs"
    bound = ">= " if missed else ""  # runs that never reached it count at their epochs: a lower bound
    return verdict, text + f"{bound}{iv.value:.2f}x the epochs{_ci(iv)} ({pd_said} vs {geo_interval(ec).value:.2f})"


def pipedream_needs_more_epochs(runs: pd.DataFrame, epochs: pd.DataFrame | None = None) -> dict:
    name = "PipeDream needs more epochs to a validation target than a flushing pipeline or DDP at the same global batch"
    stale, sync = _of(runs, ASYNC_PIPELINES), _of(runs, SYNCHRONOUS)
    stale = stale[pd.to_numeric(stale["devices"], errors="coerce") >= 2]  # one stage: no pipeline, no staleness
    e = _epochs_of(pd.concat([stale, sync]), epochs) if len(stale) and len(sync) else pd.DataFrame()
    pairs = []
    for _, a in stale.groupby(["label", stale["devices"].astype(int)]) if len(e) else []:
        a = a[a["run_id"].astype(str).isin(e["run_id"])]
        matched = _same_setup(a, sync)
        matched = matched[matched["run_id"].astype(str).isin(e["run_id"])]
        pairs += [(a, c) for _, c in matched.groupby(["label", matched["devices"].astype(int)]) if len(a)]
    if not pairs:
        return _claim(name, NOT_MEASURED, "needs PipeDream at 2 or more stages and a flushing pipeline or DDP with "
                      "validation curves of 2 or more epochs at one global batch and learning rate")  # fmt: skip
    found = [_stale_pair(e, a, c) for a, c in pairs]
    used = pd.concat([pd.concat([a, c]) for a, c in pairs]).drop_duplicates("run_id")
    return _claim(name, _all(v for v, _ in found), "; ".join(t for _, t in found), used)


def _summary(run_dir) -> dict:
    path = Path(str(run_dir)) / "summary.json"
    try:
        s = records_io.read_json(path) if path.is_file() else {}
    except (OSError, ValueError):
        return {}  # load() said why
    return s if isinstance(s, dict) else {}


def _stash_record(s: dict) -> tuple[tuple, tuple, int, int] | None:
    """(counted per stage, predicted per stage, the stage with the most, that stage's model states) of one record;
    None when it states no stash."""
    ranks = s.get("state_bytes_per_rank") or []
    if not any("stash" in r for r in ranks):
        return None
    counted = tuple(r.get("stash") or 0 for r in ranks)
    predicted = tuple(
        (s.get("predicted_memory") or {}).get("stash_per_stage") or [r.get("stash_predicted") for r in ranks]
    )
    states = [(r.get("params") or 0) + (r.get("grads") or 0) + (r.get("optimizer") or 0) for r in ranks]
    top = max(range(len(counted)), key=lambda i: counted[i])
    return counted, predicted, top, states[top]


def _stash_point(label: str, n: int, summaries: list[dict]) -> list[tuple[str | None, str]]:
    """(verdict, text) per distinct stash of one PipeDream point's records (settings outside the label, such as
    adapter.flush_every, can differ): does not hold where a stage counts none of a stash predicted, holds where
    some is counted, None (no verdict) where none is predicted (one stage; a drain after every mini-batch)."""
    out = []
    for counted, predicted, top, states in dict.fromkeys(r for r in map(_stash_record, summaries) if r):
        if any(p and not c for c, p in zip(counted, predicted)):
            verdict = FAILS
        else:
            verdict = HOLDS if any(counted) else None if not any(p or 0 for p in predicted) else UNDECIDED
        same = "= predicted" if counted == predicted else f"(predicted {', '.join(_mib(p or 0) for p in predicted)})"
        text = f"{label} x{n}: stash per stage {', '.join(_mib(c) for c in counted)} counted {same}"
        share = f"{100 * counted[top] / states:.0f} %" if states else "?"
        if any(counted):
            text += f"; stage {top}'s is {share} of its model states ({_mib(states)})"
        else:
            text += ", none counted" if any(p or 0 for p in predicted) else ", none predicted"
        out.append((verdict, text))
    return out


def pipedream_stash_costs_memory(runs: pd.DataFrame) -> dict:
    name = "PipeDream's weight stash costs memory (stashed parameter versions per stage)"
    stale = _of(runs, ASYNC_PIPELINES)
    found = []
    for (label, n), sub in stale.groupby(["label", stale["devices"].astype(int)]) if len(stale) else []:
        found += _stash_point(label, n, [_summary(d) for d in sub.get("run_dir", pd.Series(dtype=object))])
    if not any(v for v, _ in found):
        why = "needs PipeDream records with a stash predicted and counted (state_bytes.stash, 2 or more stages)"
        return _claim(name, NOT_MEASURED, "; ".join([why, *(t for _, t in found)]))
    return _claim(name, _all(v for v, _ in found if v), "; ".join(t for _, t in found), stale)


def fastest(runs: pd.DataFrame) -> list[dict]:
    """Per GPU count: the series with the lowest geometric-mean time per training sample, called fastest only
    when it beats every other series there (`ptbench.analysis.stats.rank`: Welch on logs, Holm-adjusted)."""
    out = []
    have = runs[pd.to_numeric(runs["time_per_sample_used_s"], errors="coerce").notna()]
    for n, sub in have.groupby(have["devices"].astype(int)):
        values = {k: _num(g["time_per_sample_used_s"]).tolist() for k, g in sub.groupby("label")}
        if len(values) < 2:
            out.append(
                _claim(f"fastest framework at x{n}", NOT_MEASURED, f"only {next(iter(values))} ran at x{n}", sub)
            )
            continue
        r = rank(values)
        best = r["best"]
        head = f"**{best}** {1e3 * geo_interval(values[best]).value:.3g} ms/sample (geometric mean)"
        head += "" if r["fastest"] else ", not faster than every other series"
        said = "; ".join(v["text"] for v in r["versus"])
        out.append(_claim(f"fastest framework at x{n}", MEASURED, f"{head}; {said}", sub))
    return out


MEMORY_CHECKS = (zero_memory_share, zero_memory_falls_ddp_flat, pipeline_memory_plateaus, megatron_memory_u_shape)
TIME_CHECKS = (zero_time_close_to_ddp, fastest)
# the adapters whose runs each check reads: a run of theirs left out of the verdicts is named beside it
CHECK_ADAPTERS = {
    zero_memory_share: ("ddp", "zero"),
    zero_memory_falls_ddp_flat: ("ddp", "zero"),
    zero_time_close_to_ddp: ("ddp", "zero"),
    pipeline_memory_plateaus: PIPELINES,
    megatron_memory_u_shape: ("megatron",),
    pipedream_needs_more_epochs: (*ASYNC_PIPELINES, *SYNCHRONOUS),
    pipedream_stash_costs_memory: ASYNC_PIPELINES,
}


def _phase(runs: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """The runs of one phase of `python -m ptbench.paper` (experiment paper-epoch-* / paper-memory-* /
    paper-stateff-*) when the records hold that phase; otherwise every run."""
    mine = runs[runs["experiment"].astype(str).str.startswith(prefix)] if "experiment" in runs else runs.iloc[:0]
    return mine if len(mine) else runs


def _left_out(per_run: pd.DataFrame, include_contended: bool) -> pd.DataFrame:
    """The runs the verdicts do not use, with why: their status (failed, oom, killed, ...) or contention."""
    if per_run.empty or "status" not in per_run:
        return per_run.assign(why=pd.Series(dtype=object))
    why = pd.Series(np.where(per_run["status"] != "ok", per_run["status"].astype(str), None), index=per_run.index)
    if not include_contended and "contention" in per_run:
        why = why.where(why.notna() | per_run["contention"].isna(), "contention")
    return per_run[why.notna()].assign(why=why[why.notna()])


def _left_out_text(left: pd.DataFrame) -> str:
    """'left out: ddp x1 (contention), zero x2 (2 runs: failed)'; '' when none."""
    if left.empty:
        return ""
    parts = []
    for (label, n), sub in left.groupby(["label", pd.to_numeric(left["devices"], errors="coerce").fillna(0)]):
        reasons = ", ".join(sorted(set(sub["why"])))
        parts.append(f"{label} x{int(n)} ({f'{len(sub)} runs: ' if len(sub) > 1 else ''}{reasons})")
    return "left out: " + ", ".join(parts)


def _with_left_out(claim: dict, left: pd.DataFrame) -> dict:
    said = _left_out_text(left)
    return {**claim, "numbers": f"{claim['numbers']} ({said})" if said else claim["numbers"], "left_out": said}


def _phases_of(sub: pd.DataFrame, everything: pd.DataFrame, prefix: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the used runs of a phase, the left-out runs of that phase: all of them where no record names phases)."""
    has = "experiment" in everything and everything["experiment"].astype(str).str.startswith(prefix).any()
    left = everything[everything["experiment"].astype(str).str.startswith(prefix)] if has else everything
    return _phase(sub, prefix), left


def claims(per_run: pd.DataFrame, include_contended: bool = False, epochs: pd.DataFrame | None = None) -> dict:
    """workload -> the checks over its finished runs (rows of `ptbench.analysis.tables.runs` with status ok):
    memory checks on the paper's memory phase, time checks on its epoch-time phase, the epochs-to-target check on
    its statistical-efficiency phase, where present. `epochs`: the per-epoch frame (`ptbench.analysis.load.load`)
    the epochs-to-target check reads; None: read from the runs' folders. Each check names the runs of its adapters
    that were left out (contention, failed, ...) beside its numbers (`left_out`)."""
    ok = per_run[(per_run["status"] == "ok")] if len(per_run) else per_run
    if "mem_plot_bytes" not in ok:
        ok = ok.assign(mem_plot_bytes=np.nan)
    done = ok  # records that warn of contention: out of the timing verdicts; memory is not a timing
    if not include_contended and "contention" in ok:
        done = ok[ok["contention"].isna()]
    left = _left_out(per_run, include_contended) if len(per_run) else per_run
    out = {}
    # every workload with a finished run: its memory claims stand on contended runs too, so a workload whose
    # every run is contended still has them (its time claims then have no run)
    for w in sorted(ok["workload"].unique()) if len(ok) else []:
        sub, gone = done[done["workload"] == w], left[left["workload"] == w]
        (memory, lm), (timed, lt), (trained, ls) = (
            _phases_of(sub, gone, p) for p in ("paper-memory-", "paper-epoch-", "paper-stateff-")
        )
        memory, lm = _phases_of(ok[ok["workload"] == w], gone[gone["why"] != "contention"], "paper-memory-")
        checks = [(c, memory, lm) for c in MEMORY_CHECKS[:2]] + [(zero_time_close_to_ddp, timed, lt)]
        checks += [(c, memory, lm) for c in MEMORY_CHECKS[2:]]
        found = [_with_left_out(c(used), _of(lo, CHECK_ADAPTERS[c])) for c, used, lo in checks]
        found.append(_with_left_out(pipedream_needs_more_epochs(trained, epochs), _of(ls, CHECK_ADAPTERS[
            pipedream_needs_more_epochs])))  # fmt: skip
        found.append(_with_left_out(pipedream_stash_costs_memory(memory), _of(lm, ASYNC_PIPELINES)))
        out[w] = found + _fastest_with_left_out(timed, lt)
    return out


def _fastest_with_left_out(timed: pd.DataFrame, left: pd.DataFrame) -> list[dict]:
    """`fastest` per GPU count, each naming the runs left out at that count; a count whose every run was left out
    gets a row saying so."""
    n_of = lambda f: pd.to_numeric(f["devices"], errors="coerce")  # noqa: E731
    found = [_with_left_out(c, left[n_of(left) == int(c["claim"].rsplit("x", 1)[1])]) for c in fastest(timed)]
    seen = set(n_of(timed).dropna().astype(int))
    for n in sorted(set(n_of(left).dropna().astype(int)) - seen):
        found.append(_with_left_out(_claim(f"fastest framework at x{n}", NOT_MEASURED, f"no run at x{n} is used"),
                                    left[n_of(left) == n]))  # fmt: skip
    return sorted(found, key=lambda c: int(c["claim"].rsplit("x", 1)[1]))


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
        cfg = read_yaml(path) if path.exists() else None
    except (OSError, ValueError, yaml.YAMLError):
        return np.nan  # load() said why
    extra = cfg.get("extra") if isinstance(cfg, dict) else None
    v = extra.get("batch_reduced_from") if isinstance(extra, dict) else None
    return float(v) if v is not None else np.nan


def claims_lines(
    per_run: pd.DataFrame,
    include_contended: bool = False,
    epochs: pd.DataFrame | None = None,
    found: dict | None = None,
) -> list[str]:
    """The report's "Paper claims" section (`epochs`: as `claims` takes it; `found`: `claims`' answer, when the
    caller has it already)."""
    lines = [
        "## Paper claims",
        "",
        (
            "The findings of Lin et al. checked against these records (analysis/claims.py states each test). "
            "Memory is the busiest rank's peak (`mem_plot_bytes`), time is per training sample over steady epochs; "
            "CPU ranks share one machine's memory and cores, so CPU verdicts check the harness, not the paper. "
            "Each claim is decided on the 90 % interval of a ratio (Welch's t on the logs) against the paper's "
            "range: inside it holds, wholly outside it does not hold, straddling it (or without repeats) it is "
            "undecided. Speed comparisons say `A is x % faster than B [lo, hi]` (95 %, Holm-adjusted), "
            "`equivalent` or `not distinguishable`; runs whose record warns of contention are "
            + ("kept (asked for)." if include_contended else "left out.")
        ),
        "",
    ]
    found = claims(per_run, include_contended, epochs) if found is None else found
    for workload, checked in found.items():
        table = pd.DataFrame(
            [(c["claim"], f"**{c['verdict']}**", c["numbers"], ", ".join(c["runs"]) or "-") for c in checked],
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
