"""The one training loop, shared by every adapter.

Per epoch: set the sampler's epoch, reset peak memory, run the steps (each timed by phase), then
validate, then let the meter gather per-rank numbers into the epoch event (one collective round per
epoch: per-step losses stay on the device until the epoch ends, so the loop never forces a host sync
for them). Inside the epoch the only collective of the harness's own is the stop agreement, every
`trainer.stop_check_every` steps on a CPU group (bench/core/stopping.py).

The loop's companions, along torchtitan's component lines:
- bench/runner/meter.py: the epoch event, and the conventions its numbers follow;
- bench/runner/summary.py: the run's summary from the events, and the record rank 0 writes;
- bench/runner/resume.py: the state a checkpoint carries (`TrainState`) and saving / loading it
  (`Checkpointer`: `trainer.checkpoint_every`, and on a stop signal when checkpointing is on);
- bench/runner/faults.py: failures and stops injected on purpose (tests).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ptbench.adapters.base import Adapter, compile_stats
from ptbench.core import memory
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.errors import ConfigError
from ptbench.core.loaders import data_workers, eval_loader, train_loader
from ptbench.core.memory import SavedTensorLedger, StepPeak
from ptbench.core.records import RunRecord
from ptbench.core.schedule import Schedule
from ptbench.core.stopping import StopFlag, Watchdog
from ptbench.core.timing import PhaseTimer
from ptbench.runner.console import progress
from ptbench.runner.faults import Faults
from ptbench.runner.meter import CONVENTIONS, Meter
from ptbench.runner.plan import RunPlan
from ptbench.runner.profiling import StepProfiler
from ptbench.runner.resume import Checkpointer, TrainState
from ptbench.runner.sampling import SampledTiming
from ptbench.runner.summary import RunSummary, launch_time
from ptbench.runner.syncs import SyncCounter
from ptbench.workloads.base import Workload

__all__ = ["CONVENTIONS", "Trainer"]


class Trainer:
    def __init__(
        self,
        cfg: BenchConfig,
        plan: RunPlan,
        ctx: DistContext,
        adapter: Adapter,
        workload: Workload,
        record: RunRecord | None,
        stop: StopFlag | None = None,
        watchdog: Watchdog | None = None,
        run_dir: Path | None = None,
        resume_from: Path | None = None,
        resume_info: dict | None = None,
    ):
        adapter.check_checkpointing(cfg)  # ranks skip the adapter's validate (the launcher ran it)
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.workload = workload
        self.record = record  # only on rank 0
        self.stop = stop or StopFlag()
        self.watchdog = watchdog or Watchdog(0, lambda idle: None)
        self.stop_requested = False  # all ranks agreed to stop (graceful preemption)
        self.first_step_end: float | None = None
        self.timer = PhaseTimer(cuda_sync=cfg.trainer.sync_timing)  # CUDA events; per-phase sync only as a diagnostic
        self.timer.use_devices(adapter.devices())  # every device a process drives (GPipe's partitions)
        self.state = TrainState(self.timer)
        self.syncs = _sync_counter(cfg, ctx, adapter)
        if self.syncs is not None:
            self.timer.watch_steps(self.syncs)
        # trainer.profile: traces of a window of steps, the communication ledger, bubble, waits (profiling.py)
        self.profiler = StepProfiler.of(cfg, plan, ctx, run_dir, adapter)
        self.meter = Meter(cfg, plan, ctx, adapter, self.profiler)
        self.summary = RunSummary(cfg, plan, ctx, adapter, workload)
        # the last untimed step's saved activations and optimizer-phase peak (memory ledger), once counted
        self.step_memory = {"saved_activations": None, "step_peak": None}
        self.checkpointer = Checkpointer(cfg, plan, ctx, adapter, self.state, run_dir, self.watchdog, resume_info)
        self.resume_from = Path(resume_from) if resume_from is not None else None
        self.faults = Faults(cfg.trainer, ctx.rank)
        self.sampling = SampledTiming.of(cfg, ctx.device)  # trainer.timing_sample (None: full epochs)
        if ctx.rank == 0:
            _warn_if_resume_cannot_save(cfg, adapter)

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def saved_on_stop(self) -> bool:
        return self.checkpointer.saved_on_stop

    def run(self) -> dict:
        t = self.cfg.trainer
        train, sampler, val, workers = self._loaders()
        steps_per_epoch = sampler.steps if t.max_steps <= 0 else min(sampler.steps, t.max_steps)
        self.checkpointer.set_steps_per_epoch(steps_per_epoch)
        self.full_epoch_steps = sampler.steps  # a whole pass over the data (incomplete last batch dropped)
        # lr schedule (bench/core/schedule.py): stepped after every optimizer step; each step's lr kept by the state
        self.state.use_schedule(
            None
            if self.cfg.lr_schedule.name == "constant"
            else Schedule(self.cfg.lr_schedule, self.adapter.optimizer, steps_per_epoch, t.epochs * steps_per_epoch)
        )
        epochs = []
        start_epoch = 0
        if self.resume_from is not None:
            start_epoch = self.checkpointer.restore(self.resume_from)
            epochs = self.checkpointer.replace_events(self.record, start_epoch)
        run_start = self.state.start_run()
        diverged = None  # the global step of the first non-finite loss, found when the epoch's losses are on the host
        for epoch in range(start_epoch, t.epochs):
            prior = self.state.continued(epoch)
            if prior is not None:
                sampler.set_position(epoch, prior["step_in_epoch"])
            else:
                sampler.set_epoch(epoch)
            event = self._epoch(epoch, train, val, steps_per_epoch, run_start)
            epochs.append(event)
            if self.record is not None:
                self.record.append_event(event)
            diverged = self._diverged(event)
            if self.stop_requested or diverged is not None:  # every rank has the same event: all stop
                break
        profile = self.profiler.finish()  # a collective when trainer.profile is set
        return self.summary.totals(
            epochs,
            status=self._status(diverged),
            diverged_at_step=diverged,
            total_time=self.state.prior_run_time + time.perf_counter() - run_start,
            steps=self.global_step,
            startup_s=self.first_step_end - launch_time() if self.first_step_end else None,
            stop_signal=self.stop.signal_name,
            checkpoint=self.checkpointer.describe(),
            resumed_from=self.state.resumed_from,
            timing={**self.timer.settings, "count_syncs": self.syncs is not None},
            data_workers=workers,
            samples_dropped=len(sampler.dataset) - sampler.steps * self.plan.global_batch,  # the incomplete last batch
            profile=profile,
        )

    def _diverged(self, event: dict) -> int | None:
        """The global step of the epoch's first non-finite loss (rank 0 says the run stops), or None."""
        diverged = event.get("diverged_at_step")
        if diverged is not None and self.ctx.rank == 0:
            print(
                f"error: training diverged: the loss was not finite at global step {diverged} (epoch "
                f"{event['epoch']}); the run stops here with status diverged",
                file=sys.stderr,
                flush=True,
            )
        return diverged

    def _status(self, diverged: int | None) -> str:
        if diverged is not None:
            return "diverged"
        if self.stop_requested:  # every rank agreed to stop: Ctrl-C, else a preemption's signal
            return "interrupted" if self.stop.interrupted else "preempted"
        return "ok"

    def _loaders(self):
        t = self.cfg.trainer
        train_set, val_set = self.workload.datasets(local_rank=self.ctx.local_rank)
        batch, dp_size, dp_rank = self.plan.local_batch, self.plan.dp_size, self.adapter.dp_rank
        workers = data_workers(self.cfg.data.num_workers, self.ctx.local_world_size)
        train, sampler = train_loader(
            train_set, dp_size, dp_rank, batch, t.grad_accum, t.seed, workers, self.ctx.device.type
        )
        if sampler.steps < 1:
            raise ConfigError(
                f"the training set has {len(train_set)} samples, fewer than one global batch of "
                f"{self.plan.global_batch}; lower trainer.batch_size or add data"
            )
        # trainer.max_eval_batches: None (the default) = as many batches as trainer.max_steps when that caps
        # the epoch (a short run validates briefly; val_samples in the epoch event says how many), else all
        cap = t.max_eval_batches if t.max_eval_batches is not None else max(t.max_steps, 0)
        val = eval_loader(val_set, dp_size, dp_rank, batch, workers, cap)
        return train, sampler, val, workers

    # --- one epoch -------------------------------------------------------------------------------
    def _epoch(self, epoch: int, train, val, steps: int, run_start: float) -> dict:
        self.adapter.train()
        self.timer.reset()
        memory.reset_peaks(self.adapter.devices())
        rss_before = memory.rss()  # CPU: the interpreter and model states already resident
        prior = self.state.start_epoch(epoch)  # the part before a restart, when this epoch continues
        done = prior["step_in_epoch"] if prior else 0
        first_step = self.state.epoch_first_step
        bar = self._progress(steps, epoch)
        it = iter(train)
        if prior:  # after iter(): see `_continue`
            self._continue(done, bar)
        c0 = compile_stats() if self.cfg.trainer.compile else None
        if self.sampling is not None:
            self.sampling.start_epoch()
        self.state.start_timing()
        self.train_steps(it, steps - done, bar)
        self.adapter.end_epoch()  # work an adapter keeps in flight across steps ends here (a pipeline's drain)
        self._synchronize()
        epoch_time = self.state.epoch_time()  # the restart gap and the time spent saving are not training time
        losses = self.state.epoch_losses(self.ctx.device)
        if bar is not None:
            bar.close()
        c1 = compile_stats() if c0 is not None else None
        mem = self._peak_memory(rss_before)  # training peak, before validation allocates
        state_bytes = self.adapter.state_bytes()
        host_syncs = self.syncs.result() if self.syncs is not None else None

        tv = time.perf_counter()
        val_metrics = {} if self.stop_requested else self._validate(val, epoch)  # preempted: save the grace time
        val_time = time.perf_counter() - tv

        event = self.meter.epoch_event(
            epoch,
            losses=losses,
            rows=self.state.epoch_rows(),
            first_step=first_step,
            epoch_time=epoch_time,
            val_time=val_time,
            mem=mem,
            state=state_bytes,
            val_metrics=val_metrics,
            run_start=run_start,
            partial=self.stop_requested or len(losses) < self.full_epoch_steps,
            lrs=self.state.lrs if self.state.schedule is not None else None,
            checkpoint_time=self.state.checkpoint_time,
            compile=self.meter.compile_event(c0, c1, compile_stats(), first_step, self.global_step)
            if c0 is not None
            else None,
            resumed_at=prior["global_step"] if prior else None,
            counted={**self.step_memory, "host_syncs": host_syncs},
        )
        return event if self.sampling is None else self.sampling.annotate(event, self.full_epoch_steps)

    def _continue(self, done: int, bar) -> None:
        """An epoch that continues after a restart, `done` steps in: the loader drew its base seed from the global
        generator at iter(), as it did at this epoch's start before the restart; the steps then see the RNG where
        the checkpoint left it."""
        self.state.set_rng()
        if bar is not None:
            bar.update(done)

    def _synchronize(self) -> None:
        for d in self.adapter.devices():  # every device this process drives (GPipe: several)
            if torch.device(d).type == "cuda":
                torch.cuda.synchronize(d)

    def _peak_memory(self, rss_before: int | None) -> dict:
        """The epoch's peaks on every device this process drives; on CPU also what training added to the process."""
        mem = memory.peak_over(self.adapter.devices())
        if mem.get("peak_rss") is not None and rss_before is not None:
            mem["peak_rss_delta"] = mem["peak_rss"] - rss_before
        return mem

    def train_steps(self, it, steps: int, bar=None) -> list[torch.Tensor]:
        """The hot loop: `steps` optimizer steps from iterator `it`, each timed by phase."""
        t = self.cfg.trainer
        device = self.ctx.device
        state, schedule = self.state, self.state.schedule
        losses = state.start_steps()  # a checkpoint saves the epoch's losses so far
        for _ in range(steps):
            # trainer.profile: the profiler starts before the step's timer, and out of the epoch's time
            state.exclude(self.profiler.start_window(state.global_step))
            self.timer.start_step()
            with self.timer.phase("data"):
                micro = []
                for _ in range(t.grad_accum):
                    x, y = next(it)
                    micro.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
            self.faults.before_step(state.global_step)
            if schedule is not None:
                state.log_lr(schedule.lr())
            with self._step_measures(state.global_step):
                loss = self.adapter.train_step(micro, self.timer)
            if schedule is not None:
                schedule.step()
            self.timer.end_step()
            # trainer.profile: the trace's export after the step's timer, and out of the epoch's time
            state.exclude(self.profiler.end_window())
            if self.first_step_end is None:  # startup ends when step 1 has run, not when it was queued
                self._synchronize()
                self.first_step_end = time.time()
            state.step_done(loss if loss is not None else torch.zeros((), device=device))
            if self._after_step(bar):
                break
        return losses

    @contextlib.contextmanager
    def _step_measures(self, step: int):
        """The measurements around one step's body: trainer.profile's window (profiling.py) and, in the last
        untimed step, the memory ledger's counts."""
        # what autograd saves in the last untimed step (the first holds one-off work such as a pipeline's shape
        # inference), counted per rank
        count = step == self.cfg.trainer.untimed_steps - 1 and self.step_memory["saved_activations"] is None
        # and the optimizer phase's peak there, once the optimizer's state exists (torch makes it in the first
        # step) and not inside trainer.profile's window (one profiler at a time)
        measure = count and step >= 1 and not self.profiler.covers(step)
        peak = StepPeak(self.ctx.device) if measure else None
        with (
            self.timer.watching("optimizer", peak),
            SavedTensorLedger(self.adapter.modules()) if count else contextlib.nullcontext() as ledger,
            self.profiler.step(step),
        ):
            yield
        if count:
            self.step_memory = {
                "saved_activations": ledger.result(),
                "step_peak": peak.peak if peak is not None else None,
            }

    def _after_step(self, bar) -> bool:
        """What follows every step (its count is in `state.global_step`); True when the loop stops: measured
        enough (trainer.timing_sample) or every rank agreed to stop (then a checkpoint when checkpointing is on)."""
        t = self.cfg.trainer
        state = self.state
        if state.global_step == t.untimed_steps:
            self.meter.after_warmup(self.adapter.devices())  # the recorded peak is then the steady steps'
            if t.compile:
                self.meter.warmup_ended()
        self.watchdog.beat()
        if bar is not None:
            bar.update(1)
        self.faults.after_step(state.global_step, self.stop)
        if self.checkpointer.due(state.global_step):
            self.checkpointer.save("every")
        if self.sampling is not None and self.sampling.enough(
            state.epoch_rows, state.epoch_first_step, state.global_step
        ):
            return True  # trainer.timing_sample: measured enough; the epoch's time is an estimate
        if state.global_step % t.stop_check_every == 0 and self.stop.agreed():
            self.stop_requested = True
            if self.checkpointer.enabled:
                self.checkpointer.save("stop")
            return True
        return False

    @torch.no_grad()
    def _validate(self, val, epoch: int = 0) -> dict:
        if not self.cfg.trainer.eval_every_epoch:
            return {}
        t = self.cfg.trainer
        bar = progress(len(val), f"epoch {epoch} validation", self.ctx.rank, t.progress, t.log_every, "batch")
        self.adapter.eval()
        device = self.ctx.device
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for x, y, w in val:
            s = self.adapter.eval_step(x.to(device), y.to(device), w.to(device))
            if self.adapter.reports_metrics:
                sums += s.to(device)
            self.watchdog.beat()
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        dist.all_reduce(sums)
        self.adapter.train()
        return self.workload.metrics(sums.cpu())

    def _progress(self, steps: int, epoch: int):
        t = self.cfg.trainer  # bench/runner/console.py: a tqdm bar on a terminal, else a line every log_every steps
        return progress(steps, f"epoch {epoch}", self.ctx.rank, t.progress, t.log_every)


def _sync_counter(cfg: BenchConfig, ctx: DistContext, adapter: Adapter) -> SyncCounter | None:
    """trainer.count_syncs: host-device synchronisations of each timed step and their source lines."""
    if not cfg.trainer.count_syncs:
        return None
    return SyncCounter(ctx.device, cfg.trainer.untimed_steps, getattr(adapter, "optimizer", None)).install()


def _warn_if_resume_cannot_save(cfg: BenchConfig, adapter: Adapter) -> None:
    refusal = adapter.checkpoint_refusal(cfg)
    if cfg.trainer.resume == "auto" and refusal:
        print(
            f"warning: adapter={adapter.name} cannot checkpoint ({refusal}): "
            "trainer.resume=auto writes no checkpoint, a preempted run starts over",
            file=sys.stderr,
            flush=True,
        )
