"""The run's summary from its epoch events, and the record rank 0 writes: that summary with the run's setup
(bench/core/schema.py SUMMARY). The events and the conventions their numbers follow: bench/runner/meter.py."""

from __future__ import annotations

import sys
import time

import numpy as np
from omegaconf import OmegaConf

from ptbench import adapters
from ptbench.adapters.base import Adapter, compile_stats
from ptbench.core import schema
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.loaders import loader_options
from ptbench.runner.meter import CONVENTIONS
from ptbench.runner.plan import RunPlan
from ptbench.workloads.base import Workload

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


class RunSummary:
    """The run's totals from its epoch events (`totals`), and those with the run's setup from the config, plan
    and adapter it holds: the record rank 0 writes (`record`)."""

    def __init__(self, cfg: BenchConfig, plan: RunPlan, ctx: DistContext, adapter: Adapter, workload: Workload):
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.workload = workload

    def totals(
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
            "global_batch": self.plan.global_batch,
            "local_batch": self.plan.local_batch,
            "samples_dropped_per_epoch": samples_dropped,
            "data_workers": data_workers,
            # loader and input settings as used: pin_memory, persistent_workers, channels_last, decoder, cache
            "data_pipeline": {**loader_options(self.ctx.device.type, data_workers), **self.workload.describe()},
            "compile": self._compile_summary(leaked),
            **self._times(epochs),
            "timing": timing,
            "tf32": self.cfg.trainer.tf32,
            "warnings": self._warnings(epochs, leaked, data_workers) + [w for w in [flops_check.get("warning")] if w],
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
        return self._ended(summary, last, diverged_at_step, profile)

    def _times(self, epochs: list[dict]) -> dict:
        """Step time and throughput over every timed step, epoch times over whole epochs."""
        timed = [e for e in epochs if e["timed_steps"]]
        total_timed = sum(e["timed_steps"] for e in timed)
        mean_step = sum(e["step_time_mean_s"] * e["timed_steps"] for e in timed) / total_timed if total_timed else None
        whole = [e["epoch_time_s"] for e in epochs if not e["partial"]]
        steady = [e["epoch_time_s"] for e in epochs[1:] if not e["partial"]]  # epoch 0 holds the warm-up
        batch = self.plan.global_batch
        return {
            "step_time_mean_s": mean_step,
            "samples_per_s": batch / mean_step if mean_step else None,
            "tokens_per_s": batch * self.plan.tokens_per_sample / mean_step if mean_step else None,
            # mean over whole epochs; over all epochs (flagged) when every epoch was cut short
            "epoch_time_mean_s": float(np.mean(whole or [e["epoch_time_s"] for e in epochs])) if epochs else None,
            "epoch_time_mean_includes_partial": not whole and bool(epochs),
            # whole epochs after the first (warm-up, NCCL init, first-step probes): what speedup should use
            "epoch_time_steady_s": float(np.mean(steady)) if steady else None,
        }

    def _ended(self, summary: dict, last: dict, diverged_at_step: int | None, profile: dict | None) -> dict:
        """The summary checked, with how the run ended: the divergence or the interruption in one line, and
        trainer.profile's keys (checked at the top level when the summary is written)."""
        if diverged_at_step is not None:
            summary["diverged_at_step"] = diverged_at_step
            summary["error"] = (
                f"training diverged: the loss was not finite at global step {diverged_at_step} (run stopped at "
                f"the end of epoch {last.get('epoch')}); its times are not comparable: lower optimizer.lr "
                f"(now {self.cfg.optimizer.lr:g}) or set trainer.grad_clip"
            )
        schema.check(summary, schema.SUMMARY, "summary.json", deep=True)
        if profile is not None:
            summary["profile"] = profile
        if summary["status"] == "interrupted" and not summary.get("error"):  # the report's one line on it
            summary["error"] = f"interrupted (Ctrl-C, SIGINT) after step {summary['steps']}"
        return summary

    def record(self, summary: dict, *, requeue: str | None, threads: int, rank_environment: dict) -> dict:
        """Rank 0's final summary: the totals, the Slurm job to requeue (`requeue`: its id, None: none), and the
        run's setup from the config, plan and adapter it holds and the rank's start (`threads`, CPU
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

    def _warnings(self, epochs: list[dict], leaked: int, workers: int) -> list[str]:
        warnings = list(self.plan.warnings)  # found before launch (contention)
        data_share = [e["data_share"] for e in epochs if e["timed_steps"] and e.get("data_share") is not None]
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
