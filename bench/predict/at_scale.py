"""Predict at W from a dry run: `python -m ptbench.scale ... --world-size W` ran one rank of W on torch's fake
process group and recorded (status dry_run, `dry_run` in bench/core/schema.py) the collectives that rank issued
per step and its memory per category.

A target at W takes its collectives from that ledger (op, group size, calls and each call's padded buffer, as the
framework issued them) instead of the comm formula's params x dtype, which misses padding and what a framework
keeps gathered, and its memory per rank from the dry run's tracker, with the memory model's figure beside it. A
dry run matches a target of the same series, workload and model size (FLOPs per sample), precision, local batch
and micro-batch count at W; of several ranks, the one with the highest peak (a pipeline's stages differ). It
measures no time: the step still takes ptbench.comm's fit at the ledger's group sizes and the calibration runs'
compute, and is refused, in one line, where they do not reach (more ranks than this machine's cores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptbench.core.readers import read_record, read_yaml, record_files, skipped
from ptbench.predict.points import Point, series_of, shape_of


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class DryRun:
    path: str
    series: str
    workload: str
    world_size: int
    rank: int
    shape: tuple
    local_batch: int
    microbatches: int
    ledger: tuple  # the last step's rows: op, group_size, count, buffer_bytes, bytes (bus)
    ledger_bytes: float  # bus bytes per step
    formula_bytes: float | None  # the comm formula's, at the same layout
    tracker_peak: int | None  # torch's MemTracker, this rank's peak
    model_peak: int | None  # the memory model's, at the tracker's peak (dry_run.memory), else predicted_memory

    @property
    def key(self) -> tuple:
        return (self.series, self.workload, self.shape, self.local_batch, self.microbatches, self.world_size)


def _dry_run(path: Path, s: dict) -> DryRun:
    d, plan, layout = s["dry_run"], s.get("plan") or {}, s.get("layout") or {}
    comm, tracker = d.get("comm") or {}, d.get("tracker") or {}
    total = ((d.get("memory") or {}).get("parts") or {}).get("total") or {}  # the model at the tracker's peak
    ledger = tuple(dict(r) for r in d.get("ledger") or [])
    return DryRun(
        path=str(path.parent),
        series=series_of(s),
        workload=str(s.get("workload") or ""),
        world_size=int(s.get("world_size") or layout.get("world_size")),
        rank=int(d.get("rank") or 0),
        shape=shape_of(s),
        local_batch=int(plan.get("local_batch") or 0),
        microbatches=int(layout.get("microbatches") or 1),
        ledger=ledger,
        ledger_bytes=float(comm.get("ledger") or sum(float(r["bytes"]) for r in ledger)),
        formula_bytes=float(comm["formula"]) if comm.get("formula") is not None else None,
        tracker_peak=int(tracker["peak_total"]) if tracker.get("peak_total") is not None else None,
        model_peak=int(total.get("model") or (s.get("predicted_memory") or {}).get("total") or 0) or None,
    )


def load_dry_runs(root: Path) -> list[DryRun]:
    """Every dry-run record under root (status dry_run with its `dry_run` measurements)."""
    out = []
    for path in record_files(root, "summary.json"):
        s = read_record(path)
        if not s or s.get("status") != "dry_run" or not isinstance(s.get("dry_run"), dict):
            continue
        try:
            out.append(_dry_run(path, s))
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # fields of the wrong type
            skipped(f"{path.parent}: {type(e).__name__}: {e}")
    return out


def match(target: Point, dry: list[DryRun]) -> DryRun | None:
    """The dry run of the target's point at its W; of several ranks, the busiest (highest tracker peak)."""
    key = (target.series, target.workload, target.shape, target.local_batch, target.microbatches, target.world_size)
    mine = [d for d in dry if d.key == key]
    return max(mine, key=lambda d: d.tracker_peak or 0) if mine else None


def ledger_collectives(d: DryRun) -> list[dict]:
    """The ledger in comm_volume's form: per (op, group size), its calls and the mean buffer of a call (the
    alpha-beta is linear in the size between measured sizes, so the mean gives the same total). Groups of one
    move nothing."""
    return [
        dict(
            name=f"dry_run_{r['op']}",
            op=r["op"],
            group="dry_run",
            group_size=int(r["group_size"]),
            message_bytes=float(r["buffer_bytes"]) / int(r["count"]),
            calls=float(r["count"]),
        )
        for r in d.ledger
        if int(r["group_size"]) > 1 and int(r["count"]) > 0
    ]


def with_dry_run(target: Point, d: DryRun) -> Point:
    return replace(
        target,
        collectives=ledger_collectives(d),
        collectives_from=f"dry run at W={d.world_size}",
        memory_bytes=d.tracker_peak,
    )


def describe(d: DryRun) -> str:
    """One line: the ledger's collectives and bytes beside the formula's, the memory per rank beside the model's."""
    calls = " + ".join(f"{int(r['count'])} {r['op']}" for r in d.ledger if int(r["group_size"]) > 1) or "none"
    formula = f" (params x dtype formula {d.formula_bytes / 1e6:.1f} MB)" if d.formula_bytes is not None else ""
    model = f", memory model {size(d.model_peak)}" if d.model_peak else ""
    mem = f"{size(d.tracker_peak)}/rank (tracker{model})" if d.tracker_peak else "n/a"
    return (
        f"dry run at W={d.world_size} rank {d.rank} ({d.path}): {calls} per step, {d.ledger_bytes / 1e6:.1f} MB bus"
        f"{formula}; memory {mem}"
    )


def overrides_of(adapter: str, workload: str, run_dir: str | None, data: bool = False, **settings) -> list[str]:
    """A run's adapter, workload and batch as overrides (with `data`, its length and synthetic data's size too:
    what a training run needs to repeat it), from its config.yaml (the record holds the config, not the command line);
    `settings` replace adapter fields (stage=2)."""
    import yaml

    cfg = {}
    if run_dir and (Path(run_dir) / "config.yaml").is_file():
        try:
            cfg = read_yaml(Path(run_dir) / "config.yaml") or {}
        except (OSError, ValueError, yaml.YAMLError):
            cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    a, w, t, d = ({**(cfg.get(k) or {})} for k in ("adapter", "workload", "trainer", "data"))
    a.update(settings)
    sizes = ("seq_len", "vocab_size") if w.get("kind", "language") == "language" else ("image_size",)
    over = [f"adapter={adapter}", f"workload={workload}"]
    over += [
        f"adapter.{k}={a[k]}" for k in ("stage", "tensor_parallel", "pipeline_parallel", "microbatches") if a.get(k)
    ]
    over += [f"workload.{k}={w[k]}" for k in sizes if w.get(k) is not None]
    over += [f"trainer.{k}={t[k]}" for k in ("batch_size", "precision") if t.get(k) is not None]
    if data:  # as long as the run was: a default-length run may have no timed step left on small data
        over += [f"trainer.{k}={t[k]}" for k in ("epochs", "max_steps", "untimed_steps") if t.get(k)]
    if data and d.get("source") == "synthetic":
        over += ["data=synthetic", *(f"data.{k}={d[k]}" for k in ("train_samples", "val_samples") if d.get(k))]
    return over


def make_one(target: Point, run_dir: str | None, root: Path) -> str:
    """The command that writes the dry run this target needs, from a calibration run's config."""
    over = " ".join(overrides_of(target.adapter, target.workload, run_dir))
    return f"python -m ptbench.scale {over} results.root={root} --world-size {target.world_size}"


def missing(target: Point, dry: list[DryRun], run_dir: str | None, root: Path) -> str:
    """One line: no dry run at the target's W, what dry runs of its series there are, and the command."""
    near = sorted({d.world_size for d in dry if d.series == target.series and d.workload == target.workload})
    have = f" (its dry runs: W={','.join(map(str, near))})" if near else ""
    return (
        f"no dry run at W={target.world_size}{have}: its collectives are the comm formula's "
        f"(params x dtype, no padding); make one: {make_one(target, run_dir, root)}"
    )
