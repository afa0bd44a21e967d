"""The test helpers themselves: a missing prerequisite fails under CI and skips otherwise; the loss
checks refuse NaN, inf and flat series; a timed-out run dies with everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import in_ci, require_or_skip
from tests.helpers import REPO, assert_loss_falls, assert_losses_close, finite, run


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1", "yes", "Yes", " on "])
def test_require_or_skip_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match="CI needs Horovod: not installed"):
        require_or_skip("Horovod", "not installed")


@pytest.mark.parametrize("value", [None, "", "false", "0", "no"])
def test_require_or_skip_skips_outside_ci(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match="Horovod unavailable: not installed"):
        require_or_skip("Horovod", "not installed")


def test_loss_helpers_reject_nan_and_inf():
    good = [2.0, 1.5, 1.2]
    assert_losses_close(good, good, atol=0)
    with pytest.raises(AssertionError, match="not finite"):
        assert_losses_close(
            [2.0, float("nan"), 1.2], [2.0, float("nan"), 1.2], atol=1
        )  # NaN == NaN would pass allclose
    with pytest.raises(AssertionError, match="not finite"):
        assert_losses_close(good, [2.0, float("inf"), 1.2], atol=1)
    with pytest.raises(AssertionError, match="not finite"):
        assert_loss_falls([3.0, float("nan"), 1.0], by=0.5)
    with pytest.raises(AssertionError, match="non-empty"):
        finite([])
    with pytest.raises(AssertionError):
        assert_losses_close(good, [2.0, 1.5, 1.3], atol=0.05)  # a real difference
    with pytest.raises(AssertionError, match="steps"):
        assert_losses_close(good, good[:2], atol=1)


def test_loss_falls_rejects_a_flat_or_rising_series():
    assert_loss_falls([3.0, 2.5, 2.0], by=0.9)
    with pytest.raises(AssertionError, match="fell by 0"):
        assert_loss_falls([2.0, 2.0, 2.0], by=0.1)  # flat
    with pytest.raises(AssertionError, match="fell by"):
        assert_loss_falls([2.0, 2.1, 2.2], by=0.1)  # rising
    with pytest.raises(AssertionError, match="fell by"):
        assert_loss_falls([3.0, 2.5, 2.95], by=0.1)  # fell, then came back
    with pytest.raises(AssertionError, match="checks nothing"):
        assert_loss_falls([3.0, 2.0], by=0)


@pytest.mark.parametrize("form", ["-c", "-m"])
def test_timeout_kills_the_whole_process_group(tmp_path, form):
    """A run that outlives its timeout takes its children with it (ranks of a hung run must not linger),
    as a new interpreter (-c) and as a fork of the warm one (-m: tests/forkrun.py)."""
    pid_file = tmp_path / "child.pid"
    script = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    (tmp_path / "hang.py").write_text(script)
    cmd = [sys.executable, "-c", script] if form == "-c" else [sys.executable, "-m", "hang"]
    with pytest.raises(subprocess.TimeoutExpired):
        run(cmd, timeout=5, cwd=tmp_path)
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while (
        psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.time() < deadline
    ):
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, "grandchild survived"


def test_worker_scopes_name_files_that_exist():
    """make test's workers (conftest): the Slurm files share one scope; every other file is its own
    scope (a renamed Slurm file must not silently leave the shared scope)."""
    from tests.conftest import SLURM_FILES, SLURM_SCOPE, _scope

    for path in SLURM_FILES:
        assert (REPO / path).is_file(), path
    assert {_scope(f"{p}::test_x") for p in SLURM_FILES} == {SLURM_SCOPE}
    assert _scope("tests/test_spine.py::test_x[a::b]") == "tests/test_spine.py"


PROBE = """
import json, os, sys
report = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "path": sys.path[1:], "name": __name__,
          "main": sys.modules["__main__"].__file__, "env": sorted(os.environ.items()), "stdin": sys.stdin.read(),
          "group_leader": os.getpgid(0) == os.getpid(), "signals": [str(__import__("signal").getsignal(s)) for s in (2, 10, 13, 15, 17)],
          "test_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("tests", "pytest", "xdist", "deepspeed", "megatron")),
          "warm": "torch" in sys.modules}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_forked_run_behaves_as_a_new_interpreter(tmp_path, monkeypatch, how):
    """helpers.run starts `python -m` as a fork of a warm interpreter (tests/forkrun.py): the module sees the
    same argv, cwd, sys.path, environment, stdin, signal handlers and session as under a new interpreter
    (TRAINBENCH_TEST_FORK=0), no module of the test process, and gives the same exit code and output."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PROBE": "value", "PYTHONUNBUFFERED": "1"}
    args = ["3", "x y"] if how == "exit" else ["raise"]
    monkeypatch.setenv("TRAINBENCH_TEST_FORK", "1")  # this test is about the fork, even in a suite run without it
    forked = run([sys.executable, "-m", "probe", *args], timeout=60, env=env, cwd=tmp_path)
    monkeypatch.setenv("TRAINBENCH_TEST_FORK", "0")
    fresh = run([sys.executable, "-m", "probe", *args], timeout=60, env=env, cwd=tmp_path)
    seen = {name: json.loads(p.stdout.splitlines()[0]) for name, p in (("forked", forked), ("fresh", fresh))}
    assert seen["forked"].pop("warm") and not seen["fresh"].pop("warm")  # the fork did start warm
    assert seen["forked"] == seen["fresh"]
    assert seen["fresh"]["test_modules"] == [] and seen["fresh"]["group_leader"]
    assert forked.returncode == fresh.returncode == (3 if how == "exit" else 1)
    assert forked.stderr.startswith("to stderr\n") and fresh.stderr.startswith("to stderr\n")
    if how == "raise":
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: boom"
