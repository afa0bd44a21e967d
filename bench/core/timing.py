"""Per-step phase timers: a clock mark at each phase boundary plus an NVTX range per phase.

On CUDA the marks are CUDA events recorded on the current stream (`CudaEventClock`): they time
the GPU's own timeline, cost no host sync, and are resolved once, when the trainer reads `steps`
at the end of an epoch (one device sync there). Host work that the GPU hides (data loading while
kernels run) therefore shows as the time the GPU actually waited for it. On CPU the marks are
perf_counter readings (`HostClock`), the CPU twin of the same logic. `trainer.sync_timing=true`
adds a device sync at every phase end: a diagnostic that serialises host and device (it slows the
frameworks that overlap host work, e.g. DeepSpeed, Horovod, pipeline schedules), recorded as such.

A process that drives several GPUs (GPipe: one partition per device) times every one of them
(`PhaseTimer.use_devices`: `PerDeviceClock`, a mark = one event on each device's current stream): a
phase lasts as long as its longest device span, not only cuda:0's (whose work ends before the last
partition's). Events on two devices cannot be subtracted, so the span is the longest per-device one.

NVTX ranges (`nvtx` package) are no-ops costing ~0.1 µs when no profiler is attached, so they stay
on always; Nsight Systems then shows the same data/forward/backward/optimizer phases we record.
`torch.profiler.record_function` is kept out of this hot path (15-26 µs per call even idle).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import nvtx
import torch

# forward_backward: pipeline schedules that interleave micro-batch forwards and backwards (1F1B)
PHASES = ("data", "forward", "backward", "forward_backward", "optimizer")
_DOMAIN = nvtx.get_domain("trainbench")


class HostClock:
    """perf_counter marks: the clock on CPU (and of the CPU twin tests)."""

    name = "host_perf_counter"

    def mark(self):
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        return b - a

    def synchronize(self) -> None:
        pass


class CudaEventClock:
    """CUDA events on the current stream: marks cost no host sync; `elapsed` needs the later one done."""

    name = "cuda_events"

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3  # ms -> s

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class DeviceEventClock(CudaEventClock):
    """CUDA events on one device's current stream (not the current device's)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class PerDeviceClock:
    """One mark per device (a tuple); a span is the longest of the devices' spans between their marks."""

    name = "cuda_events_per_device"

    def __init__(self, clocks):
        self.clocks = list(clocks)

    def mark(self):
        return tuple(c.mark() for c in self.clocks)

    def elapsed(self, a, b) -> float:
        return max(c.elapsed(x, y) for c, x, y in zip(self.clocks, a, b))

    def synchronize(self) -> None:
        for c in self.clocks:
            c.synchronize()


def cuda_devices(devices) -> list[torch.device]:
    """The distinct CUDA devices among `devices` (in order): what a multi-device process must time."""
    return list(dict.fromkeys(d for d in map(torch.device, devices) if d.type == "cuda"))


def default_clock():
    return CudaEventClock() if torch.cuda.is_available() else HostClock()


class PhaseTimer:
    """`start_step`, `phase(name)` (phases of one name add up within a step: micro-batches), `end_step`.
    `steps` resolves the marks into one dict of seconds per step ({phase: s, "step": s})."""

    def __init__(self, cuda_sync: bool = False, clock=None):
        self.clock = clock or default_clock()
        self.phase_sync = bool(cuda_sync) and torch.cuda.is_available()  # diagnostic only
        self._pending: list[tuple] = []  # (start mark, end mark, [(phase, a, b), ...]) per step
        self._resolved: list[dict[str, float]] = []
        self._marks: list[tuple] = []
        self._start = None
        self._in_step = False
        self._next_clock = None  # a clock set during a step takes over at the next one
        self._watch: dict = {}  # phase name -> a context manager entered around that phase's body (`watching`)
        self._step_watchers: list = []  # objects told `start_step()` / `end_step()` (`watch_steps`)

    @property
    def settings(self) -> dict:
        # cuda_events_per_device: every device the process drives (the adapter's settings list them)
        return {"clock": self.clock.name, "phase_sync": self.phase_sync}

    def use_clock(self, clock) -> None:
        """Time with `clock` from now on (during a step: from the next step on; marks never mix clocks)."""
        if self._in_step:
            self._next_clock = clock
        else:
            self.clock = clock

    def use_devices(self, devices) -> None:
        """A process driving >= 2 GPUs (GPipe's partitions): events on every one of them, not cuda:0 only."""
        if isinstance(self.clock, PerDeviceClock) or isinstance(self._next_clock, PerDeviceClock):
            return
        cuda = cuda_devices(devices)
        if len(cuda) >= 2 and isinstance(self.clock, CudaEventClock):
            self.use_clock(PerDeviceClock(DeviceEventClock(d) for d in cuda))

    def watch_steps(self, watcher) -> None:
        """Tell `watcher` (the sync counter: `start_step()`, `end_step()`) where every step begins and ends."""
        self._step_watchers.append(watcher)

    def start_step(self) -> None:
        if self._next_clock is not None:
            self.clock, self._next_clock = self._next_clock, None
        self._in_step = True
        self._marks = []
        self._start = self.clock.mark()
        _DOMAIN.push_range(message="step")
        for w in self._step_watchers:
            w.start_step()

    @contextmanager
    def phase(self, name: str):
        _DOMAIN.push_range(message=name)
        a = self.clock.mark()
        try:
            with self._watch.get(name) or nullcontext():
                yield
        finally:
            if self.phase_sync:
                torch.cuda.synchronize()
            self._marks.append((name, a, self.clock.mark()))
            _DOMAIN.pop_range()

    @contextmanager
    def watching(self, phase: str, watcher):
        """Within this block, enter `watcher` (a context manager: StepPeak) around every `phase` body;
        None watches nothing."""
        if watcher is None:
            yield
            return
        self._watch[phase] = watcher
        try:
            yield
        finally:
            self._watch.pop(phase, None)

    def end_step(self) -> dict[str, float] | None:
        """The step's times at once with the host clock; None with events (read `steps` later)."""
        self._pending.append((self.clock, self._start, self.clock.mark(), self._marks))
        self._in_step = False
        for w in self._step_watchers:
            w.end_step()
        _DOMAIN.pop_range()
        if isinstance(self.clock, HostClock):
            return self.steps[-1]
        return None

    @property
    def steps(self) -> list[dict[str, float]]:
        if self._pending:
            for clock in {id(c): c for c, *_ in self._pending}.values():
                clock.synchronize()  # once for all pending steps: events are complete after it
            for clock, start, end, marks in self._pending:
                step: dict[str, float] = {}
                for name, a, b in marks:
                    step[name] = step.get(name, 0.0) + clock.elapsed(a, b)
                step["step"] = clock.elapsed(start, end)
                self._resolved.append(step)
            self._pending = []
        return self._resolved

    def reset(self) -> None:
        self._pending, self._resolved = [], []
