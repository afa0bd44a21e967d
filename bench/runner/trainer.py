"""The one training loop, shared by every adapter, and what it measures.

Per epoch: set the sampler's epoch, reset peak memory, run the steps (each timed by phase), then
validate, then gather per-rank numbers (one collective round per epoch: per-step losses stay on the
device until the epoch ends, so the loop never forces a host sync for them). Inside the epoch the
only collective of the harness's own is the stop agreement, every `trainer.stop_check_every` steps
on a CPU group (bench/core/guard.py).

Stated conventions (also written into every record under "conventions"):
- the first `trainer.warmup_steps` optimizer steps of the run are excluded from step statistics and
  throughput; `epoch_time_s` is the wall time of the whole epoch's training steps, warm-up included,
  validation excluded (`val_time_s` separately);
- a step's time is the slowest rank's time for that step; phase times are means over ranks;
- FLOPs are analytic (workload), training = 3 x forward; achieved FLOP/s = samples/s x FLOPs/sample.

Checkpoints (bench/core/checkpoint.py, `trainer.checkpoint_every`, and on a stop signal when
checkpointing is on): after a step, every rank writes its part through the adapter
(`save_checkpoint`) and its own trainer state (RNG states, sampler position, the epoch's losses and
step times so far) into a temp folder that rank 0 commits by a rename. A resumed run
(`trainer.resume=auto`, the record found by bench/runner/rank.py) loads it, continues the epoch at
the saved step with the same shuffle, and writes that epoch's event as if it had not stopped: its
losses and step times are the two parts joined, its epoch time their sum (the restart gap and the
time spent saving left out, and flagged); events of the epochs after the checkpoint are replaced.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ptbench.adapters.base import Adapter, compile_stats
from ptbench.core import checkpoint as ckpt
from ptbench.core import memory
from ptbench.core.config import BenchConfig
from ptbench.core.data import data_workers, eval_loader, loader_options, train_loader
from ptbench.core.dist import DistContext
from ptbench.core.errors import ConfigError
from ptbench.core.flops import math_dtype, mfu, peak_flops
from ptbench.core.guard import StopFlag, Watchdog
from ptbench.core.records import RunRecord, atomic_write, write_json
from ptbench.core.schedule import Schedule
from ptbench.core.timing import PHASES, PhaseTimer
from ptbench.runner.console import print_epoch
from ptbench.runner.plan import RunPlan
from ptbench.workloads.base import Workload

CONVENTIONS = {
    "warmup": "first trainer.warmup_steps steps of the run excluded from step stats and throughput",
    "epoch_time": "wall time of the epoch's training steps incl. warm-up; validation excluded",
    "step_time": "per step, the slowest rank; phases are means over ranks",
    "flops": "analytic, 2 FLOPs per multiply-add, training = 3 x forward",
    "memory": "CUDA: max allocated/reserved; CPU: VmHWM; both reset each epoch",
    "startup": "startup_s = launch of the command to the end of the first step",
    "compile": "trainer.compile: compilation runs in the warm-up steps (out of step stats, inside the first "
               "epoch_time_s); compile.time_s is torch._dynamo's own compile time; frames compiled after warm-up "
               "(recompiles) are counted per epoch as timed_step_frames",
    "checkpoints": "epoch_time_s leaves out time spent saving checkpoints (checkpoint_time_s); a resumed epoch's "
                   "time is the sum of its parts before and after the restart, the restart gap left out",
}


class Trainer:
    def __init__(self, cfg: BenchConfig, plan: RunPlan, ctx: DistContext, adapter: Adapter, workload: Workload,
                 record: RunRecord | None, stop: StopFlag | None = None, watchdog: Watchdog | None = None,
                 run_dir: Path | None = None, resume_from: Path | None = None, resume_info: dict | None = None):
        adapter.check_checkpointing(cfg)  # also for adapters whose validate does not call the base's
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.workload = workload
        self.record = record  # only on rank 0
        self.timer = PhaseTimer(cuda_sync=cfg.trainer.sync_timing)  # CUDA events; per-phase sync only as a diagnostic
        self.global_step = 0
        self.stop = stop or StopFlag()
        self.watchdog = watchdog or Watchdog(0, lambda idle: None)
        self.stop_requested = False  # all ranks agreed to stop (graceful preemption)
        self.first_step_end: float | None = None
        # checkpoints: on when asked for and the adapter can; resume_from: the checkpoint to continue from
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.checkpointing = self.run_dir is not None and ckpt.enabled(cfg, adapter.checkpoint_unsupported)
        self.resume_from = Path(resume_from) if resume_from is not None else None
        self.resume_info = resume_info or {}
        self.resumed_from: list[dict] = []  # one entry per restart of this record
        self.checkpoints: list[dict] = []  # every save of this record (earlier attempts' included)
        self.saved_on_stop = False
        self._last_saved = -1
        self._prior: dict | None = None  # the resumed epoch's part before the checkpoint
        self._prior_run_time = 0.0  # training time of earlier attempts, up to the checkpoint
        self._epoch_done_losses: list[float] = []
        self._epoch_rows: list[dict] = []
        self._live_losses: list[torch.Tensor] = []
        self._epoch_first_step = 0
        self._epoch_index = 0
        self._epoch_prior_time = 0.0
        self._epoch_t0 = 0.0
        self._ckpt_time = 0.0  # seconds spent saving in the current epoch (left out of its time)
        self._run_start = time.perf_counter()
        self._compile_warm: dict | None = None  # torch._dynamo counters when the warm-up ended (trainer.compile)
        self.schedule: Schedule | None = None  # built in run(), once the steps per epoch are known
        self._lrs: list[float] = []  # with a schedule: the lr of every optimizer step of the run
        stop_at = cfg.trainer.inject_stop
        self._inject_stop = tuple(int(v) for v in str(stop_at).split(":")) if stop_at else None
        if cfg.trainer.resume == "auto" and adapter.checkpoint_unsupported and ctx.rank == 0:
            print(f"warning: adapter={adapter.name} cannot checkpoint ({adapter.checkpoint_unsupported}): "
                  "trainer.resume=auto writes no checkpoint, a preempted run starts over", file=sys.stderr, flush=True)

    def _loaders(self):
        t = self.cfg.trainer
        train_set, val_set = self.workload.datasets(local_rank=self.ctx.local_rank)
        batch, dp_size, dp_rank = self.plan.local_batch, self.plan.dp_size, self.adapter.dp_rank
        self.local_batch = batch
        self.global_batch = self.plan.global_batch
        self.workers = data_workers(self.cfg.data.num_workers, self.ctx.local_world_size)
        train, sampler = train_loader(train_set, dp_size, dp_rank, batch, t.grad_accum, t.seed, self.workers,
                                      self.ctx.device.type)
        if sampler.steps < 1:
            raise ConfigError(
                f"the training set has {len(train_set)} samples, fewer than one global batch of "
                f"{self.global_batch}; lower trainer.batch_size or add data"
            )
        val = eval_loader(val_set, dp_size, dp_rank, batch, self.workers, t.max_eval_batches)
        return train, sampler, val

    def run(self) -> dict:
        t = self.cfg.trainer
        train, sampler, val = self._loaders()
        steps_per_epoch = sampler.steps if t.max_steps <= 0 else min(sampler.steps, t.max_steps)
        self.steps_per_epoch = steps_per_epoch
        self.full_epoch_steps = sampler.steps  # a whole pass over the data (incomplete last batch dropped)
        # lr schedule (bench/core/schedule.py): stepped after every optimizer step; lr per step in self._lrs
        self.schedule = None if self.cfg.schedule.name == "constant" else Schedule(
            self.cfg.schedule, self.adapter.optimizer, steps_per_epoch, t.epochs * steps_per_epoch)
        self.samples_dropped = len(sampler.dataset) - sampler.steps * self.global_batch
        epochs = []
        start_epoch = 0
        if self.resume_from is not None:
            start_epoch = self._restore(self.resume_from)
            epochs = self._replace_events(start_epoch)
        run_start = self._run_start = time.perf_counter()
        for epoch in range(start_epoch, t.epochs):
            if self._prior is not None and self._prior["epoch"] == epoch:
                sampler.set_position(epoch, self._prior["step_in_epoch"])
            else:
                sampler.set_epoch(epoch)
            event = self._epoch(epoch, train, val, steps_per_epoch, run_start)
            epochs.append(event)
            if self.record is not None:
                self.record.append_event(event)
            if self.stop_requested:
                break
        return self._summary(epochs, self._prior_run_time + time.perf_counter() - run_start)

    # --- one epoch -------------------------------------------------------------------------------
    def _epoch(self, epoch: int, train, val, steps: int, run_start: float) -> dict:
        self.adapter.train()
        self.timer.reset()
        memory.reset_peaks(self.adapter.devices())
        rss_before = memory.rss()  # CPU: the interpreter and model states already resident
        prior = self._prior if self._prior is not None and self._prior["epoch"] == epoch else None
        self._epoch_index = epoch
        self._epoch_first_step = first_step = prior["epoch_first_step"] if prior else self.global_step
        self._epoch_done_losses = list(prior["losses"]) if prior else []
        self._epoch_rows = list(prior["rows"]) if prior else []
        self._epoch_prior_time = prior["epoch_time_s"] if prior else 0.0
        self._ckpt_time = 0.0
        todo = steps - (prior["step_in_epoch"] if prior else 0)
        bar = self._progress(steps, epoch)
        it = iter(train)
        if prior:
            # after iter(): the loader draws its base seed from the global generator there, as it did at
            # this epoch's start before the restart; the steps then see the RNG where the checkpoint left it
            ckpt.set_rng_state(prior["rng"])
            if bar is not None:
                bar.update(prior["step_in_epoch"])
        c0 = compile_stats() if self.cfg.trainer.compile else None
        t0 = self._epoch_t0 = time.perf_counter()
        losses = self.train_steps(it, todo, bar)
        for d in self.adapter.devices():  # every device this process drives (GPipe: several)
            if torch.device(d).type == "cuda":
                torch.cuda.synchronize(d)
        # the restart gap and the time spent saving checkpoints are not training time
        epoch_time = self._epoch_prior_time + time.perf_counter() - t0 - self._ckpt_time
        losses = [torch.tensor(v, device=self.ctx.device) for v in self._epoch_done_losses] + losses
        if bar is not None:
            bar.close()
        c1 = compile_stats() if c0 is not None else None
        mem = memory.peak_over(self.adapter.devices())  # training peak, before validation allocates
        if mem.get("peak_rss") is not None and rss_before is not None:
            mem["peak_rss_delta"] = mem["peak_rss"] - rss_before  # what training added on top of the process
        state = self.adapter.state_bytes()

        tv = time.perf_counter()
        val_metrics = {} if self.stop_requested else self._validate(val)  # preempted: save the grace time
        val_time = time.perf_counter() - tv

        partial = self.stop_requested or len(losses) < self.full_epoch_steps
        event = self._epoch_event(epoch, losses, first_step, epoch_time, val_time, mem, state, val_metrics, run_start,
                                  partial)
        event["checkpoint_time_s"] = self._ckpt_time
        if c0 is not None:
            event["compile"] = self._compile_event(c0, c1, compile_stats(), first_step)
        if prior:
            event["resumed"] = True  # this epoch ran in two attempts: the parts are joined
            event["resumed_at_step"] = prior["global_step"]
            event["restart_gap_excluded"] = True
            event["memory_note"] = "peak memory of the attempt after the restart"
        return event

    def train_steps(self, it, steps: int, bar=None) -> list[torch.Tensor]:
        """The hot loop: `steps` optimizer steps from iterator `it`, each timed by phase."""
        t = self.cfg.trainer
        accum = t.grad_accum
        device = self.ctx.device
        losses: list[torch.Tensor] = []
        self._live_losses = losses  # a checkpoint saves the epoch's losses so far
        for _ in range(steps):
            self.timer.start_step()
            with self.timer.phase("data"):
                micro = []
                for _ in range(accum):
                    x, y = next(it)
                    micro.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
            if self.cfg.trainer.inject_fault:
                inject_fault(self.cfg.trainer.inject_fault, self.ctx.rank, self.global_step)
            if self.schedule is not None:
                self._lrs.append(self.schedule.lr())
            loss = self.adapter.train_step(micro, self.timer)
            if self.schedule is not None:
                self.schedule.step()
            self.timer.end_step()
            if self.first_step_end is None:
                self.first_step_end = time.time()
            losses.append(loss if loss is not None else torch.zeros((), device=device))
            self.global_step += 1
            if self.global_step == t.warmup_steps and t.compile:
                self._compile_warm = compile_stats()
            self.watchdog.beat()
            if bar is not None:
                bar.update(1)
            if self._inject_stop == (self.ctx.rank, self.global_step):
                self.stop.request("injected")
            if self.checkpointing and t.checkpoint_every and self.global_step % t.checkpoint_every == 0:
                self.save_checkpoint("every")
            if self.global_step % t.stop_check_every == 0 and self.stop.agreed():
                self.stop_requested = True
                if self.checkpointing:
                    self.save_checkpoint("stop")
                    self.saved_on_stop = True
                break
        return losses

    # --- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, reason: str) -> None:
        """Every rank, after a step: the adapter's state and each rank's own into a temp folder, which
        rank 0 commits by a rename and prunes to trainer.checkpoint_keep."""
        if self.global_step == self._last_saved:
            return
        start = time.perf_counter()
        state = self._rank_state()  # RNG first: nothing below may move it
        step = self.global_step
        tmp = ckpt.temp_path(self.run_dir, step)
        if self.ctx.rank == 0:
            ckpt.prepare(tmp)
        dist.barrier()
        self.adapter.save_checkpoint(tmp)
        ckpt.save_rank_state(tmp, self.ctx.rank, state)
        dist.barrier()  # every rank's part is on disk
        entry = {"step": step, "epoch": self._epoch_index, "step_in_epoch": state["step_in_epoch"], "reason": reason,
                 "time": time.time()}
        if self.ctx.rank == 0:
            ckpt.crash_hook(step)
            final = ckpt.commit(tmp, {**entry, "adapter": self.adapter.name, "format": self.adapter.checkpoint_format,
                                      "world_size": self.ctx.world_size, "point": self.plan.point,
                                      "run_id": self.run_dir.name, "steps_per_epoch": self.steps_per_epoch})
            meta = ckpt.read_meta(final)
            meta["save_time_s"] = time.perf_counter() - start  # up to the commit
            write_json(final / ckpt.META, meta)
            ckpt.prune(self.run_dir, self.cfg.trainer.checkpoint_keep)
            entry.update(name=final.name, bytes=meta["bytes"])
        dist.barrier()  # committed before any rank goes on (or exits)
        elapsed = time.perf_counter() - start
        entry["save_time_s"] = elapsed
        self.checkpoints.append(entry)
        self._ckpt_time += elapsed
        self._last_saved = step
        self.watchdog.beat()

    def _rank_state(self) -> dict:
        now = time.perf_counter()
        losses = [float(v) for v in torch.stack(self._live_losses).float().cpu()] if self._live_losses else []
        return {
            "rng": ckpt.rng_state(),
            "global_step": self.global_step,
            "epoch": self._epoch_index,
            "step_in_epoch": len(self._epoch_done_losses) + len(losses),
            "epoch_first_step": self._epoch_first_step,
            "losses": self._epoch_done_losses + losses,  # this rank's, as the epoch event's all-reduce expects
            "rows": self._epoch_rows + [dict(r) for r in self.timer.steps],
            "epoch_time_s": self._epoch_prior_time + now - self._epoch_t0 - self._ckpt_time,
            "run_time_s": self._prior_run_time + now - self._run_start,
            "resumed_from": self.resumed_from,
            "checkpoints": self.checkpoints,
            **({"schedule": self.schedule.state_dict(), "lrs": list(self._lrs)} if self.schedule is not None else {}),
        }

    def _restore(self, path: Path) -> int:
        """Load checkpoint `path` on every rank; returns the epoch to continue."""
        self.adapter.load_checkpoint(path)
        state = ckpt.load_rank_state(path, self.ctx.rank)
        meta = ckpt.read_meta(path)
        self.global_step = state["global_step"]
        self._prior = state
        self._prior_run_time = state["run_time_s"]
        self._last_saved = self.global_step
        if self.schedule is not None and "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
            self._lrs = list(state["lrs"])
        # the saves before this checkpoint, and this one (its save time was not known when it was written)
        self.checkpoints = list(state.get("checkpoints", [])) + [
            {**{k: meta.get(k) for k in ("step", "epoch", "step_in_epoch", "reason", "time", "bytes", "save_time_s")}, "name": path.name}]
        now = time.time()
        self.resumed_from = list(state.get("resumed_from", [])) + [{
            "step": self.global_step, "epoch": state["epoch"], "step_in_epoch": state["step_in_epoch"],
            "time": now, "attempt": len(state.get("resumed_from", [])) + 2,  # the first attempt is 1
            "checkpoint": path.name, "checkpoint_time": meta.get("time"),
            "restart_gap_s": now - meta["time"] if meta.get("time") else None,
            "previous_run_id": meta.get("run_id"), **self.resume_info, **ckpt.attempt(),
        }]
        self.watchdog.beat()
        if self.ctx.rank == 0:
            print(f"resumed from {path} (global step {self.global_step}, epoch {state['epoch']} step "
                  f"{state['step_in_epoch']})", flush=True)
        return state["epoch"]

    def _replace_events(self, epoch: int) -> list[dict]:
        """Rank 0: drop the events of epoch `epoch` on (the interrupted one is written again, whole);
        returns the earlier epochs' events for the summary."""
        if self.record is None:
            return []
        events = self.record.events()
        kept = [e for e in events if e.get("type") != "epoch" or e.get("epoch", 0) < epoch]
        dropped = [e.get("epoch") for e in events if e not in kept]
        path = self.record.dir / "events.jsonl"
        if dropped or path.exists():
            atomic_write(path, "".join(json.dumps(e, sort_keys=True, default=str) + "\n" for e in kept))
        self.resumed_from[-1]["events_replaced"] = dropped
        return [e for e in kept if e.get("type") == "epoch"]

    @torch.no_grad()
    def _validate(self, val) -> dict:
        if not self.cfg.trainer.eval_every_epoch:
            return {}
        self.adapter.eval()
        device = self.ctx.device
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for x, y, w in val:
            s = self.adapter.eval_step(x.to(device), y.to(device), w.to(device))
            if self.adapter.reports_metrics:
                sums += s.to(device)
            self.watchdog.beat()
        dist.all_reduce(sums)
        self.adapter.train()
        return self.workload.metrics(sums.cpu())

    def _epoch_event(self, epoch, losses, first_step, epoch_time, val_time, mem, state, val_metrics, run_start,
                     partial: bool) -> dict:
        device = self.ctx.device
        steps = len(losses)
        # per-step losses: mean over the ranks that report them
        reporting = torch.tensor([1.0 if self.adapter.reports_metrics else 0.0], device=device)
        loss_vec = torch.stack(losses).float() if losses else torch.zeros(0, device=device)
        if not self.adapter.reports_metrics:
            loss_vec = torch.zeros_like(loss_vec)
        dist.all_reduce(loss_vec)
        dist.all_reduce(reporting)
        loss_vec = (loss_vec / reporting).cpu().numpy()

        # per-step phase times of every rank: [world, steps, phases + step]
        cols = list(PHASES) + ["step"]
        rows = [[s.get(c, 0.0) for c in cols] for s in self._epoch_rows + self.timer.steps]
        local = torch.tensor(rows, dtype=torch.float64, device=device).reshape(-1, len(cols))
        gathered = [torch.zeros_like(local) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, local)
        times = torch.stack([g.cpu() for g in gathered]).numpy()

        per_rank = [None] * self.ctx.world_size
        dist.all_gather_object(per_rank, {"rank": self.ctx.rank, "host": socket.gethostname(), "memory": mem,
                                          "state_bytes": state, "epoch_time_s": epoch_time})

        timed_from = max(0, self.cfg.trainer.warmup_steps - first_step)
        timed = times[:, timed_from:, :]
        step_times = timed[:, :, -1].max(axis=0) if timed.shape[1] else np.zeros(0)
        phase_means = {c: float(timed[:, :, i].mean()) if timed.shape[1] else None for i, c in enumerate(PHASES)}
        step_stats = _stats(step_times)
        samples_per_s = self.global_batch / step_stats["mean"] if step_stats["mean"] else None
        flops_per_sample = self.plan.train_flops_per_sample
        flops_per_s = samples_per_s * flops_per_sample if samples_per_s else None
        peak = peak_flops(self.ctx.device, self.cfg.trainer.precision, self.cfg.trainer.tf32)
        devices = self.plan.devices
        slowest = max(r["epoch_time_s"] for r in per_rank)
        mfu_value, mfu_note = mfu(flops_per_s, peak, devices)
        if self.ctx.is_cuda and peak is None:
            mfu_note = (f"no MFU: no peak FLOP/s known for {torch.cuda.get_device_name(self.ctx.device)} in "
                        f"{math_dtype(self.cfg.trainer.precision, self.cfg.trainer.tf32)} (bench/core/flops.py)")
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
            "train_losses": [float(v) for v in loss_vec] if self.cfg.trainer.log_step_losses else None,
            # the lr of the epoch's first step; with a schedule, every step's (schedule=..., bench/core/schedule.py)
            "lr_epoch_start": self._lrs[first_step] if self.schedule is not None and len(self._lrs) > first_step else self.cfg.optimizer.lr,
            "lrs": self._lrs[first_step:first_step + steps] if self.schedule is not None else None,
            "memory_metric": mem_key,
            "peak_memory_max": max(mem_values) if mem_values else None,
            "peak_memory_min": min(mem_values) if mem_values else None,
            "ranks": per_rank,
            **val_metrics,
        }
        if self.ctx.rank == 0:
            print_epoch(event)
        return event

    def _compile_event(self, before: dict, trained: dict, validated: dict, first_step: int) -> dict:
        """torch._dynamo counters over the epoch: its training steps, their timed part, its validation."""
        warmup = self.cfg.trainer.warmup_steps
        if first_step >= warmup:
            timed_from = before
        elif self.global_step >= warmup and self._compile_warm is not None:
            timed_from = self._compile_warm  # the warm-up ended in this epoch
        else:
            timed_from = trained  # every step of this epoch was warm-up
        return {"train_frames": trained["frames"] - before["frames"],
                "train_time_s": trained["time_s"] - before["time_s"],
                "timed_step_frames": trained["frames"] - timed_from["frames"],
                "eval_frames": validated["frames"] - trained["frames"],
                "eval_time_s": validated["time_s"] - trained["time_s"]}

    def _summary(self, epochs: list[dict], total_time: float) -> dict:
        last = epochs[-1] if epochs else {}
        timed = [e for e in epochs if e["timed_steps"]]
        total_timed = sum(e["timed_steps"] for e in timed)
        mean_step = sum(e["step_time_mean_s"] * e["timed_steps"] for e in timed) / total_timed if total_timed else None
        whole = [e["epoch_time_s"] for e in epochs if not e["partial"]]
        steady = [e["epoch_time_s"] for e in epochs[1:] if not e["partial"]]  # epoch 0 holds the warm-up
        data_share = [e["data_share"] for e in timed if e.get("data_share") is not None]
        warnings = []
        if data_share and max(data_share) > 0.10:
            warnings.append(f"data loading is {100 * max(data_share):.0f}% of the step time (> 10%): the run is "
                            f"input-bound; raise data.num_workers (now {self.workers}) or use faster storage")
        leaked = sum(e["compile"]["timed_step_frames"] for e in epochs if e.get("compile"))
        if leaked:
            warnings.append(f"torch.compile compiled {leaked} frame(s) after the warm-up (recompiles): those steps' "
                            "times include compilation; raise trainer.warmup_steps or find the recompile (TORCH_LOGS=recompiles)")
        if any(e.get("mfu_note") for e in epochs):
            warnings.append(next(e["mfu_note"] for e in epochs if e.get("mfu_note")))
        keys = ("val_loss", "val_accuracy", "val_perplexity", "train_loss", "peak_memory_max", "peak_memory_min", "mfu")
        return {
            "status": "preempted" if self.stop_requested else "ok",
            "checkpoint": self._checkpoint_summary(),
            **({"resumed_from": self.resumed_from, "restart_gap_excluded": True} if self.resumed_from else {}),
            "startup_s": self.first_step_end - launch_time() if self.first_step_end else None,
            "stop_signal": self.stop.signal_name,
            "epochs_completed": len(epochs),
            "total_time_s": total_time,
            "steps": self.global_step,
            "global_batch": self.global_batch,
            "local_batch": self.local_batch,
            "samples_dropped_per_epoch": self.samples_dropped,  # the incomplete last global batch
            "data_workers": self.workers,
            # loader and input settings as used: pin_memory, persistent_workers, channels_last, decoder, cache
            "data_pipeline": {**loader_options(self.ctx.device.type, self.workers), **self.workload.describe()},
            "compile": self._compile_summary(leaked),
            "step_time_mean_s": mean_step,
            "samples_per_s": self.global_batch / mean_step if mean_step else None,
            "tokens_per_s": self.global_batch * self.plan.tokens_per_sample / mean_step if mean_step else None,
            # mean over whole epochs; over all epochs (flagged) when every epoch was cut short
            "epoch_time_mean_s": float(np.mean(whole or [e["epoch_time_s"] for e in epochs])) if epochs else None,
            "epoch_time_mean_includes_partial": not whole and bool(epochs),
            # whole epochs after the first (warm-up, NCCL init, first-step probes): what speedup should use
            "epoch_time_steady_s": float(np.mean(steady)) if steady else None,
            "timing": self.timer.settings,
            "tf32": self.cfg.trainer.tf32,
            "warnings": warnings,
            "state_bytes_per_rank": [r["state_bytes"] for r in last.get("ranks", [])],
            "hosts": [r["host"] for r in last.get("ranks", [])],  # one per rank, in rank order
            **{k: last.get(k) for k in keys},
        }

    def _compile_summary(self, timed_step_frames: int) -> dict | None:
        t = self.cfg.trainer
        if not t.compile:
            return None
        total = compile_stats()
        return {"backend": t.compile_backend, "how": self.adapter.compile_how, "time_s": total["time_s"],
                "frames": total["frames"], "graphs": total["graphs"], "warmup_steps": t.warmup_steps,
                "timed_step_frames": timed_step_frames}

    def _checkpoint_summary(self) -> dict | None:
        if not self.checkpointing:
            return None
        latest = ckpt.latest(self.run_dir) if self.ctx.rank == 0 else None
        return {"every": self.cfg.trainer.checkpoint_every, "keep": self.cfg.trainer.checkpoint_keep,
                "on_stop": True, "format": self.adapter.checkpoint_format, "saved": self.checkpoints,
                "latest": latest.name if latest else None}

    def _progress(self, steps: int, epoch: int):
        show = self.cfg.trainer.progress
        if self.ctx.rank != 0 or not (sys.stdout.isatty() if show is None else show):
            return None
        from tqdm import tqdm

        return tqdm(total=steps, desc=f"epoch {epoch}", unit="step", leave=False, dynamic_ncols=True)


def launch_time() -> float:
    """When the user's command started: the local launcher's start (BENCH_LAUNCH_T0), else this process's."""
    import os

    import psutil

    return float(os.environ.get("BENCH_LAUNCH_T0") or psutil.Process().create_time())


def inject_fault(spec: str, rank: int, step: int) -> None:
    """Fail on purpose (tests of failure capture): "raise@1:3" = rank 1 raises at step 3."""
    kind, _, where = spec.partition("@")
    fault_rank, _, fault_step = where.partition(":")
    if rank != int(fault_rank) or step != int(fault_step):
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out of memory on rank {rank} at step {step}")
    if kind == "exit":
        import os

        os._exit(3)
    if kind == "hang":  # stop calling collectives, as a deadlocked rank does
        while True:
            time.sleep(1)
    raise ConfigError(f"trainer.inject_fault={spec}: KIND must be raise, oom, hang or exit")


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
