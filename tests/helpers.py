"""Run the harness as a user would (`python -m bench ...` in a subprocess) and read its records."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(*overrides: str, results: Path, timeout: int = 600, env: dict | None = None, module: str = "bench"):
    """Run `python -m bench` with overrides; returns the CompletedProcess. Records go under `results`."""
    cmd = [sys.executable, "-m", module, *overrides, f"results.root={results}"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_dirs(results: Path) -> list[Path]:
    return sorted(p.parent for p in Path(results).rglob("summary.json"))


def only_run(results: Path) -> Path:
    dirs = run_dirs(results)
    assert len(dirs) == 1, dirs
    return dirs[0]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> list[float]:
    return [loss for e in events(run_dir) for loss in e["train_losses"]]


def check_ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
