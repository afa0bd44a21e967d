"""A dry run's measurements beside the models: the comm formula (ptbench.core.comm_volume) against the
collective ledger, the memory model (ptbench.core.memory_model) against the tracker, and their ratios
(model over measured; 1.0 is exact)."""

from __future__ import annotations

# model part -> (tracker categories summed, the moment they are read): the model's states are what a rank
# holds when its optimizer step starts (parameters, gradients, optimizer state all alive); activations and
# the total are the step's peak
MEMORY_PARTS = {
    "params": (("Parameter", "Sharded Param"), "step_start"),
    "grads": (("Gradient", "Sharded Grad"), "step_start"),
    "optimizer": (("Optstate", "OptState"), "step_start"),
    # what autograd saves, against the tracker's Activation at the peak; the temporaries of backward (the loss's,
    # a unit's unsharded gradients: the tracker's Temp) are in the total
    "saved_activations": (("Activation",), "at_peak"),
    "total": (("Total",), "at_peak"),
}
# ops the comm formula counts (a recv is the peer's send)
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all")


def comm(formula: dict, ledger: list[dict]) -> dict:
    """Bytes per step by op, formula beside ledger (the last step's), and their ratio; total the same."""
    measured: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in ledger:
        if row["op"] in COMM_OPS:
            measured[row["op"]] = measured.get(row["op"], 0.0) + row["bytes"]
            counts[row["op"]] = counts.get(row["op"], 0) + row["count"]
    predicted = dict(formula.get("by_op", {}))
    ops = sorted(set(measured) | set(predicted))
    by_op = {
        op: dict(
            formula=predicted.get(op, 0.0),
            ledger=measured.get(op, 0.0),
            count=counts.get(op, 0),
            ratio=_ratio(predicted.get(op, 0.0), measured.get(op, 0.0)),
        )
        for op in ops
    }
    total_f, total_m = sum(predicted.values()), sum(measured.values())
    return dict(by_op=by_op, formula=total_f, ledger=total_m, ratio=_ratio(total_f, total_m))


def memory(prediction: dict, tracked: dict) -> dict:
    """Per model part: predicted bytes, tracked bytes, ratio; `worst`: the part furthest from 1."""
    out = {}
    for part, (categories, when) in MEMORY_PARTS.items():
        snap = tracked.get(when) or {}
        measured = sum(snap.get(c, 0) for c in categories) if part != "total" else tracked.get("peak_total", 0)
        measured += _held(tracked).get(part, 0)
        model = prediction.get(part, 0) + (prediction.get("master", 0) if part == "optimizer" else 0)
        out[part] = dict(model=int(model), tracker=int(measured), ratio=_ratio(model, measured), read=when)
    rated = [(p, v["ratio"]) for p, v in out.items() if v["ratio"] is not None]
    worst = max(rated, key=lambda pv: abs(pv[1] - 1.0), default=(None, None))
    return dict(parts=out, worst_part=worst[0], worst=worst[1])


def _held(tracked: dict) -> dict:
    """What the tracker calls Activation when the optimizer step starts, moved to where it belongs. Backward has
    freed every activation by then: what remains was allocated outside forward and backward and outlives them
    (the input batch; megatron-core's gradient buffer, zeroed in place before each forward, whose `main_grad`s
    leave the tracker's Gradient empty; DeepSpeed's fp32 gradient partitions). It is taken out of the activations
    at the peak, and is the gradients where the tracker's gradient categories hold nothing."""
    start = tracked.get("step_start") or {}
    held = start.get("Activation", 0)
    if not held:
        return {}
    out = {"saved_activations": -held}
    if not any(start.get(c, 0) for c in MEMORY_PARTS["grads"][0]):
        out["grads"] = held
    return out


def _ratio(model: float, measured: float) -> float | None:
    if measured == 0:
        return 1.0 if model == 0 else None
    return model / measured


def table(point: dict) -> str:
    """The point's comparison as text, ending in the one summary line `scale: ...`."""
    c, m = point["comm"], point["memory"]
    lines = [
        f"dry run: adapter={point['adapter']} workload={point['workload']} W={point['world_size']} "
        f"rank={point['rank']} layout={point['layout']} (no time, overlap, NCCL algorithms or losses)"
    ]
    lines.append(f"  {'collective':<16}{'count':>7}{'formula MB':>14}{'ledger MB':>14}{'ratio':>9}")
    for op, v in c["by_op"].items():
        lines.append(
            f"  {op:<16}{v['count']:>7}{v['formula'] / 1e6:>14.2f}{v['ledger'] / 1e6:>14.2f}{_fmt(v['ratio']):>9}"
        )
    lines.append(f"  {'total':<16}{'':>7}{c['formula'] / 1e6:>14.2f}{c['ledger'] / 1e6:>14.2f}{_fmt(c['ratio']):>9}")
    lines.append(f"  {'memory':<16}{'read':>11}{'model MB':>14}{'tracker MB':>14}{'ratio':>9}")
    for part, v in m["parts"].items():
        lines.append(
            f"  {part:<16}{v['read']:>11}{v['model'] / 1e6:>14.2f}{v['tracker'] / 1e6:>14.2f}{_fmt(v['ratio']):>9}"
        )
    if point["standins"]:
        lines.append(f"  stand-ins: {', '.join(point['standins'])}")
    return "\n".join(lines)


def summary_line(point: dict) -> str:
    return (
        f"scale: adapter={point['adapter']} workload={point['workload']} W={point['world_size']} "
        f"comm_ratio={_fmt(point['comm']['ratio'])} memory_ratio_worst={_fmt(point['memory']['worst'])} "
        f"seconds={point['seconds']:.1f}"
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
