"""`python -m ptbench.scale --matrix`: every adapter x workload x W x (first, last rank) of the dry-run matrix, then
one table and GPT-2 medium's detail. What `make scale` runs.

The frameworks are imported once, here; each point then runs in a child forked from this process: its own memory
(its max RSS read back by wait4), the frameworks' global state as imported (DeepSpeed's and Megatron's groups are
module globals), and a time limit. `jobs` children run at once. A point over POINT_LIMIT_S is stopped and said in
one line with the command that runs it alone; its group's larger W are then not started (they take longer).
The models compared (ptbench.core.memory_model, comm_volume, bench/scale/compare.py) are imported by each point, not
here: a point compares with the code on disk when it starts, against the modules this process imported at its start
(code edited during a run can meet its older half: run the matrix again).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("gpt2_small", "gpt2_medium", "resnet50", "vgg16")
ADAPTERS = (
    "fsdp",
    "tensor_parallel",
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "megatron",
    "pipeline",
    "pipedream",
    "gpipe",
    "horovod",
)
WORLDS = (8, 64, 256, 1024)
RANKS = ("0", "last")
POINT_LIMIT_S = 120  # of the point's CPU time (its wall time on a quiet machine: one thread)
WALL_FACTOR = 8  # ... and its wall time may be this many times that on a shared machine
MEMORY_LIMIT_GIB = 8.0
LINE = re.compile(
    r"scale: adapter=(\S+) workload=(\S+) W=(\d+) comm_ratio=(\S+) memory_ratio_worst=(\S+) seconds=(\S+)"
)
HEADS = {"gpt2_small": 12, "gpt2_medium": 16}
# points that cannot fit POINT_LIMIT_S on this machine, measured: said in one line with their command, not started
_ZERO3 = (
    "DeepSpeed's ZeRO-3 slices every gradient and every gathered parameter into W pieces each step "
    "(reduce_scatter_coalesced, the all-gather's partitions), each a FakeTensor operator: gpt2_medium took 44 s of "
    "CPU at W=64 and was stopped at 120 s at W=256 (2026-12-02)"
)
SLOW: dict[tuple[str, str, int], str] = {
    ("zero3", "gpt2_medium", 256): _ZERO3,
    ("zero3", "gpt2_medium", 1024): _ZERO3,
    ("zero3", "gpt2_small", 1024): _ZERO3 + "; gpt2_small has half its tensors, and 4 x the slices at 1024",
}


@dataclass(frozen=True)
class Point:
    adapter: str
    workload: str
    world_size: int
    rank: str  # "0" or "last"
    extra: tuple = ()  # overrides given to every point

    def overrides(self) -> list[str]:
        return [*overrides(self.adapter, self.workload), *self.extra]

    def command(self) -> str:
        args = " ".join(self.overrides())
        return f"python -m ptbench.scale {args} --world-size {self.world_size} --rank {self.rank}"


def overrides(adapter: str, workload: str) -> list[str]:
    """A point's overrides: tensor parallel (torch's, Megatron's) within a node of 8 where the heads divide, else
    4; a pipeline of 4 stages; zero1-3 are adapter=zero at that stage (conf/adapter/zero3.yaml)."""
    out = [f"adapter={adapter}", f"workload={workload}", "results.experiment=scale"]
    if adapter in ("tensor_parallel", "megatron") and workload in HEADS:
        out.append(f"adapter.tensor_parallel={8 if HEADS[workload] % 8 == 0 else 4}")
    if adapter == "pipeline":  # its default is a stage per rank: 4 stages, data parallel across the rest
        out += ["adapter.pipeline_parallel=4", "adapter.microbatches=4", "adapter.batch_policy=per_device"]
    return out


def points(
    worlds=WORLDS, workloads=WORKLOADS, adapters=ADAPTERS, ranks=RANKS, extra=()
) -> tuple[list[Point], list[dict]]:
    """The points to run, and a row for each adapter that cannot run on the fake backend (one line, once)."""
    from ptbench.scale.run import CANNOT_RUN

    out, rows = [], []
    for adapter in adapters:
        if adapter in CANNOT_RUN:
            rows.append(dict(adapter=adapter, why=CANNOT_RUN[adapter], kind="cannot_run"))
            continue
        out += [Point(adapter, m, w, r, tuple(extra)) for m in workloads for w in worlds for r in ranks]
    # W by W: the small worlds of every adapter first (a group's larger W is skipped once a smaller one ran over)
    return sorted(out, key=lambda p: worlds.index(p.world_size)), rows


def run_matrix(
    worlds=WORLDS, out=None, run_point=None, jobs: int = 2, limit_s: float = POINT_LIMIT_S, extra=(), **select
) -> list[dict]:
    """Every point (`run_point(overrides, W, rank, record)`: one point's table, record and summary line, exit
    status), `jobs` at once, each stopped after `limit_s`; prints each point's line as it ends, then the tables.
    `select`: adapters=, workloads= (default: all); `extra`: overrides for every point."""
    todo, rows = points(worlds, extra=extra, **select)
    for r in rows:
        print(f"scale: adapter={r['adapter']} not run: {r['why']}", flush=True)
    t0 = time.perf_counter()
    _warm({p.adapter for p in todo})
    print(f"scale: frameworks imported in {time.perf_counter() - t0:.0f}s; {len(todo)} points, {jobs} at once")
    rows += _run_all(todo, run_point, jobs, limit_s, Path(tempfile.mkdtemp(prefix="ptbench-scale-")))
    wall = time.perf_counter() - t0
    print(table(rows))
    print(detail(rows, "gpt2_medium"))
    ran = [r for r in rows if r.get("kind") == "ok"]
    print(
        f"scale: matrix of {len([r for r in rows if 'workload' in r])} points ({len(ran)} run, "
        f"{sum(r['seconds'] for r in ran):.0f}s of points, {sum(r['cpu'] for r in ran):.0f}s of their CPU) in "
        f"{wall:.0f}s wall, {jobs} at once"
    )
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(wall_seconds=wall, jobs=jobs, rows=rows), indent=1))
    return rows


def _warm(adapters: set[str]) -> None:
    """Import what every point imports, once, before the first fork (each child then starts warm). Nothing is
    computed here: no thread pool is started that a forked child would inherit half-made."""
    import ptbench.scale.point  # noqa: F401
    import ptbench.scale.standins  # noqa: F401
    from ptbench.adapters import get_adapter_class
    from ptbench.runner.compose import compose, typed

    typed(compose(["workload=gpt2_tiny"]))  # Hydra's config store and schemas
    for name in {"zero" if a.startswith("zero") else a for a in adapters}:
        get_adapter_class(name)
    if adapters & {"zero1", "zero2", "zero3"}:
        from ptbench.adapters.zero import _import_deepspeed

        _import_deepspeed()
        import deepspeed.runtime.zero.stage3  # noqa: F401
    if "megatron" in adapters:
        import megatron.core.parallel_state  # noqa: F401


def _run_all(todo: list[Point], run_point, jobs: int, limit_s: float, logs: Path) -> list[dict]:
    """Run the points in forked children, `jobs` at once; a row per point, in the matrix's order."""
    pending, running, done = deque(todo), {}, {}
    over: dict[tuple[str, str], int] = {}  # group -> the W at which a point ran over the limit
    while pending or running:
        while pending and len(running) < jobs:
            busy = {(q.adapter, q.workload): q.world_size for q, *_ in running.values()}
            # not beside a smaller W of its group, which may yet run over the limit
            p = next((q for q in pending if busy.get((q.adapter, q.workload), q.world_size) >= q.world_size), None)
            if p is None:
                break
            pending.remove(p)
            why = SLOW.get((p.adapter, p.workload, p.world_size))
            if why is None and (p.adapter, p.workload) in over and p.world_size > over[(p.adapter, p.workload)]:
                why = f"W={over[(p.adapter, p.workload)]} was over {limit_s:g}s of CPU, and a larger W takes longer"
            if why is not None:
                done[p] = _emit(p, dict(kind="skipped", why=f"{why}; alone: {p.command()}"))
                continue
            log = logs / f"{p.adapter}-{p.workload}-w{p.world_size}-{p.rank}.log"
            running[_fork(p, run_point, log)] = (p, time.perf_counter(), log, [False])
        if not running:  # every point left was skipped
            continue
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            for child, (p, start, _, killed) in running.items():
                if not killed[0] and _spent(child, start) > limit_s:
                    os.kill(child, signal.SIGKILL)
                    killed[0] = True
                    over[(p.adapter, p.workload)] = min(p.world_size, over.get((p.adapter, p.workload), 1 << 30))
            time.sleep(0.1)
            continue
        p, start, log, killed = running.pop(pid)
        row = _row(p, log, status, usage.ru_maxrss / 2**20, killed[0], limit_s)  # ru_maxrss: KiB on Linux
        # the child's own CPU time beside its wall time: on a machine shared with other jobs the wall time is theirs too
        row.update(wall=round(time.perf_counter() - start, 1), cpu=round(usage.ru_utime + usage.ru_stime, 1))
        done[p] = _emit(p, row)
    return [dict(adapter=p.adapter, workload=p.workload, world_size=p.world_size, rank=p.rank, **done[p]) for p in todo]


def _spent(pid: int, start: float) -> float:
    """A running child's CPU seconds (/proc/PID/stat utime + stime): a point is single-threaded, so on a quiet
    machine this is its wall time, and on one shared with other jobs it is still the point's own; its wall time
    over WALL_FACTOR x the limit stops it too. The wall time where /proc is not there."""
    wall = time.perf_counter() - start
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return wall
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return max(cpu, wall / WALL_FACTOR)


def _fork(p: Point, run_point, log: Path) -> int:
    """A child that runs one point with its output in `log`, and exits with the point's status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = run_point(p.overrides(), p.world_size, p.rank, True)
    except BaseException:  # noqa: BLE001 - the child never returns into the parent's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _row(p: Point, log: Path, status: int, rss_gib: float, killed: bool, limit_s: float) -> dict:
    """A finished child's row: its summary line's numbers, or why it has none."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.strip().splitlines()
    summary = next((m for m in map(LINE.fullmatch, reversed(lines)) if m), None)
    if killed:
        why = f"over {limit_s:g}s of CPU (stopped); alone: {p.command()}"
        return dict(kind="over", why=why, max_rss_gib=rss_gib)
    if summary is None:
        refused = next((x.split(" not run: ", 1)[1] for x in lines if " not run: " in x), None)
        if refused is not None:
            return dict(kind="refused", why=refused)
        code = os.waitstatus_to_exitcode(status)
        last = lines[-1][:200] if lines else ""
        return dict(kind="failed", why=f"exit {code}: {last}; alone: {p.command()}", max_rss_gib=rss_gib)
    record = re.search(r"record: (\S+)", text)
    row = dict(
        kind="ok",
        comm_ratio=_num(summary[4]),
        memory_ratio_worst=_num(summary[5]),
        seconds=float(summary[6]),
        max_rss_gib=round(rss_gib, 2),
        record=record[1] if record else None,
    )
    if rss_gib > MEMORY_LIMIT_GIB:
        row["limit"] = f"over the {MEMORY_LIMIT_GIB:g} GiB limit of a point"
    return row


def _emit(p: Point, row: dict) -> dict:
    """The point's one line as it ends."""
    if row["kind"] == "ok":
        line = (
            f"scale: adapter={p.adapter} workload={p.workload} W={p.world_size} comm_ratio={_fmt(row['comm_ratio'])} "
            f"memory_ratio_worst={_fmt(row['memory_ratio_worst'])} seconds={row['seconds']:.1f} rank={p.rank} "
            f"cpu_seconds={row['cpu']:.1f} max_rss_gib={row['max_rss_gib']:.2f}"
        )
    else:
        line = f"scale: adapter={p.adapter} workload={p.workload} W={p.world_size} rank={p.rank} not run: {row['why']}"
    print(line, flush=True)
    return row


def _num(text: str) -> float | None:
    return None if text == "n/a" else float(text)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    """adapter x workload x W x rank: comm ratio, worst memory ratio, seconds, max RSS; a refusal that holds at
    every W and rank of a workload once."""
    head = f"{'adapter':<16}{'workload':<13}{'W':>6}{'rank':>6}{'comm ratio':>12}{'memory worst':>14}{'seconds':>9}"
    lines = [head + f"{'CPU s':>8}{'RSS GiB':>9}"]
    said: set[tuple[str, str, str]] = set()
    for r in rows:
        if "workload" not in r:
            continue
        at = f"{r['adapter']:<16}{r['workload']:<13}{r['world_size']:>6}{r['rank']:>6}"
        if r["kind"] == "ok":
            lines.append(
                at + f"{_fmt(r['comm_ratio']):>12}{_fmt(r['memory_ratio_worst']):>14}{r['seconds']:>9.1f}"
                f"{r['cpu']:>8.1f}{r['max_rss_gib']:>9.2f}" + (f"  {r['limit']}" if r.get("limit") else "")
            )
        elif (r["adapter"], r["workload"], r["why"]) not in said:
            said.add((r["adapter"], r["workload"], r["why"]))
            lines.append(at + f"  {r['kind']}: {r['why'][:150]}")
    return "\n".join(lines)


# The link a projection assumes: 8 GPUs a node. NVLink 4 with NVSwitch: 900 GB/s per GPU both directions, 450 GB/s
# each way; 400 Gb/s InfiniBand NDR per GPU (MLCommons inference v4.1, NVIDIA's H200-SXM-141GBx8 system: "18x 4th
# Gen NVLink, 900GB/s", "10x 400Gbe Infiniband", 8 of them the GPUs'). A ring inside a node runs at the NVLink
# rate; a ring across nodes crosses them on 8 NICs at once (NCCL's channels), 8 x 50 GB/s = 400 GB/s of bus
# bandwidth. Bus bytes over those rates (nccl-tests' busbw): the time of the collectives with no overlap, no latency.
LINK = dict(gpus_per_node=8, nvlink_bus_gbps=450.0, ib_bus_gbps=400.0)
# ... and the compute beside it, an assumption: 40 % of an H200's dense BF16 peak (989 TFLOP/s: NVIDIA's datasheet
# gives 1,979 with sparsity), on the plan's training FLOPs of this rank's share of the step
COMPUTE_FLOPS = 0.4 * 989e12


def comm_seconds(ledger: list[dict], tp: int) -> float:
    """The step's collectives on LINK: a tensor-parallel group (size tp <= 8, ranks adjacent) inside a node, the
    rest across nodes; send/recv of a pipeline across nodes at one NIC's 50 GB/s."""
    total = 0.0
    for row in ledger:
        inside = row["group_size"] <= LINK["gpus_per_node"] and row["group_size"] == tp and tp > 1
        rate = LINK["nvlink_bus_gbps"] if inside else LINK["ib_bus_gbps"]
        if row["op"] in ("send_recv", "recv"):
            rate = LINK["ib_bus_gbps"] / LINK["gpus_per_node"]
            if row["op"] == "recv":
                continue  # the peer's send
        total += row["bytes"] / (rate * 1e9)
    return total


def detail(rows: list[dict], workload: str) -> str:
    """One workload's points as bench/README.md shows them (rank 0): memory per rank (the model's total against
    the tracker's peak), bytes per step (formula against ledger), and the collectives' projected time on LINK,
    read back from each point's record; a ratio outside 1 % (comm) or 5 % (memory) is marked *."""
    lines = [
        f"{workload}, rank 0: | adapter | W | memory per rank, model / tracker (GB) | ratio | bytes per step, "
        "formula / ledger (GB) | ratio | projection on LINK: comm + compute = step (ms) |"
    ]
    for r in rows:
        if r.get("workload") != workload or r.get("rank") != "0" or not r.get("record"):
            continue
        s = json.loads((Path(r["record"]) / "summary.json").read_text())
        d, layout, plan = s["dry_run"], s.get("layout") or {}, s.get("plan") or {}
        tp, pp = int(layout.get("tp") or 1), int(layout.get("pp") or 1)
        mem, comm = d["memory"]["parts"]["total"], d["comm"]
        wire = comm_seconds(d["ledger"], tp) * 1e3
        # this rank's share of its replica's step: 1/tp of each layer, 1/pp of the layers
        compute = plan["train_flops_per_sample"] * plan["local_batch"] / (tp * pp) / COMPUTE_FLOPS * 1e3
        lines.append(
            f"| {r['adapter']} | {r['world_size']} | {mem['model'] / 1e9:.2f} / {mem['tracker'] / 1e9:.2f} | "
            f"{_mark(mem['ratio'], 0.05)} | {comm['formula'] / 1e9:.3f} / {comm['ledger'] / 1e9:.3f} | "
            f"{_mark(comm['ratio'], 0.01)} | {wire:.1f} + {compute:.1f} = {wire + compute:.1f} |"
        )
    return "\n".join(lines)


def _mark(ratio: float | None, tolerance: float) -> str:
    return "n/a" if ratio is None else f"{ratio:.4f}" + (" *" if abs(ratio - 1) > tolerance else "")
