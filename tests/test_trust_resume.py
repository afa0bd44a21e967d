"""Resume from a group's shared results folder, attacked by a group member: two uids, umask 002, real renames.

The victim's run is stopped with a checkpoint (trainer.inject_stop), then run again with trainer.resume=auto as a
requeued job does. When the victim says it resumes (its checkpoint checked, moved into the new record), the
attacker swaps in a checkpoint of their own whose DCP `.metadata` is a pickle that, once loaded, touches a marker
file as the victim. They rename the checked step folder away where they can (a record an earlier version left
group-writable), else the whole record folder (the experiment folder is the group's). The swap lands after the check and before the load every time: the victim
prints its line about a second before it loads. Before the fix the marker appeared; after it, one line refuses
the swapped-in folder and nothing of the attacker's runs. PTBENCH_RACE_REPEATS sets how many attacks (2 here).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ptbench.core import checkpoint as ckpt
from ptbench.core.checkpoint_load import pin, restricted_unpickling
from ptbench.core.errors import ConfigError
from tests.helpers import kill_group, run, summary
from tests.test_checkpoint import TINY as CHECKPOINT_RUN

TINY = [*CHECKPOINT_RUN, "trainer.resume=auto"]  # the checkpoint tests' tiny run, resumed as a requeued job
STEP = "step-000003"

# Run by the attacker when the victim has said it resumes: swap in the planted folder (see the docstring).
SWAP = textwrap.dedent(
    """
    import os, sys
    exp, planted, name = sys.argv[1:4]
    for rec in sorted(os.listdir(exp)):
        step = os.path.join(exp, rec, "checkpoints", name)
        if rec.startswith("."):
            continue
        try:
            os.rename(step, step + ".gone")
            os.rename(os.path.join(planted, "checkpoints", name), step)
            print("swapped the step folder of", rec)
        except PermissionError:
            os.rename(os.path.join(exp, rec), os.path.join(exp, "." + rec + ".gone"))
            os.rename(planted, os.path.join(exp, rec))
            print("swapped the record folder", rec)
        break
    """
)


class _Payload:
    """Unpickled, it runs a command as whoever loads it (what a planted checkpoint does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(tu, planted: Path, marker: Path) -> None:
    """The attacker's record folder with a checkpoint whose files verify against its own forged meta.json."""
    step = planted / "checkpoints" / STEP
    (step / "dcp").mkdir(parents=True)
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    meta = {
        "step": 3,
        "epoch": 0,
        "step_in_epoch": 3,
        "adapter": "ddp",
        "world_size": 2,
        "time": 1e10,
        "manifest": {},
        "bytes": 0,
        "files": 1,
    }
    (step / "meta.json").write_text(__import__("json").dumps(meta))
    for p in (planted, *planted.rglob("*")):
        os.chown(p, tu.ATTACKER, tu.ATTACKER)
        p.chmod(0o755 if p.is_dir() else 0o644)


def _resume_under_attack(tu, results: Path, planted: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The victim's second run; the attacker swaps when the victim says it resumes. (victim's run, swap's output)"""
    cmd = tu.victim(sys.executable, "-m", "ptbench", *TINY, f"results.root={results}")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=tu.env(OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    out, swapped = [], ""
    try:
        for line in proc.stdout:
            out.append(line)
            if "resuming from" in line and not swapped:
                swap = run(
                    tu.attacker(sys.executable, "-c", SWAP, str(results / "smoke"), str(planted), STEP),
                    60,
                    env=tu.env(),
                )
                swapped = swap.stdout + swap.stderr
        err = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), err), swapped


@pytest.mark.timeout(1200)
def test_a_group_member_swapping_the_checkpoint_after_the_check_runs_nothing(two_users):
    tu = two_users
    repeats = int(os.environ.get("PTBENCH_RACE_REPEATS", "2"))
    first = tu.shared(tu.base / "first")
    stopped = run(
        tu.victim(sys.executable, "-m", "ptbench", *TINY, "trainer.inject_stop=0:3", f"results.root={first}"),
        300,
        env=tu.env(),
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    (record,) = [p for p in (first / "smoke").iterdir() if not p.name.startswith(".")]
    assert summary(record)["status"] == "preempted"
    outcomes = []
    for i in range(repeats):
        results = tu.base / f"attack-{i}"
        subprocess.run(["cp", "-a", str(first), str(results)], check=True)  # the same stopped record each time
        marker = tu.base / "home" / f"ran-as-victim-{i}"
        planted = results / "smoke" / ".planted"
        _plant(tu, planted, marker)
        proc, swapped = _resume_under_attack(tu, results, planted)
        assert "swapped the record folder" in swapped, (swapped, proc.stdout[-4000:], proc.stderr[-3000:])
        assert not marker.exists(), f"attack {i}: the planted pickle ran as the victim ({swapped.strip()})"
        # the record folder the victim resumed in is the attacker's now: the checkpoint in it is refused where
        # it is opened (its owner), and nothing is written into it
        lines = [x for x in proc.stderr.splitlines() if x.strip() and "Warning" not in x and "warn(" not in x]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert "another user's folder (uid 61002)" in lines[0], lines
        said = lines[0]
        outcomes.append(f"{swapped.strip()} -> {said}")
        shutil.rmtree(results, ignore_errors=True)
    print("\n".join(outcomes))


def test_a_pinned_checkpoint_reads_what_was_checked_whatever_is_renamed_after(tmp_path):
    """The check cannot lose the race: once pinned, a rename of the checked folder and another folder in its
    place change nothing the loaders read, and that other folder, not ours, is refused when pinned."""
    ckpt_dir = tmp_path / "checkpoints"
    tmp = ckpt.temp_path(tmp_path, 3)
    ckpt.prepare(tmp)
    (tmp / "trainer-rank0.pt").write_bytes(b"ours")
    step = ckpt.commit(tmp, {"step": 3, "point": "p", "adapter": "ddp", "world_size": 1})
    expect = {"point": "p", "adapter": "ddp", "world_size": 1}
    with pin(step, verify=True, expect=expect) as pinned:
        os.rename(step, ckpt_dir / "gone")  # what a group member does after the check
        theirs = ckpt_dir / step.name
        theirs.mkdir()
        (theirs / "trainer-rank0.pt").write_bytes(b"theirs")
        (theirs / "meta.json").write_text((ckpt_dir / "gone" / "meta.json").read_text())
        os.chown(theirs, 61002, 61002)
        assert (pinned.path / "trainer-rank0.pt").read_bytes() == b"ours"
    assert Path.cwd() != ckpt_dir / "gone"  # the working directory is given back
    with pytest.raises(ConfigError, match=r"^not resuming from .*: owned by uid 61002, not you \(uid 0\)"):
        pin(theirs, verify=True, expect=expect)
    os.chown(theirs, 0, 0)  # ours, but its file is not what the manifest says
    with pytest.raises(ConfigError, match=r"trainer-rank0.pt has 6 bytes, the manifest says 4"):
        pin(theirs, verify=True, expect=expect)
    with pytest.raises(ConfigError, match=r"meta.json says point='p', this run is 'q'"):
        pin(ckpt_dir / "gone", verify=True, expect={**expect, "point": "q"})


def test_checkpoint_files_are_unpickled_through_an_allowlist_even_where_a_framework_asks_for_pickle(tmp_path):
    """DeepSpeed and Megatron call torch.load(weights_only=False); DCP reads .metadata with pickle.load. Inside
    restricted_unpickling neither runs a planted object: run as a real DCP load of a real checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, tmp_path / "planted.pt")
    with restricted_unpickling(), pytest.raises(pickle.UnpicklingError, match="posix.system"):
        torch.load(tmp_path / "planted.pt", weights_only=False)
    state = {"w": torch.arange(4.0)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    loaded = {"w": torch.zeros(4)}
    with restricted_unpickling():
        dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"))  # DCP's own metadata passes
    assert torch.equal(loaded["w"], state["w"])
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with restricted_unpickling(), pytest.raises(BaseException) as refused:
        dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"))
    assert "global posix.system is not checkpoint metadata" in str(refused.value) or any(
        "posix.system" in str(f) for f in getattr(refused.value, "failures", {}).values()
    ), refused.value
    assert not marker.exists()
    torch.load(tmp_path / "planted.pt", weights_only=False)  # outside, as a framework loads it: the payload is live
    assert marker.exists()


def test_a_resume_under_a_folder_everyone_may_write_is_refused_in_one_line(tmp_path):
    root = tmp_path / "results"
    record = root / "exp" / "run-1"
    record.mkdir(parents=True)
    (root / "exp").chmod(0o777)
    line = ckpt.open_to_everyone(record, [root])
    assert line == (
        f"not resuming from {record}: {root / 'exp'} (mode 0777) may be written by every user without the sticky "
        f"bit, so anyone can swap a record in it: chmod o-w {root / 'exp'} (or +t), or set trainer.resume=never"
    )
    (root / "exp").chmod(0o1777)  # sticky, as /tmp: no one renames what is not theirs
    assert ckpt.open_to_everyone(record, [root]) is None
    (root / "exp").chmod(0o2775)  # a group folder: a group member's swap is refused where it is loaded
    assert ckpt.open_to_everyone(record, [root]) is None


def test_a_pinned_checkpoint_with_a_cut_meta_json_is_refused_in_one_line(tmp_path):
    tmp = ckpt.temp_path(tmp_path, 1)
    ckpt.prepare(tmp)
    step = ckpt.commit(tmp, {"step": 1})
    (step / "meta.json").write_text('{"step": 1, "manif')
    with pytest.raises(ConfigError, match=r"^not resuming from .*: meta.json is not JSON \("):
        pin(step, verify=True)
