"""What the training loop measured, as the record: the epoch event and the summary (bench/core/schema.py).

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
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ptbench import adapters
from ptbench.adapters.base import Adapter, compile_stats
from ptbench.core import memory, schema
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.flops import math_dtype, mfu, peak_flops
from ptbench.core.loaders import loader_options
from ptbench.core.timing import PHASES
from ptbench.runner.console import print_epoch
from ptbench.runner.plan import RunPlan
from ptbench.workloads.base import Workload

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
# the last epoch's values the summary repeats
LAST_EPOCH = (
    "val_loss",
    "val_accuracy",
    "val_perplexity",
    "train_loss",
    "peak_memory_max",
    "peak_memory_min",
    "peak_memory_after_warmup",
    "mfu",
)


class Meter:
    """Turns one epoch's raw measurements into its event, the events into the run's summary, and that summary
    with the run's setup into the record rank 0 writes (`record`)."""

    def __init__(
        self, cfg: BenchConfig, plan: RunPlan, ctx: DistContext, adapter: Adapter, workload: Workload, profiler=None
    ):
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.workload = workload
        self.compile_warm: dict | None = None  # torch._dynamo counters when the warm-up ended (trainer.compile)
        self.warmup_memory: dict | None = None  # this rank's warm-up peaks (after_warmup), until its epoch's event
        self.global_batch = plan.global_batch
        self.local_batch = plan.local_batch
        self.profiler = profiler  # the trainer's StepProfiler (trainer.profile): collective waits per rank

    # --- one epoch -------------------------------------------------------------------------------
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
        device = self.ctx.device
        steps = len(losses)
        warmup, self.warmup_memory = self.warmup_memory, None  # the epoch in which the warm-up ended has it
        if warmup is not None and first_step + steps <= self.cfg.trainer.untimed_steps:
            mem = memory.with_warmup(mem, warmup)  # the reset came after this epoch's last step
        loss_vec = self._mean_losses(losses)
        times, per_rank = self._gather(
            rows,
            {
                "rank": self.ctx.rank,
                "host": socket.gethostname(),
                "memory": mem,
                "memory_warmup": warmup,
                "state_bytes": state,
                "saved_activations": counted["saved_activations"],
                "step_peak": counted["step_peak"],
                "host_syncs": counted["host_syncs"],
                "epoch_time_s": epoch_time,
                "comm_wait_s": self.profiler.wait_in(first_step, first_step + steps) if self.profiler else None,
            },
        )

        timed_from = max(0, self.cfg.trainer.untimed_steps - first_step)
        timed = times[:, timed_from:, :]
        step_times = timed[:, :, -1].max(axis=0) if timed.shape[1] else np.zeros(0)
        phase_means = {c: float(timed[:, :, i].mean()) if timed.shape[1] else None for i, c in enumerate(PHASES)}
        step_stats = _stats(step_times)
        samples_per_s = self.global_batch / step_stats["mean"] if step_stats["mean"] else None
        flops_per_sample = self.plan.train_flops_per_sample
        flops_per_s = samples_per_s * flops_per_sample if samples_per_s else None
        t = self.cfg.trainer
        peak = peak_flops(device, t.precision, t.tf32)
        devices = self.plan.devices
        slowest = max(r["epoch_time_s"] for r in per_rank)
        mfu_value, mfu_note = mfu(flops_per_s, peak, devices)
        if self.ctx.is_cuda and peak is None:
            mfu_note = (
                f"no MFU: no peak FLOP/s known for {torch.cuda.get_device_name(device)} in "
                f"{math_dtype(t.precision, t.tf32)} (bench/core/flops.py)"
            )
        mem_key = "peak_allocated" if self.ctx.is_cuda else "peak_rss"
        mem_values = [r["memory"][mem_key] for r in per_rank if r["memory"][mem_key] is not None]
        event = {
            "type": "epoch",
            "epoch": epoch,
            "steps": steps,
            "timed_steps": int(len(step_times)),
            "warmup_steps_excluded": int(steps - len(step_times)),
            "global_batch": self.global_batch,
            "devices": devices,  # world_size x devices per process (GPipe drives several from one)
            # the slowest rank's: an epoch ends when its last rank does
            "epoch_time_s": slowest,
            # cut short (trainer.max_steps, a stop signal): flagged, and left out of epoch-time means
            "partial": partial,
            "val_time_s": val_time,
            "wall_time_s": time.perf_counter() - run_start,
            "step_time_mean_s": step_stats["mean"],
            "step_time_p50_s": step_stats["p50"],
            "step_time_p95_s": step_stats["p95"],
            "step_time_cv": step_stats["cv"],
            # the timed steps' times (slowest rank per step), rounded to the us: the step-time interval
            "step_times_s": [round(float(v), 6) for v in step_times],
            **{f"{c}_time_mean_s": v for c, v in phase_means.items()},
            "data_share": phase_means["data"] / step_stats["mean"] if step_stats["mean"] else None,
            "samples_per_s": samples_per_s,
            "epoch_samples_per_s": self.global_batch * steps / slowest if slowest > 0 else None,
            "tokens_per_s": samples_per_s * self.plan.tokens_per_sample if samples_per_s else None,
            "train_flops_per_sample": flops_per_sample,
            "flops_per_s": flops_per_s,
            "mfu": mfu_value,
            "mfu_note": mfu_note,
            "train_loss": float(loss_vec.mean()) if len(loss_vec) else None,
            "train_losses": [float(v) for v in loss_vec] if t.log_step_losses else None,
            # the lr of the epoch's first step; with a schedule, every step's (lr_schedule=..., bench/core/schedule.py)
            "lr_epoch_start": lrs[first_step] if lrs is not None and len(lrs) > first_step else self.cfg.optimizer.lr,
            "lrs": lrs[first_step : first_step + steps] if lrs is not None else None,
            "memory_metric": mem_key,
            "peak_memory_max": max(mem_values) if mem_values else None,
            "peak_memory_min": min(mem_values) if mem_values else None,
            **self._warmup_peaks(per_rank, mem_key, first_step, steps),
            "ranks": per_rank,
            **_stragglers(timed, per_rank),
            **val_metrics,
            "checkpoint_time_s": checkpoint_time,
        }
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

    # --- the run ---------------------------------------------------------------------------------
    def summary(
        self,
        epochs: list[dict],
        *,
        status: str,
        total_time: float,
        steps: int,
        startup_s: float | None,
        stop_signal: str | None,
        checkpoint: dict | None,
        resumed_from: list[dict],
        timing: dict,
        data_workers: int,
        samples_dropped: int,
        diverged_at_step: int | None = None,
        profile: dict | None = None,
    ) -> dict:
        """The run's totals from its epoch events (`record` adds the run's setup before rank 0 writes it).
        `data_workers`: the loaders' worker processes; `samples_dropped`: per epoch, the incomplete last
        global batch; `diverged_at_step`: the global step whose training loss was first non-finite (status
        diverged); `profile`: what trainer.profile's window measured."""
        last = epochs[-1] if epochs else {}
        timed = [e for e in epochs if e["timed_steps"]]
        total_timed = sum(e["timed_steps"] for e in timed)
        mean_step = sum(e["step_time_mean_s"] * e["timed_steps"] for e in timed) / total_timed if total_timed else None
        whole = [e["epoch_time_s"] for e in epochs if not e["partial"]]
        steady = [e["epoch_time_s"] for e in epochs[1:] if not e["partial"]]  # epoch 0 holds the warm-up
        leaked = sum(e["compile"]["timed_step_frames"] for e in epochs if e.get("compile"))
        # rank 0 alone writes the summary: the others skip the count (a whole-model pass on the meta device)
        flops_check = self._flops_check() if self.ctx.rank == 0 else {}
        summary = {
            "status": status,
            "checkpoint": checkpoint,
            **({"resumed_from": resumed_from, "restart_gap_excluded": True} if resumed_from else {}),
            "startup_s": startup_s,
            "stop_signal": stop_signal,
            "epochs_completed": len(epochs),
            "total_time_s": total_time,
            "steps": steps,
            "global_batch": self.global_batch,
            "local_batch": self.local_batch,
            "samples_dropped_per_epoch": samples_dropped,
            "data_workers": data_workers,
            # loader and input settings as used: pin_memory, persistent_workers, channels_last, decoder, cache
            "data_pipeline": {**loader_options(self.ctx.device.type, data_workers), **self.workload.describe()},
            "compile": self._compile_summary(leaked),
            "step_time_mean_s": mean_step,
            "samples_per_s": self.global_batch / mean_step if mean_step else None,
            "tokens_per_s": self.global_batch * self.plan.tokens_per_sample / mean_step if mean_step else None,
            # mean over whole epochs; over all epochs (flagged) when every epoch was cut short
            "epoch_time_mean_s": float(np.mean(whole or [e["epoch_time_s"] for e in epochs])) if epochs else None,
            "epoch_time_mean_includes_partial": not whole and bool(epochs),
            # whole epochs after the first (warm-up, NCCL init, first-step probes): what speedup should use
            "epoch_time_steady_s": float(np.mean(steady)) if steady else None,
            "timing": timing,
            "tf32": self.cfg.trainer.tf32,
            "warnings": self._warnings(epochs, timed, leaked, data_workers)
            + [w for w in [flops_check.get("warning")] if w],
            "flops_check": flops_check,
            "memory_ledger": self._memory_ledger(last),
            "state_bytes_per_rank": [r["state_bytes"] for r in last.get("ranks", [])],
            "hosts": [r["host"] for r in last.get("ranks", [])],  # one per rank, in rank order
            **{k: last.get(k) for k in LAST_EPOCH},
            # the warm-up's own peak (the epoch in which it ended): beside the steady peak_memory_max
            "warmup_peak_memory_max": next(
                (e["warmup_peak_memory_max"] for e in epochs if e.get("warmup_peak_memory_max") is not None), None
            ),
        }
        if diverged_at_step is not None:
            summary["diverged_at_step"] = diverged_at_step
            summary["error"] = (
                f"training diverged: the loss was not finite at global step {diverged_at_step} (run stopped at "
                f"the end of epoch {last.get('epoch')}); its times are not comparable: lower optimizer.lr "
                f"(now {self.cfg.optimizer.lr:g}) or set trainer.grad_clip"
            )
        schema.check(summary, schema.SUMMARY, "summary.json", deep=True)
        if profile is not None:  # the profiler's own keys: checked at the top level when the summary is written
            summary["profile"] = profile
        if status == "interrupted" and not summary.get("error"):  # the report's one line on it
            summary["error"] = f"interrupted (Ctrl-C, SIGINT) after step {steps}"
        return summary

    def record(self, summary: dict, *, requeue: str | None, threads: int, rank_environment: dict) -> dict:
        """Rank 0's final summary: the totals, the Slurm job to requeue (`requeue`: its id, None: none), and the
        run's setup from the config, plan and adapter this meter holds and the rank's start (`threads`, CPU
        threads per rank; `rank_environment`, the adapter's variables and the values the process started with)."""
        extra = OmegaConf.to_container(self.cfg.extra) if OmegaConf.is_config(self.cfg.extra) else self.cfg.extra
        return {
            **summary,
            **({"requeue": {"slurm_job_id": requeue, "time": time.time()}} if requeue else {}),
            "adapter_settings": self.adapter.describe(),
            "plan": self.plan.describe(),
            "layout": self.plan.layout.as_dict(),
            "precision": self.plan.precision,
            "predicted_memory": self.plan.predicted_memory,
            "comm_volume": self.plan.comm_volume,
            "extra": extra,
            "batch_reduced_from": (extra or {}).get("batch_reduced_from") if isinstance(extra, dict) else None,
            "phase_semantics": self.adapter.phase_semantics,
            "precision_semantics": self.adapter.precision_semantics,
            "batch_policy": self.plan.batch_policy,
            "warmup_steps": self.cfg.trainer.untimed_steps,
            "launcher": self.ctx.launcher,
            "conventions": CONVENTIONS,
            "frameworks_imported": frameworks_imported(),
            "cpu_threads_per_rank": threads,
            "rank_environment": rank_environment,
        }

    def _memory_ledger(self, last: dict) -> dict | None:
        """Predicted (memory model, busiest rank) vs counted (last untimed step, each rank) saved-activation bytes."""
        from ptbench.core.memory_model import ledger_fields

        # gpipe (one process, several devices): the rank's count holds each partition's (adapters/gpipe.py)
        counted = [r.get("saved_activations") for r in last.get("ranks", [])]
        steps = [r.get("step_peak") for r in last.get("ranks", [])]
        return ledger_fields(self.plan.predicted_memory, counted, steps)

    def _flops_check(self) -> dict:
        """The MFU cross-check: the plan's analytic training FLOPs per sample beside FlopCounterMode's count
        (ptbench.core.flops.flops_check; a meta-device pass, nothing computed). Never fatal."""
        from ptbench.core.flops import flops_check

        try:
            counted = self.workload.counted_flops()["total"]
        except Exception as e:  # noqa: BLE001 - a model the counter cannot run must not fail the run
            return {"error": f"{type(e).__name__}: {e}"}
        return flops_check(self.plan.train_flops_per_sample, counted)

    def _warnings(self, epochs: list[dict], timed: list[dict], leaked: int, workers: int) -> list[str]:
        warnings = list(self.plan.warnings)  # found before launch (contention)
        data_share = [e["data_share"] for e in timed if e.get("data_share") is not None]
        if data_share and max(data_share) > 0.10:
            warnings.append(
                f"data loading is {100 * max(data_share):.0f}% of the step time (> 10%): the run is "
                f"input-bound; raise data.num_workers (now {workers}) or use faster storage"
            )
        if leaked:
            warnings.append(
                f"torch.compile compiled {leaked} frame(s) after the warm-up (recompiles): those steps' "
                "times include compilation; raise trainer.untimed_steps or find the recompile (TORCH_LOGS=recompiles)"
            )
        if any(e.get("mfu_note") for e in epochs):
            warnings.append(next(e["mfu_note"] for e in epochs if e.get("mfu_note")))
        return warnings

    def _compile_summary(self, timed_step_frames: int) -> dict | None:
        t = self.cfg.trainer
        if not t.compile:
            return None
        total = compile_stats()
        return {
            "backend": t.compile_backend,
            "how": self.adapter.compile_how,
            "time_s": total["time_s"],
            "frames": total["frames"],
            "graphs": total["graphs"],
            "warmup_steps": t.untimed_steps,
            "timed_step_frames": timed_step_frames,
        }


def frameworks_imported() -> list[str]:
    """Frameworks other than torch that this process has imported (ddp must import none)."""
    tops = {m.split(".")[0] for m in adapters.frameworks().values()} - {"torch"}
    return sorted(m for m in tops if m in sys.modules)


def launch_time() -> float:
    """When the user's command started: the local launcher's start (BENCH_LAUNCH_T0), else this process's."""
    import os

    import psutil

    return float(os.environ.get("BENCH_LAUNCH_T0") or psutil.Process().create_time())


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
