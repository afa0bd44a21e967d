"""Leave-one-out, targets, the error table and predictions.jsonl (what the report's section reads)."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

from ptbench.core.readers import jsonl
from ptbench.predict.model import Prediction, fit_comm, predict, reference_exposed
from ptbench.predict.points import CONTENTION, CommReport, Point, PredictError

PREDICTIONS = "predictions.jsonl"


def error_pct(pred: Prediction) -> float:
    return (pred.step / pred.target.step - 1) * 100


def kendall(preds: list[Prediction]) -> tuple[float | None, list[str]]:
    """Kendall tau of the series' order by predicted vs measured step time within each device count and link;
    the mean over those groups weighted by their size, and one line per group."""
    from scipy.stats import kendalltau

    groups: dict[tuple, list[Prediction]] = {}
    for p in preds:
        groups.setdefault((p.target.world_size, p.target.link), []).append(p)
    taus, lines = [], []
    for (n, link), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if len({p.target.series for p in ps}) < 2:
            continue
        tau = kendalltau([p.step for p in ps], [p.target.step for p in ps]).statistic
        taus.append((tau, len(ps)))
        link_s = f"{link:g} Mbit/s" if link is not None else "this machine's link"
        pairs = [(a.target, b.target) for i, a in enumerate(ps) for b in ps[i + 1 :]]
        close = sum(abs(a.step - b.step) < a.spread * a.step + b.spread * b.step for a, b in pairs)
        lines.append(
            f"  tau at {n} ranks, {link_s}: {tau:.2f} over {len(ps)} points; {close} of {len(pairs)} pairs measured "
            "closer than their run-to-run noise"
        )
    if not taus:
        return None, ["  tau: n/a (no device count with two or more series predicted)"]
    return sum(t * k for t, k in taus) / sum(k for _, k in taus), lines


def table(preds: list[Prediction], skipped: list[tuple[Point, str]]) -> list[str]:
    head = f"{'point':<56} {'measured':>10} {'predicted':>10} {'interval':>17} {'err':>8} {'noise':>7}  exposed e"
    lines = [head, "-" * len(head)]
    for p in preds:
        t = p.target
        lines.append(
            f"{t.label():<56} {t.step * 1e3:>8.1f}ms {p.step * 1e3:>8.1f}ms "
            f"{f'[{p.lo * 1e3:.1f}-{p.hi * 1e3:.1f}]':>17} {error_pct(p):>+7.1f}% {t.spread * 100:>6.1f}%  "
            f"{p.exposed:.2f} ({p.exposed_from})"
            + (f"; micro-batch time {p.micro_batch_time_from}" if p.micro_batch_time_from else "")
            + contended_mark(t)
        )
    for t, why in skipped:
        lines.append(
            f"{t.label():<56} {t.step * 1e3:>8.1f}ms   not predicted: {why.split(' (')[0].split(': run')[0]}"
            + contended_mark(t)
        )
    return lines


def contended_mark(t: Point) -> str:
    return f"; contended {t.contended}/{len(t.contention)} runs" if t.contended else ""


def behind(preds: list[Prediction], skipped: list[tuple[Point, str]] = ()) -> list[Point]:
    """The measured points behind a table: its targets and the calibration points each prediction used."""
    seen: dict[tuple, Point] = {}
    for p in [*(q.target for q in preds), *(c for q in preds for c in q.calibration), *(t for t, _ in skipped)]:
        if p.contention:  # a target not measured has no runs
            seen.setdefault(p.key, p)
    return list(seen.values())


def contention_line(points: list[Point]) -> str | None:
    """One line when runs behind the figures warn of contention (their records' `contention:` warnings): a loaded
    machine's times move with the load, so the errors say as much about it as about the model."""
    runs = sum(len(p.contention) for p in points)
    warned = [c for p in points for c in p.contention if c]
    if not warned:
        return None
    example = warned[0].removeprefix(CONTENTION).strip().split(" (")[0].split(": ")[0]
    share = f"all {runs} runs" if len(warned) == runs else f"{len(warned)} of {runs} runs"
    share = "the one run behind these figures warns" if runs == 1 else f"{share} behind these figures warn"
    return (
        f"contention: {share} of contention (e.g. {example}): their times are a "
        "loaded machine's, so the figures are provisional; rerun them on a quiet machine to make them the model's"
    )


def summary_line(preds: list[Prediction]) -> str:
    errs = [abs(error_pct(p)) for p in preds]
    tau, _ = kendall(preds)
    tau_s = f"{tau:.2f}" if tau is not None else "n/a"
    return f"median |err| {statistics.median(errs):.1f} %, max {max(errs):.1f} %, tau {tau_s}"


def report(preds: list[Prediction], skipped: list[tuple[Point, str]]) -> list[str]:
    noise = [p.target.spread * 100 for p in preds]
    lines = table(preds, skipped)
    lines += kendall(preds)[1]
    lines.append(
        f"  run-to-run noise (repeats' half range): median {statistics.median(noise):.1f} %, max {max(noise):.1f} %"
    )
    if line := contention_line(behind(preds, skipped)):
        lines.append(line)
    lines.append(summary_line(preds))
    return lines


def leave_one_out(points: list[Point], reports: list[CommReport], root: str) -> tuple[list, list]:
    """Each point predicted from all the others (the comm measurement stays: it is the network, not a point)."""
    if not reports:
        n = max((p.world_size for p in points), default=2)
        raise PredictError(
            f"no ptbench.comm measurement under {root}: run python -m ptbench.comm --world-size {n} --out {root}/comm"
        )
    fits = fit_comm(reports)
    preds, skipped = [], []
    for target in points:
        rest = [p for p in points if p.key != target.key]
        try:
            preds.append(predict(target, rest, fits, reference_exposed(rest, fits), root))
        except PredictError as e:
            skipped.append((target, str(e)))
    if not preds:
        raise PredictError(
            f"too few points for leave-one-out in {root}: {len(points)} point(s), and none has a second point of its "
            "series (another link rate, device count or micro-batch count) to be predicted from"
        )
    return preds, skipped


def held_out(calibration: list[Point], targets: list[Point], reports: list[CommReport], root: str):
    fits = fit_comm(reports)
    ref = reference_exposed(calibration, fits)
    preds, skipped = [], []
    for t in targets:
        try:
            preds.append(predict(t, calibration, fits, ref, root))
        except PredictError as e:
            skipped.append((t, str(e)))
    return preds, skipped


def write_predictions(root: Path, mode: str, preds: list[Prediction], measured: bool) -> Path:
    """root/predictions.jsonl: this mode's lines replace its previous ones (the other modes' stay)."""
    path = root / PREDICTIONS
    keep = []
    if path.exists():  # bounded (a results folder may be a group's): a line that is not an object is dropped
        keep = [json.dumps(v) for _, v in jsonl(path) if isinstance(v, dict) and v.get("mode") != mode]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for p in preds:
        t = p.target
        keep.append(
            json.dumps(
                {
                    "mode": mode,
                    "created": when,
                    "series": t.series,
                    "world_size": t.world_size,
                    "microbatches": t.microbatches,
                    "local_batch": t.local_batch,
                    "workload": t.workload,
                    "link_mbit": t.link,
                    "predicted_step_s": p.step,
                    "interval_s": [p.lo, p.hi],
                    "predicted_epoch_s": p.epoch,
                    "predicted_samples_per_s": p.throughput,
                    "compute_s": p.compute,
                    "comm_s": p.comm,
                    "exposed": p.exposed,
                    "micro_batch_time_from": p.micro_batch_time_from or None,
                    "memory_bytes_per_rank": t.memory_bytes,
                    "measured_step_s": t.step if measured else None,
                    "err_pct": error_pct(p) if measured else None,
                    "noise_pct": t.spread * 100 if measured else None,
                    # runs behind this figure (the point's own, its calibration's) that warn of contention
                    "contended_runs": sum(c.contended for c in behind([p])),
                }
            )
        )
    path.write_text("\n".join(keep) + "\n")
    return path
