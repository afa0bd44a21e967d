"""What the training loop measured in one epoch, as its event (bench/core/schema.py EPOCH_EVENT); the run's
summary and the record built from the events: bench/runner/summary.py.

Stated conventions (also written into every record under "conventions"):
- the first `trainer.untimed_steps` optimizer steps of the run are excluded from step statistics and
  throughput; `epoch_time_s` is the wall time of the whole epoch's training steps, warm-up included,
  validation excluded (`val_time_s` separately);
- a step's time is the slowest rank's time for that step; phase times are means over ranks;
- FLOPs are analytic (workload), training = 3 x forward; achieved FLOP/s = samples/s x FLOPs/sample.

The epoch event costs one collective round per epoch (losses all-reduced, phase times and per-rank
facts gathered): the loop keeps per-step losses on the device until the epoch ends.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from ptbench.adapters.base import Adapter, compile_stats
from ptbench.core import memory, schema
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.flops import math_dtype, mfu, peak_flops
from ptbench.core.timing import PHASES
from ptbench.runner.console import print_epoch
from ptbench.runner.plan import RunPlan

CONVENTIONS = {
    "warmup": "first trainer.untimed_steps steps of the run excluded from step stats and throughput",
    "epoch_time": "wall time of the epoch's training steps incl. warm-up; validation excluded",
    "step_time": "per step, the slowest rank; phases are means over ranks",
    "flops": "analytic, 2 FLOPs per multiply-add, training = 3 x forward (vision: less the first convolution's "
    "input gradient); flops_check: the same counted by torch's FlopCounterMode",
    "memory": "CUDA: max allocated/reserved; CPU: VmHWM; both reset each epoch and after the warm-up steps: "
    "an epoch's peak is the steady steps' (peak_memory_after_warmup), warmup_peak_memory_max the warm-up's",
    "startup": "startup_s = launch of the command to the end of the first step",
    "compile": "trainer.compile: compilation runs in the warm-up steps (out of step stats, inside the first "
    "epoch_time_s); compile.time_s is torch._dynamo's own compile time; frames compiled after warm-up "
    "(recompiles) are counted per epoch as timed_step_frames",
    "checkpoints": "epoch_time_s leaves out time spent saving checkpoints (checkpoint_time_s); a resumed epoch's "
    "time is the sum of its parts before and after the restart, the restart gap left out",
}


class Meter:
    """Turns one epoch's raw measurements into its event (`epoch_event`, a collective: every rank calls it)."""

    def __init__(self, cfg: BenchConfig, plan: RunPlan, ctx: DistContext, adapter: Adapter, profiler=None):
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.compile_warm: dict | None = None  # torch._dynamo counters when the warm-up ended (trainer.compile)
        self.warmup_memory: dict | None = None  # this rank's warm-up peaks (after_warmup), until its epoch's event
        self.profiler = profiler  # the trainer's StepProfiler (trainer.profile): collective waits per rank

    def epoch_event(
        self,
        epoch: int,
        *,
        losses: list[torch.Tensor],
        rows: list[dict],
        first_step: int,
        epoch_time: float,
        val_time: float,
        mem: dict,
        state: dict,
        val_metrics: dict,
        run_start: float,
        partial: bool,
        lrs: list[float] | None,
        checkpoint_time: float,
        compile: dict | None,
        resumed_at: int | None,
        counted: dict,
    ) -> dict:
        """The epoch's event (a collective: every rank calls it). `rows`: this rank's per-step phase times;
        `lrs`: with an lr schedule, the lr of every step of the run so far; `resumed_at`: the global step
        of the checkpoint this epoch continued from (None: it ran in one attempt); `counted`: this rank's
        saved_activations and step_peak (the last untimed step, memory ledger) and host_syncs (trainer.count_syncs)."""
        steps = len(losses)
        warmup, self.warmup_memory = self.warmup_memory, None  # the epoch in which the warm-up ended has it
        if warmup is not None and first_step + steps <= self.cfg.trainer.untimed_steps:
            mem = memory.with_warmup(mem, warmup)  # the reset came after this epoch's last step
        loss_vec = self._mean_losses(losses)
        facts = {"memory": mem, "memory_warmup": warmup, "state_bytes": state, **counted, "epoch_time_s": epoch_time}
        times, per_rank = self._gather(rows, self._rank_facts(facts, first_step, steps))
        timed = times[:, max(0, self.cfg.trainer.untimed_steps - first_step) :, :]
        slowest = max(r["epoch_time_s"] for r in per_rank)
        event = {
            "type": "epoch",
            "epoch": epoch,
            "steps": steps,
            "timed_steps": int(timed.shape[1]),
            "warmup_steps_excluded": int(steps - timed.shape[1]),
            "global_batch": self.plan.global_batch,
            "devices": self.plan.devices,  # world_size x devices per process (GPipe drives several from one)
            "epoch_time_s": slowest,  # the slowest rank's: an epoch ends when its last rank does
            # cut short (trainer.max_steps, a stop signal): flagged, and left out of epoch-time means
            "partial": partial,
            "val_time_s": val_time,
            "wall_time_s": time.perf_counter() - run_start,
            **self._speed(timed, steps, slowest),
            **self._losses(loss_vec, lrs, first_step, steps),
            **self._memory(per_rank, first_step, steps),
            "ranks": per_rank,
            **_stragglers(timed, per_rank),
            **val_metrics,
            "checkpoint_time_s": checkpoint_time,
        }
        return self._flagged(event, compile, loss_vec, first_step, resumed_at)

    def _rank_facts(self, facts: dict, first_step: int, steps: int) -> dict:
        """This rank's row of the event (`ranks`): who it is, and `facts` (its memory, state bytes, counts, time)."""
        waits = self.profiler.wait_in(first_step, first_step + steps) if self.profiler else None
        return {"rank": self.ctx.rank, "host": socket.gethostname(), **facts, "comm_wait_s": waits}

    def _speed(self, timed: np.ndarray, steps: int, slowest: float) -> dict:
        """The timed steps' times (the slowest rank per step), phase means over ranks, throughput and MFU."""
        step_times = timed[:, :, -1].max(axis=0) if timed.shape[1] else np.zeros(0)
        phases = {c: float(timed[:, :, i].mean()) if timed.shape[1] else None for i, c in enumerate(PHASES)}
        stats = _stats(step_times)
        mean, batch = stats["mean"], self.plan.global_batch
        samples_per_s = batch / mean if mean else None
        flops_per_s = samples_per_s * self.plan.train_flops_per_sample if samples_per_s else None
        mfu_value, mfu_note = self._mfu(flops_per_s)
        return {
            "step_time_mean_s": mean,
            "step_time_p50_s": stats["p50"],
            "step_time_p95_s": stats["p95"],
            "step_time_cv": stats["cv"],
            # the timed steps' times (slowest rank per step), rounded to the us: the step-time interval
            "step_times_s": [round(float(v), 6) for v in step_times],
            **{f"{c}_time_mean_s": v for c, v in phases.items()},
            "data_share": phases["data"] / mean if mean else None,
            "samples_per_s": samples_per_s,
            "epoch_samples_per_s": batch * steps / slowest if slowest > 0 else None,
            "tokens_per_s": samples_per_s * self.plan.tokens_per_sample if samples_per_s else None,
            "train_flops_per_sample": self.plan.train_flops_per_sample,
            "flops_per_s": flops_per_s,
            "mfu": mfu_value,
            "mfu_note": mfu_note,
        }

    def _mfu(self, flops_per_s: float | None) -> tuple[float | None, str | None]:
        """(MFU, why there is none) of `flops_per_s` against the devices' peak in the run's math dtype."""
        t = self.cfg.trainer
        peak = peak_flops(self.ctx.device, t.precision, t.tf32)
        value, note = mfu(flops_per_s, peak, self.plan.devices)
        if self.ctx.is_cuda and peak is None:
            note = (
                f"no MFU: no peak FLOP/s known for {torch.cuda.get_device_name(self.ctx.device)} in "
                f"{math_dtype(t.precision, t.tf32)} (bench/core/flops.py)"
            )
        return value, note

    def _losses(self, loss_vec: np.ndarray, lrs: list[float] | None, first_step: int, steps: int) -> dict:
        """The epoch's mean training loss (every step's with trainer.log_step_losses) and its lr."""
        return {
            "train_loss": float(loss_vec.mean()) if len(loss_vec) else None,
            "train_losses": [float(v) for v in loss_vec] if self.cfg.trainer.log_step_losses else None,
            # the lr of the epoch's first step; with a schedule, every step's (lr_schedule=..., bench/core/schedule.py)
            "lr_epoch_start": lrs[first_step] if lrs is not None and len(lrs) > first_step else self.cfg.optimizer.lr,
            "lrs": lrs[first_step : first_step + steps] if lrs is not None else None,
        }

    def _memory(self, per_rank: list[dict], first_step: int, steps: int) -> dict:
        """The highest and lowest peak over ranks, and whether they leave the warm-up out (`_warmup_peaks`)."""
        key = "peak_allocated" if self.ctx.is_cuda else "peak_rss"
        values = [r["memory"][key] for r in per_rank if r["memory"][key] is not None]
        return {
            "memory_metric": key,
            "peak_memory_max": max(values) if values else None,
            "peak_memory_min": min(values) if values else None,
            **self._warmup_peaks(per_rank, key, first_step, steps),
        }

    def _flagged(self, event: dict, compile: dict | None, loss_vec, first_step: int, resumed_at: int | None) -> dict:
        """The event with what happened to it (compiles, a non-finite loss, a restart), printed and checked."""
        if compile is not None:
            event["compile"] = compile
        nonfinite = np.flatnonzero(~np.isfinite(loss_vec))
        if len(nonfinite):  # found on the losses the event brings to the host anyway: no per-step sync
            event["diverged_at_step"] = first_step + int(nonfinite[0]) + 1
        if resumed_at is not None:
            event["resumed"] = True  # this epoch ran in two attempts: the parts are joined
            event["resumed_at_step"] = resumed_at
            event["restart_gap_excluded"] = True
            event["memory_note"] = "peak memory of the attempt after the restart"
        if self.ctx.rank == 0:
            print_epoch(event)
        return schema.check(event, schema.EPOCH_EVENT, "events.jsonl", deep=True)

    def _mean_losses(self, losses: list[torch.Tensor]) -> np.ndarray:
        """Per-step losses, each the mean over the ranks that report them."""
        device = self.ctx.device
        reports = self.adapter.reports_metrics
        reporting = torch.tensor([1.0 if reports else 0.0], device=device)
        loss_vec = torch.stack(losses).float() if losses else torch.zeros(0, device=device)
        if not reports:
            loss_vec = torch.zeros_like(loss_vec)
        dist.all_reduce(loss_vec)
        dist.all_reduce(reporting)
        return (loss_vec / reporting).cpu().numpy()

    def _gather(self, rows: list[dict], facts: dict) -> tuple[np.ndarray, list[dict]]:
        """Every rank's per-step phase times, [world, steps, phases + step], and every rank's `facts`."""
        cols = list(PHASES) + ["step"]
        table = [[s.get(c, 0.0) for c in cols] for s in rows]
        local = torch.tensor(table, dtype=torch.float64, device=self.ctx.device).reshape(-1, len(cols))
        gathered = [torch.zeros_like(local) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, local)
        per_rank = [None] * self.ctx.world_size
        dist.all_gather_object(per_rank, facts)
        return torch.stack([g.cpu() for g in gathered]).numpy(), per_rank

    def after_warmup(self, devices) -> None:
        """Called once, after the last untimed step: keeps this rank's warm-up peaks (cuDNN autotuning,
        compilation, the memory ledger's step) as their own reading and resets the peaks, so the epoch's
        recorded peak, the one set against the memory model, is the steady steps'."""
        self.warmup_memory = memory.end_warmup(devices)

    def _warmup_peaks(self, per_rank: list[dict], mem_key: str, first_step: int, steps: int) -> dict:
        """`peak_memory_after_warmup`: whether the epoch's peaks leave the warm-up steps out (the epoch began
        after them, or every rank reset its peaks when they ended); and in the epoch in which the warm-up
        ended, `warmup_peak_memory_max`: the highest warm-up peak over ranks."""
        warm = [r["memory_warmup"] for r in per_rank if r.get("memory_warmup")]
        for r in per_rank:
            if r.get("memory_warmup") is None:
                r.pop("memory_warmup", None)
        untimed = self.cfg.trainer.untimed_steps
        holds_warmup = first_step < untimed
        after = not holds_warmup or (
            first_step + steps > untimed and len(warm) == len(per_rank) and all(w["reset"] for w in warm)
        )
        out = {"peak_memory_after_warmup": after}
        values = [w[mem_key] for w in warm if w.get(mem_key) is not None]
        if values:
            out["warmup_peak_memory_max"] = max(values)
        return out

    def warmup_ended(self) -> None:
        """Called at the last warm-up step (trainer.compile): later compiles are recompiles in timed steps."""
        self.compile_warm = compile_stats()

    def compile_event(self, before: dict, trained: dict, validated: dict, first_step: int, global_step: int) -> dict:
        """torch._dynamo counters over the epoch: its training steps, their timed part, its validation."""
        warmup = self.cfg.trainer.untimed_steps
        if first_step >= warmup:
            timed_from = before
        elif global_step >= warmup and self.compile_warm is not None:
            timed_from = self.compile_warm  # the warm-up ended in this epoch
        else:
            timed_from = trained  # every step of this epoch was warm-up
        return {
            "train_frames": trained["frames"] - before["frames"],
            "train_time_s": trained["time_s"] - before["time_s"],
            "timed_step_frames": trained["frames"] - timed_from["frames"],
            "eval_frames": validated["frames"] - trained["frames"],
            "eval_time_s": validated["time_s"] - trained["time_s"],
        }


def _stragglers(timed: np.ndarray, per_rank: list[dict]) -> dict:
    """Per-rank mean step time (each rank's own clock), the waits in collectives the profiled steps measured
    (trainer.profile), and the slowest rank: the one with the most step time outside collective waits
    (a straggler makes the others wait for it), else the longest own step time."""
    waits = [r.pop("comm_wait_s", None) for r in per_rank]  # not a rank-row field: moved to the event
    if not timed.shape[1]:
        return {}
    own = [float(v) for v in timed[:, :, -1].mean(axis=1)]
    if all(w is not None for w in waits):
        busy = [o - w for o, w in zip(own, waits)]
        by = "step time less collective wait (profiled steps)"
    else:
        busy, waits, by = own, None, "own step time (no profiled steps: trainer.profile)"
    return {
        "rank_step_time_mean_s": own,
        "rank_comm_wait_s": waits,
        "slowest_rank": int(np.argmax(busy)),
        "slowest_rank_by": by,
    }


def _stats(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {"mean": None, "p50": None, "p95": None, "cv": None}
    mean = float(x.mean())
    return {
        "mean": mean,
        "p50": float(np.percentile(x, 50)),
        "p95": float(np.percentile(x, 95)),
        "cv": float(x.std() / mean) if mean > 0 else None,
    }
