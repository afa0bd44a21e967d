"""Per-step phase timers: perf_counter plus an NVTX range per phase.

NVTX ranges (`nvtx` package) are no-ops costing ~0.1 µs when no profiler is attached, so they stay
on always; Nsight Systems then shows the same data/forward/backward/optimizer phases we record.
On CUDA the timer synchronizes at each phase boundary (`trainer.sync_timing`), otherwise kernels
queued in one phase would be billed to the next. `torch.profiler.record_function` is kept out of
this hot path (15-26 µs per call even idle).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import nvtx
import torch

# forward_backward: pipeline schedules that interleave micro-batch forwards and backwards (1F1B)
PHASES = ("data", "forward", "backward", "forward_backward", "optimizer")
_DOMAIN = nvtx.get_domain("trainbench")


class PhaseTimer:
    def __init__(self, cuda_sync: bool):
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._step_start = 0.0

    def _sync(self) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()

    def start_step(self) -> None:
        self._sync()
        self._current = {}
        self._step_start = time.perf_counter()
        _DOMAIN.push_range(message="step")

    @contextmanager
    def phase(self, name: str):
        """Time one phase; phases of the same name within a step add up (micro-batches)."""
        _DOMAIN.push_range(message=name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - t0
            _DOMAIN.pop_range()

    def end_step(self) -> dict[str, float]:
        self._sync()
        self._current["step"] = time.perf_counter() - self._step_start
        _DOMAIN.pop_range()
        self.steps.append(self._current)
        return self._current

    def reset(self) -> None:
        self.steps = []
