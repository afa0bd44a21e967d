"""Standard log sinks beside a run's record: MLPerf-logging `:::MLLOG` lines, TensorBoard scalars, and
optional Weights & Biases / MLflow runs.

Each sink is optional and never required: the record (summary.json, events.jsonl) stays the source
of truth, and a sink that cannot be written says why and changes nothing else.

    write_mllog(run_dir, summary, events, config) -> Path      # RUN_DIR/mllog.txt
    write_tensorboard(run_dir, events) -> Path | None           # RUN_DIR/tensorboard/ (needs `tensorboard`)
    write_wandb(run_dir, summary, events, config) -> Path       # RUN_DIR/wandb/ (needs `wandb`; offline without a key)
    write_mlflow(run_dir, summary, events, config) -> str       # an MLflow run (needs `mlflow`), its run id
    write_sinks(run_dir, mllog=True, tensorboard=False, wandb=False, mlflow=False) -> dict  # from the record files

W&B and MLflow come from their own packages, installed as extras (`pip install -e ".[wandb]"`,
`".[mlflow]"`) and switched on with results.wandb=true / results.mlflow=true; asked for and not
installed, the run is refused before launch (`check_sinks`, one line). Both are written after the
run from the record: the flattened config as parameters (config), the per-epoch scalars
TensorBoard gets, the per-step losses, and the summary's scalars. W&B runs offline (WANDB_MODE=offline,
files in RUN_DIR/wandb, `wandb sync` uploads them later) unless WANDB_API_KEY or WANDB_MODE is set;
its project is WANDB_PROJECT, else results.experiment. MLflow logs to MLFLOW_TRACKING_URI (mlflow's
own default otherwise), experiment = results.experiment, run name = the run id; a store MLflow refuses (MLflow 3's
default is a sqlite file, which mlflow-skinny cannot open; a local folder needs MLFLOW_ALLOW_FILE_STORE=true) is
refused before launch too, in one line naming what to set (MLFLOW_FIX).

MLLOG: one `:::MLLOG {json}` line per event with the fields of the mlperf-logging package
(namespace, time_ms, event_type INTERVAL_START / INTERVAL_END / POINT_IN_TIME, key, value,
metadata) and its `mllog.constants` keys: submission_*, global_batch_size, opt_name,
opt_base_learning_rate, seed, run_start / run_stop (status success or aborted), epoch_start /
epoch_stop and eval_start / eval_stop per epoch (metadata epoch_num), eval_accuracy (vision:
top-1 accuracy; language: validation perplexity, said in the metadata), cache_clear false (the harness
clears no cache). The MLCommons `mlperf-logging` package (extra `mllog`) writes them with its
`mllog.MLLogger` and its constants, always: results.mllog=true without it is refused before launch
(`check_sinks`). submission_benchmark is MLPerf's benchmark name where the workload is one (resnet50*:
`resnet`, so its compliance checker's rules apply), else the workload's name. Times: the run's start (wall clock) plus each epoch event's `wall_time_s` (seconds since
the first epoch began, after its validation), `val_time_s` and `epoch_time_s`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

from ptbench.core.readers import MAX_EVENTS_BYTES, read_bytes, read_json, read_lines
from ptbench.core.records import own_folder, write_at

MLLOG_FILE = "mllog.txt"
TENSORBOARD_DIR = "tensorboard"

# workload name prefix -> the mlperf-logging constant naming its MLPerf benchmark
MLPERF_BENCHMARKS = {"resnet50": "RESNET"}


def _constants() -> dict:
    """mlperf_logging.mllog.constants as a dict (name -> value)."""
    from mlperf_logging.mllog import constants as c

    return {k: getattr(c, k) for k in dir(c) if k.isupper()}


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
    benchmark = next((c[k] for p, k in MLPERF_BENCHMARKS.items() if str(workload).startswith(p)), workload)
    point = "POINT_IN_TIME"
    add(point, c["SUBMISSION_BENCHMARK"], benchmark, **({"workload": workload} if benchmark != workload else {}))
    add(point, c["SUBMISSION_ORG"], "trainbench")
    add(point, c["SUBMISSION_DIVISION"], c["OPEN"])
    add(point, c["SUBMISSION_STATUS"], c["RESEARCH"])
    add(
        point,
        c["SUBMISSION_PLATFORM"],
        f"{summary.get('devices') or summary.get('world_size')}x "
        f"{summary.get('adapter') or _get(config, 'adapter.name', '?')}",
    )
    add(point, c["CACHE_CLEAR"], False)  # no cache is dropped before a run
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
        add(
            "INTERVAL_END",
            c["EPOCH_STOP"],
            t_ms=stop,
            epoch_num=n,
            partial=bool(e.get("partial")),
            samples=(e.get("steps") or 0) * (e.get("global_batch") or 0),
        )
        metric, name = (
            (e.get("val_accuracy"), "top1_accuracy") if kind == "vision" else (e.get("val_perplexity"), "perplexity")
        )
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
    """RUN_DIR/mllog.txt: the run as MLPerf-logging lines, written by mlperf_logging.mllog's MLLogger (see the
    module doc). Returns the path."""
    from mlperf_logging.mllog import mllog

    run_dir = Path(run_dir)
    events = [e for e in events if e.get("type", "epoch") == "epoch"]
    t0 = _start_time_s(run_dir, summary, events) if start_time_s is None else float(start_time_s)
    entries = mllog_entries(summary, events, config or {}, t0)
    path = run_dir / MLLOG_FILE
    logger = logging.getLogger(f"trainbench.mllog.{os.getpid()}.{id(entries)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    lines = io.StringIO()  # written below as the record's other files are: never through a link (records.write_at)
    handler = logging.StreamHandler(lines)
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
    with _own_folder(run_dir) as (folder, _):
        write_at(folder, MLLOG_FILE, lines.getvalue(), path)
    return path


@contextlib.contextmanager
def _own_folder(run_dir: Path):
    """(descriptor, path naming it) of the record folder checked as ours (records.own_folder): a sink writes
    through it, so a record folder renamed away or replaced by a link meanwhile gets nothing."""
    fd = own_folder(Path(run_dir))
    try:
        by_fd = Path(f"/proc/self/fd/{fd}")  # a library that takes a path (TensorBoard) resolves it to this folder
        yield fd, by_fd if by_fd.is_dir() else Path(run_dir)
    finally:
        os.close(fd)


def read_mllog(path) -> list[dict]:
    """The JSON objects of an MLLOG file's `:::MLLOG` lines (other lines skipped)."""
    out = []
    for line in read_bytes(Path(path), MAX_EVENTS_BYTES).decode().splitlines():
        if line.startswith(":::MLLOG "):
            out.append(json.loads(line[len(":::MLLOG ") :]))
    return out


# per-epoch scalars every sink writes: tag -> epoch event key
EPOCH_SCALARS = (
    ("train/loss", "train_loss"),
    ("val/loss", "val_loss"),
    ("val/accuracy", "val_accuracy"),
    ("val/perplexity", "val_perplexity"),
    ("time/epoch_s", "epoch_time_s"),
    ("time/step_mean_s", "step_time_mean_s"),
    ("throughput/samples_per_s", "samples_per_s"),
    ("throughput/tokens_per_s", "tokens_per_s"),
    ("memory/peak_max_bytes", "peak_memory_max"),
)
# summary scalars W&B and MLflow get (the run's outcome), beside comm_volume.total_bytes
SUMMARY_SCALARS = (
    "step_time_mean_s",
    "samples_per_s",
    "tokens_per_s",
    "epoch_time_mean_s",
    "epoch_time_steady_s",
    "peak_memory_max",
    "mfu",
    "train_loss",
    "val_loss",
    "val_accuracy",
    "val_perplexity",
    "startup_s",
    "total_time_s",
)
OPTIONAL_SINKS = {"wandb": "wandb", "mlflow": "mlflow", "mllog": "mlperf_logging"}  # results.<key> -> module to import
MLFLOW_FIX = (
    "set MLFLOW_TRACKING_URI to your tracking server (http://HOST:5000), or keep the runs in a local folder "
    "with MLFLOW_TRACKING_URI=file:./mlruns and MLFLOW_ALLOW_FILE_STORE=true"
)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def sink_unavailable(name: str) -> str | None:
    """Why the optional sink `name` (wandb, mlflow) cannot be written here, or None when it can."""
    import importlib

    try:
        importlib.import_module(OPTIONAL_SINKS[name])
    except ImportError as e:
        return f"{OPTIONAL_SINKS[name]} is not installed ({e})"
    return None


def mlflow_client():
    """MLflow's client for MLFLOW_TRACKING_URI. Its stores are opened here (no network: a server is first asked
    when a run is logged), so a store MLflow refuses is a RuntimeError of one line naming what to set."""
    import mlflow
    from mlflow import MlflowClient

    try:
        return MlflowClient()
    except Exception as e:  # noqa: BLE001 - mlflow raises several types here, each a paragraph long
        raise RuntimeError(
            f"MLflow cannot use the tracking store {mlflow.get_tracking_uri()} ({type(e).__name__}): {MLFLOW_FIX}"
        ) from e


def check_sinks(results) -> None:
    """Before launch: every optional sink asked for (results.wandb / .mlflow / .mllog) is importable, and MLflow's
    tracking store opens, else ConfigError with one line naming the fix."""
    from ptbench.core.errors import ConfigError

    for key in OPTIONAL_SINKS:
        if _get(results, key, False) is True:
            why = sink_unavailable(key)
            if why:
                raise ConfigError(
                    f'results.{key}=true but {why}: pip install -e ".[{key}]" (the optional extra), '
                    f"or set results.{key}=false"
                )
    if _get(results, "mlflow", False) is True:
        try:
            mlflow_client()
        except RuntimeError as e:
            raise ConfigError(f"results.mlflow=true but {e}; or set results.mlflow=false") from None


def _scalars(summary: dict) -> dict:
    out = {f"summary/{k}": float(summary[k]) for k in SUMMARY_SCALARS if _number(summary.get(k))}
    cv = summary.get("comm_volume") or {}
    if _number(cv.get("total_bytes")):
        out["summary/comm_bytes_per_step"] = float(cv["total_bytes"])
    return out


def _epoch_rows(events: list[dict]):
    """(epoch, {tag: value}) per epoch event and (global step, loss) per optimizer step."""
    epochs, steps, step = [], [], 0
    for e in events:
        if e.get("type", "epoch") != "epoch":
            continue
        epochs.append((int(e.get("epoch", 0)), {tag: float(e[k]) for tag, k in EPOCH_SCALARS if _number(e.get(k))}))
        for loss in e.get("train_losses") or []:
            if _number(loss):
                steps.append((step, float(loss)))
            step += 1
    return epochs, steps


def write_wandb(run_dir, summary: dict, events: list[dict], config) -> Path:
    """A W&B run in RUN_DIR/wandb from the record: config, per-epoch scalars (x axis `epoch`), per-step
    losses (x axis `global_step`), summary scalars. Offline unless WANDB_API_KEY or WANDB_MODE is set."""
    with _own_folder(run_dir):  # W&B's files are written by its service process too: the path, checked as ours
        _write_wandb(Path(run_dir), summary, events, config)
    return Path(run_dir) / "wandb"


def _write_wandb(folder: Path, summary: dict, events: list[dict], config) -> None:
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or summary.get("experiment") or "trainbench",
        name=summary.get("run_id") or folder.name,
        dir=str(folder),
        mode=mode,
        config=config or {},
        job_type="benchmark",
        tags=[str(summary[k]) for k in ("adapter", "workload") if summary.get(k)],
    )
    try:
        run.define_metric("global_step")
        run.define_metric("train/step_loss", step_metric="global_step")
        run.define_metric("epoch")
        for tag, _ in EPOCH_SCALARS:
            run.define_metric(tag, step_metric="epoch")
        epochs, steps = _epoch_rows(events)
        for step, loss in steps:
            run.log({"global_step": step, "train/step_loss": loss})
        for ep, values in epochs:
            run.log({"epoch": ep, **values})
        run.summary.update({**_scalars(summary), "status": summary.get("status")})
    finally:
        run.finish(exit_code=0 if summary.get("status") == "ok" else 1)


def write_mlflow(run_dir, summary: dict, events: list[dict], config) -> str:
    """An MLflow run from the record (experiment = results.experiment, name = run id): the flattened
    config as parameters, per-epoch scalars (step = epoch), per-step losses (train/step_loss, step =
    global step), summary scalars; status FINISHED for an ok run, else FAILED. Returns its run id."""
    from mlflow.entities import Metric, Param, RunTag

    client = mlflow_client()  # MLFLOW_TRACKING_URI, or mlflow's default
    name = summary.get("experiment") or "default"
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name)
    run = client.create_run(exp_id, run_name=summary.get("run_id") or Path(run_dir).name)
    rid = run.info.run_id
    try:
        now = int(time.time() * 1000)
        params = [Param(k, str(v)[:6000]) for k, v in sorted(_flat(config).items())]
        tags = [
            RunTag(k, str(summary[k]))
            for k in ("adapter", "workload", "world_size", "point", "status", "run_id")
            if summary.get(k) is not None
        ] + [RunTag("run_dir", str(Path(run_dir).resolve()))]
        epochs, steps = _epoch_rows(events)
        metrics = [Metric("train/step_loss", loss, now, step) for step, loss in steps]
        metrics += [Metric(tag, v, now, ep) for ep, values in epochs for tag, v in values.items()]
        metrics += [Metric(k, v, now, 0) for k, v in _scalars(summary).items()]
        for i in range(0, max(len(params), len(metrics), 1), 100):  # the tracking API's batch limits
            client.log_batch(rid, metrics=metrics[i : i + 100], params=params[i : i + 100], tags=tags if i == 0 else [])
    except BaseException:
        client.set_terminated(rid, "FAILED")
        raise
    client.set_terminated(rid, "FINISHED" if summary.get("status") == "ok" else "FAILED")
    return rid


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

    with _own_folder(run_dir) as (_, folder):
        writer = SummaryWriter(log_dir=str(folder / TENSORBOARD_DIR))
        _tensorboard_scalars(writer, events)
    return Path(run_dir) / TENSORBOARD_DIR


def _tensorboard_scalars(writer, events: list[dict]) -> None:
    try:
        step = 0
        for e in events:
            if e.get("type", "epoch") != "epoch":
                continue
            ep = int(e.get("epoch", 0))
            for tag, key in EPOCH_SCALARS:
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


def write_sinks(
    run_dir, mllog: bool = True, tensorboard: bool = False, wandb: bool = False, mlflow: bool = False
) -> dict:
    """The sinks asked for, from a finished record (summary.json, events.jsonl, config.yaml in RUN_DIR): the one
    call a runner makes after writing the summary. Returns {sink: path, or "skipped: why" / "failed: why"};
    never raises."""
    run_dir = Path(run_dir)
    result: dict = {}
    try:  # bounded reads (records.read_bytes): a sink never breaks a run
        summary = read_json(run_dir / "summary.json")
        ev_path = run_dir / "events.jsonl"
        events = read_lines(ev_path) if ev_path.exists() else []
        config = {}
        if (run_dir / "config.yaml").exists():
            import yaml

            config = yaml.safe_load(read_bytes(run_dir / "config.yaml").decode()) or {}
    except Exception as e:  # noqa: BLE001 - a sink never breaks a run
        return {"mllog": f"failed: {type(e).__name__}: {e}"} if mllog else {}
    for name, on, fn in (
        ("mllog", mllog, lambda: write_mllog(run_dir, summary, events, config)),
        ("tensorboard", tensorboard, lambda: write_tensorboard(run_dir, events)),
        ("wandb", wandb, lambda: write_wandb(run_dir, summary, events, config)),
        ("mlflow", mlflow, lambda: write_mlflow(run_dir, summary, events, config)),
    ):
        if not on:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = fn()
            result[name] = str(path) if path is not None else f"skipped: {tensorboard_unavailable()}"
        except Exception as e:  # noqa: BLE001
            result[name] = f"failed: {type(e).__name__}: {e}"
            print(  # the exception's whole first line: a cut one can lose the fix it names
                f"warning: the {name} sink of {run_dir} failed (the record is complete): {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                file=sys.stderr,
                flush=True,
            )
    return result
