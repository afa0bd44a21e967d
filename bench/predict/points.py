"""A results folder -> measured points and ptbench.comm reports, read from the records' JSON only.

A point is one (series, workload, world size, micro-batches, local batch, link rate): its runs (repeats) pooled.
The series is the adapter with the settings that change its compute (ZeRO stage, schedule, tp, pp). The link rate
(Mbit/s) of a record or a comm report is its `extra.link_mbit` (a run's `+extra.link_mbit=300`), else the number
in the nearest folder above it named `link-<N>mbit` (what `python -m ptbench.predict validate` writes); None when
neither says (the link the machine has).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ptbench.core.comm_volume import ring_factor
from ptbench.core.readers import Unreadable, comm_reports, jsonl, readable, skipped, summaries

CONTENTION = "contention:"  # how a record's warnings of a loaded machine start (bench/runner/checks.py, contention.py)
LINK_DIR = re.compile(r"^link-(\d+(?:\.\d+)?)mbit$")


class PredictError(ValueError):
    """Bad input or a target outside what the model was calibrated for: one line for the user."""


def link_of(path: Path, extra) -> float | None:
    if isinstance(extra, dict) and extra.get("link_mbit") is not None:
        return float(extra["link_mbit"])
    for parent in path.parents:
        if m := LINK_DIR.match(parent.name):
            return float(m.group(1))
    return None


def series_of(s: dict) -> str:
    """The adapter and the settings that change what a rank computes per step (not the device count,
    micro-batch count or link: those the model predicts across)."""
    settings = s.get("adapter_settings") or {}
    layout = s.get("layout") or {}
    parts = [s.get("adapter") or "?"]
    if settings.get("stage") is not None:
        parts.append(f"stage={settings['stage']}")
    if settings.get("schedule") and (layout.get("pp") or 1) > 1:
        parts.append(f"schedule={settings['schedule']}")
    for key in ("tp", "pp"):
        if (layout.get(key) or 1) > 1:
            parts.append(f"{key}={layout[key]}")
    return " ".join(parts)


def shape_of(s: dict) -> tuple:
    """The workload's size as a record states it (training FLOPs per sample: its parameters and sequence or image)
    and the precision: a dry run and a measured run of one workload name can differ in both."""
    return ((s.get("plan") or {}).get("train_flops_per_sample"), s.get("precision"))


@dataclass
class Point:
    series: str
    adapter: str
    world_size: int
    microbatches: int
    link: float | None
    workload: str = ""
    local_batch: int = 0
    steps: list[float] = field(default_factory=list)  # step-time mean of each run
    epoch_steps: list[float] = field(default_factory=list)  # of each epoch of each run (spread of one run)
    epoch_ratio: float = 0.0  # epoch time / step time (steps per epoch and what lies outside steps)
    global_batch: int = 0
    batch_policy: str = ""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    collectives: list[dict] = field(default_factory=list)
    memory_bytes: int | None = None
    exposed_measured: float | None = None  # trainer.profile: exposed / time in collectives, over the ranks
    collectives_from: str = "formula"  # or "trace": the profiled step's collectives (profile.ranks[].by_kind)
    cpu: bool = True
    run_dirs: list[str] = field(default_factory=list)
    fb_steps: list[float] = field(default_factory=list)  # forward + backward per step, each run (the epochs' phases)
    contention: list[str] = field(default_factory=list)  # each run's first `contention:` warning, "" for a quiet run
    shape: tuple = ()  # the model's size and precision (`shape_of`): what a dry run at W must share

    @property
    def key(self) -> tuple:
        return (self.series, self.workload, self.world_size, self.microbatches, self.local_batch, self.link)

    @property
    def contended(self) -> int:
        """Runs of this point whose record warns of contention (bench/runner/contention.py): a loaded machine's
        times, which the report keeps out of its verdicts."""
        return sum(1 for c in self.contention if c)

    @property
    def step(self) -> float:
        return statistics.fmean(self.steps)

    @property
    def spread(self) -> float:
        """Run-to-run noise: half the range of the repeats' step times over their mean (of the epochs when
        the point ran once), as a fraction."""
        vals = self.steps if len(self.steps) > 1 else self.epoch_steps
        if len(vals) < 2:
            return 0.0
        return (max(vals) - min(vals)) / 2 / statistics.fmean(vals)

    def label(self) -> str:
        link = f"{self.link:g} Mbit/s" if self.link is not None else "-"
        return f"{self.series} | n={self.world_size} m={self.microbatches} b={self.local_batch} | {link}"


FB = ("forward_time_mean_s", "backward_time_mean_s", "forward_backward_time_mean_s")


def _epoch_steps(run: Path, window) -> tuple[list[float], list[float]]:
    """Each epoch's step-time mean, and its forward + backward time per step (the phases; the optimizer step and
    data loading left out); a profiled run's epochs that hold its profiled steps (trainer.profile's window,
    global steps) left out when another epoch is clean: the profiler slows the steps it records."""
    out, first = [], 0
    try:  # bounded: a record folder may be another user's (a line that is not JSON is left out)
        lines = [e for _, e in jsonl(run / "events.jsonl")]
    except Unreadable as e:
        skipped(str(e))
        return [], []
    except OSError:
        return [], []
    for e in lines:
        if isinstance(e, dict) and e.get("type") == "epoch" and e.get("step_time_mean_s"):
            steps = int(e.get("steps") or 0)
            profiled = bool(window) and first < window["start"] + window["count"] and window["start"] < first + steps
            out.append((float(e["step_time_mean_s"]), sum(float(e.get(k) or 0) for k in FB), profiled))
            first += steps
    kept = [o for o in out if not o[2]] or out
    return [t for t, _, _ in kept], [fb for _, fb, _ in kept if fb > 0]


def _on_cpu(run: Path) -> bool:
    env = readable(run / "env.json") or {}
    return not env.get("gpu_count")


def _exposed_fraction(prof) -> float | None:
    ranks = prof.get("ranks") if isinstance(prof, dict) else None
    if not ranks:
        return None
    comm = sum(float(r.get("comm_time_s") or 0) for r in ranks)
    return sum(float(r.get("exposed_comm_s") or 0) for r in ranks) / comm if comm > 0 else None


OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def _traced_collectives(prof, formula: list[dict], world: int) -> list[dict]:
    """The collectives a profiled step ran (the traces' c10d operators, per kind: calls and bytes per step, the
    busiest rank's), in comm_volume's form: one item per kind at its mean message size (the alpha-beta model is
    linear in the size, so the mean gives the same total). Collectives the formula leaves out (a pipeline's tied
    embedding all-reduce, Megatron's vocabulary all-reduces) are in it. The group is the formula's for that kind,
    else all ranks; send/recv are activations (they scale with the micro-batches)."""
    ranks = prof.get("ranks") if isinstance(prof, dict) else None
    out = []
    for op in OPS:
        seen = [r["by_kind"][op] for r in ranks or [] if isinstance(r.get("by_kind"), dict) and op in r["by_kind"]]
        calls = max((float(k.get("calls") or 0) for k in seen), default=0.0)
        bus = max((float(k.get("bus_bytes") or 0) for k in seen), default=0.0)
        like = next((c for c in formula if c["op"] == op), {"group": "world", "group_size": world})
        # the message bytes that cross the link, from the bus bytes: the traces' message bytes also hold
        # collectives over groups of one (Megatron's data-parallel group at dp=1), which move nothing
        total = bus / ring_factor(op, int(like["group_size"])) if int(like["group_size"]) > 1 else 0.0
        if not calls or not total:
            continue
        name = "traced_activation_send_recv" if op == "send_recv" else f"traced_{op}"
        out.append(
            dict(
                name=name,
                op=op,
                group=like["group"],
                group_size=like["group_size"],
                message_bytes=total / calls,
                calls=calls,
            )
        )
    return out


def load_points(root: Path) -> list[Point]:
    """Every finished run under root (status ok, a step time and a communication volume), pooled by point."""
    points: dict[tuple, Point] = {}
    for path, s in summaries([root]):
        if s.get("status") != "ok" or not s.get("step_time_mean_s"):
            continue
        try:
            _add_point(points, path, s)
        except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as e:  # fields of the wrong type
            skipped(f"{path.parent}: {type(e).__name__}: {e}")
    return list(points.values())


def _add_point(points: dict, path: Path, s: dict) -> None:
    """The record `s` (at `path`) into its point of `points`, when it has a communication volume."""
    cv = s.get("comm_volume") or {}
    if "collectives" not in cv:
        return
    layout = s.get("layout") or {}
    p = Point(
        series=series_of(s),
        adapter=s.get("adapter") or "?",
        world_size=int(s.get("world_size") or layout.get("world_size") or 1),
        microbatches=int(layout.get("microbatches") or 1),
        link=link_of(path, s.get("extra")),
        workload=str(s.get("workload") or ""),
        local_batch=int(s.get("local_batch") or 0),
    )
    p = points.setdefault(p.key, p)
    window = (s.get("profile") or {}).get("window") if isinstance(s.get("profile"), dict) else None
    epochs, fb = _epoch_steps(path.parent, window)
    p.steps.append(statistics.fmean(epochs) if window and epochs else float(s["step_time_mean_s"]))
    p.epoch_steps += epochs
    if fb:
        p.fb_steps.append(statistics.fmean(fb))
    epoch = s.get("epoch_time_steady_s") or s.get("epoch_time_mean_s")
    if epoch:
        p.epoch_ratio = float(epoch) / float(s["step_time_mean_s"])
    p.global_batch = int(s.get("global_batch") or 0)
    p.shape = shape_of(s)
    p.batch_policy = s.get("batch_policy") or ""
    p.dp, p.tp, p.pp = (int(layout.get(k) or 1) for k in ("dp", "tp", "pp"))
    p.collectives = cv["collectives"]
    p.memory_bytes = (s.get("predicted_memory") or {}).get("total")
    p.cpu = _on_cpu(path.parent)
    if (fraction := _exposed_fraction(s.get("profile"))) is not None:
        p.exposed_measured = fraction
    if traced := _traced_collectives(s.get("profile"), cv["collectives"], p.world_size):
        p.collectives, p.collectives_from = traced, "trace"
    p.run_dirs.append(str(path.parent))
    p.contention.append(next((str(w) for w in s.get("warnings") or [] if str(w).startswith(CONTENTION)), ""))


@dataclass
class CommReport:
    world_size: int
    link: float | None
    rows: list[dict]  # ptbench.comm's results: op, bytes (S), time_s
    path: str


def load_comm(root: Path, folder: str = "comm") -> list[CommReport]:
    """Every `python -m ptbench.comm --out` report under root (a comm/ folder, as a sweep stores it)."""
    out = []
    for path, rep in comm_reports(root, folder):
        try:
            rows = [r for r in rep.get("results") or [] if r.get("time_s") and not r.get("wrong")]
            out.append(CommReport(int(rep["world_size"]), link_of(path, rep.get("extra")), rows, str(path)))
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            skipped(f"{path}: {type(e).__name__}: {e}")
    return out
