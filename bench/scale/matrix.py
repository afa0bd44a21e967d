"""`python -m ptbench.scale --matrix`: every adapter x workload x W of the dry-run matrix, one subprocess per point
(each its own memory, and a time limit), then one table. What `make scale` runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
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
POINT_TIMEOUT_S = 150
LINE = re.compile(
    r"scale: adapter=(\S+) workload=(\S+) W=(\d+) comm_ratio=(\S+) memory_ratio_worst=(\S+) seconds=(\S+)"
)
HEADS = {"gpt2_small": 12, "gpt2_medium": 16}


def overrides(adapter: str, workload: str) -> list[str]:
    """A point's overrides: tensor parallel (torch's, Megatron's) within a node of 8 where the heads divide, else
    4; zero1-3 are adapter=zero at that stage (conf/adapter/zero3.yaml)."""
    out = [f"adapter={adapter}", f"workload={workload}", "results.experiment=scale"]
    if adapter in ("tensor_parallel", "megatron") and workload in HEADS:
        out.append(f"adapter.tensor_parallel={8 if HEADS[workload] % 8 == 0 else 4}")
    return out


def run_matrix(worlds=WORLDS, workloads=WORKLOADS, adapters=ADAPTERS, out: Path | None = None) -> list[dict]:
    """Every point; the adapters that cannot run on the fake backend get their one line, once."""
    from ptbench.scale.run import CANNOT_RUN

    rows: list[dict] = []
    t0 = time.perf_counter()
    for adapter in adapters:
        if adapter in CANNOT_RUN:
            print(f"scale: adapter={adapter} not run: {CANNOT_RUN[adapter]}", flush=True)
            rows.append(dict(adapter=adapter, why=CANNOT_RUN[adapter]))
            continue
        for workload in workloads:
            for world in worlds:
                row = _point(adapter, workload, world)
                rows.append(row)
                if "why" in row and world == worlds[0]:
                    break  # a refusal of the layout or the workload holds at every W: said once
    print(table(rows))
    print(detail(rows, "gpt2_medium"))
    print(f"scale: matrix of {len(rows)} rows in {time.perf_counter() - t0:.0f}s")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rows, indent=1))
    return rows


def _point(adapter: str, workload: str, world: int) -> dict:
    cmd = [sys.executable, "-m", "ptbench.scale", *overrides(adapter, workload), "--world-size", str(world)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=POINT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        why = f"over {POINT_TIMEOUT_S}s"
        print(f"scale: adapter={adapter} workload={workload} W={world} not run: {why}", flush=True)
        return dict(adapter=adapter, workload=workload, world_size=world, why=why)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    m = LINE.fullmatch(last)
    print(
        last if last else f"scale: adapter={adapter} workload={workload} W={world} exit {done.returncode}", flush=True
    )
    if not m:
        why = last.split(" not run: ", 1)[-1] if " not run: " in last else f"exit {done.returncode}"
        return dict(adapter=adapter, workload=workload, world_size=world, why=why)
    record = re.search(r"record: (\S+)", done.stdout)
    return dict(
        adapter=adapter,
        workload=workload,
        world_size=world,
        comm_ratio=_num(m[4]),
        memory_ratio_worst=_num(m[5]),
        seconds=float(m[6]),
        record=record[1] if record else None,
    )


def _num(text: str) -> float | None:
    return None if text == "n/a" else float(text)


def table(rows: list[dict]) -> str:
    lines = [f"{'adapter':<16}{'workload':<13}{'W':>6}{'comm ratio':>12}{'memory worst':>14}{'seconds':>9}"]
    for r in rows:
        if "workload" not in r:
            continue
        if "why" in r:
            lines.append(f"{r['adapter']:<16}{r['workload']:<13}{r['world_size']:>6}  not run: {r['why'][:90]}")
            continue
        comm = "n/a" if r["comm_ratio"] is None else f"{r['comm_ratio']:.4f}"
        mem = "n/a" if r["memory_ratio_worst"] is None else f"{r['memory_ratio_worst']:.4f}"
        lines.append(
            f"{r['adapter']:<16}{r['workload']:<13}{r['world_size']:>6}{comm:>12}{mem:>14}{r['seconds']:>9.1f}"
        )
    return "\n".join(lines)


def detail(rows: list[dict], workload: str) -> str:
    """One workload's points as bench/README.md shows them: memory per rank (the model's total against the
    tracker's peak) and bytes per step (formula against ledger), read back from each point's record."""
    lines = [
        f"{workload}: | adapter | W | memory per rank, model / tracker (GB) | ratio | bytes per step, formula / "
        "ledger (GB) | ratio |"
    ]
    for r in rows:
        if r.get("workload") != workload or not r.get("record"):
            continue
        d = json.loads((Path(r["record"]) / "summary.json").read_text())["dry_run"]
        mem, comm = d["memory"]["parts"]["total"], d["comm"]
        lines.append(
            f"| {r['adapter']} | {r['world_size']} | {mem['model'] / 1e9:.2f} / {mem['tracker'] / 1e9:.2f} | "
            f"{mem['ratio']:.4f} | {comm['formula'] / 1e9:.3f} / {comm['ledger'] / 1e9:.3f} | {comm['ratio']:.4f} |"
        )
    return "\n".join(lines)
