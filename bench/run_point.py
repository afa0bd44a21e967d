"""Run `python -m ptbench` in a subprocess, as a user would, and read the record it wrote.

Every driver that runs points (smoke, demo, sweep, overhead, memory study) goes through `run_bench`.
The run gets its own session, so a timeout ends the launcher *and* its ranks, nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ptbench.core.readers import read_record
from ptbench.core.records import RunRecord, new_run_id, results_folder


@dataclass
class BenchRun:
    command: list[str]
    returncode: int | None  # None: ended at the timeout
    run_dir: Path | None  # None: no record (refused before launch)
    summary: dict = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "timeout"
        return self.summary.get("status") or ("failed" if self.returncode else "ok")

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.summary.get("status") == "ok"

    @property
    def error_line(self) -> str:
        """The run's error: the record's, else the last `error:` line (a refusal), else the last line."""
        if self.summary.get("error"):
            return str(self.summary["error"])
        # Hydra ends a failed job with a hint about HYDRA_FULL_ERROR: the error itself is the line before it
        lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
        return next(
            (ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else f"exit {self.returncode}"
        )


def run_bench(
    overrides: list[str],
    *,
    root: Path | None = None,
    experiment: str | None = None,
    run_id: str | None = None,
    timeout: float | None = None,
    capture: bool = True,
    env: dict | None = None,
    run_name: tuple[str, str, int] = ("run", "point", 0),
) -> BenchRun:
    """`python -m ptbench <overrides>` with its record at <root>/<experiment>/<run_id> (root and experiment
    None: the point's own); `run_name` (adapter, workload, ranks) names a generated run id. On timeout
    the process group gets SIGTERM, then SIGKILL."""
    run_id = run_id or new_run_id(*run_name)
    where = [
        *([f"results.root={root}"] if root is not None else []),
        *([f"results.experiment={experiment}"] if experiment is not None else []),
        f"results.run_id={run_id}",
    ]
    cmd = [sys.executable, "-m", "ptbench", *overrides, *where]
    run_dir = record_dir([*overrides, *where], run_id)
    pipe = subprocess.PIPE if capture else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True, env={**os.environ, **(env or {})}
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        out, err = _end(proc)
        code = None
    except BaseException:  # Ctrl-C in the driver: take the run down with it
        _end(proc)
        raise
    summary_path = run_dir / "summary.json" if run_dir else None
    summary = (read_record(summary_path) or {}) if summary_path and summary_path.exists() else {}
    if code is None and summary.get("status") in ("running", "failed"):  # ended by us: say so in the record
        summary.update(status="timeout", error=f"ended at the driver's timeout of {timeout:.0f}s")
        RunRecord(run_dir).write_summary(summary)
    return BenchRun(cmd, code, run_dir if summary else None, summary, out or "", err or "", time.perf_counter() - t0)


def record_dir(overrides: list[str], run_id: str) -> Path | None:
    """Where `python -m ptbench <overrides>` writes its record (None: the overrides do not compose)."""
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose

    try:
        cfg = compose(overrides)
    except ConfigError:
        return None
    return results_folder(cfg.results) / run_id


def _end(proc: subprocess.Popen) -> tuple[str, str]:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""
