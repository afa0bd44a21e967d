"""Standard log sinks beside a run's record: MLPerf-logging `:::MLLOG` lines and TensorBoard scalars.

Each sink is optional and never required: the record (summary.json, events.jsonl) stays the source
of truth, and a sink that cannot be written says why and changes nothing else.

    write_mllog(run_dir, summary, events, config) -> Path      # RUN_DIR/mllog.txt
    write_tensorboard(run_dir, events) -> Path | None           # RUN_DIR/tensorboard/ (needs `tensorboard`)
    write_sinks(run_dir, mllog=True, tensorboard=False) -> dict # both, from the record files

MLLOG: one `:::MLLOG {json}` line per event with the fields of the mlperf-logging package
(namespace, time_ms, event_type INTERVAL_START / INTERVAL_END / POINT_IN_TIME, key, value,
metadata) and its `mllog.constants` keys: submission_*, global_batch_size, opt_name,
opt_base_learning_rate, seed, run_start / run_stop (status success or aborted), epoch_start /
epoch_stop and eval_start / eval_stop per epoch (metadata epoch_num), eval_accuracy (vision:
top-1 accuracy; language: validation perplexity, said in the metadata). When mlperf-logging is
installed its `mllog.MLLogger` writes the lines; otherwise they are written by hand in the same
format. Times: the run's start (wall clock) plus each epoch event's `wall_time_s` (seconds since
the first epoch began, after its validation), `val_time_s` and `epoch_time_s`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path

MLLOG_FILE = "mllog.txt"
TENSORBOARD_DIR = "tensorboard"
_MLLOG_TEMPLATE = ":::MLLOG {}"

# the mlperf-logging constants used (mllog.constants names and values), for the hand-written path
_K = {
    "SUBMISSION_BENCHMARK": "submission_benchmark", "SUBMISSION_DIVISION": "submission_division",
    "SUBMISSION_ORG": "submission_org", "SUBMISSION_PLATFORM": "submission_platform",
    "SUBMISSION_STATUS": "submission_status", "INIT_START": "init_start", "INIT_STOP": "init_stop",
    "RUN_START": "run_start", "RUN_STOP": "run_stop", "EPOCH_START": "epoch_start", "EPOCH_STOP": "epoch_stop",
    "EVAL_START": "eval_start", "EVAL_STOP": "eval_stop", "EVAL_ACCURACY": "eval_accuracy",
    "GLOBAL_BATCH_SIZE": "global_batch_size", "GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "OPT_NAME": "opt_name", "OPT_BASE_LR": "opt_base_learning_rate", "SEED": "seed",
    "TRAIN_SAMPLES": "train_samples", "EVAL_SAMPLES": "eval_samples", "OPEN": "open", "RESEARCH": "research",
    "SUCCESS": "success", "ABORTED": "aborted",
}


def _constants() -> dict:
    try:
        from mlperf_logging.mllog import constants as c
    except ImportError:
        return dict(_K)
    return {k: getattr(c, k, v) for k, v in _K.items()}


def _get(cfg, dotted: str, default=None):
    """cfg["a"]["b"] for "a.b" on a dict or an attribute tree (DictConfig, dataclass); default if absent."""
    cur = cfg
    for part in dotted.split("."):
        if isinstance(cur, dict):
            cur = cur.get(part)
        else:
            try:
                cur = getattr(cur, part)
            except Exception:  # noqa: BLE001 - missing key of a structured config
                cur = None
        if cur is None:
            return default
    return cur


def _start_time_s(run_dir: Path, summary: dict, events: list[dict]) -> float:
    """Wall-clock seconds of the run's start: the summary's own stamp if it has one, else the
    summary file's modification time minus the run's total time, else now minus it."""
    for key in ("start_time", "started_at", "run_start_time"):
        v = summary.get(key)
        if isinstance(v, (int, float)) and v > 1e9:
            return float(v)
    total = summary.get("total_time_s")
    if not isinstance(total, (int, float)):
        total = max((e.get("wall_time_s") or 0 for e in events), default=0.0)
    path = Path(run_dir) / "summary.json"
    end = path.stat().st_mtime if path.exists() else time.time()
    return end - float(total)


def mllog_entries(summary: dict, events: list[dict], config, start_time_s: float) -> list[dict]:
    """The MLLOG events of a run, in order: {event_type, key, value, metadata, time_ms}."""
    c = _constants()
    t0 = int(round(start_time_s * 1000))
    out: list[dict] = []

    def add(kind, key, value=None, t_ms=t0, **meta):
        out.append({"event_type": kind, "key": key, "value": value, "metadata": meta or None, "time_ms": int(t_ms)})

    kind = _get(config, "workload.kind", "language")
    workload = summary.get("workload") or _get(config, "workload.name", "unknown")
    point = "POINT_IN_TIME"
    add(point, c["SUBMISSION_BENCHMARK"], workload)
    add(point, c["SUBMISSION_ORG"], "trainbench")
    add(point, c["SUBMISSION_DIVISION"], c["OPEN"])
    add(point, c["SUBMISSION_STATUS"], c["RESEARCH"])
    add(point, c["SUBMISSION_PLATFORM"], f"{summary.get('devices') or summary.get('world_size')}x "
                                         f"{summary.get('adapter') or _get(config, 'adapter.name', '?')}")
    add("INTERVAL_START", c["INIT_START"])
    first_epoch = events[0] if events else {}
    startup = summary.get("startup_s")
    init_end = t0 + (1000 * float(startup) if isinstance(startup, (int, float)) and not events else 0)
    add("INTERVAL_END", c["INIT_STOP"], t_ms=init_end)
    gb = summary.get("global_batch") or first_epoch.get("global_batch")
    add(point, c["GLOBAL_BATCH_SIZE"], gb)
    add(point, c["GRADIENT_ACCUMULATION_STEPS"], _get(config, "trainer.grad_accum", 1))
    add(point, c["OPT_NAME"], _get(config, "optimizer.name"))
    add(point, c["OPT_BASE_LR"], _get(config, "optimizer.lr"))
    add(point, c["SEED"], _get(config, "trainer.seed"))
    steps = first_epoch.get("steps")
    if steps and gb:
        add(point, c["TRAIN_SAMPLES"], int(steps) * int(gb))
    if _get(config, "data.val_samples") is not None and _get(config, "data.source") == "synthetic":
        add(point, c["EVAL_SAMPLES"], _get(config, "data.val_samples"))
    add("INTERVAL_START", c["RUN_START"], t_ms=init_end)
    last = init_end
    for e in events:
        n = int(e.get("epoch", 0)) + 1  # MLPerf counts epochs from 1
        wall, val, ep = e.get("wall_time_s"), e.get("val_time_s") or 0.0, e.get("epoch_time_s")
        if not isinstance(wall, (int, float)) or not isinstance(ep, (int, float)):
            continue
        stop = t0 + 1000 * (wall - val)
        start = stop - 1000 * ep
        add("INTERVAL_START", c["EPOCH_START"], t_ms=start, epoch_num=n)
        add("INTERVAL_END", c["EPOCH_STOP"], t_ms=stop, epoch_num=n, partial=bool(e.get("partial")),
            samples=(e.get("steps") or 0) * (e.get("global_batch") or 0))
        metric, name = (e.get("val_accuracy"), "top1_accuracy") if kind == "vision" else (e.get("val_perplexity"), "perplexity")
        if metric is not None and isinstance(metric, (int, float)) and math.isfinite(metric):
            add("INTERVAL_START", c["EVAL_START"], t_ms=stop, epoch_num=n)
            add("INTERVAL_END", c["EVAL_STOP"], t_ms=t0 + 1000 * wall, epoch_num=n)
            add(point, c["EVAL_ACCURACY"], float(metric), t_ms=t0 + 1000 * wall, epoch_num=n, metric=name)
        last = max(last, t0 + 1000 * wall)
    status = c["SUCCESS"] if summary.get("status") == "ok" else c["ABORTED"]
    total = summary.get("total_time_s")
    end = t0 + 1000 * float(total) if isinstance(total, (int, float)) else last
    add("INTERVAL_END", c["RUN_STOP"], t_ms=max(end, last), status=status, harness_status=summary.get("status"))
    return out


def write_mllog(run_dir, summary: dict, events: list[dict], config, start_time_s: float | None = None) -> Path:
    """RUN_DIR/mllog.txt: the run as MLPerf-logging lines (see the module doc). Returns the path.
    Uses mlperf_logging.mllog's MLLogger when the package is installed, else writes the same format."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = [e for e in events if e.get("type", "epoch") == "epoch"]
    t0 = _start_time_s(run_dir, summary, events) if start_time_s is None else float(start_time_s)
    entries = mllog_entries(summary, events, config or {}, t0)
    path = run_dir / MLLOG_FILE
    tmp = run_dir / f".{MLLOG_FILE}.tmp"
    try:
        from mlperf_logging.mllog import mllog
    except ImportError:
        mllog = None
    if mllog is not None:
        logger = logging.getLogger(f"trainbench.mllog.{os.getpid()}.{id(entries)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = logging.FileHandler(tmp, mode="w")
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
        try:
            ml = mllog.MLLogger(logger=logger, default_namespace="")
            emit = {"INTERVAL_START": ml.start, "INTERVAL_END": ml.end, "POINT_IN_TIME": ml.event}
            for x in entries:
                emit[x["event_type"]](key=x["key"], value=x["value"], metadata=x["metadata"], time_ms=x["time_ms"])
        finally:
            logger.removeHandler(handler)
            handler.close()
    else:
        lines = []
        for x in entries:
            meta = {"source": "trainbench", **(x["metadata"] or {})}
            lines.append(_MLLOG_TEMPLATE.format(json.dumps({
                "namespace": "", "time_ms": x["time_ms"], "event_type": x["event_type"], "key": x["key"],
                "value": x["value"], "metadata": meta})))
        tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def read_mllog(path) -> list[dict]:
    """The JSON objects of an MLLOG file's `:::MLLOG` lines (other lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.startswith(":::MLLOG "):
            out.append(json.loads(line[len(":::MLLOG "):]))
    return out


def tensorboard_unavailable() -> str | None:
    """Why TensorBoard scalars cannot be written here, or None when they can."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        return f"tensorboard is not installed ({e}); pip install tensorboard"
    return None


def write_tensorboard(run_dir, events: list[dict]) -> Path | None:
    """RUN_DIR/tensorboard/: per epoch train/loss, val/<metric>, time/epoch_s, throughput/samples_per_s
    (step = epoch number), and train/step_loss per optimizer step (step = global step). Returns the
    folder, or None (with a warning saying why) when the tensorboard package is absent."""
    why = tensorboard_unavailable()
    if why:
        warnings.warn(f"no TensorBoard scalars: {why}")
        return None
    from torch.utils.tensorboard import SummaryWriter

    out = Path(run_dir) / TENSORBOARD_DIR
    writer = SummaryWriter(log_dir=str(out))
    try:
        step = 0
        for e in events:
            if e.get("type", "epoch") != "epoch":
                continue
            ep = int(e.get("epoch", 0))
            for tag, key in (("train/loss", "train_loss"), ("val/loss", "val_loss"), ("val/accuracy", "val_accuracy"),
                             ("val/perplexity", "val_perplexity"), ("time/epoch_s", "epoch_time_s"),
                             ("time/step_mean_s", "step_time_mean_s"), ("throughput/samples_per_s", "samples_per_s"),
                             ("throughput/tokens_per_s", "tokens_per_s"), ("memory/peak_max_bytes", "peak_memory_max")):
                v = e.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    writer.add_scalar(tag, float(v), ep)
            for loss in e.get("train_losses") or []:
                if isinstance(loss, (int, float)):
                    writer.add_scalar("train/step_loss", float(loss), step)
                step += 1
        writer.flush()
    finally:
        writer.close()
    return out


def write_sinks(run_dir, mllog: bool = True, tensorboard: bool = False) -> dict:
    """Both sinks from a finished record (summary.json, events.jsonl, config.yaml in RUN_DIR): the one
    call a runner makes after writing the summary. Returns {sink: path, or "skipped: why" / "failed: why"};
    never raises."""
    run_dir = Path(run_dir)
    result: dict = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        ev_path = run_dir / "events.jsonl"
        events = [json.loads(ln) for ln in ev_path.read_text().splitlines() if ln.strip()] if ev_path.exists() else []
        config = {}
        if (run_dir / "config.yaml").exists():
            import yaml

            config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except Exception as e:  # noqa: BLE001 - a sink never breaks a run
        return {"mllog": f"failed: {type(e).__name__}: {e}"} if mllog else {}
    for name, on, fn in (("mllog", mllog, lambda: write_mllog(run_dir, summary, events, config)),
                         ("tensorboard", tensorboard, lambda: write_tensorboard(run_dir, events))):
        if not on:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = fn()
            result[name] = str(path) if path is not None else f"skipped: {tensorboard_unavailable()}"
        except Exception as e:  # noqa: BLE001
            result[name] = f"failed: {type(e).__name__}: {e}"
    return result
