"""Any tree of run records -> one tidy DataFrame (one row per run x epoch).

A run folder is any folder holding `summary.json` or `config.yaml` (see bench/records.py). Runs that
produced no epoch (failed before the first epoch ended, still running, or missing: a folder with a
config but no summary) still appear, as one row with `epoch` NaN, their `status` and `error`, so a
sweep's holes stay visible instead of vanishing from the plots.

Columns: identity (run_id, run_dir, experiment, adapter, workload, kind, label), layout (world_size,
devices, stage, tp, pp, schedule, microbatches, batch_policy, global_batch, ...), outcome (status,
error, failed_rank), every scalar of the epoch event (epoch_time_s, *_time_mean_s, samples_per_s,
val_loss, ...), plus derived: `val_metric`/`val_metric_name` (accuracy for vision, perplexity for
language), `samples_per_epoch`, and the model-state bytes of the rank with the highest peak memory
(`state_params`, `state_grads`, `state_optimizer`, `state_bytes`, `mem_rank`).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

# config.yaml path -> column (the flattened config fields a comparison is usually keyed by)
CONFIG_FIELDS = {
    "workload.name": "workload",
    "workload.kind": "kind",
    "adapter.name": "adapter",
    "adapter.stage": "stage",
    "adapter.tensor_parallel": "tp",
    "adapter.pipeline_parallel": "pp",
    "adapter.sequence_parallel": "sequence_parallel",
    "adapter.schedule": "schedule",
    "adapter.microbatches": "microbatches",
    "adapter.offload_optimizer": "offload_optimizer",
    "adapter.offload_params": "offload_params",
    "adapter.batch_policy": "batch_policy",
    "launcher.name": "launcher",
    "launcher.nprocs": "nprocs",
    "trainer.batch_size": "batch_size",
    "trainer.grad_accum": "grad_accum",
    "trainer.precision": "precision",
    "trainer.epochs": "epochs_planned",
    "trainer.max_steps": "max_steps",
    "optimizer.name": "optimizer",
    "optimizer.lr": "lr",
    "data.source": "data_source",
    "results.experiment": "experiment",
    "results.point": "point",  # sweep point id (bench/sweep.py)
}
# settings that make two runs of one adapter different series when they differ (tp/pp are left out:
# they usually follow the device count within one series)
LABEL_FIELDS = ("stage", "schedule", "microbatches", "sequence_parallel", "offload_optimizer", "offload_params",
                "precision", "batch_policy", "batch_size", "grad_accum", "optimizer")
EVENT_SKIP = {"type", "ranks", "train_losses"}
STATE_PARTS = ("params", "grads", "optimizer")


class AnalysisError(ValueError):
    """A problem with the records or the request, stated in one line for the user."""


def find_runs(root: str | Path) -> list[Path]:
    """Every run folder under root (root itself may be one)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"results folder {root} does not exist; run `python -m bench ...` or `make demo` first")
    found = {p.parent for name in ("summary.json", "config.yaml") for p in root.rglob(name)}
    return sorted(d for d in found if not any(part.startswith(".") for part in d.relative_to(root).parts))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{i + 1}: not JSON, skipped")
    return [e for e in events if e.get("type", "epoch") == "epoch"]


def _state_of_peak_rank(event: dict) -> dict:
    """Model-state bytes of the rank whose peak memory is highest (the one a per-device budget must fit)."""
    ranks = event.get("ranks") or []
    if not ranks:
        return {}
    metric = event.get("memory_metric") or "peak_rss"

    def peak(r):
        v = (r.get("memory") or {}).get(metric)
        return -1 if v is None else v

    top = max(ranks, key=peak)
    s = top.get("state_bytes") or {}
    parts = {f"state_{k}": s.get(k) for k in STATE_PARTS}
    known = [v for v in parts.values() if v is not None]
    # adapters may add detail (e.g. per pipeline partition) beside the three totals: sum only those
    totals = [sum((r.get("state_bytes") or {}).get(k) or 0 for k in STATE_PARTS) for r in ranks]
    return {**parts, "state_bytes": sum(known) if known else None, "state_bytes_max": max(totals) if totals else None,
            "mem_rank": top.get("rank"), "ranks_reported": len(ranks)}


def load_run(run_dir: str | Path) -> list[dict]:
    """Rows (one per epoch, or one if there is none) for one run folder."""
    run_dir = Path(run_dir)
    cfg = {}
    if (run_dir / "config.yaml").exists():
        try:
            cfg = _flatten(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
        except yaml.YAMLError as e:
            warnings.warn(f"{run_dir / 'config.yaml'}: {e}")
    summary = {}
    if (run_dir / "summary.json").exists():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError as e:
            warnings.warn(f"{run_dir / 'summary.json'}: {e}")
    env = {}
    if (run_dir / "env.json").exists():
        try:
            env = json.loads((run_dir / "env.json").read_text())
        except json.JSONDecodeError:
            pass

    base = {col: cfg.get(key) for key, col in CONFIG_FIELDS.items()}
    for col in ("adapter", "workload", "experiment", "point"):
        base[col] = summary.get(col) or base[col]
    world = summary.get("world_size") or base["nprocs"]
    base.update(
        run_dir=str(run_dir),
        run_id=summary.get("run_id") or run_dir.name,
        status=summary.get("status") or "missing",  # a config but no summary: the launcher never got going
        error=summary.get("error"),
        failed_rank=summary.get("failed_rank"),
        world_size=world,
        devices=summary.get("devices"),
        local_batch=summary.get("local_batch"),
        host=env.get("host"),
        git_sha=env.get("git_sha"),
        torch=(env.get("versions") or {}).get("torch"),
    )
    events = _read_events(run_dir / "events.jsonl")
    if not events:
        base["global_batch"] = summary.get("global_batch")
        return [base]
    rows = []
    for e in events:
        row = dict(base)
        row.update({k: v for k, v in e.items() if k not in EVENT_SKIP and not isinstance(v, (list, dict))})
        row.update(_state_of_peak_rank(e))
        rows.append(row)
    return rows


def load(*roots: str | Path) -> pd.DataFrame:
    """All runs under the given folders, one row per run x epoch; see the module doc for columns."""
    rows = [row for root in roots for d in find_runs(root) for row in load_run(d)]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    for col in ("epoch", "devices", "world_size", "global_batch", "steps", "stage", "tp", "pp"):
        if col not in df:
            df[col] = np.nan
    for col in ("epoch", "devices", "world_size", "global_batch", "steps"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    # records without a devices field (older ones): one device per rank
    df["devices"] = df["devices"].fillna(df["world_size"]).astype("Int64")
    # an adapter without tensor/pipeline parallel keys (ddp, zero, fsdp, horovod) has TP = PP = 1
    known = df["status"] != "missing" if "status" in df else True
    for col in ("tp", "pp"):
        df[col] = pd.to_numeric(df[col], errors="coerce").mask(known & df[col].isna(), 1)
    df["world_size"] = df["world_size"].astype("Int64")
    df["samples_per_epoch"] = df["steps"] * df["global_batch"]
    # epochs capped by trainer.max_steps hold different sample counts: compare time per sample
    df["time_per_sample_s"] = df["epoch_time_s"] / df["samples_per_epoch"] if "epoch_time_s" in df else np.nan
    df["val_metric_name"] = np.where(df["kind"] == "vision", "val_accuracy", "val_perplexity")
    df["val_metric"] = np.nan
    for name in ("val_accuracy", "val_perplexity"):
        if name in df:
            pick = df["val_metric_name"] == name
            df.loc[pick, "val_metric"] = pd.to_numeric(df.loc[pick, name], errors="coerce")
    df["label"] = series_labels(df)
    order = ["experiment", "workload", "label", "adapter", "devices", "world_size", "status", "epoch", "run_id"]
    df = df[order + [c for c in df.columns if c not in order]]
    return df.sort_values(["workload", "label", "devices", "run_id", "epoch"], na_position="last").reset_index(drop=True)


def series_labels(df: pd.DataFrame) -> pd.Series:
    """One series per adapter, split by the settings that differ among its finished runs: "zero stage=2".
    (Only finished runs decide the split, so a failed attempt with odd settings does not rename the series.)"""
    labels = df["adapter"].fillna("?").astype(str)
    for adapter, sub in df.groupby("adapter", dropna=False):
        done = sub[sub["status"].isin(["ok", "preempted"])]
        ref = done if len(done) else sub
        varying = [f for f in LABEL_FIELDS if f in ref and ref[f].astype(str).nunique(dropna=False) > 1]
        if not varying:
            continue
        idx = sub.index
        labels.loc[idx] = labels.loc[idx] + sub[varying].apply(
            lambda r: "".join(f" {k}={_short(v)}" for k, v in r.items()), axis=1)
    return labels


def _short(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: means over its epochs for times and rates, the last epoch for metrics and
    memory state, the highest per-rank peak memory over epochs."""
    if df.empty:
        return df
    keys = ["run_dir"]
    mean_cols = [c for c in df.columns if c.endswith("_time_mean_s") or c in (
        "epoch_time_s", "step_time_mean_s", "step_time_p50_s", "step_time_p95_s", "samples_per_s",
        "epoch_samples_per_s", "tokens_per_s", "flops_per_s", "mfu", "val_time_s", "time_per_sample_s")]
    last_cols = [c for c in df.columns if c not in mean_cols and c not in keys]
    df = df.sort_values("epoch")
    g = df.groupby(keys, sort=False, dropna=False)
    out = g[last_cols].last()  # last non-null per column: the final epoch's metrics and the run's identity
    nums = df[mean_cols].apply(pd.to_numeric, errors="coerce")  # all-None columns (e.g. mfu on CPU) are object
    out[mean_cols] = nums.groupby(df["run_dir"], sort=False).mean()
    if "peak_memory_max" in df:
        out["peak_memory_max"] = g["peak_memory_max"].max()
    out["epochs"] = g["epoch"].count()
    out = out.reset_index()
    return out.sort_values(["workload", "label", "devices", "run_id"]).reset_index(drop=True)


def ok(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of finished runs with measurements."""
    if df.empty:
        return df
    return df[(df["status"].isin(["ok", "preempted"])) & df["epoch"].notna()]
