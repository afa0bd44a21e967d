"""Any tree of run records -> one tidy DataFrame (one row per run x epoch).

A run folder is any folder holding `summary.json` or `config.yaml` (see ptbench.core.records). Runs that
produced no epoch (failed before the first epoch ended, still running, or missing: a folder with a
config but no summary) still appear, as one row with `epoch` NaN, their `status` and `error`, so a
sweep's holes stay visible instead of vanishing from the plots. Only `status == "ok"` counts as
finished (`ok`); a preempted run keeps its own status and is listed with the runs that did not finish.
A record whose summary.json or an events.jsonl line is not JSON (cut short) is `damaged`, its reason in
`error` (what its summary said in `status_written`); a diverged run (non-finite loss) keeps `diverged`; a
`running` record whose launcher on this host is gone (SIGKILL, the OOM killer) is `killed`.

Columns: identity (run_id, run_dir, experiment, adapter, workload, kind, label), layout (world_size,
devices, stage, tp, pp, schedule, microbatches, batch_policy, global_batch, ...; tp/pp/dp from the summary's
`layout` where the record has one, else the adapter's config keys), outcome (status,
error, failed_rank), every scalar of the epoch event (epoch_time_s, *_time_mean_s, samples_per_s,
val_loss, partial, ...), the summary's `epoch_time_steady_s`, plus derived: `val_metric`/`val_metric_name`
(accuracy for vision, perplexity for language), `samples_per_epoch`, memory of the busiest rank
(see `_memory_fields`), and, for runs profiled with trainer.profile, the profiled step's parts (`_profile_fields`).

Series labels (`label`) come from each run's own record only: its adapter, the settings that make it
a different series (ZeRO stage, schedule, offload, precision, optimizer, ...) and its global-batch
rule, e.g. "zero stage=3 gb=8/replica". Adding runs to a folder never renames another run's series.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from ptbench.analysis import records_io
from ptbench.analysis.records_io import Unreadable, skipped
from ptbench.core.readers import comm_reports, owner_gone, record_files

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
    "results.point": "point",  # sweep point id (bench/runner/points.py)
    "results.repeat": "repeat",  # repeat index (python -m ptbench.sweep run --repeats N)
    "trainer.seed": "seed",
    "extra.batch_reduced_from": "batch_reduced_from",  # a point retried after an OOM (bench/runner/points.py oom_retry)
}
# a record's warnings of contention (bench/runner/checks.py contention_warnings) start with this
CONTENTION = "contention:"
# summary["layout"] fields taken as columns where a record has them (over the config's tp/pp keys)
LAYOUT_FIELDS = ("tp", "pp", "dp", "devices_per_process")
# Settings that make two runs of one adapter different series, in label order, with the value at
# which a setting is left out of the label (None: shown whenever the record has it). tp/pp are left
# out: they usually follow the device count within one series. The batch policy, batch size and
# grad accumulation make the label's "gb=" part (`batch_rule`).
LABEL_SETTINGS = {
    "stage": None,
    "schedule": "1f1b",
    "microbatches": 0,
    "sequence_parallel": False,
    "precision": "fp32",
    "optimizer": "adamw",
    "grad_accum": 1,
}
LABEL_ALWAYS = {"pipeline": ("schedule",)}  # shown even at the default value: it names the series
LABEL_NAMES = {"sequence_parallel": "sp", "grad_accum": "accum"}
EVENT_SKIP = {"type", "ranks", "train_losses"}
STATE_PARTS = ("params", "grads", "optimizer")
# what a global batch of B follows, per adapter.batch_policy (global batch = B x that)
BATCH_UNITS = {"per_device": "/replica", "linear": "/device", "fixed": "", "per_microbatch": "/microbatch"}


def read_yaml(path: Path):
    """A record's YAML, bounded (records_io): Unreadable or yaml.YAMLError when it cannot be read."""
    return records_io.read_yaml(path)


class AnalysisError(ValueError):
    """A problem with the records or the request, stated in one line for the user."""


class NoRecords(AnalysisError):
    """A folder holding no run record; shown in a notebook as its one line (IPython's `_render_traceback_`)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def user_path(path: str | Path) -> Path:
    """A folder as the user typed it (`~` and $VARS expanded), absolute. A relative path is taken from the
    folder the user's shell was in ($PWD) when it started Jupyter or papermill, not from the notebook's own
    folder (where Jupyter starts its kernels); without $PWD, from the current directory."""
    p = Path(os.path.expandvars(os.path.expanduser(str(path))))
    if p.is_absolute():
        return p
    pwd = os.environ.get("PWD")
    base = Path(pwd) if pwd and Path(pwd).is_dir() else Path.cwd()
    return (base / p).resolve()


def find_runs(root: str | Path) -> list[Path]:
    """Every run folder under root (root itself may be one), as far down as the records' reader searches
    (`record_files`: a tree made thousands of folders deep is named in one line, not a RecursionError); a folder
    below a hidden one (a name starting with ".") is none."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(
            f"results folder {root} does not exist; run `python -m ptbench ...` or `make demo` first"
        )
    found = {p.parent for name in ("summary.json", "config.yaml") for p in record_files(root, name)}
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


def _read_events(path: Path, damage: list[str] | None = None) -> list[dict]:
    """The epoch events of events.jsonl; a line that is not a JSON object (half-written) is skipped and
    named in `damage`; a file that cannot be read at all (records_io's bounds) is named there too."""
    if not os.path.lexists(path):
        return []
    events = []
    try:
        lines = list(records_io.read_jsonl(path))
    except (OSError, Unreadable) as e:
        lines = []
        skipped(path, _first_line(e))  # the one line; the run stays in the tables as damaged, with the reason
        _damaged(path, f"{path.name} cannot be read: {_first_line(e)}", damage)
    over = []  # lines past records_io's bounds (not cut short: made so): said in one line per file
    for i, event in lines:
        if isinstance(event, dict):
            events.append(event)
            continue
        why = _first_line(event) if isinstance(event, Exception) else "not a JSON object"
        over += [(i, why)] if isinstance(event, Unreadable) else []
        hint = "" if isinstance(event, Unreadable) else ": a line cut short?"
        _damaged(path, f"{path.name}:{i} is not a JSON object ({why}){hint}", damage)
    if over:
        skipped(f"{path}:{over[0][0]}", over[0][1] + (f" (and {len(over) - 1} more line(s))" if len(over) > 1 else ""))
    return [e for e in events if e.get("type", "epoch") == "epoch"]


def _damaged(path: Path, why: str, damage: list[str] | None) -> None:
    if damage is None:
        warnings.warn(f"{path.parent}/{why}")
    else:
        damage.append(why)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# --- memory ------------------------------------------------------------------------------------------
def _is_host(device) -> bool:
    return str(device).split(":")[0] == "cpu"


def _per_device_states(s: dict) -> list[dict]:
    """Per-device detail of one rank's states (gpipe: one entry per partition or device), [] if none."""
    for key in ("per_device", "per_partition"):
        entries = s.get(key)
        if isinstance(entries, list) and entries and all(isinstance(e, dict) and "device" in e for e in entries):
            return entries
    return []


def _sum_parts(entries: list[dict]) -> dict:
    return {
        k: sum(e.get(k) or 0 for e in entries) if any(e.get(k) is not None for e in entries) else None
        for k in STATE_PARTS
    }


def _host_parts(s: dict, offload_optimizer, offload_params) -> set[str]:
    """Parts of a GPU rank's states held in host memory: from the record's `device` tag where it has
    one (a device string for all parts, or {part: device}), else from the ZeRO offload settings."""
    tag = s.get("device")
    flags = set()
    if _true(offload_optimizer):
        flags.add("optimizer")
    if _true(offload_params):
        flags.add("params")
    if isinstance(tag, str):
        return set(STATE_PARTS) if _is_host(tag) else set()
    if isinstance(tag, dict):
        return {k for k in STATE_PARTS if (_is_host(tag[k]) if k in tag else k in flags)}
    return flags


def _memory_fields(event: dict, offload_optimizer=None, offload_params=None) -> dict:
    """Memory of the rank whose peak is highest (the one a per-device budget must fit), and the
    model-state bytes to set against that peak.

    The peak plotted (`mem_plot_metric`): CUDA `peak_allocated`; CPU `peak_rss_delta` (peak RSS minus
    RSS before the first step) when every rank records it, else `peak_rss` (VmHWM, which holds the
    whole interpreter). States set against it (`dev_state_*`): on a rank that drives several devices
    (gpipe) the states on its busiest device when the record has per-device states; on a GPU run the
    parts held in host memory (ZeRO offload, or a `device` tag saying cpu) are left out of the device
    bar and reported as `host_state_bytes` / `host_state_parts`.
    """
    ranks = [r for r in (event.get("ranks") or []) if isinstance(r, dict)]
    if not ranks:
        return {}
    metric = event.get("memory_metric") or "peak_rss"
    on_cpu = metric == "peak_rss"
    plot_metric = metric
    if on_cpu and all((r.get("memory") or {}).get("peak_rss_delta") is not None for r in ranks):
        plot_metric = "peak_rss_delta"

    def peak(r):
        v = (r.get("memory") or {}).get(plot_metric)
        return -1 if v is None else v

    top = max(ranks, key=peak)
    mem = top.get("memory") or {}
    s = top.get("state_bytes") or {}
    parts = {f"state_{k}": s.get(k) for k in STATE_PARTS}
    known = [v for v in parts.values() if v is not None]
    # adapters may add detail (e.g. per pipeline partition) beside the three totals: sum only those
    totals = [sum((r.get("state_bytes") or {}).get(k) or 0 for k in STATE_PARTS) for r in ranks]
    out = {
        **parts,
        "state_bytes": sum(known) if known else None,
        "state_bytes_max": max(totals) if totals else None,
        "mem_rank": top.get("rank"),
        "ranks_reported": len(ranks),
        "mem_plot_metric": plot_metric,
        "mem_plot_bytes": mem.get(plot_metric),
        "mem_device": None,
        "mem_note": None,
    }

    device_parts = {k: s.get(k) for k in STATE_PARTS}
    host = set() if on_cpu else _host_parts(s, offload_optimizer, offload_params)
    per_dev = _per_device_states(s)
    if per_dev and not on_cpu:  # on a CPU every device is the one process memory: the totals are right
        readings = [d for d in (mem.get("per_device") or []) if isinstance(d, dict) and d.get(plot_metric) is not None]
        gpu_devices = sorted({str(e["device"]) for e in per_dev if not _is_host(e["device"])})
        if readings:
            busiest = max(readings, key=lambda d: d[plot_metric])
            device, out["mem_plot_bytes"] = str(busiest.get("device")), busiest[plot_metric]
        elif len(gpu_devices) == 1:
            device = gpu_devices[0]
        else:
            device = None
        if device is not None:
            device_parts = _sum_parts([e for e in per_dev if str(e["device"]) == device])
            out["mem_device"] = device
            out["mem_note"] = f"states of {device}, the busiest device of the rank"
        else:
            device_parts = _sum_parts([e for e in per_dev if not _is_host(e["device"])])
            out["mem_note"] = "states summed over the rank's devices (no per-device peak recorded)"
        hosted = _sum_parts([e for e in per_dev if _is_host(e["device"])])
        out["host_state_bytes"] = sum(v for v in hosted.values() if v) or None
        out["host_state_parts"] = ",".join(k for k in STATE_PARTS if hosted[k]) or None
    else:
        if len(mem.get("per_device") or []) > 1 and not on_cpu:
            out["mem_note"] = "states of all the rank's devices against one device's peak (no per-device states)"
        held = [k for k in STATE_PARTS if k in host and s.get(k)]
        out["host_state_bytes"] = sum(s[k] for k in held) or None
        out["host_state_parts"] = ",".join(held) or None
        device_parts = {k: (0 if k in host and v is not None else v) for k, v in device_parts.items()}
    out.update({f"dev_state_{k}": v for k, v in device_parts.items()})
    return out


# --- communication volume and the measured network ----------------------------------------------------
PROFILE_PARTS = ("compute", "exposed_comm", "bubble", "other")  # a profiled step's parts, bottom up
PROFILE_COLS = ("profile_step_s", *(f"profile_{p}_s" for p in PROFILE_PARTS))


def _profile_fields(prof) -> dict:
    """The record's `profile` (trainer.profile, bench/runner/profiling.py): its profiled step split into
    parts that add up to it, per rank from the per-rank figures, then the mean over ranks (seconds per
    profiled step). Per rank r: `compute` = its compute_s (operators running, union); `bubble` (pipeline
    runs, rank r = stage r) = the stage's measured bubble share (profile.bubble.per_stage, idle share of the
    schedule's span) x its step time, at most step - compute; `exposed_comm` = its exposed_comm_s (collectives
    running with no operator beside them) less the bubble (a stage waits for the others inside its p2p
    receives: that wait is the bubble, counted once), within what is left; `other` = the rest (Python between
    operators, the loss and optimizer outside the operators). None where not profiled."""
    ranks = prof.get("ranks") if isinstance(prof, dict) else None
    if not ranks or not all(isinstance(r, dict) and r.get("step_time_s") is not None for r in ranks):
        return dict.fromkeys(PROFILE_COLS)
    per_stage = (prof.get("bubble") or {}).get("per_stage") or []
    sums = dict.fromkeys(PROFILE_COLS, 0.0)
    for i, r in enumerate(ranks):
        step = float(r["step_time_s"])
        compute = min(float(r.get("compute_s") or 0.0), step)
        share = per_stage[i] if len(per_stage) == len(ranks) and per_stage[i] is not None else 0.0
        bubble = min(max(share, 0.0) * step, step - compute)
        exposed = min(max(float(r.get("exposed_comm_s") or 0.0) - bubble, 0.0), step - compute - bubble)
        for key, v in zip(PROFILE_COLS, (step, compute, exposed, bubble, step - compute - bubble - exposed)):
            sums[key] += v
    n = len(ranks)
    return {
        "profile_step_s": sums["profile_step_s"] / n,
        **{f"profile_{p}_s": sums[f"profile_{p}_s"] / n for p in PROFILE_PARTS},
    }


def _comm_fields(cv) -> dict:
    """The record's `comm_volume` (bench/core/comm_volume/, bytes per optimizer step per rank) as
    columns; `comm_collectives` keeps the per-collective list as JSON for `comm_table`."""
    if not isinstance(cv, dict) or cv.get("error") or "total_bytes" not in cv:
        return {
            "comm_bytes_per_step": None,
            "comm_backend": (cv or {}).get("backend") if isinstance(cv, dict) else None,
            "comm_phases": None,
            "comm_formula": None,
            "comm_collectives": None,
            "comm_error": cv.get("error") if isinstance(cv, dict) else None,
        }
    cols = cv.get("collectives") or []
    return {
        "comm_bytes_per_step": cv["total_bytes"],
        "comm_backend": cv.get("backend"),
        "comm_phases": ",".join(cv.get("phases") or []) or None,
        "comm_formula": "; ".join(f"{c['name']}: {c['formula']}" for c in cols) or None,
        "comm_collectives": json.dumps(cols),
        "comm_error": None,
    }


COMM_FOLDER = "comm"  # `python -m ptbench.sweep run` stores `python -m ptbench.comm --out` here


def load_comm(*roots: str | Path) -> list[dict]:
    """Every `python -m ptbench.comm` JSON report in a `comm/` folder under the roots (what a sweep
    stores beside its records: the records' reader, `comm_reports`), each with its `path`."""
    return [{**rep, "path": str(path)} for root in roots for path, rep in comm_reports(root, COMM_FOLDER)]


# --- labels ------------------------------------------------------------------------------------------
def _true(v) -> bool:
    return isinstance(v, (bool, np.bool_)) and bool(v)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA


def _short(v) -> str:
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    return str(v)


def _same(a, b) -> bool:
    try:
        return bool(a == b) or _short(a) == _short(b)
    except (TypeError, ValueError):
        return False


def batch_rule(policy, batch_size, grad_accum=1, global_batch=None) -> str:
    """The "gb=" part of a label: the global batch as the run's settings define it, so that one
    series keeps one label at every device count: "gb=8/replica" (per_device: 8 x data-parallel
    replicas), "gb=8/device" (linear), "gb=32" (fixed), "gb=4/microbatch" (per_microbatch: x micro-
    batches x replicas). grad_accum multiplies all but per_microbatch's (shown as accum=N). Without
    those settings in the record: the recorded global batch, else "gb=?"."""
    if not _missing(batch_size) and isinstance(policy, str) and policy in BATCH_UNITS:
        b = float(batch_size)
        if policy != "per_microbatch" and not _missing(grad_accum):
            b *= float(grad_accum)
        return f"gb={_short(b)}{BATCH_UNITS[policy]}"
    if not _missing(global_batch):
        return f"gb={_short(float(global_batch))}"
    return "gb=?"


def run_label(fields: dict) -> str:
    """A run's series label from its own record (adapter, settings, batch rule); a `label` the record
    carries itself wins (with the batch rule added if it has none)."""
    own = fields.get("record_label")
    gb = batch_rule(
        fields.get("batch_policy"), fields.get("batch_size"), fields.get("grad_accum"), fields.get("global_batch")
    )
    if isinstance(own, str) and own.strip():
        return own if "gb=" in own else f"{own} {gb}"
    adapter = fields.get("adapter")
    label = "?" if _missing(adapter) else str(adapter)
    always = LABEL_ALWAYS.get(label, ())
    for key, default in LABEL_SETTINGS.items():
        v = fields.get(key)
        if _missing(v) or (key not in always and default is not None and _same(v, default)):
            continue
        if key == "sequence_parallel":
            label += " sp" if _true(v) else ""
            continue
        label += f" {LABEL_NAMES.get(key, key)}={_short(v)}"
    offload = [p for p, k in (("optimizer", "offload_optimizer"), ("params", "offload_params")) if _true(fields.get(k))]
    if offload:
        label += f" offload={'+'.join(offload)}"
    return f"{label} {gb}"


def series_labels(df: pd.DataFrame) -> pd.Series:
    """Each row's label from that row's own fields (`run_label`): stable whatever else is loaded."""
    cols = [
        c
        for c in dict.fromkeys(
            (
                "adapter",
                "record_label",
                "batch_policy",
                "batch_size",
                "grad_accum",
                "global_batch",
                "offload_optimizer",
                "offload_params",
                *LABEL_SETTINGS,
            )
        )
        if c in df
    ]
    return pd.Series([run_label(r) for r in df[cols].to_dict("records")], index=df.index, dtype=object)


# --- loading -----------------------------------------------------------------------------------------
def _text(v) -> str | None:
    """A record's text field as text: what no run writes there (a list, a mapping) is shown, never keyed on."""
    return v if v is None or isinstance(v, str) else json.dumps(v, default=str)[:200]


def _read_config(path: Path) -> dict:
    """config.yaml flattened; {} (and a line saying why) when it cannot be read."""
    if not os.path.lexists(path):
        return {}
    try:
        cfg = read_yaml(path) or {}
        if not isinstance(cfg, dict):
            raise Unreadable("not a YAML mapping")
        return _flatten(cfg)
    except (OSError, ValueError, yaml.YAMLError) as e:
        skipped(path, _first_line(e))
        return {}


def load_run(run_dir: str | Path) -> list[dict]:
    """Rows (one per epoch, or one if there is none) for one run folder."""
    run_dir = Path(run_dir)
    cfg = _read_config(run_dir / "config.yaml")
    summary = {}
    damage: list[str] = []  # why this record cannot be trusted whole: its status becomes `damaged`
    if os.path.lexists(run_dir / "summary.json"):
        try:
            summary = records_io.read_json(run_dir / "summary.json")
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
        except (OSError, Unreadable) as e:
            summary = {}
            skipped(run_dir / "summary.json", _first_line(e))
            damage.append(f"summary.json cannot be read: {_first_line(e)}")
        except ValueError as e:
            summary = {}
            damage.append(f"summary.json is not a JSON object ({_first_line(e)}): cut short?")
    env = {}
    if os.path.lexists(run_dir / "env.json"):
        try:
            env = records_io.read_json(run_dir / "env.json")
        except (OSError, ValueError) as e:
            skipped(run_dir / "env.json", _first_line(e))
        env = env if isinstance(env, dict) else {}

    base = {col: cfg.get(key) for key, col in CONFIG_FIELDS.items()}
    base.update(_comm_fields(summary.get("comm_volume")))
    base.update(_profile_fields(summary.get("profile")))
    for col in ("adapter", "workload", "experiment", "point"):
        base[col] = (summary.get(col) if col == "point" else _text(summary.get(col))) or base[col]
    # the run's layout as its adapter laid it out (summary "layout"); older records: the config's keys
    layout = summary.get("layout") if isinstance(summary.get("layout"), dict) else {}
    for col in LAYOUT_FIELDS:
        if layout.get(col) is not None:
            base[col] = layout[col]
    world = summary.get("world_size") or layout.get("world_size") or base["nprocs"]
    base.update(
        run_dir=str(run_dir),
        run_id=_text(summary.get("run_id")) or run_dir.name,
        status=_text(summary.get("status")) or "missing",  # a config but no summary: the launcher never got going
        error=_text(summary.get("error")),
        failed_rank=summary.get("failed_rank"),
        world_size=world,
        devices=summary.get("devices"),
        local_batch=summary.get("local_batch"),
        epoch_time_steady_s=summary.get("epoch_time_steady_s"),
        record_label=_text(summary.get("label")) or _text(cfg.get("results.label")),
        # contention found before or during the run (its `warnings` starting "contention:"): kept out of verdicts
        contention="; ".join(w for w in summary.get("warnings") or [] if str(w).startswith(CONTENTION)) or None,
        host=env.get("host"),
        git_sha=env.get("git_sha"),
        torch=(env.get("versions") or {}).get("torch"),
        # GPU runs: which GPU and which NCCL/driver (env.json), so runs of two clusters are told apart
        gpu=(env.get("gpus") or [None])[0],
        gpu_count=env.get("gpu_count"),
        nccl=env.get("nccl"),
        driver=env.get("driver"),
    )
    events = _read_events(run_dir / "events.jsonl", damage)
    if base["status"] == "running" and (gone := owner_gone(summary.get("owner"))):
        base.update(status="killed", error=gone, status_written="running")
    if damage:  # kept in the tables with the reason, never counted as finished
        base.update(status="damaged", error="; ".join(damage), status_written=summary.get("status"))
    if not events:
        base["global_batch"] = summary.get("global_batch")
        return [base]
    rows = []
    for e in events:
        row = dict(base)
        row.update({k: v for k, v in e.items() if k not in EVENT_SKIP and not isinstance(v, (list, dict))})
        # the timed steps' times (a list per epoch): the point's step-time median and its bootstrap interval
        row["step_times_s"] = e["step_times_s"] if isinstance(e.get("step_times_s"), list) else None
        est = e.get("epoch_time_estimate")  # trainer.timing_sample: the epoch's whole time is an estimate
        if isinstance(est, dict):
            row.update({f"epoch_time_estimate_{k}": est.get(k) for k in ("value_s", "lo_s", "hi_s", "steps_in_epoch")})
            row["epoch_time_estimate_s"] = row.pop("epoch_time_estimate_value_s")
        row.update(_memory_fields(e, base.get("offload_optimizer"), base.get("offload_params")))
        rows.append(row)
    return rows


def _load_one(run_dir: Path) -> list[dict]:
    """`load_run`, or one `damaged` row saying why when the record holds what no run writes (a field of
    the wrong type, say): one bad record never stops the others from loading."""
    try:
        return load_run(run_dir)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OSError) as e:
        why = f"the record cannot be read: {type(e).__name__}: {_first_line(e)}"
        skipped(run_dir, why)
        row = {**dict.fromkeys(CONFIG_FIELDS.values()), "world_size": None, "devices": None}
        return [{**row, "run_dir": str(run_dir), "run_id": run_dir.name, "status": "damaged", "error": why}]


def load(*roots: str | Path, empty_ok: bool = True) -> pd.DataFrame:
    """All runs under the given folders, one row per run x epoch; see the module doc for columns.
    `empty_ok=False` (the notebooks): a folder that is missing or holds no record raises NoRecords, one line."""
    try:
        rows = [row for root in roots for d in find_runs(root) for row in _load_one(d)]
        rows = [row for row in rows if row.get("status") != "dry_run"]  # no time: analysis/at_scale.py shows them
    except FileNotFoundError as e:
        if empty_ok:
            raise
        raise NoRecords(str(e)) from None
    df = pd.DataFrame(rows)
    if df.empty and not empty_ok:
        raise NoRecords(
            f"no run records under {', '.join(str(Path(r).resolve()) for r in roots)}: point BENCH_RESULTS (or "
            "RESULTS_DIR) at a folder that `python -m ptbench` or `make demo` wrote"
        )
    if df.empty:
        return df
    for col in (
        "epoch",
        "devices",
        "world_size",
        "global_batch",
        "steps",
        "stage",
        "tp",
        "pp",
        "epoch_time_s",
        "epoch_time_steady_s",
    ):
        if col not in df:
            df[col] = np.nan
    for col in ("epoch", "devices", "world_size", "global_batch", "steps", "epoch_time_s", "epoch_time_steady_s"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    # an epoch cut short (trainer.max_steps, preemption) says so; records without the flag: complete
    df["partial"] = df["partial"].map(_true).astype(bool) if "partial" in df else False
    # records without a devices field (older ones): one device per rank
    df["devices"] = df["devices"].fillna(df["world_size"]).astype("Int64")
    # an adapter without tensor/pipeline parallel keys (ddp, zero, fsdp, horovod) has TP = PP = 1
    known = df["status"] != "missing" if "status" in df else True
    for col in ("tp", "pp"):
        df[col] = pd.to_numeric(df[col], errors="coerce").mask(known & df[col].isna(), 1)
    df["world_size"] = df["world_size"].astype("Int64")
    df["samples_per_epoch"] = df["steps"] * df["global_batch"]
    # epochs capped by trainer.max_steps hold different sample counts: compare time per sample
    df["time_per_sample_s"] = df["epoch_time_s"] / df["samples_per_epoch"]
    df["val_metric_name"] = np.where(df["kind"] == "vision", "val_accuracy", "val_perplexity")
    df["val_metric"] = np.nan
    for name in ("val_accuracy", "val_perplexity"):
        if name in df:
            pick = df["val_metric_name"] == name
            df.loc[pick, "val_metric"] = pd.to_numeric(df.loc[pick, name], errors="coerce")
    df["label"] = series_labels(df)
    order = ["experiment", "workload", "label", "adapter", "devices", "world_size", "status", "epoch", "run_id"]
    df = df[order + [c for c in df.columns if c not in order]]
    return df.sort_values(["workload", "label", "devices", "run_id", "epoch"], na_position="last").reset_index(
        drop=True
    )
