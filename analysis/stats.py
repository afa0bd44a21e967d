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
- several comparisons behind one answer: Holm's step-down adjustment of their Welch p-values (`holm`) over
  every pair of points that has an interval (a one-run point has none and stays out of the family), each
  interval shown at the level its Holm threshold implies; "fastest" is an intersection-union test: the best
  point is faster than every other one in that family;
- runs whose times agree exactly carry no spread to test against (a coarse timer, a cached result): no
  interval for times; `exact=True` (deterministic bytes) takes the ratio as known;
- repeats: the runs per point that find a `margin` difference with 80 % power, from the noncentral t
  (`scipy.stats.nct`, df 2(n - 1)) at the level of Holm's first step over the family (`repeats_for`).
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


def ratio_interval(a, b, paired: bool = False, level: float = LEVEL, exact: bool = False) -> Interval:
    """Ratio of geometric means A / B with its interval: Welch's t on the logs (`paired`: ttest_rel on the logs,
    repeat i of A beside repeat i of B, for an interleaved A/A or A/B measurement only). Runs that agree exactly
    on both sides give no interval (a timer's resolution is not a spread of zero) unless `exact` (deterministic
    values such as allocated bytes: the ratio is known)."""
    la, lb = np.log(_clean(a)), np.log(_clean(b))
    if len(la) == 0 or len(lb) == 0:
        return _none(math.nan, 0, "none")
    if paired:
        if len(la) != len(lb):
            raise ValueError(f"paired ratio: {len(la)} runs of A against {len(lb)} of B")
        d = la - lb
        if len(d) < 2:
            return _none(float(np.exp(d.mean())), len(d), "one pair")
        if _flat(d):  # the runs vary, their ratio does not: the ratio is known
            return _agreeing(float(np.exp(d.mean())), len(d), "paired t on logs", level, exact or not _flat(la))
        t = sps.ttest_rel(la, lb)
        ci = t.confidence_interval(level)
        r = float(np.exp(d.mean()))
        return Interval(r, float(np.exp(ci.low)), float(np.exp(ci.high)), len(d), "paired t on logs", t.pvalue, level)
    r = float(np.exp(la.mean() - lb.mean()))
    n = min(len(la), len(lb))
    if n < 2:
        return _none(r, n, "one repeat")
    if _flat(la) and _flat(lb):  # no spread on either side
        return _agreeing(r, n, "Welch t on logs", level, exact)
    t = sps.ttest_ind(la, lb, equal_var=False)
    ci = t.confidence_interval(level)
    return Interval(r, float(np.exp(ci.low)), float(np.exp(ci.high)), n, "Welch t on logs", float(t.pvalue), level)


def _agreeing(r: float, n: int, method: str, level: float, exact: bool) -> Interval:
    """Runs that agree exactly: a known ratio for deterministic values, no interval for times."""
    if exact:
        return Interval(r, r, r, n, f"{method} (all equal, exact)", 0.0 if r != 1 else 1.0, level)
    return Interval(r, math.nan, math.nan, n, f"{method}: runs agree exactly, no spread to test (timer resolution?)")


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
        why = "" if speed.method in ("one repeat", "none") else f" ({speed.method})"
        out["text"] = (
            f"{NOT_DISTINGUISHABLE} ({name_a} vs {name_b}: {speed.n} repeat(s), no interval{why}; repeat points)"
        )
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


def pair_family(values: dict) -> dict:
    """{(a, b): Welch p} for every pair of points that has an interval: the Holm family of printed statements
    (a one-run point, or two points whose runs agree exactly, have none and stay out)."""
    names = sorted(values)
    fam = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            p = ratio_interval(values[a], values[b]).p
            if np.isfinite(p):
                fam[(a, b)] = p
    return fam


def holm_levels(family: dict, level: float = LEVEL) -> tuple[dict, dict]:
    """({pair: Holm-adjusted p}, {pair: the interval level its step of Holm's procedure implies})."""
    keys = sorted(family, key=lambda k: family[k])
    m = len(keys)
    adj = dict(zip(family, holm(list(family.values())))) if m else {}
    return adj, {k: 1 - (1 - level) / (m - i) for i, k in enumerate(keys)}


def rank(values: dict, margin: float = MARGIN, level: float = LEVEL) -> dict:
    """Points ranked by the geometric mean of their runs' times (lower is better): {order, best, fastest,
    versus, family, spread, plan}. Each printed comparison of the best with another point is Holm-adjusted over
    every pair that has an interval (`pair_family`), at its Holm level; `fastest` (an intersection-union test)
    only when the best is faster than every other point. `spread`: the pooled run-to-run sd of log time;
    `plan`: the runs per point that would resolve ±`margin` at that spread over the full family."""
    values = {k: _clean(v) for k, v in values.items() if len(_clean(v))}
    order = sorted(values, key=lambda k: (geo_interval(values[k]).value, k))
    spread = pooled_spread(values)
    k = len(order)
    plan = repeats_for(spread, margin, comparisons=max(1, k * (k - 1) // 2)) if spread else None
    out = {"order": order, "best": order[0] if order else None, "fastest": False, "versus": [], "family": 0,
           "spread": spread, "plan": plan, "level": level}  # fmt: skip
    if k < 2:
        return out
    best = order[0]
    family = pair_family(values)
    adj, levels = holm_levels(family, level)
    versus = []
    for o in order[1:]:
        key = tuple(sorted((best, o)))
        d = decide(best, values[best], o, values[o], margin, level=levels.get(key, level))
        p = adj.get(key, math.nan)
        if d["kind"] == FASTER and not p < 1 - level:  # Holm stopped at an earlier comparison
            d.update(kind=NOT_DISTINGUISHABLE, faster=None, text=f"{NOT_DISTINGUISHABLE} (Holm: {d['text']})")
        versus.append({**d, "p_holm": p})
    fastest = all(v["kind"] == FASTER and v["faster"] == best for v in versus)
    return {**out, "fastest": fastest, "versus": versus, "family": len(family)}


def pooled_spread(values: dict) -> float:
    """One run's sd of log time pooled over the points with two or more runs (0 when none has)."""
    ss, df = 0.0, 0
    for v in values.values():
        logs = np.log(_clean(v)[_clean(v) > 0])
        if len(logs) >= 2:
            ss += float(((logs - logs.mean()) ** 2).sum())
            df += len(logs) - 1
    return math.sqrt(ss / df) if df else 0.0


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


def power_of(n: int, spread: float, margin: float = MARGIN, level: float = LEVEL, comparisons: int = 1) -> float:
    """The chance that n runs per point find a `margin` difference (two-sided t on logs, df 2(n - 1), at level
    1 - (1 - level) / comparisons, Holm's first step) when one run's log time has sd `spread`: the noncentral t."""
    if n < 2 or spread <= 0:
        return 1.0 if spread <= 0 and n >= 2 else 0.0
    df, alpha = 2 * (n - 1), (1 - level) / max(1, comparisons)
    ncp = math.log1p(margin) / (spread * math.sqrt(2 / n))
    t = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(t, df, ncp) + sps.nct.cdf(-t, df, ncp))


def repeats_for(
    spread: float, margin: float = MARGIN, power: float = POWER, level: float = LEVEL, comparisons: int = 1
) -> int:
    """The fewest runs per point (at least 2) whose `power_of` reaches `power` (2 % spread: 4, 3 %: 8)."""
    n = 2
    while power_of(n, spread, margin, level, comparisons) < power and n < 1000:
        n += 1
    return n


def resolve_text(spread: float, comparisons: int = 1, margin: float = MARGIN) -> str:
    """ "N runs per point would resolve ±5 % ..." at a pooled spread, or why no plan can be given."""
    if not spread:
        return "no point has two runs, so no spread to plan repeats from (repeat points)"
    n = repeats_for(spread, margin, comparisons=comparisons)
    return (f"{n} runs per point would resolve ±{100 * margin:.0f} % at the pooled spread {100 * spread:.1f} % "
            f"(noncentral t, 80 % power, Holm over {comparisons} comparison{'s' if comparisons > 1 else ''})")  # fmt: skip


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


# --- the error rates and power of these rules, simulated --------------------------------------------------
def _study(rng, k: int, n: int, spread: float, faster: float = 0.0) -> dict:
    """One simulated ranking: k points of n log-normal runs, point 0 `faster` (0.05: 5 % less time)."""
    shift = [-math.log1p(faster) if i == 0 else 0.0 for i in range(k)]
    return rank({f"p{i}": np.exp(rng.normal(shift[i], spread, n)).tolist() for i in range(k)})


def error_table(trials: int = 1000, seed: int = 0) -> list[dict]:
    """Simulated: among k tied points, the share of studies printing any "faster" statement and calling one
    point "fastest" (both should stay at or under 5 %); and the power to find a point 5 % faster than one
    other at the repeats `repeats_for` plans (and one fewer), at 2 % and 3 % spread."""
    rng, rows = np.random.default_rng(seed), []
    for k in (2, 3, 5):
        for n in (2, 3, 5, 10):
            said = [_study(rng, k, n, 0.03) for _ in range(trials)]
            rows.append({"case": f"{k} tied points", "runs": n, "spread": 0.03,
                         "any faster": np.mean([any(v["kind"] == FASTER for v in r["versus"]) for r in said]),
                         "fastest": np.mean([r["fastest"] for r in said])})  # fmt: skip
    for spread in (0.02, 0.03):
        plan = repeats_for(spread)
        for n in (plan - 1, plan):
            said = [_study(rng, 2, n, spread, faster=MARGIN) for _ in range(trials)]
            rows.append({"case": "one point 5 % faster", "runs": n, "spread": spread,
                         "any faster": np.mean([r["fastest"] and r["best"] == "p0" for r in said]),
                         "fastest": power_of(n, spread)})  # fmt: skip
    return rows


def error_lines(rows: list[dict], trials: int) -> list[str]:
    out = [f"simulated, {trials} studies per row; tied rows: share with a false verdict (nominal <= 0.05); "
           "5 % rows: share that find it (simulated) and the planned power (noncentral t)",
           f"{'case':<22} {'runs':>4} {'spread':>6} {'faster/found':>12} {'fastest/planned':>15}"]  # fmt: skip
    for r in rows:
        out.append(f"{r['case']:<22} {r['runs']:>4} {100 * r['spread']:>5.0f}% {r['any faster']:>12.3f} "
                   f"{r['fastest']:>15.3f}")  # fmt: skip
    return out


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
