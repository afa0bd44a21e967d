"""Statistics behind every comparison: intervals of a point's times and of ratios, and verdicts (scipy.stats).

Methods, stated once:
- times and rates over a point's repeats: the geometric mean with a Student-t interval on the logs,
  back-transformed (`exp` of `scipy.stats.ttest_1samp(log x).confidence_interval()`), so never negative;
- a point's step time: the same over its runs' median step times (the steps of one run are autocorrelated,
  so they are not independent samples of the point); one run gives no interval;
- a ratio of times A / B: Welch's t on the logs, `scipy.stats.ttest_ind(log a, log b, equal_var=False)`,
  back-transformed: the ratio of geometric means with its interval; `paired=True` (ttest_rel on the logs) only
  when the caller says that repeat i of A ran beside repeat i of B (an A/A measurement);
- a verdict, decided on the interval alone with a margin stated in advance (`MARGIN`): `A is x % faster than
  B [lo %, hi %]` when the 95 % interval of the speed ratio excludes 1; `equivalent within ±δ` when its 90 %
  interval (two one-sided tests) lies inside [1/(1+δ), 1+δ]; else `not distinguishable`;
- several comparisons behind one answer: Holm's step-down adjustment of their Welch p-values (`holm`), each
  interval shown at the level its Holm threshold implies.
An A/A measurement (`python -m ptbench.sweep noise`) estimates the run-to-run spread and plans the number of
repeats (`noise_result`); it never moves a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
CLAIM_LEVEL = 0.90  # claims: a 90 % interval against the paper's range (two one-sided 5 % tests)
MARGIN = 0.05  # equivalence margin of a speed comparison, stated before any run: ±5 %
NOT_DISTINGUISHABLE = "not distinguishable"
EQUIVALENT = "equivalent"
FASTER = "faster"


@dataclass(frozen=True)
class Interval:
    value: float
    lo: float
    hi: float
    n: int
    method: str
    p: float = math.nan  # the test's two-sided p-value of ratio 1 (Welch / paired), where there is one
    level: float = LEVEL

    @property
    def finite(self) -> bool:
        return bool(np.isfinite(self.lo) and np.isfinite(self.hi))


def _clean(x) -> np.ndarray:
    a = np.asarray([v for v in (x if x is not None else []) if v is not None], dtype=float)
    return a[np.isfinite(a)]


def _flat(logs: np.ndarray) -> bool:
    """No spread beyond rounding (scipy's moments lose all precision on nearly equal data)."""
    return bool(np.ptp(logs) <= 1e-12 * max(1.0, float(np.abs(logs).max())))


def _none(value: float, n: int, method: str) -> Interval:
    return Interval(value, math.nan, math.nan, n, method)


def geo_interval(x, level: float = LEVEL) -> Interval:
    """Geometric mean of positive `x` with the back-transformed Student-t interval of the mean log (n < 2: none)."""
    a = _clean(x)
    a = a[a > 0]
    if len(a) == 0:
        return _none(math.nan, 0, "none")
    logs = np.log(a)
    g = float(np.exp(logs.mean()))
    if len(a) < 2:
        return _none(g, 1, "one run")
    if _flat(logs):  # every repeat equal: a t interval of width 0
        return Interval(g, g, g, len(a), "t on logs (all equal)", level=level)
    ci = sps.ttest_1samp(logs, 0.0).confidence_interval(level)
    return Interval(g, float(np.exp(ci.low)), float(np.exp(ci.high)), len(a), "t on logs", level=level)


def run_median_interval(step_lists, level: float = LEVEL) -> Interval:
    """A point's step time from its runs: `geo_interval` of each run's median step time (one run: no interval)."""
    meds = [float(np.median(s)) for s in step_lists if isinstance(s, (list, tuple, np.ndarray)) and len(s)]
    iv = geo_interval(meds, level)
    return Interval(iv.value, iv.lo, iv.hi, iv.n, f"{iv.method} of run medians", level=level)


def ratio_interval(a, b, paired: bool = False, level: float = LEVEL) -> Interval:
    """Ratio of geometric means A / B with its interval: Welch's t on the logs (`paired`: ttest_rel on the logs,
    repeat i of A beside repeat i of B, for an interleaved A/A or A/B measurement only)."""
    la, lb = np.log(_clean(a)), np.log(_clean(b))
    if len(la) == 0 or len(lb) == 0:
        return _none(math.nan, 0, "none")
    if paired:
        if len(la) != len(lb):
            raise ValueError(f"paired ratio: {len(la)} runs of A against {len(lb)} of B")
        d = la - lb
        if len(d) < 2:
            return _none(float(np.exp(d.mean())), len(d), "one pair")
        if _flat(d):
            r = float(np.exp(d.mean()))
            return Interval(r, r, r, len(d), "paired t on logs (all equal)", 0.0 if r != 1 else 1.0, level)
        t = sps.ttest_rel(la, lb)
        ci = t.confidence_interval(level)
        r = float(np.exp(d.mean()))
        return Interval(r, float(np.exp(ci.low)), float(np.exp(ci.high)), len(d), "paired t on logs", t.pvalue, level)
    r = float(np.exp(la.mean() - lb.mean()))
    n = min(len(la), len(lb))
    if n < 2:
        return _none(r, n, "one repeat")
    if _flat(la) and _flat(lb):  # no spread on either side: the ratio is known exactly
        return Interval(r, r, r, n, "Welch t on logs (all equal)", 0.0 if r != 1 else 1.0, level)
    t = sps.ttest_ind(la, lb, equal_var=False)
    ci = t.confidence_interval(level)
    return Interval(r, float(np.exp(ci.low)), float(np.exp(ci.high)), n, "Welch t on logs", float(t.pvalue), level)


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input's order."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p)
    adj = np.minimum(1.0, np.maximum.accumulate(p[order] * (len(p) - np.arange(len(p)))))
    out = np.empty_like(adj)
    out[order] = adj
    return out.tolist()


def _pct(r: float) -> str:
    return f"{100 * (r - 1):.1f} %"


def decide(name_a: str, times_a, name_b: str, times_b, margin: float = MARGIN, level: float = LEVEL) -> dict:
    """The verdict of A against B from their times (lower is better): kind (faster / equivalent / not
    distinguishable), who is faster, the speed interval, and its text. `level`: the interval's level, lowered
    by Holm's adjustment when the comparison is one of several (`rank`)."""
    speed = ratio_interval(times_b, times_a, level=level)  # B's time / A's: > 1 when A is faster
    out = {"kind": NOT_DISTINGUISHABLE, "faster": None, "speed": speed, "p": speed.p, "a": name_a, "b": name_b}
    if not speed.finite:
        out["text"] = f"{NOT_DISTINGUISHABLE} ({name_a} vs {name_b}: {speed.n} repeat(s), no interval; repeat points)"
        return out
    detail = f"{100 * level:.3g} %, {speed.method}, n={speed.n}"
    if speed.lo > 1 or speed.hi < 1:
        fast, slow, s = (name_a, name_b, speed) if speed.lo > 1 else (name_b, name_a, _inverse(speed))
        out.update(kind=FASTER, faster=fast, text=f"{fast} is {_pct(s.value)} faster than {slow} "
                   f"[{_pct(s.lo)}, {_pct(s.hi)}] ({detail})")  # fmt: skip
        return out
    tost = ratio_interval(times_b, times_a, level=1 - 2 * (1 - level))  # 95 % -> 90 %: two one-sided tests
    inside = 1 / (1 + margin) <= tost.lo and tost.hi <= 1 + margin
    said = f"{EQUIVALENT} within ±{100 * margin:.0f} %" if inside else NOT_DISTINGUISHABLE
    out.update(kind=EQUIVALENT if inside else NOT_DISTINGUISHABLE, text=f"{said} ({name_a} / {name_b} speed "
               f"{speed.value:.3f} [{speed.lo:.3f}, {speed.hi:.3f}], {detail}; margin ±{100 * margin:.0f} %)")  # fmt: skip
    return out


def _inverse(iv: Interval) -> Interval:
    return Interval(1 / iv.value, 1 / iv.hi, 1 / iv.lo, iv.n, iv.method, iv.p, iv.level)


def verdict(name_a: str, times_a, name_b: str, times_b, margin: float = MARGIN) -> str:
    """`A is x % faster than B [lo %, hi %]`, `equivalent within ±δ` or `not distinguishable` (see `decide`)."""
    return decide(name_a, times_a, name_b, times_b, margin)["text"]


def rank(values: dict, margin: float = MARGIN, level: float = LEVEL) -> dict:
    """Points ranked by the geometric mean of their runs' times (lower is better): {order, best, fastest,
    versus}. The best is `fastest` only when it is faster than every other point by Welch's test on logs,
    Holm-adjusted over those comparisons; `versus` holds each comparison (`decide`) at its Holm level."""
    values = {k: _clean(v) for k, v in values.items() if len(_clean(v))}
    order = sorted(values, key=lambda k: (geo_interval(values[k]).value, k))
    if len(order) < 2:
        return {"order": order, "best": order[0] if order else None, "fastest": False, "versus": []}
    best, others = order[0], order[1:]
    raw = [ratio_interval(values[o], values[best]).p for o in others]
    known = [p if np.isfinite(p) else 1.0 for p in raw]
    m = len(others)
    thresholds = {o: (1 - level) / (m - i) for i, o in enumerate(sorted(others, key=lambda o: known[others.index(o)]))}
    adj = holm(known)
    versus = []
    for o, p in zip(others, adj):
        d = decide(best, values[best], o, values[o], margin, level=1 - thresholds[o])
        if d["kind"] == FASTER and p >= 1 - level:  # Holm stopped at an earlier comparison
            d.update(kind=NOT_DISTINGUISHABLE, faster=None, text=f"{NOT_DISTINGUISHABLE} (Holm: {d['text']})")
        versus.append({**d, "p_holm": p})
    return {"order": order, "best": best, "fastest": all(v["kind"] == FASTER for v in versus), "versus": versus}


def point_stats(runs, keys=("point",), steps_column: str = "step_times_s"):
    """One row per point of a per-run frame: repeats, and for epoch times, rates and the median step time the
    geometric mean with its 95 % interval (*_lo / *_hi; `geo_interval`, step time: `run_median_interval`)."""
    import pandas as pd

    rows = []
    for key, g in runs.groupby(list(keys), dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["repeats"] = len(g)
        for col in ("epoch_time_used_s", "epoch_time_steady_s", "epoch_time_s", "samples_per_s", "step_time_p50_s"):
            if col in g:
                iv = geo_interval(pd.to_numeric(g[col], errors="coerce"))
                row.update({col: iv.value, f"{col}_lo": iv.lo, f"{col}_hi": iv.hi})
        if steps_column in g:
            iv = run_median_interval(list(g[steps_column]))
            row.update(step_time_median_s=iv.value, step_time_median_lo=iv.lo, step_time_median_hi=iv.hi)
        rows.append(row)
    return pd.DataFrame(rows)


# The noise file of `python -m ptbench.sweep noise` (<results>/<experiment>/noise/noise-*.json), not a run record
NOISE_FIELDS = {
    "kind": "A/A (the same point twice) or A/B (B: the point with b_overrides)",
    "overrides": "the point's overrides (arm A)",
    "b_overrides": "what arm B adds",
    "metric": "what a and b hold: each run's median step time (events step_time_p50_s, median over epochs)",
    "a": "arm A's runs, in the interleaved order (s)",
    "b": "arm B's runs, repeat i of B ran right after repeat i of A (s)",
    "contended_runs": "runs whose record warns of contention (other work on the machine during the run)",
}
POWER = 0.80


def repeats_for(spread: float, margin: float = MARGIN, power: float = POWER, level: float = LEVEL) -> int:
    """Runs per point for Welch's test on logs to find a `margin` difference with `power`, when one run's log
    time has standard deviation `spread` (normal approximation, n = 2 (z_a + z_b)^2 s^2 / log(1 + margin)^2)."""
    z = sps.norm.ppf(1 - (1 - level) / 2) + sps.norm.ppf(power)
    return max(2, math.ceil(2 * (z * spread / math.log1p(margin)) ** 2))


def noise_result(a, b, kind: str = "A/A") -> dict:
    """The A/A (or A/B) measurement of `python -m ptbench.sweep noise`: B's step times against A's, interleaved
    pairs, as a paired ratio with its interval; `spread`: one run's standard deviation of log time (the pairs'
    log ratios' sd / sqrt 2, which does not shrink with more pairs), and the repeats it plans for ±MARGIN."""
    iv = ratio_interval(b, a, paired=True)
    pct = 100 * (iv.value - 1)
    if not iv.finite or iv.lo <= 1 <= iv.hi:
        said = NOT_DISTINGUISHABLE
    else:
        s = iv if pct > 0 else _inverse(iv)
        said = f"B is {_pct(s.value)} {'slower' if pct > 0 else 'faster'} than A [{_pct(s.lo)}, {_pct(s.hi)}]"
    d = np.log(_clean(b)) - np.log(_clean(a))
    spread = float(d.std(ddof=1) / math.sqrt(2)) if len(d) >= 2 else None
    plan = repeats_for(spread) if spread else None
    return {"ratio": iv.value, "lo": iv.lo, "hi": iv.hi, "n": iv.n, "method": iv.method, "verdict": said,
            "spread": spread if kind == "A/A" else None, "repeats_for_margin": plan if kind == "A/A" else None,
            "margin": MARGIN}  # fmt: skip


NOISE_FIX = "copy the noise file into a folder of yours and name the copy"


def _main(argv=None) -> int:
    import argparse
    import json
    import sys
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m ptbench.analysis")
    p.add_argument("what", choices=["noise"])
    p.add_argument("file", type=Path, help="a noise JSON of `python -m ptbench.sweep noise` (a, b: step times)")
    args = p.parse_args(argv)
    from ptbench.analysis import records_io, safe_io
    from ptbench.analysis.load import AnalysisError

    try:
        rec = records_io.read_json(args.file)
        if not isinstance(rec, dict) or not isinstance(rec.get("a"), list) or not isinstance(rec.get("b"), list):
            raise ValueError("not a noise measurement (a JSON object with lists `a` and `b`)")
        res = noise_result(rec["a"], rec["b"], rec.get("kind", "A/A"))
        rec.update(res)
        # written back as the report writes: into a folder checked as ours, replacing (never following) a link
        safe_io.write_text(args.file, json.dumps(rec, indent=1) + "\n", fix=NOISE_FIX)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {args.file}: {e}; name the noise file `python -m ptbench.sweep noise` wrote", file=sys.stderr)
        return 2
    label = rec.get("kind", "A/A") + (f" (B: {' '.join(rec['b_overrides'])})" if rec.get("b_overrides") else "")
    spread = ""
    if res["spread"] is not None:
        spread = (f"; run-to-run spread {100 * res['spread']:.1f} % (sd of log time): {res['repeats_for_margin']} "
                  f"runs per point find a {100 * MARGIN:.0f} % difference {100 * POWER:.0f} % of the time")  # fmt: skip
    if rec.get("contended_runs"):
        spread += f" ({rec['contended_runs']} of {len(rec['a']) + len(rec['b'])} runs contended: the machine was busy)"
    print(
        f"noise {label}: B/A step time {res['ratio']:.4f} [{res['lo']:.4f}, {res['hi']:.4f}] "
        f"(95 %, {res['method']}, {res['n']} interleaved pairs): {res['verdict']}{spread}"
    )
    print(f"noise: {args.file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
