"""The weight stash of an asynchronous pipeline (README.md, "Weight stash"): the extra versions of its parameters
each stage keeps beside the live ones, so that a mini-batch's backward runs with the weights its forward used.

PipeDream (Narayanan et al., SOSP 2019) stashes one version per mini-batch in flight: stage s of p has
p-1-s of them at its steady-state peak, ceil((p-1-s)/m) when a mini-batch is m micro-batches sharing one version.
PipeDream-2BW (ICML 2021) keeps two versions, one stashed per stage. A version holds the stage's parameters
(a tied copy that arrives with each mini-batch is not stashed) in the states' bytes per element."""

from __future__ import annotations

import math

from ptbench.core.memory_model.counting import even_split
from ptbench.core.memory_model.inputs import Inputs


def stash_copies(rule: str, stages: int, microbatches: int = 1, flush_every: int = 0) -> list[int]:
    """Extra parameter versions each stage holds at its peak under `rule` (ptbench.core.layout.WEIGHT_STASH).

    Weight stashing: c = ceil((p-1-s)/m) in steady state. A drain every K mini-batches (`flush_every`) cuts the
    steady state short: after a drain the stage binds one version until its first step, so it holds
    min(c, max(1, K - c)) versions (none with K = 1, every mini-batch drained before the next); the epoch's own
    drain does the same to an epoch of fewer than 2c mini-batches (not modelled)."""
    if rule == "double_buffered":
        return [1] * stages
    if rule != "weight_stashing":
        return [0] * stages
    out = []
    for s in range(stages):
        c = math.ceil((stages - 1 - s) / max(1, microbatches))
        out.append(c if not flush_every or not c else 0 if flush_every == 1 else min(c, max(1, flush_every - c)))
    return out


def stage_params(layer_params, stages: int, balance=None) -> list[int]:
    """Parameter elements of each stage: the layers' counts summed over `balance` (None: an even split)."""
    counts = list(layer_params)
    balance = list(balance) if balance else even_split(len(counts), stages)
    if len(balance) != stages or sum(balance) != len(counts):
        raise ValueError(f"stage balance {balance} does not split {len(counts)} layers into {stages} stages")
    out, start = [], 0
    for n in balance:
        out.append(sum(counts[start : start + n]))
        start += n
    return out


def stash_per_stage(inp: Inputs, notes: list) -> tuple[list[float], str]:
    """(bytes each pipeline stage's stash holds, the formula): copies x the stage's parameters x the states'
    bytes per element; [] without a stash."""
    cost, lay = inp.cost, inp.layout
    if cost.weight_stash == "none":
        return [], ""
    copies = stash_copies(cost.weight_stash, lay.pp, lay.microbatches, cost.flush_every)
    b = inp.state_bytes
    if cost.layer_params:
        params = stage_params(cost.layer_params, lay.pp, cost.stage_balance)
        where = "the stage's parameters (tied copy not stashed)"
    else:
        params = [inp.model.params / lay.pp] * lay.pp
        where = "Ψ/p"
        notes.append("stash taken as Ψ/p per stage (the adapter states no layer parameters)")
    rule = "ceil((p-1-s)/m)" if cost.weight_stash == "weight_stashing" else "1"
    rule += f", a drain every {cost.flush_every} mini-batches" if cost.flush_every else ""
    return [float(c * b * p) for c, p in zip(copies, params)], f"{rule} copies x {b} x {where}: {copies}"


def stash_of(stage_name: str, stash: list[float]) -> float:
    """The stash of the stage `compose` evaluates: first, last, `stage k`, or the largest (any stage alike)."""
    if not stash:
        return 0.0
    if stage_name == "first":
        return stash[0]
    if stage_name == "last":
        return stash[-1]
    if stage_name.startswith("stage "):
        return stash[int(stage_name.split()[1])]
    return max(stash)
