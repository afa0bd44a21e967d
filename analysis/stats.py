"""Statistics behind every comparison (issue 29): intervals of a point's times and of ratios, and verdicts.

Method, stated once (scipy is not a dependency; `scipy.stats.bootstrap`, method percentile, is used when it is
installed, else the same percentile bootstrap in numpy):
- a point's median step time from its per-step times (`step_times_s` in a record, when the meter writes it):
  a percentile bootstrap of the median, 2000 resamples, numpy's default generator with seed 0 (fixed, so a
  report is reproducible);
- across repeats (epoch time, throughput): the mean with a Student-t interval (n - 1 degrees of freedom);
- a ratio of times A / B: on the logs, paired (mean of the per-repeat log ratios, t interval) when the
  repeats were interleaved (repeat i of A ran beside repeat i of B), else Welch's interval of the difference
  of the mean logs; back-transformed, so the interval is of the ratio of geometric means.
A verdict says `A is x % ± y % faster than B` from that interval, or `not distinguishable` when the
interval holds 1 or lies inside the noise floor (an A/A measurement: `python -m ptbench.sweep noise`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0
# two-sided 97.5 % quantiles of Student's t, df 1..30 (beyond: the normal's 1.960)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: float) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom (a table, linear in between)."""
    if not df or df < 1 or math.isnan(df):
        return math.nan
    if df >= 30:
        return 1.960 + (_T975[-1] - 1.960) * 30 / df  # ~ t's 1/df approach to the normal
    lo = int(df)
    return _T975[lo - 1] + (df - lo) * ((_T975[lo] if lo < 30 else 1.960) - _T975[lo - 1])


@dataclass(frozen=True)
class Interval:
    value: float
    lo: float
    hi: float
    n: int
    method: str

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2


def _clean(x) -> np.ndarray:
    a = np.asarray([v for v in (x if x is not None else []) if v is not None], dtype=float)
    return a[np.isfinite(a)]


def bootstrap_median(x, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """The median of `x` with a percentile-bootstrap interval (scipy's BCa bootstrap when installed)."""
    a = _clean(x)
    if len(a) == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "none")
    med = float(np.median(a))
    if len(a) < 3:
        return Interval(med, math.nan, math.nan, len(a), "too few samples")
    if a.min() == a.max():  # every sample equal: so is every resample's median
        return Interval(med, med, med, len(a), "all samples equal")
    try:
        from scipy import stats as sps

        r = sps.bootstrap((a,), np.median, confidence_level=level, n_resamples=resamples, method="percentile", rng=seed)
        low, high = float(r.confidence_interval.low), float(r.confidence_interval.high)
        return Interval(med, low, high, len(a), "scipy percentile bootstrap")
    except ImportError:
        pass
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)
    q = (1 - level) / 2
    return Interval(med, float(np.quantile(meds, q)), float(np.quantile(meds, 1 - q)), len(a), "numpy bootstrap")


def mean_interval(x) -> Interval:
    """The mean of repeats with a Student-t 95 % interval (n < 2: no interval)."""
    a = _clean(x)
    if len(a) == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "none")
    m = float(a.mean())
    if len(a) < 2:
        return Interval(m, math.nan, math.nan, 1, "one repeat")
    h = t975(len(a) - 1) * float(a.std(ddof=1)) / math.sqrt(len(a))
    return Interval(m, m - h, m + h, len(a), "t")


def ratio_interval(a, b, paired: bool | None = None) -> Interval:
    """Ratio of times mean(A) / mean(B) (geometric) with a 95 % interval, on the logs. `paired`: repeat i
    of A with repeat i of B (interleaved runs); None: paired when both have the same count >= 2."""
    la, lb = np.log(_clean(a)), np.log(_clean(b))
    if len(la) == 0 or len(lb) == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "none")
    if paired is None:
        paired = len(la) == len(lb) and len(la) >= 2
    if paired:
        d = la - lb
        m = float(d.mean())
        if len(d) < 2:
            return Interval(math.exp(m), math.nan, math.nan, 1, "one pair")
        h = t975(len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
        return Interval(math.exp(m), math.exp(m - h), math.exp(m + h), len(d), "paired t on logs")
    m = float(la.mean() - lb.mean())
    if len(la) < 2 or len(lb) < 2:
        return Interval(math.exp(m), math.nan, math.nan, min(len(la), len(lb)), "one repeat")
    va, vb = la.var(ddof=1) / len(la), lb.var(ddof=1) / len(lb)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va**2 / (len(la) - 1) if va else 0) + (vb**2 / (len(lb) - 1) if vb else 0) or math.inf)
    h = t975(df if math.isfinite(df) else 1000) * se if se else 0.0
    return Interval(math.exp(m), math.exp(m - h), math.exp(m + h), min(len(la), len(lb)), "Welch t on logs")


NOT_DISTINGUISHABLE = "not distinguishable"


def verdict(name_a: str, times_a, name_b: str, times_b, paired: bool | None = None, noise: float = 0.0) -> str:
    """`A is x % ± y % faster than B` (times: lower is better), or `not distinguishable` when the
    interval of the speed ratio B/A holds 1 or lies inside the noise floor (a fraction, e.g. 0.03 = ±3 %)."""
    r = ratio_interval(times_b, times_a, paired)  # > 1: A faster
    if not np.isfinite(r.lo) or not np.isfinite(r.hi):
        return f"{NOT_DISTINGUISHABLE} ({name_a} vs {name_b}: {r.n} repeat(s), no interval; repeat the points)"
    x, y = 100 * (r.value - 1), 100 * r.half_width
    detail = f"{name_a} / {name_b} speed {r.value:.3f} [{r.lo:.3f}, {r.hi:.3f}], n={r.n}"
    if r.lo <= 1 <= r.hi or (1 - noise <= r.lo and r.hi <= 1 + noise):
        floor = f"noise floor ±{100 * noise:.1f} %" if noise else "no A/A noise floor measured: ptbench.sweep noise"
        return f"{NOT_DISTINGUISHABLE} ({detail}; {floor})"
    faster, slower, x = (name_a, name_b, x) if x > 0 else (name_b, name_a, 100 * (1 / r.value - 1))
    return f"{faster} is {x:.1f} % ± {y:.1f} % faster than {slower} ({detail})"


def point_stats(runs, keys=("point",), steps_column: str = "step_times_s"):
    """One row per point of a per-run frame (columns epoch_time_steady_s / epoch_time_s, samples_per_s,
    step_time_p50_s, optional step_times_s lists): repeats, means and 95 % intervals as *_lo / *_hi."""
    import pandas as pd

    rows = []
    for key, g in runs.groupby(list(keys), dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["repeats"] = len(g)
        for col in ("epoch_time_used_s", "epoch_time_steady_s", "epoch_time_s", "samples_per_s", "step_time_p50_s"):
            if col in g:
                iv = mean_interval(g[col])
                row.update({col: iv.value, f"{col}_lo": iv.lo, f"{col}_hi": iv.hi})
        if steps_column in g:  # per-step times (a list per run): the median's bootstrap interval over all steps
            steps = [t for ts in g[steps_column] if isinstance(ts, (list, tuple)) for t in ts]
            iv = bootstrap_median(steps)
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


def noise_result(a, b, kind: str = "A/A") -> dict:
    """The A/A (or A/B) measurement of `python -m ptbench.sweep noise`: B's step times against A's,
    interleaved pairs, as a paired ratio with its interval; an A/A's noise floor is the interval's reach."""
    iv = ratio_interval(b, a, paired=True)
    pct, half = 100 * (iv.value - 1), 100 * iv.half_width
    if not (np.isfinite(iv.lo) and np.isfinite(iv.hi)) or iv.lo <= 1 <= iv.hi:
        said = NOT_DISTINGUISHABLE
    else:
        said = f"B is {abs(pct):.1f} % ± {half:.1f} % {'slower' if pct > 0 else 'faster'} than A"
    floor = max(abs(iv.lo - 1), abs(iv.hi - 1)) if kind == "A/A" and np.isfinite(iv.hi) else None
    return {"ratio": iv.value, "lo": iv.lo, "hi": iv.hi, "n": iv.n, "method": iv.method, "noise_floor": floor,
            "verdict": said}  # fmt: skip


def _main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m ptbench.analysis")
    p.add_argument("what", choices=["noise"])
    p.add_argument("file", type=Path, help="a noise JSON of `python -m ptbench.sweep noise` (a, b: step times)")
    args = p.parse_args(argv)
    rec = json.loads(args.file.read_text())
    res = noise_result(rec["a"], rec["b"], rec.get("kind", "A/A"))
    rec.update(res)
    args.file.write_text(json.dumps(rec, indent=1) + "\n")
    label = rec.get("kind", "A/A") + (f" (B: {' '.join(rec['b_overrides'])})" if rec.get("b_overrides") else "")
    floor = f"; noise floor ±{100 * res['noise_floor']:.1f} %" if res["noise_floor"] is not None else ""
    if rec.get("contended_runs"):
        floor += f" ({rec['contended_runs']} of {len(rec['a']) + len(rec['b'])} runs contended: the machine was busy)"
    print(
        f"noise {label}: B/A step time {res['ratio']:.4f} [{res['lo']:.4f}, {res['hi']:.4f}] "
        f"(95 %, {res['method']}, {res['n']} interleaved pairs): {res['verdict']}{floor}"
    )
    print(f"noise: {args.file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
