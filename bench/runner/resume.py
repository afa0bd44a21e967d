"""What a checkpoint carries so that a stopped run continues bit-exactly, and the saving and loading of it.

`TrainState` (torchtitan's TrainState: `state_dict()` / `load_state_dict()`) is the trainer's own part
of a checkpoint, per rank: the global step, the RNG states, the interrupted epoch's part done so far
(losses, per-step phase times, training time), the run's training time, the lr schedule and the
record's history (every save, every restart). The adapter writes the model and optimizer part.

`Checkpointer` (bench/core/checkpoint.py holds the folder rules): after a step, every rank writes its
part into a temp folder that rank 0 commits by a rename and prunes to trainer.checkpoint_keep. A
resumed run (`trainer.resume=auto`, the record found by bench/runner/rank.py) loads it, continues the
epoch at the saved step with the same shuffle, and writes that epoch's event as if it had not stopped:
its losses and step times are the two parts joined, its epoch time their sum (the restart gap and the
time spent saving left out, and flagged); events of the epochs after the checkpoint are replaced.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ptbench.adapters.base import Adapter
from ptbench.core import checkpoint as ckpt
from ptbench.core.checkpoint_load import Pinned, pin, restricted_unpickling
from ptbench.core.config import BenchConfig
from ptbench.core.dist import DistContext
from ptbench.core.errors import ConfigError
from ptbench.core.records import STORAGE_ERRNOS, RunRecord, atomic_write, dumps, write_json
from ptbench.core.schedule import Schedule
from ptbench.core.stopping import Watchdog
from ptbench.core.timing import PhaseTimer
from ptbench.runner.plan import RunPlan


class TrainState:
    """The loop's position and the current epoch's measurements so far: what one rank's checkpoint holds."""

    def __init__(self, timer: PhaseTimer):
        self.timer = timer  # its `steps` are this attempt's per-step phase times of the epoch
        self.schedule: Schedule | None = None  # given once the steps per epoch are known (`use_schedule`)
        self.global_step = 0
        self.epoch = 0
        self.epoch_first_step = 0  # the global step the epoch started at
        # the epoch's part before a restart (empty in an epoch that runs in one attempt)
        self.done_losses: list[float] = []
        self.done_rows: list[dict] = []
        self.done_time = 0.0
        self.losses: list[torch.Tensor] = []  # this attempt's losses of the epoch, on the device
        self.epoch_t0 = 0.0
        self.checkpoint_time = 0.0  # seconds spent saving in the current epoch (left out of its time)
        self.run_start = time.perf_counter()
        self.prior_run_time = 0.0  # training time of earlier attempts, up to the checkpoint
        self.lrs: list[float] = []  # with a schedule: the lr of every optimizer step of the run
        self.resumed_from: list[dict] = []  # one entry per restart of this record
        self.checkpoints: list[dict] = []  # every save of this record (earlier attempts' included)
        self.restored: dict | None = None  # the loaded state: its epoch continues where it stopped

    def use_schedule(self, schedule: Schedule | None) -> None:
        self.schedule = schedule  # None: a constant lr; given before a restore, which loads its position

    def start_run(self) -> float:
        """The run's clock starts now (after a restore: loading is not training time); returns the start."""
        self.run_start = time.perf_counter()
        return self.run_start

    def start_timing(self) -> None:
        self.epoch_t0 = time.perf_counter()  # the epoch's clock

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent inside the epoch (the profiler's start and export) out of its time."""
        self.epoch_t0 += seconds

    def start_steps(self) -> list[torch.Tensor]:
        """A new list of this attempt's losses (a checkpoint saves the epoch's losses so far); returns it."""
        self.losses = []
        return self.losses

    def log_lr(self, lr: float) -> None:
        """The lr the coming optimizer step uses (with a schedule: the epoch events' `lrs`)."""
        self.lrs.append(lr)

    def step_done(self, loss: torch.Tensor) -> None:
        """One optimizer step ran: its loss (on the device) is kept and the global step advances."""
        self.losses.append(loss)
        self.global_step += 1

    def continued(self, epoch: int) -> dict | None:
        """The restored state if `epoch` is the one it stopped in, else None."""
        return self.restored if self.restored is not None and self.restored["epoch"] == epoch else None

    def start_epoch(self, epoch: int) -> dict | None:
        """Reset the per-epoch parts (to the restored part when this epoch continues); returns that part."""
        prior = self.continued(epoch)
        self.epoch = epoch
        self.epoch_first_step = prior["epoch_first_step"] if prior else self.global_step
        self.done_losses = list(prior["losses"]) if prior else []
        self.done_rows = list(prior["rows"]) if prior else []
        self.done_time = prior["epoch_time_s"] if prior else 0.0
        self.losses = []
        self.checkpoint_time = 0.0
        return prior

    def epoch_time(self) -> float:
        """The epoch's training time so far: both parts, without the time spent saving."""
        return self.done_time + time.perf_counter() - self.epoch_t0 - self.checkpoint_time

    def epoch_losses(self, device) -> list[torch.Tensor]:
        return [torch.tensor(v, device=device) for v in self.done_losses] + self.losses

    def epoch_rows(self) -> list[dict]:
        return self.done_rows + self.timer.steps

    def state_dict(self) -> dict:
        now = time.perf_counter()
        losses = [float(v) for v in torch.stack(self.losses).float().cpu()] if self.losses else []
        return {
            "rng": ckpt.rng_state(),  # first: nothing below may move it
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": len(self.done_losses) + len(losses),
            "epoch_first_step": self.epoch_first_step,
            "losses": self.done_losses + losses,  # this rank's, as the epoch event's all-reduce expects
            "rows": self.done_rows + [dict(r) for r in self.timer.steps],
            "epoch_time_s": self.done_time + now - self.epoch_t0 - self.checkpoint_time,
            "run_time_s": self.prior_run_time + now - self.run_start,
            "resumed_from": self.resumed_from,
            "checkpoints": self.checkpoints,
            **({"schedule": self.schedule.state_dict(), "lrs": list(self.lrs)} if self.schedule is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the RNG is set when the epoch's data iterator exists (`set_rng`)."""
        self.global_step = state["global_step"]
        self.restored = state
        self.prior_run_time = state["run_time_s"]
        self.resumed_from = list(state.get("resumed_from", []))
        self.checkpoints = list(state.get("checkpoints", []))
        if self.schedule is not None and "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
            self.lrs = list(state["lrs"])

    def set_rng(self) -> None:
        ckpt.set_rng_state(self.restored["rng"])


class Checkpointer:
    """Saves (every rank, after a step) and loads checkpoints of one record; off when not asked for or
    when the adapter cannot checkpoint."""

    def __init__(
        self,
        cfg: BenchConfig,
        plan: RunPlan,
        ctx: DistContext,
        adapter: Adapter,
        state: TrainState,
        run_dir: Path | None,
        watchdog: Watchdog,
        resume_info: dict | None = None,
    ):
        self.cfg = cfg
        self.plan = plan
        self.ctx = ctx
        self.adapter = adapter
        self.state = state
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.watchdog = watchdog
        self.resume_info = resume_info or {}
        self.enabled = self.run_dir is not None and ckpt.enabled(cfg, adapter.checkpoint_refusal(cfg))
        self.saved_on_stop = False
        self.steps_per_epoch = 0  # recorded in each checkpoint's meta (`set_steps_per_epoch`)
        self._last_saved = -1

    def set_steps_per_epoch(self, steps: int) -> None:
        self.steps_per_epoch = steps  # known once the loaders exist

    def due(self, step: int) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return self.enabled and bool(every) and step % every == 0

    def save(self, reason: str) -> None:
        """Every rank, after a step: the adapter's state and each rank's own into a temp folder, which
        rank 0 commits by a rename and prunes to trainer.checkpoint_keep."""
        step = self.state.global_step
        self.saved_on_stop |= reason == "stop"
        if step == self._last_saved:  # a stop right after a save: that save is the stop's
            return
        start = time.perf_counter()
        rank_state = self.state.state_dict()  # RNG first: nothing below may move it
        tmp = ckpt.temp_path(self.run_dir, step)
        if self.ctx.rank == 0:
            self._unless_full(tmp, step, ckpt.prepare, tmp)
        dist.barrier()
        self._unless_full(tmp, step, self.adapter.save_checkpoint, tmp)
        self._unless_full(tmp, step, ckpt.save_rank_state, tmp, self.ctx.rank, rank_state)
        dist.barrier()  # every rank's part is on disk
        entry = {
            "step": step,
            "epoch": self.state.epoch,
            "step_in_epoch": rank_state["step_in_epoch"],
            "reason": reason,
            "time": time.time(),
        }
        if self.ctx.rank == 0:
            ckpt.crash_hook(step)
            final = self._unless_full(
                tmp,
                step,
                ckpt.commit,
                tmp,
                {
                    **entry,
                    "adapter": self.adapter.name,
                    "format": self.adapter.checkpoint_format,
                    "world_size": self.ctx.world_size,
                    "point": self.plan.point,
                    "run_id": self.run_dir.name,
                    "steps_per_epoch": self.steps_per_epoch,
                },
            )
            meta = ckpt.read_meta(final)
            meta["save_time_s"] = time.perf_counter() - start  # up to the commit
            write_json(final / ckpt.META, meta)
            ckpt.make_private(final)  # meta.json written again: under umask 002 it would be group-writable
            ckpt.prune(self.run_dir, self.cfg.trainer.checkpoint_keep)
            entry.update(name=final.name, bytes=meta["bytes"])
        dist.barrier()  # committed before any rank goes on (or exits)
        elapsed = time.perf_counter() - start
        entry["save_time_s"] = elapsed
        self.state.checkpoints.append(entry)
        self.state.checkpoint_time += elapsed
        self._last_saved = step
        self.watchdog.beat()

    def _unless_full(self, tmp: Path, step: int, fn, *args):
        """`fn(*args)` of a save; a write error (a full disk, a quota, a read-only folder) removes the partial
        save (never a checkpoint: only a committed folder with its manifest is) and ends the run, saying why."""
        try:
            return fn(*args)
        except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
            e = _inner(exc, OSError) or _full_disk(exc, tmp)
            if e is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            keep = self.cfg.trainer.checkpoint_keep
            fix = (
                f"free space under {self.run_dir.parent} or lower trainer.checkpoint_keep ({keep})"
                if e.errno in (errno.ENOSPC, errno.EDQUOT)
                else f"{tmp.parent}: {STORAGE_ERRNOS.get(e.errno, 'check it')}, or choose another results.root=PATH"
            )
            raise OSError(
                e.errno,
                f"checkpoint {ckpt.name(step)} not saved, the partial save removed ({_strerror(e)}); {fix}",
            ) from exc

    def restore(self, path: Path) -> int:
        """Load checkpoint `path` on every rank; returns the epoch to continue. Each rank reads it through a
        descriptor it checked (`checkpoint_load.pin`): rank 0 verifies every file, the others that they hold
        the same meta.json, so a folder swapped after rank 0 chose it is refused, never loaded."""
        allow = self.adapter.checkpoint_safe_globals()
        with self._pinned(path) as pinned, restricted_unpickling(allow, path) as refusals:
            try:
                self.adapter.load_checkpoint(pinned.path)
            except BaseException as exc:  # DCP wraps (or rewords) each rank's refusal: say the refusal itself
                refused = _inner(exc, ConfigError) or (refusals[0] if refusals else None)
                if refused is None or refused is exc:
                    raise
                raise refused from None
            saved = ckpt.load_rank_state(pinned.path, self.ctx.rank)
            meta = pinned.meta
        self.state.load_state_dict(saved)
        self._last_saved = self.state.global_step
        # the saves before this checkpoint, and this one (its save time was not known when it was written)
        keys = ("step", "epoch", "step_in_epoch", "reason", "time", "bytes", "save_time_s")
        self.state.checkpoints.append({**{k: meta.get(k) for k in keys}, "name": path.name})
        now = time.time()
        self.state.resumed_from.append(
            {
                "step": self.state.global_step,
                "epoch": saved["epoch"],
                "step_in_epoch": saved["step_in_epoch"],
                "time": now,
                "attempt": len(saved.get("resumed_from", [])) + 2,  # the first attempt is 1
                "checkpoint": path.name,
                "checkpoint_time": meta.get("time"),
                "restart_gap_s": now - meta["time"] if meta.get("time") else None,
                "previous_run_id": meta.get("run_id"),
                **self.resume_info,
                **ckpt.attempt(),
            }
        )
        self.watchdog.beat()
        if self.ctx.rank == 0:
            print(
                f"resumed from {path} (global step {self.state.global_step}, epoch {saved['epoch']} step "
                f"{saved['step_in_epoch']})",
                flush=True,
            )
        return saved["epoch"]

    def _pinned(self, path: Path) -> Pinned:
        expect = {"point": self.plan.point, "adapter": self.adapter.name, "world_size": self.ctx.world_size}
        pinned, error = None, None
        try:
            pinned = pin(path, verify=self.ctx.rank == 0, expect=expect)
        except ConfigError as e:
            error = str(e)
        seen = [None] * self.ctx.world_size
        dist.all_gather_object(seen, (pinned.digest if pinned else None, error))  # all load, or none does
        errors = [e for _, e in seen if e]
        refusal = errors[0] if errors else None
        if refusal is None and any(digest != seen[0][0] for digest, _ in seen):
            refusal = _differs(path)
        if refusal:
            if pinned:
                pinned.close()
            raise ConfigError(refusal)
        return pinned

    def replace_events(self, record: RunRecord | None, epoch: int) -> list[dict]:
        """Rank 0: drop the events of epoch `epoch` on (the interrupted one is written again, whole);
        returns the earlier epochs' events for the summary."""
        if record is None:
            return []
        events = record.events()
        kept = [e for e in events if e.get("type") != "epoch" or e.get("epoch", 0) < epoch]
        dropped = [e.get("epoch") for e in events if e not in kept]
        path = record.dir / "events.jsonl"
        if dropped or path.exists():
            atomic_write(path, "".join(dumps(e) + "\n" for e in kept))
        self.state.resumed_from[-1]["events_replaced"] = dropped
        return [e for e in kept if e.get("type") == "epoch"]

    def describe(self) -> dict | None:
        """The summary's `checkpoint` field."""
        if not self.enabled:
            return None
        latest = ckpt.latest(self.run_dir) if self.ctx.rank == 0 else None
        return {
            "every": self.cfg.trainer.checkpoint_every,
            "keep": self.cfg.trainer.checkpoint_keep,
            "on_stop": True,
            "format": self.adapter.checkpoint_format,
            "saved": self.state.checkpoints,
            "latest": latest.name if latest else None,
        }


def _differs(path: Path) -> str:
    return (
        f"not resuming from {path}: this rank found another checkpoint there than rank 0 verified (the folder was "
        "replaced while the ranks opened it); check who else can write its results folder, or set "
        "trainer.resume=never"
    )


def _full_disk(exc: BaseException, where: Path) -> OSError | None:
    """A write that failed as something other than an OSError (torch's zip writer raises RuntimeError
    "PytorchStreamWriter failed writing file ...: file write failed") on a file system with no space left:
    the full disk, named as such (checked before the partial save is removed)."""
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        return None
    # torch's zip writer after a short write: "unexpected pos N vs M" (DCP: in each rank's failure)
    said = " ".join(str(x) for x in (exc, *(getattr(exc, "failures", None) or {}).values()))
    if free < 1 << 20 or any(m in said for m in ("write failed", "unexpected pos")):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # free again once a peer removed its part
    return None


def _strerror(e: OSError) -> str:
    """What the system said, also when a write of the record named it already (records.storage_error)."""
    cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
    return cause.strerror or str(cause)


def _inner(e: BaseException, kind: type, depth: int = 0):
    """The `kind` exception behind a failure: itself, its cause, or one wrapped by a framework (torch DCP's
    CheckpointException keeps each rank's exception in `failures`)."""
    if e is None or depth > 4:
        return None
    if isinstance(e, kind):
        return e
    inner = [e.__cause__, e.__context__, getattr(e, "exc", None)]
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):  # {rank: (exception, traceback summary)}
        inner += [v[0] if isinstance(v, tuple) and v else v for v in failures.values()]
    for x in inner:
        found = _inner(x, kind, depth + 1) if isinstance(x, BaseException) else None
        if found is not None:
            return found
    return None
