"""How far a study of several minutes is: a line per finished run with the time left at the runs' mean pace.

Shared by the studies that run many points (ledger, memory_ledger, memory_study), so that none of them imports
another for it.
"""

from __future__ import annotations

import time


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s" if seconds >= 60 else f"{seconds:.0f} s"


class Tally:
    """The runs of the whole command done so far, and the time left at their mean pace."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def spent(self) -> str:
        return clock(time.perf_counter() - self.t0)

    def tick(self) -> str:
        """After a run: how far the whole command is and the time left, while runs remain."""
        self.done += 1
        if self.done >= self.total:
            return ""
        left = (self.total - self.done) * (time.perf_counter() - self.t0) / self.done
        return f"  ({self.done}/{self.total} runs in {self.spent()}, about {clock(left)} left)"


def progress(what: str, n: int, total: int, name: str, run, tally: Tally | None = None) -> None:
    """One line per finished run: a command of several minutes is never silent for long, and says how long."""
    whole = tally.tick() if tally else ""
    print(f"{what} [{n}/{total}] {name}: {run.status} in {run.wall_s:.0f}s{whole}", flush=True)
