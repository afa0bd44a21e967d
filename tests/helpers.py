"""Run the harness as a user would (`python -m ptbench ...`: a fork of a warm interpreter, tests/forkrun.py,
or a new one), read its records, and compare losses without letting garbage pass.

Every run starts in its own session (process group): on a timeout the whole group is killed, the
launcher and the ranks it spawned, so a hung test leaves nothing running into the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests import forkrun

REPO = Path(__file__).resolve().parents[1]

# The overrides of the shared reference runs (fixtures ddp_gpt2_reference and smoke_run in conftest.py)
# vocabulary 1024, not GPT-2's 50257: these runs compare adapters, and the head is most of a tiny GPT-2's work
GPT2_REFERENCE = [
    "workload=gpt2_tiny",
    "workload.vocab_size=1024",
    "workload.seq_len=32",
    "data.train_samples=256",
    "data.val_samples=32",
    "trainer.max_steps=8",
    "trainer.epochs=1",
    "trainer.batch_size=4",
    "trainer.max_eval_batches=2",
    "trainer.grad_clip=0",
    "trainer.progress=false",
]
SMOKE = ["experiment=smoke", "workload.vocab_size=256", "trainer.progress=false"]


def wikitext2_short(data_root: Path) -> list[str]:
    """gpt2_tiny for 2 short epochs (30 steps) on 2 ranks over the real Wikitext-2 subset (tokens from the shared
    cache, BENCH_CACHE_DIR): the run whose perplexity must fall, whatever the adapter."""
    return [
        "workload=gpt2_tiny",
        "data=wikitext2",
        f"data.root={data_root}/wikitext-2",
        f"data.tokenizer_dir={data_root}/gpt2-tokenizer",
        "trainer.epochs=2",
        "trainer.max_steps=30",
        "trainer.max_eval_batches=8",
        "optimizer.lr=3e-3",
        "launcher.nprocs=2",
        "trainer.progress=false",
    ]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it was started with start_new_session=True)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """subprocess.run in a new session; on timeout the whole group dies (not just the launcher).
    `python -m ...` runs as a fork of a warm interpreter (tests/forkrun.py) unless its env sets PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    if cmd[:2] == [sys.executable, "-m"] and len(cmd) > 2 and forkrun.enabled(env):
        return _run_forked(cmd, timeout, env, cwd)
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    except BaseException:  # pytest's own timeout or Ctrl-C interrupting the wait: leave nothing running
        kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run_forked(cmd: list[str], timeout: float, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """`run` for `python -m module args` as a fork of the warm interpreter, with the same timeout rule."""
    started = forkrun.Run(cmd[2], cmd[3:], env, cwd)
    try:
        try:
            code = started.wait(timeout)  # None: still running after `timeout`
        finally:  # timed out, or pytest's own timeout / Ctrl-C interrupted the wait: leave nothing running
            started.kill()
        out, err = started.output()
    finally:
        started.close()
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


def bench(*overrides: str, results: Path, timeout: int = 600, env: dict | None = None, module: str = "ptbench"):
    """Run `python -m ptbench` with overrides; returns the CompletedProcess. Records go under `results`."""
    cmd = [sys.executable, "-m", module, *overrides, f"results.root={results}"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return run(cmd, timeout, full_env)


def python_m(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m module args` in the repository, started as `run` starts it (a timeout kills its whole group)."""
    return run([sys.executable, "-m", module, *args], timeout)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Popen in a new session (stop it with kill_group); for tests that signal a running run."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )


def run_dirs(results: Path) -> list[Path]:
    for _ in range(50):
        try:
            return sorted(p.parent for p in Path(results).rglob("summary.json"))
        except FileNotFoundError:  # a running launcher's write probe, made and removed while rglob walked
            time.sleep(0.02)
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
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
    )


def ok_events(*overrides: str, results: Path) -> list[dict]:
    """The epoch events of the one run `bench(*overrides)` makes in `results`, which must end ok."""
    check_ok(bench(*overrides, results=results))
    return events(only_run(results))


# --- losses ------------------------------------------------------------------------------------------
def finite(losses, what: str = "losses") -> np.ndarray:
    """The losses as a 1-D float array; fails on an empty series or any NaN / inf."""
    arr = np.asarray(losses, dtype=np.float64)
    assert arr.ndim == 1 and arr.size > 0, f"{what}: expected a non-empty series, got {losses!r}"
    assert np.isfinite(arr).all(), f"{what}: not finite: {arr.tolist()}"
    return arr


def assert_losses_close(actual, expected, atol: float, rtol: float = 0.0, what: str = "losses") -> None:
    """Same length, both finite, equal within atol + rtol * |expected| (NaN is never equal to NaN)."""
    a, b = finite(actual, f"{what} (actual)"), finite(expected, f"{what} (expected)")
    assert a.shape == b.shape, f"{what}: {a.size} steps vs {b.size}"
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, equal_nan=False, err_msg=what)


def assert_loss_falls(losses, by: float, what: str = "losses") -> None:
    """Training is claimed: the series is finite and its last value is at least `by` (> 0) below its first."""
    assert by > 0, "a loss that must fall by 0 or less checks nothing"
    arr = finite(losses, what)
    assert arr.size >= 2, f"{what}: one step cannot show a fall"
    assert arr[-1] <= arr[0] - by, f"{what}: fell by {arr[0] - arr[-1]:.4g}, less than {by}: {arr.tolist()}"
