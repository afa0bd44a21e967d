"""`python -m <module> args` for the tests, started as a fork of a warm interpreter instead of a new one.

Why: a run of the harness spends about 5 s of CPU importing torch and torch._dynamo before it does
anything, and the suite starts about 150 of them on a 2-core machine. Here Python's own forkserver
(multiprocessing, start method "forkserver") keeps one clean server process per test worker that has
imported torch once; each run is a fork of that server which then becomes `python -m module args`
(runpy.run_module, as `-m` does) with the test's environment, working directory and output files.

The server is started from a fresh interpreter, not forked from the test worker: no test state, no
monkeypatch, no imported framework and no thread of pytest's is in it. It preloads only torch,
torch._dynamo, torch.distributed, Hydra/OmegaConf and numpy, the modules every run imports first; no
framework (DeepSpeed, Megatron, Horovod, torchgpipe) is preloaded, so a record's frameworks_imported is
what the run itself imported. A fresh interpreter is used instead when the run's environment sets
PYTHONPATH (the preloaded modules could not be shadowed) or when TRAINBENCH_TEST_FORK=0 is set.

What the fork sets up as a new interpreter would: its own session (a timeout kills the whole group),
SIGINT as a child of the test worker would have it, stdin from /dev/null, stdout/stderr to files
(unbuffered, as PYTHONUNBUFFERED=1), os.environ replaced by the run's environment, the working
directory, sys.path and sys.argv as `python -m` sets them. Its exit status is what `python -m` gives:
SystemExit's code, 1 with a traceback for an exception. tests/test_helpers.py compares the two ways.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "hydra", "omegaconf", "numpy"]


def enabled(env: dict) -> bool:
    """Whether a run with this environment may be a fork of the warm server."""
    return os.environ.get("TRAINBENCH_TEST_FORK", "1") != "0" and "PYTHONPATH" not in env


_context = None


def _ctx():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD + [__name__])
    return _context


_PATH: list[str] = []


def _fresh_sys_path() -> list[str]:
    """sys.path of a new interpreter without its first entry (`python -m` puts the working directory there)."""
    if not _PATH:
        code = "import json, sys; print(json.dumps(sys.path[1:]))"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        _PATH.extend(
            json.loads(
                subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
            )
        )
    return _PATH


def _become(
    module: str, args: list[str], env: dict, cwd: str, out: str, err: str, path: list[str], sigint_ignored: bool
) -> None:
    """In the forked child: turn into `python -m module args` and run it (never returns normally)."""
    os.setsid()
    # a new interpreter keeps SIGINT ignored if its parent ignored it, else raises KeyboardInterrupt on it; the
    # fork would have the forkserver's own setting (which depends on how the test session was started)
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]  # this module: imported to unpickle the call, not by the run
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        new = os.open(name, flags)
        os.dup2(new, fd)
        os.close(new)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [cwd, *path]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Run:
    """A started run: pid (it leads its own process group), wait(timeout) -> exit code, and its output."""

    def __init__(self, module: str, args: list[str], env: dict, cwd: Path):
        self._dir = tempfile.TemporaryDirectory(prefix="forkrun-")
        self.out, self.err = (Path(self._dir.name) / n for n in ("stdout", "stderr"))
        self.out.touch()
        self.err.touch()
        self._proc = _ctx().Process(
            target=_become,
            daemon=False,
            name=f"python -m {module}",
            args=(
                module,
                list(args),
                dict(env),
                str(cwd),
                str(self.out),
                str(self.err),
                _fresh_sys_path(),
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            ),
        )
        self._proc.start()
        self.pid = self._proc.pid

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL the run's process group and reap the run, if it is still running: the group, or the run
        alone when it is killed before its first line made the group (os.setsid in _become)."""
        if self.wait(0) is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def output(self) -> tuple[str, str]:
        text = [p.read_text(errors="backslashreplace") for p in (self.out, self.err)]
        return text[0], text[1]

    def close(self) -> None:
        self._dir.cleanup()
