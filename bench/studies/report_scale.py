"""`python -m ptbench.studies.report_scale --records 1000 [--records 10000] [--keep DIR]`: how long the report takes
on a large study.

Writes N synthetic run records shaped like a real sweep (adapters x workloads x ranks 1..64 x repeats, 2-4
epochs, some runs oom / failed / timeout / preempted) with the record writer real runs use
(ptbench.core.records: config.yaml from the composed config, env.json, events.jsonl, summary.json), then
times `python -m ptbench.analysis report` on them as its own process (wall clock, as a user waits for it)
and prints records, seconds and what the report holds. A benchmark, not a test: the numbers depend on
the machine. With --keep, records and report stay in DIR (records of the same N there are reused).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptbench.core.records import RunWriter, atomic_write, environment, write_json

EXPERIMENT = "report-scale"
RANKS = (1, 2, 4, 8, 16, 32, 64)
# (adapter, workload, adapter overrides of the series, scaling exponent of its synthetic epoch time): a
# paper-like grid of series; each adapter lays a point out itself (its smoke_overrides and layout)
SERIES = (
    *(
        (a, "gpt2_tiny", o, eff)
        for a, o, eff in (
            ("ddp", {}, 0.9),
            ("zero", {"stage": 1}, 0.82),
            ("zero", {"stage": 2}, 0.79),
            ("zero", {"stage": 3}, 0.76),
            ("fsdp", {}, 0.83),
            ("megatron", {}, 0.75),
            ("gpipe", {}, 0.7),
            ("pipeline", {"microbatches": 4}, 0.72),
        )
    ),
    *(
        (a, "resnet50_tiny", o, eff)
        for a, o, eff in (
            ("ddp", {}, 0.9),
            ("zero", {"stage": 2}, 0.79),
            ("fsdp", {}, 0.83),
            ("gpipe", {}, 0.7),
            ("pipeline", {"microbatches": 4}, 0.72),
        )
    ),
)
OUTCOMES = (("ok", 0.88), ("oom", 0.03), ("failed", 0.03), ("timeout", 0.02), ("preempted", 0.04))
ERRORS = {
    "oom": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "failed": "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "timeout": "no progress for 600s (trainer.hang_timeout_s=600): a rank stopped calling collectives or hangs",
}
PHASES = ("data", "forward", "forward_backward", "backward", "optimizer")
MARKER = ".report_scale.json"  # in the records folder: what this driver wrote there (hidden: no run folder)


class Configs:
    """A series' point at N devices as its adapter lays it out: the composed config (Hydra, as `python -m
    ptbench` composes it, with the adapter's own overrides for N devices), its layout, sharding and global
    batch, one composition per point; the config.yaml text gets the run id per record."""

    def __init__(self):
        self.points: dict = {}

    def point(self, adapter: str, workload: str, extra: dict, devices: int) -> dict:
        key = (adapter, workload, tuple(sorted(extra.items())), devices)
        if key not in self.points:
            from omegaconf import OmegaConf

            from ptbench.adapters import get_adapter_class
            from ptbench.runner.compose import compose, typed

            cls = get_adapter_class(adapter)
            overrides = [f"adapter={adapter}", f"workload={workload}", "data=synthetic", "trainer.batch_size=8"]
            overrides += [*cls.smoke_overrides(devices), *(f"adapter.{k}={v}" for k, v in extra.items())]
            overrides += [f"results.experiment={EXPERIMENT}", "results.run_id=@RUN_ID@"]
            cfg = compose(overrides)
            run = typed(cfg)
            lay = cls.layout(run, cls.processes(run))
            self.points[key] = {
                "layout": lay.as_dict(),
                "sharding": cls.cost_inputs(run).sharding,
                "global_batch": cls.local_batch_size(run, lay.world_size) * lay.dp,
                "config": OmegaConf.to_container(cfg, resolve=True),
                "text": {},
            }
        return self.points[key]

    @staticmethod
    def get(point: dict, epochs: int, run_id: str) -> str:
        """config.yaml of a run of `point` with `epochs` epochs (one YAML dump per distinct setting)."""
        if epochs not in point["text"]:
            from omegaconf import OmegaConf

            point["config"]["trainer"]["epochs"] = epochs
            point["text"][epochs] = OmegaConf.to_yaml(OmegaConf.create(point["config"]))
        return point["text"][epochs].replace("@RUN_ID@", run_id)


def comm_volume(adapter: str, lay: dict, sharding: str, params: int) -> dict | None:
    """The record's comm_volume from the one comm-volume model (None if that model refuses the point)."""
    try:
        from ptbench.core.comm_volume import Activation, Inputs, compose, record_fields
        from ptbench.core.layout import CostInputs, Layout

        layout = Layout(**{k: v for k, v in lay.items() if k != "devices"})  # the adapter's, as recorded
        act = Activation(layers=4, hidden=128, seq_len=32, micro_batch=2)
        inp = Inputs(layout, CostInputs(sharding=sharding), params=params, act=act, label=adapter)
        return record_fields(compose(inp), "gloo")
    except Exception as e:  # noqa: BLE001 - the record says why, as a real run's does
        return {"error": f"{type(e).__name__}: {e}"}


def shards(sharding: str, lay: dict) -> tuple[int, int, int]:
    """What parameters, gradients and optimizer state are divided by on a device, from the adapter's sharding
    (ptbench.core.layout.SHARDING) and layout: a model-parallel shard, times dp where the states are sharded."""
    model, dp = lay["tp"] * lay["pp"], lay["dp"]
    over_dp = {"zero1": (1, 1, dp), "zero2": (1, dp, dp), "zero3": (dp, dp, dp), "fsdp": (dp, dp, dp)}
    over_dp["distributed_optimizer"] = (1, 1, dp)
    return tuple(model * k for k in over_dp.get(sharding, (1, 1, 1)))


def write_record(root: Path, i: int, rng: random.Random, configs: Configs, env: dict) -> str:
    """One run's record folder; returns its status."""
    adapter, workload, extra, eff = SERIES[i % len(SERIES)]
    ranks = RANKS[(i // len(SERIES)) % len(RANKS)]
    repeat = i // (len(SERIES) * len(RANKS))
    point_cfg = configs.point(adapter, workload, extra, ranks)
    lay, sharding = point_cfg["layout"], point_cfg["sharding"]
    devices = lay["world_size"] * lay["devices_per_process"]
    status = rng.choices([s for s, _ in OUTCOMES], [w for _, w in OUTCOMES])[0]
    if status == "oom" and devices < 4:
        status = "ok"
    epochs = 2 + (repeat % 3)
    run_id = f"{adapter}-{workload}-d{devices}-r{repeat}-{i:06d}"
    point = f"{adapter}{''.join(f'-{k}{v}' for k, v in extra.items())}-{workload}-d{devices}"
    identity = {
        "experiment": EXPERIMENT,
        "point": point,
        "adapter": adapter,
        "workload": workload,
        "world_size": lay["world_size"],
        "devices": devices,
    }
    run_dir = root / run_id
    writer = RunWriter(run_dir, identity)
    run_dir.mkdir(parents=True)
    atomic_write(run_dir / "config.yaml", configs.get(point_cfg, epochs, run_id))
    write_json(run_dir / "env.json", env)
    writer.record.write_summary({"status": "running", **writer.identity})
    if status in ("oom", "failed", "timeout"):
        writer.fail(status, ERRORS[status], failed_rank=rng.randrange(lay["world_size"]))
        return status
    language = workload.startswith("gpt2")
    params = 7_000_000 if language else 23_500_000
    shard = shards(sharding, lay)
    pt = dict(
        language=language,
        params=params,
        global_batch=point_cfg["global_batch"],
        steps=max(1, 4096 // point_cfg["global_batch"]),
        devices=devices,
        lay=lay,
        state={"params": 4 * params // shard[0], "grads": 4 * params // shard[1], "optimizer": 8 * params // shard[2]},
    )
    n_epochs = epochs if status == "ok" else rng.randint(1, epochs)
    run = _write_epochs(writer, pt, status, n_epochs, (60.0 if language else 90.0) / devices**eff, rng)
    summary = _summary(pt, status, n_epochs, run)
    summary.update(
        adapter_settings={"name": adapter, **extra},
        plan={**identity, "global_batch": pt["global_batch"]},
        comm_volume=comm_volume(adapter, lay, sharding, params),
    )
    writer.finish(summary)
    return status


def _ranks_memory(pt: dict, t: float, rng: random.Random) -> list[dict]:
    """Each rank's row of an epoch event: its time, memory and state bytes."""
    mem = []
    for r in range(pt["lay"]["world_size"]):
        peak = int((sum(pt["state"].values()) + 300 * 2**20 / pt["devices"] ** 0.5) * rng.uniform(0.98, 1.02))
        mem.append(
            {
                "rank": r,
                "host": f"node{r // 8:03d}",
                "epoch_time_s": t * rng.uniform(0.97, 1.0),
                "memory": {"peak_rss": peak + 900 * 2**20, "peak_rss_delta": peak, "rss_before_step": 900 * 2**20},
                "state_bytes": dict(pt["state"]),
            }
        )
    return mem


def _write_epochs(writer: RunWriter, pt: dict, status: str, n_epochs: int, base: float, rng) -> dict:
    """The run's epoch events (a preempted run's last one partial); what its summary reads of them."""
    wall, epoch_times = 0.0, []
    for e in range(n_epochs):
        partial = status == "preempted" and e == n_epochs - 1
        t = base * (1.25 if e == 0 else 1.0) * rng.uniform(0.95, 1.05) * (0.4 if partial else 1.0)
        done = max(1, int(pt["steps"] * 0.4)) if partial else pt["steps"]
        wall += t + 2.0
        epoch_times.append((t, partial))
        metric = (
            {"val_perplexity": 400.0 / (1 + e) * rng.uniform(0.98, 1.02), "val_loss": 6.0 - 0.4 * e}
            if pt["language"]
            else {"val_accuracy": min(0.95, 0.3 + 0.15 * e) * rng.uniform(0.98, 1.02), "val_loss": 2.0 - 0.2 * e}
        )
        mem = _ranks_memory(pt, t, rng)
        writer.record.append_event(_epoch_event(pt, e, done, t, partial, wall, mem, metric))
    peaks = [m["memory"]["peak_rss"] for m in mem]
    sps = pt["global_batch"] / (t / done)  # the last epoch's
    return dict(wall=wall, epoch_times=epoch_times, mem=mem, peaks=peaks, metric=metric, sps=sps)


def _epoch_event(pt: dict, e: int, done: int, t: float, partial: bool, wall: float, mem: list, metric: dict) -> dict:
    step = t / done
    phase = dict(zip(PHASES, (0.03 * step, 0.3 * step, 0.0, 0.55 * step, 0.1 * step)))
    peaks = [m["memory"]["peak_rss"] for m in mem]
    gb, params = pt["global_batch"], pt["params"]
    sps = gb / step
    return {
        "type": "epoch",
        "epoch": e,
        "steps": done,
        "timed_steps": done - (1 if e == 0 else 0),
        "warmup_steps_excluded": 1 if e == 0 else 0,
        "global_batch": gb,
        "devices": pt["devices"],
        "epoch_time_s": t,
        "partial": partial,
        "val_time_s": 1.5,
        "wall_time_s": wall,
        "step_time_mean_s": step,
        "step_time_p50_s": step * 0.99,
        "step_time_p95_s": step * 1.08,
        "step_time_cv": 0.03,
        **{f"{c}_time_mean_s": v for c, v in phase.items()},
        "data_share": 0.03,
        "samples_per_s": sps,
        "epoch_samples_per_s": gb * done / t,
        "tokens_per_s": sps * 32 if pt["language"] else None,
        "train_flops_per_sample": 6 * params * 32,
        "flops_per_s": sps * 6 * params * 32,
        "mfu": None,
        "mfu_note": None,
        "train_loss": 6.2 - 0.4 * e,
        "train_losses": None,
        "lr_epoch_start": 3e-4,
        "lrs": None,
        "memory_metric": "peak_rss",
        "peak_memory_max": max(peaks),
        "peak_memory_min": min(peaks),
        "ranks": mem,
        **metric,
    }


def _summary(pt: dict, status: str, n_epochs: int, run: dict) -> dict:
    whole = [t for t, p in run["epoch_times"] if not p]
    steady = [t for t, p in run["epoch_times"][1:] if not p]
    mem, metric, steps = run["mem"], run["metric"], pt["steps"]
    return {
        "status": status,
        "checkpoint": None,
        "startup_s": 4.0,
        "stop_signal": "SIGTERM" if status == "preempted" else None,
        "epochs_completed": n_epochs,
        "total_time_s": run["wall"],
        "steps": steps * n_epochs,
        "global_batch": pt["global_batch"],
        "local_batch": 8,
        "samples_dropped_per_epoch": 0,
        "data_workers": 2,
        "data_pipeline": {"pin_memory": False, "persistent_workers": True},
        "compile": None,
        "step_time_mean_s": whole[0] / steps if whole else None,
        "samples_per_s": run["sps"],
        "tokens_per_s": None,
        "epoch_time_mean_s": sum(whole) / len(whole) if whole else None,
        "epoch_time_mean_includes_partial": not whole,
        "epoch_time_steady_s": sum(steady) / len(steady) if steady else None,
        "timing": {"sync": True},
        "tf32": False,
        "warnings": [],
        "state_bytes_per_rank": [m["state_bytes"] for m in mem],
        "hosts": [m["host"] for m in mem],
        "val_loss": metric["val_loss"],
        "val_accuracy": metric.get("val_accuracy"),
        "val_perplexity": metric.get("val_perplexity"),
        "train_loss": 6.0,
        "peak_memory_max": max(run["peaks"]),
        "peak_memory_min": min(run["peaks"]),
        "mfu": None,
        "adapter_settings": None,
        "plan": None,
        "precision": "fp32",
        "predicted_memory": None,
        "comm_volume": None,
        "extra": {},
        "batch_reduced_from": None,
        "phase_semantics": {},
        "precision_semantics": "autocast",
        "batch_policy": "per_device",
        "warmup_steps": 1,
        "launcher": "local",
        "conventions": {},
        "frameworks_imported": [],
        "cpu_threads_per_rank": 1,
        "layout": pt["lay"],
    }


def write_records(root: Path, n: int, seed: int = 0) -> dict:
    """N records under root (a fresh folder); {status: count}."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    configs, env = Configs(), environment()
    counts: dict = {}
    for i in range(n):
        s = write_record(root, i, rng, configs, env)
        counts[s] = counts.get(s, 0) + 1
    (root / MARKER).write_text(json.dumps({"records": n, "seed": seed, "statuses": counts}))
    return counts


def time_report(records: Path, out: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Wall-clock seconds of `python -m ptbench.analysis report RECORDS --out OUT` as its own process."""
    if out.exists():
        shutil.rmtree(out)
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(records), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - t, proc


def contents(out: Path) -> dict:
    """What the report holds: figures (PNG), tables (CSV), report.md's sections."""
    md = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    return {
        "figures": len(list((out / "figures").glob("*.png"))),
        "tables": len(list(out.glob("*.csv"))),
        "sections": [ln[3:] for ln in md.splitlines() if ln.startswith("## ")],
    }


def run_one(n: int, folder: Path, seed: int) -> int:
    records, out = folder / "records", folder / "report"
    marker = records / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("records") == n:
        print(f"records: {n} reused from {records}", flush=True)
    else:
        if records.exists():
            shutil.rmtree(records)
        t = time.perf_counter()
        counts = write_records(records, n, seed)
        print(
            f"records: {n} written to {records} in {time.perf_counter() - t:.1f}s "
            f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))})",
            flush=True,
        )
    seconds, proc = time_report(records, out)
    if proc.returncode != 0:
        print(f"error: the report failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    c = contents(out)
    print(
        f"report_scale: records={n} seconds={seconds:.1f} figures={c['figures']} tables={c['tables']} "
        f"sections={len(c['sections'])} out={out}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.studies.report_scale", description=__doc__.splitlines()[0])
    p.add_argument(
        "--records", type=int, action="append", help="records to write (repeat for several sizes; default 1000)"
    )
    p.add_argument("--keep", metavar="DIR", help="keep records and report in DIR/<N>/ (records of the same N reused)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = args.records or [1000]
    if any(n < 1 for n in sizes):
        p.error("--records must be 1 or more")
    rc = 0
    for n in sizes:
        if args.keep:
            rc |= run_one(n, Path(args.keep) / str(n), args.seed)
        else:
            with tempfile.TemporaryDirectory(prefix="report-scale-") as tmp:
                rc |= run_one(n, Path(tmp), args.seed)
            print(f"report_scale: {tmp} deleted; --keep DIR keeps records and report", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
