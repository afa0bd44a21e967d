"""The storage under a run's traces and its token cache refuses a write: a real full tmpfs, a real read-only
(bind) mount, and a real EACCES from a rank that runs as an unprivileged user (root ignores permission bits, so
chmod alone cannot refuse it). Each ends in one line on the console naming the path and the fix, with the
traceback in the rank's error file and a final record.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import SMOKE, bench, kill_group, only_run, run, run_dirs, start, summary
from tests.test_faults_records import fill, small_fs  # noqa: F401 - a fixture (a real 2 MiB tmpfs)

TRACE_FIX = "or choose another results.root=PATH, or drop trainer.profile"


def _one_line(err: str) -> str:
    """The run's one line: no traceback on the console."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("run failed")]
    assert len(lines) == 1, err[-3000:]
    print(lines[0])  # what a user sees (pytest -s)
    return lines[0]


def _full_disk_line(proc, path: str, fix: str) -> None:
    """The run failed (exit 1) in one line: it cannot write a file matching the pattern `path` for want of space,
    and says to free space there, or the pattern `fix`."""
    line = _one_line(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(rf"cannot write {path} \(No space left on device\): free space there, {fix}$", line), line


def _traceback_in_error_files(run_dir: Path) -> None:
    files = list(run_dir.glob("error-rank*.json"))
    assert files and any("Traceback" in f.read_text() for f in files), files


# --- traces (trainer.profile) ---------------------------------------------------------------------
def test_traces_on_a_full_disk_are_one_line_naming_the_file(small_fs):
    """512 KiB left on the tmpfs: the record fits, a rank's trace (about 0.8 MiB) does not. torch's export says
    nothing when its write fails (it leaves RANK.json.tmp and no RANK.json): the run says it, and removes it."""
    fill(small_fs)
    filler = small_fs / "filler"
    os.truncate(filler, filler.stat().st_size - (512 << 10))
    proc = bench(*SMOKE, "trainer.profile=1:1", results=small_fs, timeout=300)
    run_dir = only_run(small_fs)
    _full_disk_line(proc, rf"{re.escape(str(run_dir))}/traces/(rank\d|merged)\.json", re.escape(TRACE_FIX))
    s = summary(run_dir)
    assert s["status"] == "failed" and f"{run_dir}/traces/" in s["error"], s
    # Both ranks export at once onto the same full disk: each keeps a space reserve of its own for its error
    # file (one shared reserve let the other rank's export take that room back before the file was written)
    files = list(run_dir.glob("error-rank*.json"))
    assert files and all("Traceback" in f.read_text() for f in files), files
    assert not list(run_dir.glob(".space-reserve*")), list(run_dir.iterdir())
    assert not list((run_dir / "traces").glob("*.tmp")), list((run_dir / "traces").iterdir())


def test_traces_into_a_read_only_folder_are_one_line_naming_the_file(tmp_path):
    """RUN_DIR/traces becomes a read-only bind mount once the run has its record, before the profiled step."""
    cmd = [sys.executable, "-m", "ptbench", *SMOKE, "trainer.profile=30:1", "trainer.max_steps=40"]
    proc = start([*cmd, "data.train_samples=4096", f"results.root={tmp_path}"])
    traces = None
    try:
        deadline = time.time() + 240
        while not run_dirs(tmp_path):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        traces = run_dirs(tmp_path)[0] / "traces"
        traces.mkdir()
        made = subprocess.run(["mount", "--bind", str(traces), str(traces)], capture_output=True, text=True)
        if made.returncode:
            pytest.skip(f"cannot bind-mount here ({made.stderr.strip()}): needs root")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(traces)], check=True)
        _, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
        proc.wait()
        if traces is not None:
            subprocess.run(["umount", "-l", str(traces)], check=False, capture_output=True)
    line = _one_line(err)
    run_dir = only_run(tmp_path)
    assert proc.returncode == 1, err[-3000:]
    assert re.search(
        rf"cannot write {re.escape(str(traces))}/rank\d\.json \(Read-only file system\): it is on a read-only file "
        rf"system, {re.escape(TRACE_FIX)}$",
        line,
    ), line
    assert summary(run_dir)["status"] == "failed"
    _traceback_in_error_files(run_dir)


# --- the token cache (data=wikitext2) -----------------------------------------------------------------
def _wikitext_run(data_root: Path, folder: Path, cache: Path) -> list[str]:
    """A small wikitext-2 run (its own 60 KB of text, so its cache is new) caching its tokens in `cache`."""
    wt = folder / "wt"
    wt.mkdir(parents=True)
    raw = (data_root / "wikitext-2" / "valid.txt").read_bytes()
    (wt / "train.txt").write_bytes(raw[:60_000])
    (wt / "valid.txt").write_bytes(raw[:20_000])
    tokenizer = folder / "tokenizer"
    shutil.copytree(data_root / "gpt2-tokenizer", tokenizer)
    return [
        *SMOKE,
        "data=wikitext2",
        f"data.root={wt}",
        f"data.tokenizer_dir={tokenizer}",
        f"data.cache_dir={cache}",
        "workload.vocab_size=50257",
        "launcher.nprocs=1",
        "trainer.max_steps=2",
    ]


def test_a_token_cache_on_a_full_disk_is_one_line_naming_the_file(data_root, small_fs, tmp_path):
    cache = small_fs / "cache"
    cache.mkdir()
    fill(small_fs)  # an empty probe file still fits (an inode, no block): the cache's bytes do not
    proc = bench(*_wikitext_run(data_root, tmp_path, cache), results=tmp_path / "r", timeout=300)
    fix = r"or set data\.cache_dir=<a folder with \d+ KiB free> \(the token cache\)"
    _full_disk_line(proc, rf"{re.escape(str(cache))}/wt\.train\.txt\.\S+\.u16", fix)
    run_dir = only_run(tmp_path / "r")
    assert summary(run_dir)["status"] == "failed"
    _traceback_in_error_files(run_dir)
    assert not [p for p in cache.iterdir() if p.name != "filler"], list(cache.iterdir())  # no partial file


def test_a_token_cache_on_a_read_only_file_system_is_one_line(data_root, small_fs, tmp_path):
    cache = small_fs / "cache"
    cache.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    proc = bench(*_wikitext_run(data_root, tmp_path, cache), results=tmp_path / "r", timeout=300)
    line = _one_line(proc.stderr)
    assert proc.returncode == 1 and line == (
        f"run failed: rank 0: ConfigError: data.cache_dir: no file can be made in {cache} (Read-only file system); "
        "set data.cache_dir=<a writable folder>"
    ), line
    run_dir = only_run(tmp_path / "r")
    assert summary(run_dir)["status"] == "failed"
    _traceback_in_error_files(run_dir)


# --- EACCES: the rank runs as an unprivileged user -----------------------------------------------------
@pytest.fixture
def unprivileged():
    """A folder everyone can enter (pytest's own are root's, mode 700) and the command prefix that runs as
    nobody; skipped where setpriv or that user is missing, or this is not root."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a rank as another user")
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    base = Path(tempfile.mkdtemp(prefix="ptbench-eacces-", dir="/tmp"))
    base.chmod(0o755)
    try:
        prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        yield base, prefix
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_eacces_on_the_token_cache_and_the_results_is_one_line(data_root, unprivileged):
    base, prefix = unprivileged
    results, cache, locked = base / "results", base / "cache", base / "locked"
    for d in (results, cache, locked):
        d.mkdir()
    results.chmod(0o777)  # the user's own results; the cache folder and `locked` stay root's, mode 755
    overrides = _wikitext_run(data_root, base / "data", cache)
    for p in (base / "data", *(base / "data").rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    env = {**os.environ, "HOME": str(results), "XDG_CACHE_HOME": str(results / ".cache"), "PYTHONUNBUFFERED": "1"}
    cmd = [*prefix, sys.executable, "-m", "ptbench", *overrides]
    proc = run([*cmd, f"results.root={results}"], timeout=300, env=env)
    line = _one_line(proc.stderr)
    assert proc.returncode == 1 and line == (
        f"run failed: rank 0: ConfigError: data.cache_dir: no file can be made in {cache} (Permission denied); "
        "set data.cache_dir=<a writable folder>"
    ), line
    run_dir = only_run(results)
    assert summary(run_dir)["status"] == "failed"
    _traceback_in_error_files(run_dir)

    proc = run([*cmd, f"results.root={locked}"], timeout=300, env=env)  # the record itself: before any rank
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    print(lines)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0] == (
        f"error: results.root={locked} is not writable ({locked}: Permission denied); set results.root=<a writable "
        "folder>"
    ), lines
    assert not list(locked.iterdir())
