"""`trainer.profile=START:COUNT`: torch.profiler over COUNT optimizer steps from global step START (0-based),
one Chrome/Perfetto trace per rank in RUN_DIR/traces/rank{R}.json and a merged one (traces/merged.json,
each rank a process row, pid = rank), and what the traces measure (bench/core/trace_ledger.py): the
communication ledger per collective kind beside the corrected formulas (bench/core/comm_volume/
`corrected`), the exposed (non-overlapped) communication per rank, the pipeline bubble per stage, and
the time each rank waits in collectives (the straggler view of the epoch event).

Inside the window only, thin wrappers mark what the trace alone does not say: torch.distributed's
collective functions are wrapped in `ptbench.comm:OP:GROUP_SIZE` record_function labels, and the
pipeline stages' per-micro-batch work (torch.distributed.pipelining's forward_one_chunk /
backward_one_chunk, megatron-core's forward_step / backward_step) in `ptbench.stage:fwd|bwd`. They are
removed when the window ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ptbench.core import trace_ledger as ledger
from ptbench.core.errors import ConfigError
from ptbench.core.memory import quiet_cpu_profiler
from ptbench.core.records import STORAGE_ERRNOS, storage_error

COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather",
    "reduce_scatter",
    "all_reduce_coalesced",
    "broadcast",
)  # not send/recv: their bytes need no group size, and P2POp insists on the unwrapped isend/irecv


def parse_window(spec) -> tuple[int, int] | None:
    """ "START:COUNT" -> (START, COUNT); None/empty -> None; bad input -> ConfigError naming the fix."""
    if spec in (None, "", False):
        return None
    start, sep, count = str(spec).partition(":")
    try:
        window = int(start), int(count)
    except ValueError:
        window = None
    if not sep or window is None or window[0] < 0 or window[1] < 1:
        raise ConfigError(
            f"trainer.profile={spec}: use START:COUNT (profile COUNT >= 1 optimizer steps from global step START "
            ">= 0), e.g. trainer.profile=3:2"
        )
    return window


def _group(args, kwargs) -> str:
    """ "SIZE:DESCRIPTION" of the process group among a collective's arguments (default: the world)."""
    pg = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, dist.ProcessGroup)), None)
    desc = getattr(pg, "group_desc", None) if pg is not None else "default_pg"
    return f"{dist.get_world_size(pg)}:{desc or 'undescribed'}"


def _wrap_comm(name: str, fn):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"{ledger.COMM}{name}:{_group(args, kwargs)}"):
            return fn(*args, **kwargs)

    wrapper._ptbench_wrapped = True
    return wrapper


def _fsdp_root_params(adapter) -> int | None:
    """FSDP2: parameters of the root unit, those no inner fully_shard unit holds (global numel)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    if adapter is None:
        return None
    for root in adapter.modules():
        if isinstance(root, FSDPModule):
            inner = {
                id(p) for m in root.modules() if m is not root and isinstance(m, FSDPModule) for p in m.parameters()
            }
            return sum(p.numel() for p in root.parameters() if id(p) not in inner)
    return None


def _wrap_coalescing(fn):
    @contextlib.contextmanager
    def wrapper(group=None, *args, **kwargs):
        with torch.profiler.record_function(f"{ledger.COMM}coalesced:{_group((group,), {})}"):
            with fn(group, *args, **kwargs) as cm:
                yield cm

    wrapper._ptbench_wrapped = True
    return wrapper


def _wrap_stage(tag: str, fn):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"{ledger.STAGE}{tag}"):
            return fn(*args, **kwargs)

    wrapper._ptbench_wrapped = True
    return wrapper


class StepProfiler:
    """This rank's profiler window. `step(global_step)` wraps one `adapter.train_step`; `finish()` (a
    collective: every rank calls it) writes the merged trace and returns the record's `profile`."""

    def __init__(
        self,
        spec,
        ctx,
        run_dir: Path | None,
        dp: int,
        pp: int,
        microbatches: int,
        formula: dict | None,
        schedule: str | None = None,
    ):
        self.window = parse_window(spec)
        self.schedule = schedule  # "ADAPTER SCHEDULE" of a pipeline (recorded with its bubble)
        self.ctx = ctx
        self.dir = Path(run_dir) / "traces" if run_dir is not None else None
        self.dp, self.pp, self.m = dp, pp, microbatches
        self.formula = formula
        self.prof = None
        self._patched: list[tuple[object, str, object]] = []
        self.result: dict | None = None  # this rank's analysis, when the window has ended
        self.path: Path | None = None
        self._ending = False  # the window's last step ran: `end_window` stops the profiler
        self.export_s: float | None = None  # stopping the profiler, writing and reading the trace
        self.start_s: float | None = None  # starting it, before the window's first step

    @classmethod
    def of(cls, cfg, plan, ctx, run_dir: Path | None, adapter=None) -> StepProfiler:
        from ptbench.core.comm_volume import corrected

        lay = plan.layout
        formula = None
        if cfg.trainer.profile and plan.comm_volume and plan.comm_volume.get("collectives") is not None:
            formula = corrected(plan.comm_volume, plan.cost, cfg.workload, _fsdp_root_params(adapter))
        schedule = plan.cost.schedule  # the pipeline schedule, "none" without one
        return cls(
            cfg.trainer.profile,
            ctx,
            run_dir,
            lay.dp,
            lay.pp,
            lay.microbatches,
            formula,
            f"{cfg.adapter.name} {schedule}" if schedule != "none" else None,
        )

    @property
    def active(self) -> bool:
        return self.prof is not None

    def _patch(self) -> None:
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for name in COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None and not getattr(fn, "_ptbench_wrapped", False):
                originals[id(fn)] = (name, fn, _wrap_comm(name, fn))
        cm = c10d._coalescing_manager
        if not getattr(cm, "_ptbench_wrapped", False):
            originals[id(cm)] = ("_coalescing_manager", cm, _wrap_coalescing(cm))
        # torch.distributed and the frameworks' modules that imported a collective by name (Megatron's
        # `from torch.distributed import _coalescing_manager`)
        mods = [dist, c10d] + [
            m for k, m in list(sys.modules.items()) if m is not None and k.startswith(("megatron.", "deepspeed."))
        ]
        for mod in mods:
            for attr, val in list(vars(mod).items()):
                hit = originals.get(id(val))
                if hit is not None and hit[1] is val:
                    self._patched.append((mod, attr, val))
                    setattr(mod, attr, hit[2])
        stage = sys.modules.get("torch.distributed.pipelining.stage")
        if stage is not None:
            cls = stage._PipelineStageBase
            for meth, tag in (("forward_one_chunk", "fwd"), ("backward_one_chunk", "bwd")):
                self._patched.append((cls, meth, cls.__dict__[meth]))
                setattr(cls, meth, _wrap_stage(tag, cls.__dict__[meth]))
        sched = sys.modules.get("megatron.core.pipeline_parallel.schedules")
        if sched is not None:
            for fn_name, tag in (("forward_step", "fwd"), ("backward_step", "bwd")):
                self._patched.append((sched, fn_name, getattr(sched, fn_name)))
                setattr(sched, fn_name, _wrap_stage(tag, getattr(sched, fn_name)))

    def _unpatch(self) -> None:
        for owner, name, fn in reversed(self._patched):
            setattr(owner, name, fn)
        self._patched.clear()

    def covers(self, global_step: int) -> bool:
        """Whether `global_step` is inside the profile window."""
        return self.window is not None and self.window[0] <= global_step < self.window[0] + self.window[1]

    def start_window(self, global_step: int) -> float:
        """Before the timer starts the step: start the profiler if the window opens at `global_step`. Returns the
        seconds that took (0.0 otherwise), which no step time contains (Kineto's start took the first profiled
        step to 2x the median when it ran inside it)."""
        if self.window is None or global_step != self.window[0] or self.prof is not None or self.result is not None:
            return 0.0
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        acts = [ProfilerActivity.CPU]
        if self.ctx.is_cuda:
            acts.append(ProfilerActivity.CUDA)
        self._patch()
        quiet_cpu_profiler()
        self.prof = profile(activities=acts, record_shapes=True)
        self.prof.__enter__()
        self.start_s = time.perf_counter() - t0
        return self.start_s

    def step(self, global_step: int):
        """The context of one train step: nothing at all outside the window (no generator per step)."""
        if self.prof is None:
            return contextlib.nullcontext()
        return self._step(global_step)

    @contextlib.contextmanager
    def _step(self, global_step: int):
        start, count = self.window
        with torch.profiler.record_function(f"{ledger.STEP}{global_step}"):
            yield
        self._ending = global_step == start + count - 1  # stopped by `end_window`, after the step's timer

    def end_window(self) -> float:
        """After the timer has ended the step: stop the profiler and write this rank's trace if the window's
        last step has just run. Returns the seconds that took (0.0 otherwise), which no step time contains."""
        if not self._ending:
            return 0.0
        self._ending = False
        self._stop()
        return self.export_s

    def _stop(self) -> None:
        t0 = time.perf_counter()
        if self.ctx.is_cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self._unpatch()
        prof, self.prof = self.prof, None
        if self.dir is None:
            import tempfile

            self.dir = Path(tempfile.mkdtemp(prefix="ptbench-traces-"))
        self.path = self.dir / f"rank{self.ctx.rank}.json"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.path))  # writes PATH.tmp, renamed; a failed write leaves no PATH
            with open(self.path) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: a trace cut short
            raise trace_unwritten(self.path, e) from e
        self.result = ledger.analyse(trace, self.dp)
        self.export_s = time.perf_counter() - t0

    def wait_in(self, first_step: int, last_step: int) -> float | None:
        """Seconds per profiled step this rank's communication was exposed (it waited in collectives), over
        the profiled steps in [first_step, last_step); None if none were profiled there."""
        if self.result is None or not any(first_step <= g < last_step for g in self.result["steps"]):
            return None
        return self.result["exposed_s"]

    def finish(self) -> dict | None:
        """Every rank: gather the ranks' analyses; rank 0 writes the merged trace and returns the record."""
        if self.window is None:
            return None
        if self.prof is not None:  # the run ended inside the window
            self._stop()
        mine = None
        if self.result is not None:
            mine = {k: v for k, v in self.result.items() if k != "collectives"}
            mine["path"] = str(self.path)
            mine["export_s"] = self.export_s
        every = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine)
        if self.ctx.rank != 0:
            return None
        start, count = self.window
        rec = dict(window=dict(start=start, count=count), activities=["cpu", "cuda"] if self.ctx.is_cuda else ["cpu"])
        if any(r is None for r in every):
            rec["note"] = f"the window (steps {start}..{start + count - 1}) was not reached on every rank"
            return rec
        traces, merged = {}, None
        try:
            for r, info in enumerate(every):
                with open(info["path"]) as f:
                    traces[r] = json.load(f)
            merged = self.dir / "merged.json"
            with open(merged, "w") as f:
                json.dump(ledger.merge(traces), f)
        except OSError as e:  # ranks on hosts without a shared results folder; a storage that refuses: the run's end
            if merged is not None and refusal(merged, e) is not None:
                raise trace_unwritten(merged, e) from e
            rec["merge_error"] = f"{type(e).__name__}: {e}"
        rec["traces"] = [info["path"] for info in every]
        rec["export"] = {
            "seconds": [info.get("export_s") for info in every],
            "in_step_times": False,
            "in_epoch_time": False,
            "note": "stopping the profiler, writing and reading back the trace ran after the last profiled step's "
            "timer and is left out of its epoch's time; so is starting it, before the first profiled step's timer "
            f"(rank 0: {self.start_s or 0:.3f} s)",
        }
        rec["merged_trace"] = str(merged) if merged else None
        rec["ranks"] = [
            dict(
                rank=r,
                step_time_s=info["step_time_s"],
                comm_time_s=info["comm_time_s"],
                exposed_comm_s=info["exposed_s"],
                compute_s=info["compute_s"],
                by_kind=info["by_kind"],
            )
            for r, info in enumerate(every)
        ]
        rec["ledger"] = ledger_table(every, self.formula)
        rec["formula"] = self.formula
        rec["notes"] = sorted({n for info in every for n in info["notes"]})
        if self.pp > 1 and self.dp == 1 and len(every) == self.pp:
            rec["bubble"] = ledger.bubble(every, self.m, self.schedule)
        return rec


TRACE_FIX = "or choose another results.root=PATH, or drop trainer.profile"


def refusal(path: Path, e: BaseException) -> OSError | None:
    """The storage's refusal behind a failed write of `path`: `e` itself when it says so (a full disk, a quota, a
    read-only file system, no permission), else what the file system under `path` shows now. torch's trace
    export says nothing when its write fails, and a cut trace only fails to parse."""
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        return e
    where = next((p for p in (path.parent, *path.parents) if p.exists()), None)
    try:
        st = os.statvfs(where) if where is not None else None
    except OSError:
        return None
    if st is None:
        return None
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS))
    if st.f_bavail * st.f_frsize < 1 << 20:  # what the failed write left free: before its partial file goes
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if not os.access(where, os.W_OK):
        return OSError(errno.EACCES, os.strerror(errno.EACCES))
    return None


def trace_unwritten(path: Path, e: BaseException) -> BaseException:
    """A trace that could not be written: one line naming `path` and the fix where the storage refused it (its
    partial file removed, so the record still has room for its final status), else `e` itself."""
    cause = refusal(path, e)
    if cause is None:
        return e
    for partial in (path, path.with_name(path.name + ".tmp")):
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return storage_error(cause, path, TRACE_FIX)


def ledger_table(every: list[dict], formula: dict | None) -> list[dict]:
    """Per collective kind: bytes by the corrected formula and by measurement (the busiest rank's, per step,
    nccl-tests bus volume), calls, time measured (mean over ranks) and exposed time (mean over ranks)."""
    kinds = sorted({k for info in every for k in info["by_kind"]} | set((formula or {}).get("by_op", {})))
    rows = []
    for kind in kinds:
        got = [info["by_kind"].get(kind) for info in every]
        measured = max((g["bus_bytes"] for g in got if g), default=0.0)
        fbytes = (formula or {}).get("by_op", {}).get(kind)
        rows.append(
            dict(
                kind=kind,
                formula_bytes=fbytes,
                measured_bytes=measured,
                ratio=measured / fbytes if fbytes else None,
                calls=max((g["calls"] for g in got if g), default=0.0),
                time_s=sum(g["time_s"] for g in got if g) / len(every),
            )
        )
    return rows
