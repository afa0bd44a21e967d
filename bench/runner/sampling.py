"""Optional sampled timing: `trainer.timing_sample=PCT` measures an epoch's steps only until the 95 %
interval of the mean step time is within ±PCT % of it (or `trainer.timing_sample_cap` timed steps), then ends
the epoch and records its time as an ESTIMATE: the event's `epoch_time_estimate` (value, interval, steps
measured), the epoch flagged `partial` as any cut-short epoch. Full epochs stay the default (timing_sample=0).

Method, stated: every CHECK_EVERY steps after the warm-up (and from MIN_STEPS timed steps on) the epoch's timed
step times are gathered, per step the slowest rank (an all-reduce MAX: every rank gets the same numbers, so they
all stop at the same step). Step times are autocorrelated (a slow phase of the machine lasts several steps), so
the interval is Student-t's on the mean with an effective sample size, n (1 - r) / (1 + r) (AR(1)), r the lag-1
autocorrelation with the Marriott-Pope small-sample correction r + (1 + 4 r) / n, clipped to [0, 0.95]; t from
scipy.stats.t. It remains an ESTIMATE, and stopping when the interval first looks narrow enough makes it
narrower than it should be: simulated on AR(1) steps (bench/MEASUREMENTS.md, "Sampled timing"), where steps
are autocorrelated, read the estimate's interval as an 80-90 % one (two thirds at autocorrelation 0.95).
Estimate = the measured part of the epoch + mean x the steps left (interval: the same with the
mean's bounds). On CUDA each check reads the steps' events (one device sync every CHECK_EVERY steps).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

CHECK_EVERY = 5
MIN_STEPS = 10


MAX_AUTOCORRELATION = 0.95


def effective_n(x: list[float]) -> float:
    """n (1 - r) / (1 + r), r the lag-1 autocorrelation of `x` (Marriott-Pope corrected, clipped to [0, 0.95])."""
    n = len(x)
    m = sum(x) / n
    d = [v - m for v in x]
    ss = sum(v * v for v in d)
    r = sum(a * b for a, b in zip(d, d[1:])) / ss if ss else 0.0
    r = min(max(r + (1 + 4 * r) / n, 0.0), MAX_AUTOCORRELATION)
    return n * (1 - r) / (1 + r)


def mean_interval(x: list[float]) -> tuple[float, float]:
    """(mean, 95 % half-width) of the mean of autocorrelated `x`: Student-t with the effective sample size."""
    from scipy.stats import t

    n = len(x)
    m = sum(x) / n
    if n < 2:
        return m, math.inf
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    ne = effective_n(x)
    return m, float(t.ppf(0.975, max(ne - 1, 1.0))) * sd / math.sqrt(ne)


class SampledTiming:
    """The stop rule and the estimate of trainer.timing_sample (one per trainer)."""

    def __init__(self, target_pct: float, cap: int, untimed_steps: int, device):
        self.target_pct = target_pct
        self.cap = cap
        self.untimed = untimed_steps
        self.device = device
        self.last: dict | None = None  # the last check's figures (the estimate's)

    @classmethod
    def of(cls, cfg, device) -> SampledTiming | None:
        t = cfg.trainer
        return cls(t.timing_sample, t.timing_sample_cap, t.untimed_steps, device) if t.timing_sample else None

    def start_epoch(self) -> None:
        self.last = None

    def _slowest(self, rows: list[dict], first_step: int) -> list[float]:
        mine = [r["step"] for r in rows][max(0, self.untimed - first_step) :]
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local.cpu().tolist()

    def enough(self, rows_fn, first_step: int, global_step: int) -> bool:
        """After a step (every rank, same global step): True when the epoch has been measured enough."""
        timed = global_step - max(first_step, self.untimed)
        if timed < MIN_STEPS or timed % CHECK_EVERY:
            return False
        times = self._slowest(rows_fn(), first_step)
        mean, half = mean_interval(times)
        pct = 100 * half / mean if mean > 0 else math.inf
        self.last = {"n": len(times), "mean": mean, "half": half, "pct": pct}
        if pct <= self.target_pct:
            self.last["reason"] = "interval"
            return True
        if self.cap and len(times) >= self.cap:
            self.last["reason"] = "cap"
            return True
        return False

    def annotate(self, event: dict, steps_in_epoch: int) -> dict:
        """The epoch event with its `epoch_time_estimate` when sampling ended the epoch early."""
        if self.last is None or "reason" not in self.last or event["steps"] >= steps_in_epoch:
            return event
        left = steps_in_epoch - event["steps"]
        mean, half = self.last["mean"], self.last["half"]
        measured = event["epoch_time_s"]
        event["epoch_time_estimate"] = {
            "estimate": True,
            "value_s": measured + mean * left,
            "lo_s": measured + max(mean - half, 0.0) * left,  # a step takes no negative time, however wide the interval
            "hi_s": measured + (mean + half) * left,
            "steps_measured": event["steps"],
            "timed_steps_measured": self.last["n"],
            "steps_in_epoch": steps_in_epoch,
            "half_width_pct": round(self.last["pct"], 3),
            "target_pct": self.target_pct,
            "stopped_by": self.last["reason"],
        }
        return event
