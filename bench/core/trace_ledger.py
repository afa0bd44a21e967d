"""What a profiler trace says about communication, overlap and the pipeline bubble: pure functions on
Chrome-trace dicts (torch.profiler's `export_chrome_trace`), no torch at import.

The runner (bench/runner/profiling.py) profiles a window of steps and marks, in the trace:
- each profiled step: a user annotation `ptbench.step#G` (G = the global step) around `adapter.train_step`;
- each collective called through torch.distributed's Python functions: `ptbench.comm:OP:N:DESC` (N = the
  process group's size, DESC its description), around the dispatcher op `c10d::...` it issues;
- each pipeline stage's work on one micro-batch: `ptbench.stage:fwd` / `ptbench.stage:bwd`.

Bytes come from the `c10d::*` dispatcher ops (every collective goes through one, the C++ callers such as
DDP's reducer included) and their recorded input shapes and dtypes; they are turned into nccl-tests' bus
volume with bench/core/comm_volume/'s ring factors, so measured and formula bytes compare 1:1. A
collective issued from C++ (DDP's reducer) carries no `ptbench.comm` label: its group is taken as the
data-parallel group (`default_group`).

Time: on CPU (gloo) a collective runs on gloo's own threads (`gloo:*` events, matched to their c10d op in
order by size); on CUDA its NCCL kernel. Compute is the union of `aten::*` operator intervals on CPU
(GPU kernels other than NCCL's on CUDA); exposed communication is communication time not covered by
compute on that rank (Python overhead between operators counts as not compute: a slight overestimate).
"""

from __future__ import annotations

import statistics

from ptbench.core.comm_volume import ring_factor

STEP = "ptbench.step#"
COMM = "ptbench.comm:"
STAGE = "ptbench.stage:"
# a pipeline step is steady (the bubble theory's equal items held) when its work items' normalised spread is at
# most this: of a step's 32 items (2 stages, m = 8) one at 1.5x its peers gives about 0.09, one at 2x about 0.17
STEADY_CV = 0.10

# dispatcher op -> (kind, which argument holds the full (unsharded) buffer)
C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", "out"),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "send": ("send_recv", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
# gloo's own execution events: the kind it really ran (gloo reduce-scatters by an all-reduce of the buffer)
DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}


def c10d_op(name: str) -> tuple[str, object] | None:
    for prefix in ("c10d::", "_c10d_functional::", "c10d_functional::"):
        if name.startswith(prefix):
            return C10D.get(name[len(prefix) :])
    return None


def _numel(shape) -> int:
    n = 1
    for d in shape or []:
        n *= int(d)
    return n


def _elems(dims) -> int:
    """Elements of one recorded argument: a tensor's shape, or a list of shapes (TensorList)."""
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(_elems(d) if d and isinstance(d[0], list) else _numel(d) for d in dims)
    return _numel(dims)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b)."""
    a, b = union(a), union(b)
    covered, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return length(a) - covered


def clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _span(e: dict) -> tuple[float, float]:
    """An event's [start, end] on the trace clock (us)."""
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _step_windows(events: list[dict]) -> dict[int, tuple[float, float]]:
    """Global step -> its window, from the runner's `ptbench.step#G` annotations."""
    return {int(e["name"][len(STEP) :]): _span(e) for e in events if e.get("name", "").startswith(STEP)}


def _step_of(windows: dict, ts: float):
    for g, (a, b) in windows.items():
        if a <= ts <= b:
            return g
    return None


def _outer_c10d_ops(events: list[dict], windows: dict) -> list[tuple[dict, tuple, int]]:
    """The c10d ops inside a profiled step, outermost only (a coalesced op may issue another inside it, on the
    same thread), in issue order: (event, (kind, buffer argument), step)."""
    ops = []
    for e in events:
        spec = c10d_op(e.get("name", ""))
        if spec is None or e.get("cat") not in (None, "cpu_op"):
            continue
        g = _step_of(windows, float(e["ts"]))
        if g is not None:
            ops.append((e, spec, g))
    outer = []
    for e, spec, g in ops:
        t0, t1 = _span(e)
        inside = any(
            o is not e
            and o.get("tid") == e.get("tid")
            and float(o["ts"]) <= t0
            and t1 <= float(o["ts"]) + float(o["dur"])
            and (float(o["ts"]), -float(o["dur"])) != (t0, -float(e["dur"]))
            for o, _, _ in ops
        )
        if not inside:
            outer.append((e, spec, g))
    return sorted(outer, key=lambda x: float(x[0]["ts"]))


def _label_of(e: dict, labels: list[dict]) -> dict | None:
    """The `ptbench.comm:` annotation around a c10d op on its thread (None: issued from C++)."""
    t0, t1 = _span(e)
    for lab in labels:
        if lab.get("tid") == e.get("tid") and float(lab["ts"]) <= t0 and t1 <= _span(lab)[1] + 1e-3:
            return lab
    return None


def _execution(e: dict, kind: str, elems: int, n: int, pools: tuple[list, list], used: set[int]) -> dict | None:
    """The collective's execution event: the first unused one (gloo's worker event of the same size, or an NCCL
    kernel) that starts after the op was issued; marked used."""
    gloo, nccl = pools
    for pool in (gloo, nccl):
        for x in pool:
            if id(x) in used or float(x["ts"]) + 1.0 < float(e["ts"]):
                continue
            xd = (x.get("args", {}).get("Input Dims") or [[]])[0]
            if pool is nccl or _numel(xd) == elems or kind in ("all_gather",) and _numel(xd) * n == elems:
                used.add(id(x))
                return x
    return None


def _bus_bytes(kind: str, message: int, n: int) -> float:
    """nccl-tests' bus volume of one call (a recv is counted at its sender; barriers and all_to_all move none
    that the formulas count)."""
    if kind in ("all_reduce", "all_gather", "reduce_scatter"):
        return message * ring_factor(kind, n) if n > 1 else 0.0
    if kind in ("send_recv", "broadcast"):
        return float(message)
    return 0.0


def _collective_row(e, kind, arg, g, labels, default_group, pools, used) -> tuple[dict, tuple[float, float], bool]:
    """One c10d op -> its ledger row, its execution interval, and whether its dtype was missing (4 bytes taken)."""
    args = e.get("args", {})
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    label = _label_of(e, labels)
    parts = label["name"][len(COMM) :].split(":") if label else []
    n = int(parts[1]) if label else default_group
    idx = 0 if arg == "out" else arg
    elems = _elems(dims[idx]) if isinstance(idx, int) and idx < len(dims) else 0
    typ = types[idx] if isinstance(idx, int) and idx < len(types) else ""
    exe = _execution(e, kind, elems, n, pools, used)
    if typ not in DTYPE_BYTES and exe is not None:
        typ = (exe.get("args", {}).get("Input type") or [""])[0]
    size = DTYPE_BYTES.get(typ)
    message = elems * (size or 4)
    t0, t1 = _span(exe) if exe else _span(e)
    row = dict(
        kind=kind,
        op=e["name"],
        group_size=n,
        group=parts[2] if len(parts) > 2 else None,
        message_bytes=message,
        bus_bytes=_bus_bytes(kind, message, n),
        time_s=(t1 - t0) * 1e-6,
        step=g,
        labelled=label is not None,
        executed_as=exe["name"] if exe else None,
    )
    return row, (t0, t1), size is None


def _ledger_notes(rows: list[dict], unknown_dtype: int, default_group: int) -> list[str]:
    notes = []
    if unknown_dtype:
        notes.append(f"{unknown_dtype} collective(s) with no recorded dtype counted as 4-byte elements")
    if any(not r["labelled"] and r["kind"] in ("all_reduce", "all_gather", "reduce_scatter") for r in rows):
        notes.append(
            f"collectives issued from C++ (DDP's reducer) or through a cached function reference carry no group "
            f"label: group size taken as {default_group} (the one size of the trace's process groups > 1, else "
            "the data-parallel size)"
        )
    return notes


def _compute_intervals(events: list[dict], gloo: list[dict]) -> list[tuple[float, float]]:
    """Compute: aten operators on CPU threads (gloo's threads excluded), non-NCCL kernels on the GPU (gloo's
    send/recv run on the calling thread, the step's own: that one stays in)."""
    if any(e.get("cat") == "kernel" for e in events):
        return [_span(e) for e in events if e.get("cat") == "kernel" and "nccl" not in e.get("name", "").lower()]
    gloo_tids = {e.get("tid") for e in gloo} - {e.get("tid") for e in events if e.get("name", "").startswith(STEP)}
    return [
        _span(e)
        for e in events
        if e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::") and e.get("tid") not in gloo_tids
    ]


def _by_kind(rows: list[dict], k: int) -> dict:
    """Per collective kind: calls, message and bus bytes, time, each per profiled step (k steps)."""
    by_kind: dict = {}
    for r in rows:
        d = by_kind.setdefault(r["kind"], dict(calls=0, message_bytes=0.0, bus_bytes=0.0, time_s=0.0))
        d["calls"] += 1
        d["message_bytes"] += r["message_bytes"]
        d["bus_bytes"] += r["bus_bytes"]
        d["time_s"] += r["time_s"]
    return {kind: {key: v / k for key, v in d.items()} for kind, d in by_kind.items()}


def _stage_marks(events: list[dict], windows: dict) -> tuple[dict, dict]:
    """A pipeline stage's work per step: the union of its marked intervals, and the marked items themselves."""
    marks = sorted((*_span(e), e["name"][len(STAGE) :]) for e in events if e.get("name", "").startswith(STAGE))
    work = {g: union(clip([(t0, t1) for t0, t1, _ in marks], a, b)) for g, (a, b) in windows.items()}
    items = {g: [[tag, t0, t1] for t0, t1, tag in marks if a <= t0 < b] for g, (a, b) in windows.items()}
    return work, items


def analyse(trace: dict, default_group: int) -> dict:
    """One rank's trace -> its communication ledger, exposed time, work intervals (pipelines).

    Returns {steps: [G...], step_windows: {G: [t0, t1]} (us, trace clock), collectives: [{kind, op,
    group_size, message_bytes, bus_bytes, time_s, step}], by_kind: {kind: {calls, message_bytes,
    bus_bytes, time_s}} per step, comm_time_s, exposed_s, compute_s (per step, means over the profiled
    steps), stage_work: {G: [[t0, t1], ...]}, notes}."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    windows = _step_windows(events)
    labels = [e for e in events if e.get("name", "").startswith(COMM)]
    # an unlabelled collective (issued from C++): the data-parallel size, unless the trace's process groups
    # larger than one all have one size (then that one)
    sizes = {g.get("pg_size") for g in trace.get("distributedInfo", {}).get("pg_config", []) if g.get("pg_size", 1) > 1}
    if len(sizes) == 1:
        default_group = sizes.pop()
    # execution of the collective: gloo's worker events (CPU), NCCL kernels (CUDA)
    gloo = sorted((e for e in events if e.get("name", "").startswith("gloo:")), key=lambda e: float(e["ts"]))
    nccl = sorted(
        (e for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()),
        key=lambda e: float(e["ts"]),
    )
    used: set[int] = set()
    rows, comm_iv, unknown_dtype = [], [], 0
    for e, (kind, arg), g in _outer_c10d_ops(events, windows):
        row, interval, unknown = _collective_row(e, kind, arg, g, labels, default_group, (gloo, nccl), used)
        rows.append(row)
        comm_iv.append(interval)
        unknown_dtype += unknown
    comp = _compute_intervals(events, gloo)
    stage_work, stage_items = _stage_marks(events, windows)
    k = max(1, len(windows))
    exposed = comm = compute = 0.0
    for a, b in windows.values():
        civ = clip(comm_iv, a, b)
        exposed += minus(civ, clip(comp, a, b))
        comm += length(union(civ))
        compute += length(union(clip(comp, a, b)))
    return dict(
        steps=sorted(windows),
        step_windows={g: list(w) for g, w in sorted(windows.items())},
        step_time_s=sum(b - a for a, b in windows.values()) * 1e-6 / k,
        collectives=rows,
        by_kind=_by_kind(rows, k),
        comm_time_s=comm * 1e-6 / k,
        exposed_s=exposed * 1e-6 / k,
        compute_s=compute * 1e-6 / k,
        stage_work={g: [list(w) for w in iv] for g, iv in stage_work.items()},
        stage_items=stage_items,
        notes=_ledger_notes(rows, unknown_dtype, default_group),
    )


def marked(items: list[list]) -> tuple[dict, int]:
    """One stage's marks in one step ([tag, t0, t1]) -> ({tag: count}, how many lie inside another mark: a
    work item marked twice, e.g. a wrapped function calling another wrapped one; 0 when each is marked once)."""
    counts: dict = {"fwd": 0, "bwd": 0}
    for tag, _, _ in items:
        counts[tag] = counts.get(tag, 0) + 1
    spans = sorted((t0, -t1) for _, t0, t1 in items)
    nested, end = 0, float("-inf")
    for _, neg_t1 in spans:
        if -neg_t1 <= end:
            nested += 1
        end = max(end, -neg_t1)
    return counts, nested


BUBBLE_DEFINITION = (
    "wall: per step, 1 - a stage's work time / the schedule's span (first work start to last work "
    "end over all stages), work = forward/backward of one micro-batch (ptbench.stage:* marks: torch "
    "pipelining's forward_one_chunk / backward_one_chunk, the loss outside them; megatron-core's forward_step "
    "(the loss inside) / backward_step); it includes p2p transfers, torch pipelining's loss, and any time the "
    "stages could not run at once (ranks sharing CPU cores). item_cv: per direction, the coefficient of "
    "variation (population standard deviation / mean) of the work items' durations over every stage and "
    "profiled step (the theory assumes 0). step_item_cv: per profiled step, the same spread of its items, each "
    "divided by its stage's median item of that direction; steady: the wall figure over the steps whose "
    "step_item_cv is at most steady_cv (the theory's equal items held; chosen on item times, not on idle time). marks: per stage, fwd and bwd marks per profiled "
    "step; marked_once: each is m on every stage and step and no mark lies inside another. "
    "replayed: the same with the measured work items (each at its stage's fastest instance of that direction "
    "over the profiled steps) replayed in each stage's traced order with the pipeline's dependencies (forward i after the previous stage's forward i, backward i after the "
    "next stage's backward i), one device per stage and free transfers"
)


def _cv(xs: list[float]) -> float | None:
    """Population standard deviation over mean (None for no data or a zero mean)."""
    mu = statistics.fmean(xs) if xs else 0.0
    return statistics.pstdev(xs) / mu if mu > 0 else None


def _mark_counts(per_rank: list[dict], steps: list[int], microbatches: int) -> tuple[list[dict], int, bool]:
    """Per stage, its fwd and bwd marks per step; marks nested in another; whether every micro-batch's forward
    and backward was marked once on every stage, in every step measured."""
    marks = [{"fwd": [], "bwd": []} for _ in per_rank]
    nested = 0
    for s, rank in enumerate(per_rank):
        for g in steps:
            counts, n = marked(rank.get("stage_items", {}).get(g, []))
            nested += n
            for tag in ("fwd", "bwd"):
                marks[s][tag].append(counts.get(tag, 0))
    once = nested == 0 and all(n == microbatches for st in marks for tag in ("fwd", "bwd") for n in st[tag])
    return marks, nested, once


def _idle_fractions(per_rank: list[dict], steps: list[int]) -> list[list[float]]:
    """Per stage, per step: 1 - its work time / the schedule's span (first work start to last work end)."""
    fractions = [[] for _ in per_rank]
    for g in steps:
        work = [rank["stage_work"][g] for rank in per_rank]
        span = max(w[-1][1] for w in work) - min(w[0][0] for w in work)
        for s, w in enumerate(work):
            fractions[s].append(1.0 - length([tuple(x) for x in w]) / span if span > 0 else 0.0)
    return fractions


def _item_durations(per_rank: list[dict], steps: list[int]) -> dict:
    """Every work item's duration per (stage, direction), over the profiled steps."""
    by_stage: dict = {}
    for s, rank in enumerate(per_rank):
        for g in steps:
            for tag, t0, t1 in rank.get("stage_items", {}).get(g, []):
                by_stage.setdefault((s, tag), []).append(t1 - t0)
    return by_stage


def _step_item_cv(per_rank: list[dict], steps: list[int], by_stage: dict) -> list[float | None]:
    """Per step, the spread (std/mean) of its items' durations, each divided by its stage's median item of that
    direction over the profiled steps (so that a stage heavier than another does not count as spread)."""
    medians = {k: statistics.median(v) for k, v in by_stage.items()}
    step_cv = []
    for g in steps:
        xs = [
            (t1 - t0) / medians[(s, tag)]
            for s, rank in enumerate(per_rank)
            for tag, t0, t1 in rank.get("stage_items", {}).get(g, [])
            if medians[(s, tag)] > 0
        ]
        step_cv.append(_cv(xs))
    return step_cv


def _replayed(per_rank: list[dict], steps: list[int], by_stage: dict) -> list[float] | None:
    """Per stage, the mean replayed bubble: each stage's items of one direction do the same work, so their
    fastest instance over the profiled steps is the one least slowed by other ranks sharing the cores; the replay
    times every item at that."""
    fastest = {k: min(v) for k, v in by_stage.items()}
    replays = [replay([rank.get("stage_items", {}).get(g, []) for rank in per_rank], fastest) for g in steps]
    replays = [r for r in replays if r is not None]
    return [sum(r[s] for r in replays) / len(replays) for s in range(len(per_rank))] if replays else None


def _over(x: float | None, theory: float) -> float | None:
    return x / theory if x is not None and theory else None


def bubble(per_rank: list[dict], microbatches: int, schedule: str | None = None) -> dict | None:
    """Pipeline bubble per stage from every rank's `analyse` (rank r = stage r; one replica): per profiled
    step, the schedule's span is the first stage work start to the last work end over all stages; a stage's
    bubble is the part of that span it does no work (its sends, receives and waits included). Theory:
    (p-1)/(m+p-1) for GPipe and 1F1B with equal stages. `schedule`: what ran ("ADAPTER SCHEDULE"), recorded."""
    p = len(per_rank)
    steps = sorted(set.intersection(*(set(r["stage_work"]) for r in per_rank))) if per_rank else []
    steps = [g for g in steps if all(per_rank[s]["stage_work"].get(g) for s in range(p))]
    if p < 2 or not steps:
        return None
    marks, nested, once = _mark_counts(per_rank, steps, microbatches)
    fractions = _idle_fractions(per_rank, steps)
    per_stage = [sum(f) / len(f) for f in fractions]
    theory = (p - 1) / (microbatches + p - 1)
    mean = sum(per_stage) / p
    per_step = [sum(fractions[s][i] for s in range(p)) / p for i in range(len(steps))]  # the spread over steps
    by_stage = _item_durations(per_rank, steps)
    # how far the run was from the theory's equal items: the spread of one direction's item times over every
    # stage and step (a stage waits for the slowest item it depends on, so uneven items widen the bubble)
    item_cv = {tag: _cv([d for (_, t), ds in by_stage.items() if t == tag for d in ds]) for tag in ("fwd", "bwd")}
    # steady steps: those in which the theory's equal items held (a step's item spread at most STEADY_CV); the
    # selection reads the work items only, never the idle time it then averages
    step_cv = _step_item_cv(per_rank, steps, by_stage)
    steady = [i for i, c in enumerate(step_cv) if c is not None and c <= STEADY_CV]
    steady_mean = sum(per_step[i] for i in steady) / len(steady) if steady else None
    rp = _replayed(per_rank, steps, by_stage)
    rmean = sum(rp) / p if rp else None
    return dict(
        schedule=schedule,
        stages=p,
        microbatches=microbatches,
        steps=len(steps),
        marks=marks,
        nested_marks=nested,
        marked_once=once,
        per_stage=per_stage,
        mean=mean,
        per_step=per_step,
        item_cv=item_cv,
        step_item_cv=step_cv,
        steady_cv=STEADY_CV,
        steady_steps=len(steady),
        steady_mean=steady_mean,
        steady_ratio=_over(steady_mean, theory),
        theory=theory,
        ratio=_over(mean, theory),
        replayed_per_stage=rp,
        replayed_mean=rmean,
        replayed_ratio=_over(rmean, theory),
        definition=BUBBLE_DEFINITION,
    )


def replay(items: list[list], fastest: dict | None = None) -> list[float] | None:
    """Per stage, the bubble of the measured work items (each stage's [tag, t0, t1] in traced order: k-th
    fwd = micro-batch k, k-th bwd = micro-batch k) run as soon as their dependencies allow, one device per
    stage: 1 - work / the replayed span. `fastest`: {(stage, tag): duration} to use instead of each item's own."""
    p = len(items)
    dur = [[(tag, (fastest or {}).get((s, tag), t1 - t0)) for tag, t0, t1 in st] for s, st in enumerate(items)]
    if p < 2 or any(not d for d in dur):
        return None
    done: dict = {}  # (stage, tag, micro-batch) -> finish time
    pos = [0] * p
    free = [0.0] * p
    counts = [{"fwd": 0, "bwd": 0} for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pos[s] < len(dur[s]):
                tag, d = dur[s][pos[s]]
                i = counts[s][tag]
                if tag == "fwd":
                    dep = (s - 1, "fwd", i) if s > 0 else None
                else:
                    dep = (s + 1, "bwd", i) if s < p - 1 else (s, "fwd", i)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(s, tag, i)] = start + d
                counts[s][tag] += 1
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(dur[s]) for s in range(p)):
        return None  # an order the model does not know (interleaved stages)
    span = max(free)
    return [1.0 - sum(d for _, d in dur[s]) / span for s in range(p)]


def merge(traces: dict[int, dict]) -> dict:
    """Chrome traces of several ranks -> one trace: each rank a process row (pid = rank, named `rank R`);
    timestamps kept (ranks on one host share the clock)."""
    out = []
    for rank, trace in sorted(traces.items()):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for e in trace.get("traceEvents", []):
            if e.get("ph") in ("s", "f") or (
                e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels")
            ):
                continue  # flow arrows' ids are per process; the process rows are renamed above
            e = dict(e)
            e["pid"] = rank
            out.append(e)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"ranks": sorted(traces)}}
