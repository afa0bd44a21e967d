"""Failures on purpose, for the tests of failure capture and of resume (trainer.inject_fault, inject_stop),
a known slowdown for the A/B check of run-to-run spread (trainer.inject_fault=slow@FRACTION: every rank's every
step takes FRACTION longer), and a straggler (trainer.inject_fault=straggler@RANK:FRACTION: that rank's every step
takes FRACTION longer, the others wait for it in their collectives).

Checked before launch (bench/runner/checks.py, bench/core/checkpoint.py); here only their effect.
"""

from __future__ import annotations

import time

import torch

from ptbench.core.config import TrainerConfig
from ptbench.core.errors import ConfigError
from ptbench.core.stopping import StopFlag


class Faults:
    """This rank's injected fault (`trainer.inject_fault`) and stop request (`trainer.inject_stop`)."""

    def __init__(self, trainer: TrainerConfig, rank: int):
        self.rank = rank
        self.fault = trainer.inject_fault or None
        self.stop_at = tuple(int(v) for v in str(trainer.inject_stop).split(":")) if trainer.inject_stop else None
        kind, _, arg = (self.fault or "").partition("@")
        self.slow = float(arg) if kind == "slow" else None
        # "straggler@RANK:FRACTION": `slow` on that rank only, as a sleep: a straggler on its own device leaves
        # its peers' compute alone (a spin would take a core from the other ranks of a small CPU box)
        self.sleep = kind == "straggler"
        if self.sleep:
            who, _, frac = arg.partition(":")
            self.fault = None
            self.slow = float(frac) if int(who) == rank else None
        self._last = None  # perf_counter at the previous step's before_step
        self._slept = 0.0  # what that step slept

    def before_step(self, step: int) -> None:
        """After the step's data is loaded, before its compute: the injected fault, if it is this rank's and step's."""
        if self.slow is not None:
            self._slow_down()
        elif self.fault:
            inject_fault(self.fault, self.rank, step)

    def _slow_down(self) -> None:
        """Spin for `slow` x the last step's own time (the interval since the previous step's call, less what
        that one added), so every step after the first takes `slow` longer. On CUDA the queued work is
        waited for first, or the sleep would hide under it."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        pause = self.slow * max(0.0, now - self._last - self._slept) if self._last is not None else 0.0
        end = now + pause
        if self.sleep:
            time.sleep(pause)
        while time.perf_counter() < end:  # busy, as more compute would be: a sleep would let the loader's
            pass  # workers take the core meanwhile, and the step would come out less than `slow` slower
        self._last, self._slept = now, pause

    def after_step(self, step: int, stop: StopFlag) -> None:
        """After global step `step`: ask for a stop as a signal would, if this is the injected one."""
        if self.stop_at == (self.rank, step):
            stop.request("injected")


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
