"""One collective of the formula as a record item, nccl-tests' ring factors, and the timed phase it runs in."""

from __future__ import annotations

# collective item name -> the timed phase (bench/core/timing.py PHASES) it runs in, where no adapter moves it:
# ZeRO-1/2 gather the updated parameters in engine.step; gradient reduce-scatters, backward re-gathers and a
# pipeline's gradient sends default to backward
_PHASES = {
    "dp_param_all_gather": "optimizer",
    "dp_param_all_gather_fwd": "forward",
    "tp_activation_all_reduce": "forward,backward",
    "tp_activation_all_gather": "forward,backward",
    "tp_activation_reduce_scatter": "forward,backward",
    "pp_activation_send": "forward",
}


def ring_factor(op: str, n: int) -> float:
    """Per-rank bus volume over buffer size for `op` on n ranks (nccl-tests doc/PERFORMANCE.md)."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; known: all_reduce, all_gather, reduce_scatter, broadcast, send_recv")


def item(
    name: str,
    op: str,
    group: str,
    n: int,
    message: float,
    calls: float,
    formula: str,
    phase: str,
    elem: int,
) -> dict:
    """One collective: `calls` messages of `message` bytes (the full, unsharded buffer) over a group of n ranks;
    its per-rank bus bytes are calls x ring factor x message. `elem`: bytes per element as it travels."""
    return dict(
        name=name,
        op=op,
        group=group,
        group_size=n,
        message_bytes=message,
        calls=calls,
        bytes=calls * ring_factor(op, n) * message,
        formula=formula,
        phase=phase,
        bytes_per_elem=elem,
    )


def rebytes(it: dict) -> dict:
    """`it` with its bytes recomputed after its message, calls or op changed."""
    it["bytes"] = it["calls"] * ring_factor(it["op"], it["group_size"]) * it["message_bytes"]
    return it


def phase(name: str, cost) -> str:
    """The timed phase an item of the papers' formulas runs in, as the adapter's cost inputs place it: the whole
    step in one phase (`step_phase`: a pipeline schedule), the gradient all-reduce where the adapter syncs
    (`grad_sync_phase`: Horovod synchronizes in step()), else `_PHASES` (backward by default)."""
    if cost.step_phase:
        return cost.step_phase
    if name == "dp_grad_all_reduce":
        return cost.grad_sync_phase
    return _PHASES.get(name, "backward")


def by_op(items: list[dict]) -> dict:
    out: dict = {}
    for it in items:
        out[it["op"]] = out.get(it["op"], 0.0) + it["bytes"]
    return out


def retotal(vol: dict) -> dict:
    """`vol` (from `compose`) with its per-item bytes and total recomputed after its collectives changed."""
    vol["bytes"] = {it["name"]: it["bytes"] for it in vol["collectives"]}
    vol["total"] = sum(vol["bytes"].values())
    return vol
