"""Did it get slower? A baseline and a new set of runs, a verdict per point with its interval.

Each side is a results folder or a baseline file this module saved (`save_baseline`). A side is a list of
points; a point is its identity (the record's config.yaml, less what does not change what is measured:
`NOT_IDENTITY`, and less any key its own runs disagree on, such as the seed of `--vary-seed` repeats), its
finished runs, each with one value per metric, and its environment (env.json, the summary's hosts).

Points of the two sides match when their identities agree on every key both record, less the keys the caller
varies on purpose (`vary`). Per matched point and metric, with the statistics of `stats.py`:
- the ratio NEW / BASELINE of the geometric means of the runs' values (a run's step time: the median of its
  timed steps), with its 95 % interval (Welch's t on the logs) and the test's p-value, Holm-adjusted across
  the points of the comparison, metric by metric;
- a value that is the same on every run of each side is compared exactly (the interval is the ratio itself):
  model-state and communication bytes, which are counted, even from one run; peak memory and a validation
  metric at a fixed seed from two or more runs a side;
- the verdict: `same` when the 90 % interval lies inside [1/(1+margin), 1+margin] (two one-sided tests);
  else `regression` / `improvement` when the Holm-adjusted p is below 5 % and the interval lies on the worse /
  better side of 1; else `undecided`, with the runs per side (`stats.repeats_for`) that would find a
  margin-sized change at the observed spread. A change smaller than the margin that is surely there reads
  `same` (its size in the note): the margin says which changes matter.
Runs whose record warns of contention are left out as in the report (`include_contended` keeps them).
`python -m ptbench.compare` runs this module's `main` as its own process (drivers do not import analysis).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ptbench.analysis import records_io, safe_io
from ptbench.analysis.load import AnalysisError, find_runs, load
from ptbench.analysis.stats import LEVEL, MARGIN, holm, ratio_interval, repeats_for
from ptbench.analysis.tables import Study

FORMAT = "ptbench.compare.baseline"
VERSION = 1
# Config keys that do not change what is measured: the same as bench/runner/points.py's _NOT_PART_OF_POINT
# (analysis reads records only and cannot import the runner; tests/test_compare.py checks they agree).
NOT_IDENTITY = {
    "results": None,
    "hydra": None,
    "launcher": ("name", "master_addr", "master_port"),
    "data": ("root", "tokenizer_dir", "cache_dir"),
    "trainer": ("progress", "log_every", "resume", "checkpoint_every", "checkpoint_keep", "inject_stop"),
}
REGRESSION, IMPROVEMENT, SAME, UNDECIDED = "regression", "improvement", "same", "undecided"
VERDICTS = (REGRESSION, IMPROVEMENT, SAME, UNDECIDED)
ALPHA = 1 - LEVEL


@dataclass(frozen=True)
class Metric:
    title: str
    unit: str
    lower_is_better: bool = True
    # compared exactly when equal on every run of each side: `counted` values (bytes counted or derived from the
    # model) even from one run; measured ones (peak memory, a validation metric) from two or more runs a side
    exact_when_equal: bool = False
    counted: bool = False


METRICS = {
    "step_time": Metric("step time (median of a run's steps)", "s"),
    "epoch_time": Metric("epoch time", "s"),
    "throughput": Metric("throughput", "samples/s", lower_is_better=False),
    "peak_memory": Metric("peak memory of the busiest rank", "B", exact_when_equal=True),
    "state_bytes": Metric("model-state bytes of the busiest rank", "B", exact_when_equal=True, counted=True),
    "comm_bytes": Metric("communication bytes per step per rank", "B", exact_when_equal=True, counted=True),
    "comm_exposed": Metric("exposed communication time of a profiled step", "s"),
    "val_perplexity": Metric("validation perplexity, last epoch", "", exact_when_equal=True),
    "val_accuracy": Metric("validation accuracy, last epoch", "", lower_is_better=False, exact_when_equal=True),
}
DEFAULT_METRICS = ("step_time", "epoch_time")
# per-run frame column (tables.runs) of each metric but step_time (the median of the run's step times)
COLUMNS = {
    "epoch_time": "epoch_time_used_s",
    "throughput": "samples_per_s",
    "peak_memory": "mem_plot_bytes",
    "state_bytes": "state_bytes_max",
    "comm_bytes": "comm_bytes_per_step",
    "comm_exposed": "profile_exposed_comm_s",
    "val_perplexity": "val_perplexity",
    "val_accuracy": "val_accuracy",
}


# --- one side: points, their runs, their environment ----------------------------------------------------
def _flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items() if isinstance(d, dict) else ():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def identity_of(config: dict) -> dict:
    """A record's config.yaml, flattened, less the keys that do not change what is measured."""
    flat = _flatten(config)
    for group, keys in NOT_IDENTITY.items():
        for k in list(flat):
            head, _, tail = k.partition(".")
            if head == group and (keys is None or tail in keys):
                flat.pop(k)
    return flat


def _read(path: Path, reader) -> dict:
    try:
        doc = reader(path) if path.is_file() else {}
    except (OSError, ValueError) as e:
        records_io.skipped(path, e)
        return {}
    return doc if isinstance(doc, dict) else {}


def environment_of(run_dir: Path, env: dict) -> dict:
    """What the run's record says of its environment (its env.json `env`, the summary's hosts and rank
    variables), as flat text fields: versions, CUDA, NCCL, driver, GPUs, git commit, hosts, Slurm."""
    summary = _read(run_dir / "summary.json", records_io.read_json)
    system = env.get("system") if isinstance(env.get("system"), dict) else {}
    out = {f"version {k}": v for k, v in (env.get("versions") or {}).items() if isinstance(env.get("versions"), dict)}
    git = env.get("git_sha")
    out.update(
        {
            "python": env.get("python"),
            "ptbench": env.get("package_version"),
            "git commit": f"{git[:12]}{' (dirty)' if env.get('git_dirty') else ''}" if isinstance(git, str) else None,
            "CUDA (torch)": env.get("cuda"),
            "CUDA runtime": system.get("cuda_runtime"),
            "cuDNN": env.get("cudnn"),
            "NCCL": env.get("nccl"),
            "driver": env.get("driver") or system.get("nvidia_driver"),
            "GPUs": ", ".join(map(str, env.get("gpus") or [])) or None,
            "hosts": ", ".join(sorted(set(map(str, summary.get("hosts") or [env.get("host")])) - {"None"})) or None,
        }
    )
    slurm = env.get("slurm") if isinstance(env.get("slurm"), dict) else {}
    for k in ("SLURM_CLUSTER_NAME", "SLURM_JOB_PARTITION"):  # the partition: records since it was kept
        out[f"Slurm {k.removeprefix('SLURM_').lower()}"] = slurm.get(k)
    gpu_env = env.get("gpu_env") if isinstance(env.get("gpu_env"), dict) else {}
    at_start = ((summary.get("rank_environment") or {}).get("at_start") or {}) if isinstance(summary, dict) else {}
    for k, v in {**gpu_env, **(at_start if isinstance(at_start, dict) else {})}.items():
        out[f"env {k}"] = v
    return {k: str(v) for k, v in out.items() if v is not None}


def _run_values(row: pd.Series) -> dict:
    steps = row.get("step_times_s")
    values = {"step_time": float(np.median(steps)) if isinstance(steps, list) and steps else row.get("step_time_p50_s")}
    values.update({m: row.get(col) for m, col in COLUMNS.items()})
    out = {}
    for k, v in values.items():
        v = pd.to_numeric(v, errors="coerce")
        if v is not None and np.isfinite(v) and v > 0:
            out[k] = float(v)
    return out


def side_from_results(root: str | Path) -> list[dict]:
    """The points of a results folder: finished runs only, grouped by the point id their record carries."""
    root = Path(root)
    if not find_runs(root):
        raise AnalysisError(f"no run records under {root}: name a folder `python -m ptbench` or a sweep wrote")
    runs = Study(load(root)).ok_runs
    if runs.empty:
        raise AnalysisError(f"no finished run under {root} (status ok with an epoch): nothing to compare")
    points: dict[str, dict] = {}
    for _, row in runs.iterrows():
        run_dir = Path(row["run_dir"])
        config = _read(run_dir / "config.yaml", records_io.read_yaml)
        ident = identity_of(config)
        key = str(row.get("point") or json.dumps(ident, sort_keys=True, default=str))
        p = points.setdefault(key, {"point": key, "label": row.get("label"), "workload": row.get("workload"),
                                    "devices": _int(row.get("devices")), "ids": [], "runs": [], "env": {}})  # fmt: skip
        p["ids"].append(ident)
        env = _read(run_dir / "env.json", records_io.read_json)
        contended = row.get("contention")
        p["runs"].append({"run_id": str(row["run_id"]), "repeat": _int(row.get("repeat")),
                          "contended": contended if isinstance(contended, str) else None, "time": env.get("time"),
                          "values": _run_values(row), "env": environment_of(run_dir, env)})  # fmt: skip
    return [_settle(p) for p in points.values()]


def _int(v):
    v = pd.to_numeric(v, errors="coerce")
    return None if v is None or not np.isfinite(v) else int(v)


def _settle(p: dict) -> dict:
    """A point's identity: the keys all its runs agree on; its environment: each field's values over its runs."""
    ids = p.pop("ids")
    p["identity"] = {k: v for k, v in ids[0].items() if all(k in i and i[k] == v for i in ids[1:])}
    env: dict[str, set] = {}
    for r in p["runs"]:
        for k, v in r.pop("env").items():
            env.setdefault(k, set()).add(v)
    p["env"] = {k: " / ".join(sorted(v)) for k, v in sorted(env.items())}
    return p


# --- baseline files --------------------------------------------------------------------------------------
def baseline_doc(points: list[dict], source: str) -> dict:
    """The JSON of a baseline: identity keys common to every point once, each point's own keys, its runs'
    values (every metric the record has), its environment and the date of its newest run."""
    common = dict(points[0]["identity"])
    for p in points[1:]:
        common = {k: v for k, v in common.items() if k in p["identity"] and p["identity"][k] == v}
    out = []
    for p in points:
        own = {k: v for k, v in p["identity"].items() if k not in common}
        runs = [{k: r[k] for k in ("run_id", "repeat", "contended", "values")} for r in p["runs"]]
        dates = sorted(str(r["time"]) for r in p["runs"] if r.get("time"))
        out.append({"point": p["point"], "label": p["label"], "workload": p["workload"], "devices": p["devices"],
                    "identity": own, "date": dates[-1] if dates else None, "env": p["env"], "runs": runs})  # fmt: skip
    return {"format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": source, "identity_common": common, "points": out}  # fmt: skip


def save_baseline(results: str | Path, path: str | Path) -> tuple[Path, int, int]:
    """Writes the baseline of a results folder to `path` (as the report writes: into a folder of ours, never
    through a link); returns (path, points, bytes)."""
    doc = baseline_doc(side_from_results(results), str(results))
    text = json.dumps(doc, separators=(",", ":"), default=str) + "\n"
    safe_io.write_text(path, text, fix="name a baseline file in a folder of yours")
    return Path(path), len(doc["points"]), len(text.encode())


def side_from_baseline(path: str | Path) -> list[dict]:
    """The points of a baseline file; AnalysisError (one line) for a file of another format or version."""
    try:
        doc = records_io.read_json(path)
    except (OSError, ValueError) as e:
        raise AnalysisError(f"baseline {path} cannot be read ({e}): save it with --save-baseline") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AnalysisError(f"{path} is not a ptbench.compare baseline: name a results folder or a file "
                            "`python -m ptbench.compare --save-baseline FILE RESULTS` wrote")  # fmt: skip
    if doc.get("version") != VERSION:
        raise AnalysisError(f"baseline {path} is version {doc.get('version')!r}; this ptbench reads version {VERSION}"
                            ": save the baseline again with this version (--save-baseline FILE RESULTS)")  # fmt: skip
    try:
        common = dict(doc["identity_common"])
        return [{**p, "identity": {**common, **p["identity"]}, "env": dict(p["env"]),
                 "runs": [{**r, "values": {k: float(v) for k, v in r["values"].items()}} for r in p["runs"]]}
                for p in doc["points"]]  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise AnalysisError(f"baseline {path} is damaged ({type(e).__name__}: {e}): save it again") from None


def side(path: str | Path) -> list[dict]:
    """A results folder or a baseline file."""
    path = Path(path)
    if not path.exists():
        raise AnalysisError(f"{path} does not exist: name a results folder or a saved baseline file")
    return side_from_results(path) if path.is_dir() else side_from_baseline(path)


# --- matching ---------------------------------------------------------------------------------------------
def _varied(key: str, vary: tuple[str, ...]) -> bool:
    return any(key == v or key.startswith(f"{v}.") for v in vary)


def differing(a: dict, b: dict, vary: tuple[str, ...] = ()) -> dict:
    """Keys both identities hold with different values (less the varied ones): {key: (a's, b's)}."""
    return {k: (a[k], b[k]) for k in sorted(set(a) & set(b)) if a[k] != b[k] and not _varied(k, vary)}


def _name(p: dict) -> str:
    return f"{p.get('workload')} {p.get('label')} x{p.get('devices')}"


def names(points: list[dict]) -> list[str]:
    """A short name per point: workload, label and devices, plus the keys that tell apart points sharing it."""
    base = [_name(p) for p in points]
    out = []
    for i, p in enumerate(points):
        twins = [q for j, q in enumerate(points) if base[j] == base[i] and j != i]
        keys = sorted({k for q in twins for k in differing(p["identity"], q["identity"])})
        out.append(base[i] + "".join(f" {k}={p['identity'][k]}" for k in keys))
    return out


def match(base: list[dict], new: list[dict], vary: tuple[str, ...] = ()) -> tuple[list, list, list]:
    """(pairs (baseline point, new point), baseline points unmatched, new points unmatched); AnalysisError
    when a point matches several of the other side (keys left out by `vary` that tell them apart)."""
    pairs, used = [], set()
    for b in base:
        hits = [i for i, n in enumerate(new) if not differing(b["identity"], n["identity"], vary)]
        if len(hits) > 1:
            keys = sorted({k for i in hits for j in hits for k in differing(new[i]["identity"], new[j]["identity"])})
            raise AnalysisError(f"baseline point {_name(b)} matches {len(hits)} new points, told apart by "
                                f"{', '.join(keys) or 'keys outside the identity'}: vary fewer keys")  # fmt: skip
        if hits:
            if hits[0] in used:
                raise AnalysisError(f"new point {_name(new[hits[0]])} matches several baseline points: vary fewer keys")
            used.add(hits[0])
            pairs.append((b, new[hits[0]]))
    only_base = [b for b in base if not any(b is p[0] for p in pairs)]
    only_new = [n for i, n in enumerate(new) if i not in used]
    return pairs, only_base, only_new


def apart(base: list[dict], new: list[dict], vary: tuple[str, ...] = ()) -> str:
    """The keys that keep two sides with no point in common apart: per baseline point, those of the new
    point closest to it, with their values."""
    seen: dict[str, tuple] = {}
    for b in base:
        closest = min((differing(b["identity"], n["identity"], vary) for n in new), key=len)
        for k, v in closest.items():
            seen.setdefault(k, v)
    return "; ".join(f"{k} ({a!s} vs {b!s})" for k, (a, b) in list(seen.items())[:6]) or "none"


# --- one point, one metric: ratio, interval, verdict ------------------------------------------------------
def _flat(x: np.ndarray) -> bool:
    return len(x) > 0 and bool(np.ptp(x) <= 1e-12 * np.abs(x).max())


def judge(a, b, metric: Metric, margin: float = MARGIN) -> dict:
    """NEW (`b`) against BASELINE (`a`), before Holm: ratio b/a with its 95 % interval, raw p, whether the 90 %
    interval lies inside the margin (`same`), whether the value is compared exactly, and the spread."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    out = {"ratio": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "same": False, "exact": False,
           "n_a": len(a), "n_b": len(b), "spread": None}  # fmt: skip
    if not len(a) or not len(b):
        return out
    band = (1 / (1 + margin), 1 + margin)
    enough = metric.counted or min(len(a), len(b)) >= 2
    if metric.exact_when_equal and enough and _flat(a) and _flat(b):  # deterministic: one run is the value
        r = float(b[0] / a[0])
        same = band[0] <= r <= band[1]
        return {**out, "ratio": r, "lo": r, "hi": r, "p": 1.0 if r == 1 else 0.0, "same": same, "exact": True}
    iv = ratio_interval(b, a)
    out.update(ratio=iv.value, lo=iv.lo, hi=iv.hi, p=iv.p)
    if iv.finite:
        tost = ratio_interval(b, a, level=1 - 2 * ALPHA)  # 90 %: two one-sided 5 % tests
        out["same"] = bool(band[0] <= tost.lo and tost.hi <= band[1])
    logs = [np.log(x) for x in (a, b) if len(x) >= 2]
    if logs:  # one run's sd of log value, pooled over the sides that have two or more runs
        out["spread"] = float(np.sqrt(np.mean([x.var(ddof=1) for x in logs])))
    return out


def verdict_of(j: dict, p_holm: float, metric: Metric, margin: float) -> tuple[str, str]:
    """(verdict, note) of one judged pair given its Holm-adjusted p."""
    r = j["ratio"]
    change = f"{100 * (r - 1):+.1f} %" if np.isfinite(r) else ""
    if j["same"]:
        sure = np.isfinite(p_holm) and p_holm < ALPHA
        real = f"; {change} is real, within ±{100 * margin:g} %" if sure and r != 1 else ""
        return SAME, ("exact" if j["exact"] else "") + real
    worse = r > 1 if metric.lower_is_better else r < 1
    if np.isfinite(p_holm) and p_holm < ALPHA and (j["lo"] > 1 or j["hi"] < 1):
        return (REGRESSION if worse else IMPROVEMENT), "exact" if j["exact"] else ""
    if min(j["n_a"], j["n_b"]) < 2:
        return UNDECIDED, "one run on a side: no interval; repeat the point (>= 3 runs per side)"
    need = repeats_for(j["spread"], margin, comparisons=j.get("family", 1)) if j["spread"] else None
    held = "Holm: " if np.isfinite(j["p"]) and j["p"] < ALPHA else ""
    return UNDECIDED, held + (f"{need} runs per side would decide ±{100 * margin:g} % at this spread "
                              f"({100 * j['spread']:.1f} %)" if need else "no spread measured")  # fmt: skip


def compare(base: list[dict], new: list[dict], metrics=DEFAULT_METRICS, margin: float = MARGIN,
            vary: tuple[str, ...] = (), include_contended: bool = False) -> dict:  # fmt: skip
    """Every matched point x metric: its ratio, interval, verdict; the per-point verdicts; what was left out."""
    check_request(base, new, metrics, vary)
    pairs, only_base, only_new = match(base, new, vary)
    if not pairs:
        raise AnalysisError(
            f"no point in common: the two sides differ in {apart(base, new, vary)}; compare across such keys "
            "with --vary KEY[,KEY]"
        )
    pnames = names([b for b, _ in pairs])
    rows = [r for m in metrics for r in _judge_metric(pairs, pnames, m, margin, vary, include_contended)]
    table = pd.DataFrame(rows)
    left_out = 0 if include_contended else sum(bool(r.get("contended")) for pr in pairs for p in pr for r in p["runs"])
    return {
        "table": table,
        "points": point_verdicts(table),
        "only_base": names(only_base) if only_base else [],
        "only_new": names(only_new) if only_new else [],
        "env": env_differences(pairs),
        "contended_left_out": left_out,
        "margin": margin,
        "metrics": list(metrics),
        "include_contended": include_contended,
        "vary": list(vary),
    }


def _judge_metric(pairs, pnames, m: str, margin: float, vary, include_contended: bool) -> list[dict]:
    """One metric over the matched points: each judged, then Holm across them, then its verdict."""
    rows = []
    for name, (b, n) in zip(pnames, pairs):
        (va, out_a), (vb, out_b) = _values(b, m, include_contended), _values(n, m, include_contended)
        if not (va or vb or out_a or out_b):
            continue  # neither side's runs of this point hold the metric (another point's, say a profiled one)
        j = judge(va, vb, METRICS[m], margin)
        rows.append({"point": name, "metric": m, "baseline": _geo(va), "new": _geo(vb), **j,
                     "contended": out_a + out_b, "varied": _varied_text(b, n, vary)})  # fmt: skip
    # a row without a p-value (one run on a side) has nothing to test and would only halve the others' threshold
    tested = [r for r in rows if np.isfinite(r["p"])]
    adj = dict(zip(map(id, tested), holm([r["p"] for r in tested]) if tested else []))
    for r in rows:
        p = adj.get(id(r), math.nan)
        r["p_holm"], r["family"] = p, max(1, len(tested))
        r["verdict"], r["note"] = verdict_of(r, p, METRICS[m], margin)
        if r["contended"] and not (r["n_a"] and r["n_b"]):
            r["verdict"], r["note"] = UNDECIDED, "every run on a side contended (--include-contended keeps them)"
    return rows


def _values(p: dict, metric: str, include_contended: bool) -> tuple[list[float], int]:
    """(the values of a point's runs the comparison uses, how many contended runs were left out)."""
    have = [r for r in p["runs"] if metric in r["values"]]
    used = [r for r in have if include_contended or not r.get("contended")]
    return [r["values"][metric] for r in used], len(have) - len(used)


def _geo(x) -> float:
    return float(np.exp(np.mean(np.log(x)))) if len(x) else math.nan


def _varied_text(b: dict, n: dict, vary) -> str:
    keys = sorted(k for k in set(b["identity"]) | set(n["identity"]) if _varied(k, vary))
    return ", ".join(f"{k}: {b['identity'].get(k, '-')} -> {n['identity'].get(k, '-')}" for k in keys
                     if b["identity"].get(k) != n["identity"].get(k))  # fmt: skip


def point_verdicts(table: pd.DataFrame) -> pd.DataFrame:
    """One verdict per point over its metrics: regression if any, else undecided if any, else improvement if
    any, else same (an undecided metric is never hidden behind another's improvement)."""
    if table.empty:
        return pd.DataFrame(columns=["point", "verdict"])
    order = {REGRESSION: 0, UNDECIDED: 1, IMPROVEMENT: 2, SAME: 3}
    g = table.groupby("point", sort=False)["verdict"].agg(lambda v: min(v, key=order.get))
    return g.reset_index()


def counts(result: dict) -> dict:
    v = result["points"]["verdict"].value_counts()
    return {k: int(v.get(k, 0)) for k in VERDICTS}


def summary_line(result: dict) -> str:
    c = counts(result)
    return (f"compare: {len(result['points'])} points, {c[REGRESSION]} regressions, {c[IMPROVEMENT]} "
            f"improvements, {c[SAME]} same, {c[UNDECIDED]} undecided")  # fmt: skip


def check_request(base: list[dict], new: list[dict], metrics, vary) -> None:
    """One line for a request the records cannot answer: an unknown metric, one no record holds, a varied
    key no record holds."""
    for m in metrics:
        if m not in METRICS:
            raise AnalysisError(f"unknown metric {m!r}: choose from {', '.join(METRICS)}")
        if not any(m in r["values"] for p in (*base, *new) for r in p["runs"]):
            raise AnalysisError(f"no record on either side holds {m} ({METRICS[m].title}): choose another "
                                f"metric ({', '.join(DEFAULT_METRICS)} are in every finished run)")  # fmt: skip
    keys = {k for p in (*base, *new) for k in (*p["identity"], *p["env"])}
    for v in vary:
        if not any(k == v or k.startswith(f"{v}.") for k in keys):
            raise AnalysisError(f"--vary {v}: no record on either side holds that key (config keys read like "
                                "adapter.bucket_cap_mb)")  # fmt: skip


def env_differences(pairs) -> list[tuple[str, str, str]]:
    """(field, baseline's values, new's values) for every environment field that differs between the sides."""
    sides = [{}, {}]
    for pair in pairs:
        for side, p in zip(sides, pair):
            for k, v in p["env"].items():
                side.setdefault(k, set()).update(v.split(" / "))
    out = []
    for k in sorted(set(sides[0]) | set(sides[1])):
        a, b = (" / ".join(sorted(s.get(k, {"-"}))) for s in sides)
        if a != b:
            out.append((k, a, b))
    return out


# --- what a comparison writes: the table, compare.md, the figure ------------------------------------------
def _num(v: float, unit: str) -> str:
    if not np.isfinite(v):
        return "-"
    if unit == "B":
        return f"{v / 2**20:.2f} MiB" if v >= 2**20 else f"{v:.0f} B"
    return f"{v:.4g}{' ' + unit if unit else ''}"


def _interval(row) -> str:
    if row["exact"]:
        return "exact"
    return f"[{row['lo']:.3f}, {row['hi']:.3f}]" if np.isfinite(row["lo"]) else "none"


def display_table(result: dict) -> pd.DataFrame:
    """The table of a comparison as it is shown: per point and metric."""
    t = result["table"]
    unit = {m: METRICS[m].unit for m in METRICS}
    out = pd.DataFrame(
        {
            "point": t["point"],
            "metric": t["metric"],
            "baseline": [_num(v, unit[m]) for v, m in zip(t["baseline"], t["metric"])],
            "new": [_num(v, unit[m]) for v, m in zip(t["new"], t["metric"])],
            "new/baseline": [f"{r:.3f}" if np.isfinite(r) else "-" for r in t["ratio"]],
            "95 % interval": [_interval(r) for _, r in t.iterrows()],
            "runs": [f"{a} / {b}" for a, b in zip(t["n_a"], t["n_b"])],
            "p (Holm)": [f"{p:.3g}" if np.isfinite(p) and not e else "-" for p, e in zip(t["p_holm"], t["exact"])],
            "verdict": t["verdict"],
            "note": t["note"],
        }
    )
    if t["varied"].astype(bool).any():
        out.insert(2, "varied", t["varied"])
    return out


def header_lines(result: dict, base_name: str, new_name: str) -> list[str]:
    """What the table stands on: the rule, the environment differences, what was left out or unmatched."""
    m = 100 * result["margin"]
    lines = [
        f"baseline: {base_name}",
        f"new: {new_name}",
        f"rule: ratio new/baseline of the geometric means of per-run values (a run's step time: the median of its "
        f"steps), 95 % interval by Welch's t on the logs; same = 90 % interval inside ±{m:g} %; regression / "
        f"improvement = Holm-adjusted p < {ALPHA:g} across the {len(result['points'])} points (per metric) with the "
        "interval on that side of 1; a value equal on every run of each side is compared exactly",
    ]
    if result["vary"]:
        lines.append(f"varied on purpose: {', '.join(result['vary'])} (the `varied` column)")
    if result["env"]:
        lines.append("environment differences (baseline -> new):")
        lines += [f"  {k}: {a} -> {b}" for k, a, b in result["env"]]
    else:
        lines.append("environment differences: none in the records (env.json, summary.json)")
    if result["contended_left_out"]:
        lines.append(f"left out: {result['contended_left_out']} run(s) whose record warns of contention "
                     "(--include-contended keeps them)")  # fmt: skip
    elif result["include_contended"]:
        lines.append("contended runs kept (--include-contended): their times may not compare")
    for what, which in (("only in the baseline", "only_base"), ("only in new", "only_new")):
        if result[which]:
            lines.append(f"{what} (not compared): {'; '.join(result[which])}")
    return lines


def markdown(result: dict, base_name: str, new_name: str, figure: str | None) -> str:
    """compare.md: the summary line first (what a CI job posts), then the header, the table, the figure."""
    esc = safe_io.md_text
    lines = [f"# Compare: {esc(new_name)} against {esc(base_name)}", "", f"**{summary_line(result)}**", ""]
    for line in header_lines(result, base_name, new_name):
        lines.append(f"- {esc(line.strip())}" if not line.startswith("  ") else f"  - {esc(line.strip())}")
    shown = display_table(result)
    t = safe_io.md_frame(shown, keep=tuple(c for c in shown if c not in ("point", "varied", "note")))
    lines += ["", "| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in t.itertuples(index=False)]
    if figure:
        lines += ["", f"![each point's ratio new/baseline with its 95 % interval against the ±margin band]({figure})"]
    return "\n".join(lines) + "\n"


TICKS = (0.1, 0.25, 0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 2, 4, 10)
COLORS = {REGRESSION: "#c0392b", IMPROVEMENT: "#2e86c1", SAME: "#27ae60", UNDECIDED: "#7f8c8d"}


def _ticks(lo: float, hi: float) -> list[float]:
    """Round ratios inside [lo, hi], 1 always, none closer than a ninth of the axis to another (log scale)."""
    gap = math.log(hi / lo) / 9
    kept = [1.0]
    for x in sorted((x for x in TICKS if lo <= x <= hi), key=lambda x: abs(math.log(x))):
        if all(abs(math.log(x / k)) >= gap for k in kept):
            kept.append(x)
    return sorted(kept)


def figure(result: dict, out: str | Path, name: str = "compare"):
    """Each point's ratio with its 95 % interval, one panel per metric, against the band 1 ± margin."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from ptbench.analysis import plots

    t = result["table"]
    ms = list(dict.fromkeys(t["metric"]))
    points = list(dict.fromkeys(t["point"]))
    fig, axes = plt.subplots(1, len(ms), figsize=(4.5 * len(ms), 0.8 + 0.45 * len(points)), squeeze=False,
                             sharey=True, layout="constrained")  # fmt: skip
    lo_band, hi_band = 1 / (1 + result["margin"]), 1 + result["margin"]
    for ax, m in zip(axes[0], ms):
        ax.axvspan(lo_band, hi_band, color="#27ae60", alpha=0.12, label=f"±{100 * result['margin']:g} %")
        ax.axvline(1.0, color="black", lw=0.8)
        for _, r in t[t["metric"] == m].iterrows():
            y = points.index(r["point"])
            c = COLORS[r["verdict"]]
            if np.isfinite(r["lo"]):
                ax.errorbar(r["ratio"], y, xerr=[[r["ratio"] - r["lo"]], [r["hi"] - r["ratio"]]], fmt="o", color=c,
                            capsize=3)  # fmt: skip
            elif np.isfinite(r["ratio"]):
                ax.plot(r["ratio"], y, marker="x", color=c)
        ax.set_xscale("log")  # a ratio and its inverse lie equally far from 1
        lo, hi = ax.get_xlim()
        ax.xaxis.set_major_locator(FixedLocator(_ticks(lo, hi)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(METRICS[m].title, fontsize=9)
        ax.set_xlabel("new / baseline (log scale)")
    axes[0][0].set_yticks(range(len(points)), points, fontsize=8)
    axes[0][0].invert_yaxis()
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=v) for v, c in COLORS.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8)
    plots.save(fig, out, name)
    plt.close(fig)
    return Path(out) / f"{name}.png"


def write_outputs(result: dict, out: str | Path, base_name: str, new_name: str) -> Path:
    """compare.md, compare.csv and the figure (PNG, SVG) into `out`, as the report writes its files."""
    out = Path(out)
    fig = figure(result, out)
    safe_io.to_csv(result["table"], out / "compare.csv")
    return safe_io.write_text(out / "compare.md", markdown(result, base_name, new_name, fig.name))


# --- its error rates, simulated -----------------------------------------------------------------------------
def simulate(repeats: int, spread: float, change: float, trials: int = 2000, points: int = 1,
             margin: float = MARGIN, seed: int = 0) -> dict:  # fmt: skip
    """The share of comparisons of `points` points (log-normal run values, one run's sd of log `spread`, NEW
    slower by `change` on every point) with at least one point per verdict, judged as `compare` judges a metric
    (Holm across the points)."""
    rng = np.random.default_rng(seed)
    hits = dict.fromkeys(VERDICTS, 0)
    step = METRICS["step_time"]
    for _ in range(trials):
        a = np.exp(rng.normal(0.0, spread, (points, repeats)))
        b = np.exp(rng.normal(math.log1p(change), spread, (points, repeats)))
        judged = [judge(a[i], b[i], step, margin) for i in range(points)]
        adj = holm([j["p"] for j in judged])
        seen = {verdict_of(j, p, step, margin)[0] for j, p in zip(judged, adj)}
        for v in seen:
            hits[v] += 1
    return {v: hits[v] / trials for v in VERDICTS}


def error_rates(trials: int = 2000, seed: int = 0) -> pd.DataFrame:
    """False alarms on A/A data and the power to catch a 5 % and a 10 % slowdown, at 3 and 5 repeats and a
    2 % and 3 % run-to-run spread, for one point and for a 10-point comparison."""
    rows = []
    for points in (1, 10):
        for repeats in (3, 5):
            for spread in (0.02, 0.03):
                for change in (0.0, 0.05, 0.10):
                    r = simulate(repeats, spread, change, trials, points, seed=seed)
                    rows.append({"points": points, "repeats": repeats, "spread": spread, "slowdown": change,
                                 **{f"P({v})": r[v] for v in VERDICTS}})  # fmt: skip
    return pd.DataFrame(rows)


# --- the command: python -m ptbench.compare (which runs this module as its own process) ---------------------
USAGE = """Did it get slower? Points of BASELINE (a results folder or a saved baseline file) and NEW matched by what
they measure; per point and metric the ratio NEW/BASELINE with its 95 % interval and a verdict. Exit 0: no
regression decided; 1: one or more (--strict: or an undecided point); 2: bad input."""


def _margin(text: str) -> float:
    """`5`, `5%` or `5 %` -> 0.05."""
    try:
        pct = float(text.replace("%", "").strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage: write --margin 5 for ±5 %") from None
    if not 0 < pct < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: the margin is a percentage between 0 and 100 (e.g. 5)")
    return pct / 100


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ptbench.compare", description=USAGE)
    p.add_argument(
        "paths", nargs="*", metavar="BASELINE NEW", help="two results folders (BASELINE: or a baseline file)"
    )
    p.add_argument("--save-baseline", nargs=2, metavar=("FILE", "RESULTS"), help="write RESULTS' baseline to FILE")
    p.add_argument(
        "--vary",
        type=_keys,
        default=(),
        metavar="KEY[,KEY]",
        help="config keys that differ on purpose (adapter.bucket_cap_mb, trainer.precision): not matched on",
    )
    p.add_argument(
        "--metrics",
        type=_keys,
        default=DEFAULT_METRICS,
        metavar="M[,M]",
        help=f"of {', '.join(METRICS)} (default: {','.join(DEFAULT_METRICS)})",
    )
    p.add_argument("--margin", type=_margin, default=MARGIN, metavar="PCT", help="equivalence margin in %% (5)")
    p.add_argument("--strict", action="store_true", help="exit 1 for an undecided point too")
    p.add_argument("--include-contended", action="store_true", help="keep runs whose record warns of contention")
    p.add_argument("--out", type=Path, default=None, help="folder for compare.md and the figure (NEW/compare)")
    p.add_argument("--error-rates", action="store_true", help="print the simulated false-alarm rate and power")
    p.add_argument("--trials", type=int, default=1000, help="with --error-rates: comparisons per cell (1000)")
    return p  # fmt: skip


def _compare(args) -> int:
    if len(args.paths) != 2:
        raise AnalysisError(f"name two sides, BASELINE NEW (got {len(args.paths)}): results folders or a baseline file")
    base_path, new_path = map(Path, args.paths)
    result = compare(side(base_path), side(new_path), args.metrics, args.margin, args.vary,
                         args.include_contended)  # fmt: skip
    out = args.out or (new_path if new_path.is_dir() else new_path.parent) / "compare"
    import matplotlib

    matplotlib.use("Agg")  # files only
    md = write_outputs(result, out, str(base_path), str(new_path))
    for line in header_lines(result, str(base_path), str(new_path)):
        print(line)
    print(display_table(result).drop(columns="note").to_string(index=False))
    for _, r in result["table"].iterrows():
        if r["note"]:
            print(f"  {r['point']} {r['metric']}: {r['verdict']}: {r['note']}")
    print(f"compare: wrote {md} (and compare.csv, compare.png, compare.svg)")
    c = counts(result)
    print(summary_line(result))
    return 1 if c[REGRESSION] or (args.strict and c[UNDECIDED]) else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.error_rates:
            with pd.option_context("display.width", 200, "display.max_columns", 20):
                print(error_rates(args.trials).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
            return 0
        if args.save_baseline:
            path, n, size = save_baseline(args.save_baseline[1], args.save_baseline[0])
            print(f"baseline: {path}: {n} points, {size} bytes (format {FORMAT} version {VERSION})")
            return 0
        return _compare(args)
    except (AnalysisError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
