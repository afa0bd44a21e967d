"""The model: step = compute + e x communication, compute scaled for the pipeline bubble.

- communication: sum over a point's collectives of calls x t(op, group, S, link), from ptbench.comm's measured
  times per collective kind, group size and message size S: at each measured S, t = a + c / rate fitted by
  least squares across the link rates the reports span (latency + wire; the mean where they share one link),
  and linear in S between neighbouring measured sizes. a may come out below zero (1 MiB all-gather: -0.5 ms):
  the line only interpolates, as rates outside the measured ones are refused. One alpha-beta line over all sizes
  was tried: gloo's all-gather and send/recv are not affine in S (the per-byte cost grows from 512 KiB on), so
  a line fitted over 16 KiB-4 MiB was 29 % off at 1 MiB and a held-out rate; per size, within 10 %
  (bench/README, Predict).
- compute and the exposed factor e: least squares over the series' calibration points, step_i = k_i C + e T_i,
  where T_i is the point's communication time and k_i its compute relative to the target's (C): 1 for the same
  per-rank work (same workload, local batch, tp, pp), (m + p - 1) t(b) / ((m' + p - 1) t(b')) from the point's m
  micro-batches of size b to the target's m' of size b' in a p-stage pipeline: a 1F1B or GPipe step is m + p - 1
  micro-batch slots, p - 1 of them the bubble, t a micro-batch's forward and backward time at its size, from the
  folder's one-rank runs of the workload at both sizes, else proportional to the size (`slot_ratio`; the bubble
  from measured time). A series with one calibration point
  takes e as the non-overlapped fraction its profiled calibration run measured (trainer.profile: exposed / time
  in collectives, from the traces), else from the reference fit (the series with the most points, e.g. DDP at
  two link rates; clipped to 0..1, a fraction, where it is lent to another series), else 1 (all exposed).
- interval: the prediction times 1 +- the calibration points' largest run-to-run spread (the folder's median
  spread where they have none: one clean epoch of a profiled run).

Refusals (PredictError, one line): more ranks than cores on a CPU run, a collective kind, group size, message
size or link rate outside what ptbench.comm measured, no comm measurement at all, no calibration point of the
series with the same per-rank work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from ptbench.predict.points import CommReport, Point, PredictError

COMM_HINT = "python -m ptbench.comm --world-size {n} --out {root}/comm"


def _across(links: tuple) -> bool:
    """Reports at two or more known link rates: t is fitted in 1 / rate."""
    return len(links) > 1 and None not in links


@dataclass
class Fit:
    sizes: np.ndarray  # the measured message sizes, ascending
    coef: np.ndarray  # per size: a, c of t = a + c / rate (c = 0 where every report has the same link)
    links: tuple  # the link rates the fit saw (None: unknown)

    @property
    def smin(self) -> float:
        return float(self.sizes[0])

    @property
    def smax(self) -> float:
        return float(self.sizes[-1])

    @property
    def across_rates(self) -> bool:
        return _across(self.links)

    def time(self, size: float, link: float | None) -> float:
        at = self.coef[:, 0] + (self.coef[:, 1] / link if self.across_rates else 0.0)
        return max(float(np.interp(size, self.sizes, at)), 0.0)


def fit_comm(reports: list[CommReport]) -> dict[tuple[str, int], Fit]:
    """Per (op, group size) and measured size: least squares of the measured times on [1, 1 / rate] across link
    rates, or their mean on one link."""
    rows: dict[tuple[str, int], dict[float, list[tuple[float, float | None]]]] = {}
    for rep in reports:
        for r in rep.rows:
            by_size = rows.setdefault((r["op"], rep.world_size), {})
            by_size.setdefault(float(r["bytes"]), []).append((float(r["time_s"]), rep.link))
    fits = {}
    for key, by_size in rows.items():
        links = tuple(sorted({link for rs in by_size.values() for _, link in rs}, key=lambda v: -1 if v is None else v))
        across = _across(links)
        kept, coef = [], []
        for size in sorted(by_size):
            rs = by_size[size]
            if not across:
                coef.append(np.array([float(np.mean([t for t, _ in rs])), 0.0]))
            elif len({link for _, link in rs}) > 1:
                x = np.array([[1.0, 1.0 / link] for _, link in rs])
                coef.append(np.linalg.lstsq(x, np.array([t for t, _ in rs]), rcond=None)[0])
            else:  # this size at one rate only: it cannot say how it moves with the rate
                continue
            kept.append(size)
        if kept:
            fits[key] = Fit(np.array(kept), np.array(coef), links)
    return fits


def _mbit(link: float | None) -> str:
    return "an unrecorded rate" if link is None else f"{link:g} Mbit/s"


def _link_check(fit: Fit, op: str, n: int, link: float | None) -> None:
    if fit.across_rates:
        if link is None or not min(fit.links) <= link <= max(fit.links):
            raise PredictError(
                f"link {_mbit(link)} is outside the measured {min(fit.links):g}-{max(fit.links):g} Mbit/s "
                f"of {op} at {n} ranks: measure it with ptbench.comm on that link"
            )
    elif fit.links == (None,) and link is not None:
        raise PredictError(
            f"{op} at {n} ranks was measured only on this machine's own link, whose rate no record states, so no "
            f"link={link:g} can be predicted: measure ptbench.comm at two or more shaped rates (python -m "
            "ptbench.predict validate, as root, does), or leave link= out"
        )
    elif fit.links != (link,):
        raise PredictError(
            f"{op} at {n} ranks was measured only at link {_mbit(fit.links[0])}, not {_mbit(link)}: "
            "measure ptbench.comm at a second link rate to predict across rates"
        )


def comm_time(p: Point, link: float | None, fits: dict, root: str = "RESULTS_DIR") -> float:
    """Seconds per step that the point's collectives take at `link`, by the fitted alpha-beta."""
    total = 0.0
    for c in p.collectives:
        op, n, size = c["op"], int(c["group_size"]), float(c["message_bytes"])
        fit = fits.get((op, n))
        if fit is None:
            raise PredictError(
                f"no ptbench.comm measurement of {op} at {n} ranks (needed by {p.series}): "
                f"run {COMM_HINT.format(n=n, root=root)}"
            )
        if not fit.smin <= size <= fit.smax:
            raise PredictError(
                f"{op} of {size:.0f} bytes at {n} ranks is outside the measured {fit.smin:.0f}-{fit.smax:.0f} bytes: "
                "measure it (python -m ptbench.comm --min-bytes/--max-bytes)"
            )
        _link_check(fit, op, n, link)
        total += float(c["calls"]) * fit.time(size, link)
    return total


def micro_batch_times(points: list[Point], workload: str) -> dict[int, float]:
    """The workload's forward + backward time per step at each batch that a one-rank run measured (no
    communication, no pipeline): how a micro-batch's time moves with its size. Not proportional: a small
    micro-batch keeps the per-operator fixed costs of a large one."""
    times: dict[int, list[float]] = {}
    for p in points:
        if p.world_size == 1 and p.workload == workload and p.local_batch and p.fb_steps:
            times.setdefault(p.local_batch, []).extend(p.fb_steps)
    return {b: float(np.mean(ts)) for b, ts in sorted(times.items())}


def slot_ratio(b: float, b2: float, curve: dict[int, float] | None) -> tuple[float, str]:
    """A micro-batch of b over one of b2, in time: from `micro_batch_times` where it spans both (linear between
    the measured batches), else b / b2."""
    if curve and len(curve) > 1 and min(curve) <= min(b, b2) and max(b, b2) <= max(curve):
        sizes = sorted(curve)
        at = np.interp([b, b2], sizes, [curve[s] for s in sizes])
        return float(at[0] / at[1]), f"one-rank runs at batch {','.join(str(s) for s in sizes)}"
    return b / b2, "proportional to the micro-batch size"


def compute_scale(cal: Point, target: Point, curve: dict[int, float] | None = None) -> float | None:
    """k: the calibration point's compute relative to the target's (step = k C + e T, C the target's); None: not
    comparable. Between micro-batch counts of a pipeline, (m + p - 1) t(b) / ((m' + p - 1) t(b')): m, b the
    point's micro-batch count and size (global / m at the same dp), m', b' the target's, t a micro-batch's time
    (`slot_ratio`: from the one-rank runs in `curve`, else proportional to its size)."""
    if cal.series != target.series or cal.workload != target.workload or (cal.tp, cal.pp) != (target.tp, target.pp):
        return None
    if cal.microbatches == target.microbatches:
        return 1.0 if cal.local_batch == target.local_batch else None
    if cal.pp > 1 and cal.dp == target.dp and cal.global_batch and target.global_batch:
        p, m, m2 = cal.pp, cal.microbatches, target.microbatches
        ratio, _ = slot_ratio(cal.global_batch / m, target.global_batch / m2, curve)
        return (m + p - 1) * ratio / (m2 + p - 1)
    return None


def retarget(cal: Point, world: int, microbatches: int, link: float | None) -> Point:
    """The point a calibration point becomes at another device count, micro-batch count or link: data-parallel
    collectives over the new dp group; activation collectives m'/m times as often, each m/m' the bytes where the
    global batch is held; the global batch follows the adapter's batch policy."""
    dp = world // (cal.tp * cal.pp)
    if dp < 1 or dp * cal.tp * cal.pp != world:
        raise PredictError(f"{cal.series}: {world} ranks do not split into tp={cal.tp} x pp={cal.pp} x dp")
    ratio = microbatches / cal.microbatches
    cols = []
    for c in cal.collectives:
        c = dict(c)
        if c.get("group") == "dp":
            c["group_size"] = dp
        if "activation" in c.get("name", "") and ratio != 1:
            c["calls"] *= ratio  # per_microbatch: the micro-batch (the message) keeps its size
            c["message_bytes"] /= 1 if cal.batch_policy == "per_microbatch" else ratio
        if int(c["group_size"]) > 1:
            cols.append(c)
    scale = dp / cal.dp if cal.batch_policy in ("per_device", "linear") else 1
    scale *= ratio if cal.batch_policy == "per_microbatch" else 1
    return replace(
        cal,
        world_size=world,
        microbatches=microbatches,
        link=link,
        dp=dp,
        collectives=cols,
        global_batch=int(cal.global_batch * scale),
        local_batch=int(cal.global_batch * scale) // dp,
        steps=[float("nan")],
        epoch_steps=[],
        memory_bytes=cal.memory_bytes if (world, microbatches) == (cal.world_size, cal.microbatches) else None,
        run_dirs=[],
        contention=[],
    )


def check_cores(target: Point) -> None:
    cores = os.cpu_count() or 1
    if target.cpu and target.world_size > cores:
        raise PredictError(
            f"{target.world_size} ranks on {cores} cores: CPU ranks beyond the cores share them and no "
            "alpha-beta model holds there; predict at most that many ranks"
        )


@dataclass
class Prediction:
    target: Point
    step: float
    lo: float
    hi: float
    compute: float
    comm: float
    exposed: float
    exposed_from: str
    calibration: list[Point]
    micro_batch_time_from: str = ""  # a pipeline predicted at another micro-batch count: `slot_ratio`'s source

    @property
    def epoch(self) -> float:
        return self.step * self.calibration[0].epoch_ratio

    @property
    def throughput(self) -> float:
        return self.target.global_batch / self.step


def _solve(cal: list[tuple[Point, float, float]]) -> tuple[float, float] | None:
    """(C, e) from step_i = k_i C + e T_i when the points tell them apart, else None."""
    x = np.array([[k, t] for _, k, t in cal])
    if len(cal) < 2 or np.linalg.matrix_rank(x, tol=1e-9 * np.abs(x).max()) < 2:
        return None
    coef = np.linalg.lstsq(x, np.array([p.step for p, _, _ in cal]), rcond=None)[0]
    return float(coef[0]), float(coef[1])


def reference_exposed(points: list[Point], fits: dict) -> tuple[float, str]:
    """The exposed factor of the series with the most calibration points that tell C and e apart."""
    by_series: dict[str, list[Point]] = {}
    for p in points:
        by_series.setdefault(p.series, []).append(p)
    for series, pts in sorted(by_series.items(), key=lambda kv: -len(kv[1])):
        base = pts[0]
        try:
            curve = micro_batch_times(points, base.workload)
            cal = [(p, k, comm_time(p, p.link, fits)) for p in pts if (k := compute_scale(p, base, curve)) is not None]
        except PredictError:
            continue
        if solved := _solve(cal):  # lent to other series as a fraction: more than all exposed is this series' own
            return min(max(solved[1], 0.0), 1.0), series
    return 1.0, ""


def traced_for(target: Point, calibration: list[Point]) -> Point:
    """A target without traced collectives takes those of a profiled calibration point of its series and layout,
    moved to its device and micro-batch counts (the formula leaves some collectives out; the trace has them)."""
    if target.collectives_from == "trace":
        return target
    for p in calibration:
        if p.collectives_from == "trace" and compute_scale(p, target) is not None:
            moved = retarget(p, target.world_size, target.microbatches, target.link)
            return replace(target, collectives=moved.collectives, collectives_from="trace of a calibration run")
    return target


def no_calibration(target: Point, calibration: list[Point]) -> str:
    """Why no calibration point fits the target, in the words of what it is: a measured point that is its series'
    only one (leave-one-out), or a per-rank work no point of the series measured."""
    same = [p for p in calibration if p.series == target.series]
    measured = bool(target.steps) and not np.isnan(target.steps).any()
    if not same:
        if measured:
            return (
                f"the only point of {target.series} here, so nothing of its series is left to predict it from "
                "(measure it at a second link rate, device count or micro-batch count)"
            )
        return f"no measured point of {target.series} (run that series once)"
    have = ", ".join(sorted({f"{p.workload} b={p.local_batch} m={p.microbatches}" for p in same}))
    return (
        f"no {'other ' if measured else ''}point of {target.series} with its per-rank work {target.workload} "
        f"b={target.local_batch} m={target.microbatches} (measured: {have}; the same local batch, tp and pp, or "
        "another micro-batch count of a pipeline at the same global batch)"
    )


def noise_floor(points: list[Point]) -> float:
    spreads = sorted(p.spread for p in points if p.spread > 0)
    return spreads[len(spreads) // 2] if spreads else 0.0


def predict(target: Point, calibration: list[Point], fits: dict, ref: tuple[float, str], root: str) -> Prediction:
    check_cores(target)
    target = traced_for(target, calibration)
    t_comm = comm_time(target, target.link, fits, root)
    curve = micro_batch_times(calibration, target.workload)
    cal, why = [], None
    for p in calibration:
        k = compute_scale(p, target, curve)
        if k is not None:  # the target's own measured point too, when it is one (a target at a measured layout)
            try:
                cal.append((p, k, comm_time(p, p.link, fits, root)))
            except PredictError as e:  # a calibration point whose communication is not measured cannot calibrate
                why = why or e
    if not cal and why:
        raise why
    if not cal:
        raise PredictError(no_calibration(target, calibration))
    solved = _solve(cal)
    profiled = [p.exposed_measured for p, _, _ in cal if p.exposed_measured is not None]
    if solved and solved[1] >= 0:
        compute, exposed, source = solved[0], solved[1], f"fit on {len(cal)} points"
    else:
        if profiled:
            exposed, source = float(np.mean(profiled)), "profiled"
        else:
            exposed, source = ref[0], f"from {ref[1]}" if ref[1] else "assumed: nothing to fit it on"
        compute = float(np.mean([(p.step - exposed * t) / k for p, k, t in cal]))
    step = compute + exposed * t_comm
    # a calibration point with one clean epoch has no spread of its own: the folder's typical one stands in
    spread = max(p.spread for p, _, _ in cal) or noise_floor(calibration)
    other = next((p for p, _, _ in cal if p.microbatches != target.microbatches), None)
    b2 = target.global_batch / target.microbatches
    slots = slot_ratio(other.global_batch / other.microbatches, b2, curve)[1] if other else ""
    return Prediction(
        target,
        step,
        step * (1 - spread),
        step * (1 + spread),
        compute,
        t_comm,
        exposed,
        source,
        [p for p, _, _ in cal],
        slots,
    )
