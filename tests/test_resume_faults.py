"""Resume after damage: real runs, real checkpoint files damaged on disk.

A 2-rank DDP run saves every 2 steps and is stopped at step 6 (trainer.inject_stop, deterministic):
checkpoints step-4 and step-6. Damaging step-6 (a shard cut short, a meta.json cut short) makes the
next `trainer.resume=auto` run say which checkpoint it skipped and why, and continue from step 4; a
resumed attempt that fails keeps the earlier record's outcome; a record none of whose checkpoints
verifies is kept as it is and the new run says it starts from step 0, in a record of its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ptbench.core import checkpoint as ckpt
from ptbench.core.checkpoint_load import pin
from ptbench.core.errors import ConfigError
from tests.helpers import bench, check_ok, only_run, run, run_dirs, summary

TINY = [
    "experiment=smoke",
    "workload.vocab_size=256",
    "data.train_samples=64",
    "trainer.max_steps=0",  # 8 steps: 64 samples / (4 x 2 ranks)
    "trainer.stop_check_every=1",
    "trainer.progress=false",
    "trainer.resume=auto",
    "trainer.checkpoint_every=2",
    "results.point=resume-faults",  # one point whatever fault a run injects
]


def _stopped_at_6(root: Path) -> Path:
    first = bench(*TINY, "trainer.inject_stop=0:6", results=root)
    check_ok(first)
    run_dir = only_run(root)
    assert summary(run_dir)["status"] == "preempted"
    assert [p.name for _, p in ckpt.complete(run_dir)] == ["step-000004", "step-000006"]
    return run_dir


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning: ")]


def test_damaged_newest_checkpoint_is_skipped_and_a_failed_attempt_keeps_the_record(tmp_path):
    run_dir = _stopped_at_6(tmp_path)
    shard = run_dir / "checkpoints" / "step-000006" / "trainer-rank1.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # a save cut short by a full disk or a crash

    # a resumed attempt that fails after taking the record over: the record still names the earlier one
    failed = bench(*TINY, "trainer.inject_fault=raise@0:5", results=tmp_path)
    assert failed.returncode == 1, failed.stderr[-3000:]
    lines = [w for w in _warnings(failed.stderr) if "step-000006" in w]
    assert len(lines) == 1 and "trainer-rank1.pt has 100 bytes" in lines[0] and "next older" in lines[0], lines
    run_dir = only_run(tmp_path)
    s = summary(run_dir)
    assert s["status"] == "failed" and "injected fault" in s["error"], s
    assert s["previous_record"]["status"] == "preempted" and s["previous_record"]["steps"] == 6, s
    assert "step-000004" in [p.name for _, p in ckpt.complete(run_dir)]

    resumed = bench(*TINY, results=tmp_path)  # step-000006 is still damaged: step-4 again
    check_ok(resumed)
    s = summary(only_run(tmp_path))
    assert s["status"] == "ok" and s["steps"] == 8, s
    assert [(r["step"], r["previous_status"]) for r in s["resumed_from"]] == [(4, "failed")], s["resumed_from"]


def test_damaged_meta_and_no_verified_checkpoint_start_over_in_a_new_record(tmp_path):
    run_dir = _stopped_at_6(tmp_path)
    for _, p in ckpt.complete(run_dir):
        meta = p / "meta.json"
        meta.write_text(meta.read_text()[:40])  # once a bare JSONDecodeError, naming no file
    kept = (run_dir / "summary.json").read_text()

    again = bench(*TINY, results=tmp_path)
    check_ok(again)
    warnings = _warnings(again.stderr)
    assert any("step-000006" in w and "meta.json unreadable" in w for w in warnings), again.stderr[-3000:]
    assert any("no checkpoint that verifies" in w and "starts from step 0" in w for w in warnings), warnings
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2 and (run_dir / "summary.json").read_text() == kept  # the earlier record untouched
    new = summary(next(d for d in dirs if d != run_dir))
    assert new["status"] == "ok" and new["steps"] == 8 and "resumed_from" not in new, new


def test_manifest_checks_sizes_and_checksums(tmp_path):
    tmp = ckpt.temp_path(tmp_path, 3)
    ckpt.prepare(tmp)
    (tmp / "state.pt").write_bytes(b"x" * 10)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "shard").write_bytes(b"y" * 5)
    final = ckpt.commit(tmp, {"step": 3, "time": 1.0})
    meta = json.loads((final / "meta.json").read_text())
    assert meta["bytes"] == 15 and set(meta["manifest"]) == {"state.pt", "sub/shard"}
    assert ckpt.damage(final) is None
    (final / "sub" / "shard").write_bytes(b"z" * 5)  # same size, other bytes
    assert ckpt.damage(final) == "sub/shard does not match its checksum"
    # a resume chooses by sizes and hashes once, where it loads: through the descriptor the loaders read
    assert ckpt.newest_verified(tmp_path) == final
    pin(final, verify=False).close()  # the ranks that do not verify compare meta.json's digest instead
    with pytest.raises(
        ConfigError, match=r"sub/shard does not match its checksum \(changed since it was saved\); remove"
    ):
        pin(final, verify=True)
    (final / "sub" / "shard").unlink()
    assert ckpt.damage(final) == "sub/shard is missing"
    said = []
    assert ckpt.newest_verified(tmp_path, said.append) is None and "step-000003" in said[0]


def test_choosing_a_checkpoint_and_loading_it_refuse_a_writable_one_in_the_same_line(tmp_path):
    """The owner and mode checks are the pin's, run once by rank 0 before it takes a record over and again
    through the descriptor that is loaded: the same line either way."""
    tmp = ckpt.temp_path(tmp_path, 2)
    ckpt.prepare(tmp)
    (tmp / "dcp").mkdir()
    (tmp / "dcp" / ".metadata").write_bytes(b"x")
    final = ckpt.commit(tmp, {"step": 2, "time": 1.0})
    assert ckpt.unsafe_to_resume(final) is None
    (final / "dcp").chmod(0o775)  # a group's shared space under umask 002
    line = ckpt.unsafe_to_resume(final)
    assert line == (
        f"not resuming from {final / 'dcp'}: mode 0775, writable by others (loading a checkpoint can run code): "
        f"chmod -R go-w {final} if you trust it, or set trainer.resume=never"
    )
    with pytest.raises(ConfigError) as refused:
        pin(final, verify=True)
    assert str(refused.value) == line


def test_a_failed_torchrun_attempt_keeps_the_earlier_record(tmp_path):
    """torchrun ranks continue in the unfinished record itself (no launcher of ours made a new one): an
    attempt that fails there still names the earlier outcome in `previous_record`."""
    run_dir = _stopped_at_6(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ptbench"]
    failed = run(
        [*cmd, "launcher=torchrun", *TINY, "trainer.inject_fault=raise@0:7", f"results.root={tmp_path}"],
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    assert failed.returncode != 0, failed.stderr[-3000:]
    assert only_run(tmp_path) == run_dir
    s = summary(run_dir)
    assert s["status"] == "failed" and "injected fault" in s["error"], s
    assert s["previous_record"] == {
        "run_id": run_dir.name,
        "status": "preempted",
        "error": None,
        "steps": 6,
        "epochs_completed": 1,
    }, s
