"""A results root another user can write into: their records never stop our run, our writes never follow their
links, and a record reads `ok` only once it holds everything.

The attacks are real: a second uid in our group (tests/conftest.py `two_users`) plants records, folders, FIFOs and
symbolic links in a shared results root (mode 2775) and renames entries of our group-writable folders while our run
goes on; the victim runs `python -m ptbench` as its own uid under umask 002.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptbench.core import records
from tests.helpers import REPO, SMOKE, kill_group, run, start


def victim_cmd(users, root: Path, *overrides: str) -> list[str]:
    """`python -m ptbench` smoke run as the victim (its uid, our group, umask 002) into results.root=root."""
    return users.victim(sys.executable, "-m", "ptbench", *SMOKE, *overrides, f"results.root={root}")


def victim_run(users, root: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run(victim_cmd(users, root, *overrides), timeout, users.env())


def attacker(users, script: str, **env: str) -> None:
    """A shell script run as the attacker (another uid in our group), with `env` added to its environment."""
    subprocess.run(users.attacker("sh", "-c", script), check=True, env=users.env(**env), timeout=120)


def warnings_naming(stderr: str, path: Path) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning: ") and str(path) in ln]


DEEP = 3000  # folders: Path.rglob and os.walk recurse once per level (RecursionError near 1000)
MAKE_DEEP = (
    "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    os.mkdir('a', dir_fd=fd); fd, old = os.open('a', os.O_RDONLY, dir_fd=fd), fd; os.close(old)\n"
)


def remove_deep(top: Path) -> None:
    """Remove a chain of folders called `a` below `top`, deeper than a path can name (rmtree recurses), by fds."""
    fd, depth = os.open(top, os.O_RDONLY), 0
    while True:
        try:
            fd, old = os.open("a", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd), fd
        except FileNotFoundError:
            break
        os.close(old)
        depth += 1
    for _ in range(depth):
        fd, old = os.open("..", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
        os.rmdir("a", dir_fd=fd)
    os.close(fd)


def own_records(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("smoke/2*/summary.json"))


# --- 1. one hostile record stops no one ---------------------------------------------------------------
def test_a_deeply_nested_record_planted_in_a_shared_root_stops_no_run(two_users):
    """The attacker's summary.json nests 100000 levels (a RecursionError for json.loads): the victim's run still
    ends ok, with one warning line naming it; and the record folder it made is its own (the attacker cannot plant
    a file in it, though the results root is the group's)."""
    root = two_users.shared(two_users.base / "results")
    evil = root / "smoke" / "evil"
    attacker(
        two_users,
        f'mkdir -p {evil} && python3 -c \'print("[" * 100000 + "]" * 100000)\' > {evil}/summary.json',
    )
    t0 = time.monotonic()
    proc = victim_run(two_users, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (mine,) = own_records(root)
    assert json.loads((mine / "summary.json").read_text())["status"] == "ok"
    named = warnings_naming(proc.stderr, evil / "summary.json")
    assert len(named) == 1 and "nest" in named[0], proc.stderr[-3000:]
    assert stat.S_IMODE(mine.stat().st_mode) & 0o022 == 0, oct(mine.stat().st_mode)
    with pytest.raises(subprocess.CalledProcessError):
        attacker(two_users, f"touch {mine}/planted 2>/dev/null")
    print(f"victim run with a planted nested record: {time.monotonic() - t0:.1f}s")


def test_records_of_every_hostile_shape_are_skipped_and_named(two_users):
    """A FIFO called summary.json (an open that never returns), an 8 GiB sparse one, a symbolic link to /dev/zero,
    a JSON list, and a folder tree 3000 levels deep (a RecursionError for Path.rglob): the victim's run ends ok and
    names each in one line. A `running` record naming this host with a pid that is not a number (a ValueError) or
    the pid of a process that is not its writer's (pid 1) is no run of this harness: passed over, and it does not
    mark the victim's run contended."""
    root = two_users.shared(two_users.base / "results")
    exp = root / "smoke"
    host = socket.gethostname()
    attacker(
        two_users,
        f"mkdir -p {exp}/fifo {exp}/sparse {exp}/link {exp}/list {exp}/owner {exp}/deep && "
        f"mkfifo {exp}/fifo/summary.json && truncate -s 8G {exp}/sparse/summary.json && "
        f"ln -s /dev/zero {exp}/link/summary.json && echo '[1, 2]' > {exp}/list/summary.json && "
        f"""echo '{{"status": "running", "owner": {{"host": "{host}", "pid": "x"}}}}' > {exp}/owner/summary.json && """
        f"""mkdir {exp}/init && echo '{{"status": "running", "owner": {{"host": "{host}", "pid": 1}}}}' """
        f"> {exp}/init/summary.json && "
        f'python3 -c "$MAKE_DEEP" {exp}/deep {DEEP}',
        MAKE_DEEP=MAKE_DEEP,
    )
    try:
        proc = victim_run(two_users, root, timeout=180)
    finally:
        remove_deep(exp / "deep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (mine,) = own_records(root)
    assert json.loads((mine / "summary.json").read_text())["status"] == "ok"
    for name in ("fifo", "sparse", "link", "list"):
        assert len(warnings_naming(proc.stderr, exp / name / "summary.json")) == 1, (name, proc.stderr[-3000:])
    assert "other run(s) of this harness" not in proc.stderr, proc.stderr[-3000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ") and f"{exp}/deep/a/a/" in ln]


def test_an_ok_record_planted_for_our_point_does_not_skip_our_run(two_users):
    """Point ids are a hash of the config: anyone can compute ours and plant an `ok` record of it. With
    results.skip_done=true the victim's run must still run: only the victim's own records say a point is done."""
    from ptbench.runner.points import compose_point

    root = two_users.shared(two_users.base / "results")
    point = compose_point([*SMOKE, f"results.root={root}"]).results.point
    fake = root / "smoke" / "fake"
    attacker(two_users, f"""mkdir -p {fake} && echo '{{"status": "ok", "point": "{point}"}}' > {fake}/summary.json""")
    proc = victim_run(two_users, root, "results.skip_done=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped (results.skip_done=true)" not in proc.stdout, proc.stdout[-2000:]
    (mine,) = own_records(root)
    assert json.loads((mine / "summary.json").read_text())["status"] == "ok"


def test_a_reader_outside_the_run_skips_and_names_a_hostile_record(tmp_path, capsys):
    """The predictor's and the multirun tally's readers: a nested record and a 3000-deep tree are named and
    skipped, the good record still counts."""
    from ptbench.predict.points import load_points
    from ptbench.runner.points import tally

    good = tmp_path / "sweep" / "good"
    good.mkdir(parents=True)
    (good / "summary.json").write_text(json.dumps({"status": "ok"}))
    bad = tmp_path / "sweep" / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text('{"a": ' * 50000 + "1" + "}" * 50000)
    (tmp_path / "sweep" / "typed").mkdir()
    fields = {"status": "ok", "step_time_mean_s": 1.0, "world_size": "x", "comm_volume": {"collectives": []}}
    (tmp_path / "sweep" / "typed" / "summary.json").write_text(json.dumps(fields))
    subprocess.run([sys.executable, "-c", MAKE_DEEP, str(tmp_path), str(DEEP)], check=True)
    try:
        assert load_points(tmp_path) == []
        assert tally(tmp_path / "sweep").startswith("2 record(s) in ")
    finally:
        remove_deep(tmp_path)
    err = capsys.readouterr().err
    assert f"warning: skipped {bad / 'summary.json'}: nested deeper than" in err, err
    assert f"warning: skipped {tmp_path / 'sweep' / 'typed'}: ValueError" in err, err


# --- 2. writes never follow a link we did not make ------------------------------------------------------
def test_a_record_folder_premade_by_another_user_is_refused(two_users):
    """The attacker makes the folder of a run id the victim will use (results.run_id), writable by both: the
    victim's record would go into a folder the attacker controls. Refused in one line; nothing written there."""
    root = two_users.shared(two_users.base / "results")
    premade = root / "smoke" / "nightly"
    attacker(two_users, f"mkdir -p {premade} && chmod 2777 {premade}")
    proc = victim_run(two_users, root, "results.run_id=nightly")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert str(premade) in line and "another user" in line and "results.run_id" in line, line
    assert list(premade.iterdir()) == []


def test_a_record_folder_that_is_a_link_is_refused(two_users):
    """The run id's entry is the attacker's symbolic link to a folder of the victim's own: the victim's record
    would overwrite that folder's env.json. Refused in one line; the folder is untouched."""
    root = two_users.shared(two_users.base / "results")
    other = two_users.shared(two_users.base / "victim-project")
    (other / "env.json").write_text("mine\n")
    link = root / "smoke" / "nightly"
    attacker(two_users, f"mkdir -p {root}/smoke && ln -s {other} {link}")
    proc = victim_run(two_users, root, "results.run_id=nightly")
    assert sorted(p.name for p in other.iterdir()) == ["env.json"], proc.stderr[-2000:]
    assert (other / "env.json").read_text() == "mine\n"
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert str(link) in line and "symbolic link" in line, line


def test_a_record_folder_swapped_for_a_link_mid_run_gets_no_write(two_users):
    """While the victim's run trains, the attacker renames its record folder away (the experiment folder is the
    group's) and puts a symbolic link to another folder of the victim's in its place: no write of the run follows
    it (each goes through the folder it checked as its own, or is refused in one line)."""
    root = two_users.shared(two_users.base / "results")
    other = two_users.shared(two_users.base / "victim-project")
    (other / "config.yaml").write_text("mine: 1\n")
    env = two_users.env()
    proc = subprocess.Popen(
        victim_cmd(two_users, root, "trainer.max_steps=40"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not own_records(root) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        (mine,) = own_records(root)
        attacker(two_users, f"mv {mine} {root}/smoke/moved && ln -s {other} {mine}")
        out, err = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert sorted(p.name for p in other.iterdir()) == ["config.yaml"], (sorted(os.listdir(other)), err[-2000:])
    assert (other / "config.yaml").read_text() == "mine: 1\n"
    if proc.returncode:  # refused: one line naming the link
        assert str(mine) in err.strip().splitlines()[-1] and "symbolic link" in err, err[-2000:]


def test_record_writes_replace_a_planted_link_and_never_follow_one(tmp_path):
    """Inside a record folder: a symbolic link where a rank's reserve, events.jsonl or summary.json goes is refused
    or replaced, never written through."""
    target = tmp_path / "target"
    target.write_text("untouched\n")
    writer = records.RunWriter(tmp_path / "exp" / "run", {"point": "p"})
    writer.start("a: 1\n")
    os.symlink(target, writer.dir / ".space-reserve.rank1")
    writer.record.reserve(1)
    assert target.read_text() == "untouched\n"
    os.symlink(target, writer.dir / "events.jsonl")
    with pytest.raises(ValueError, match="symbolic link"):
        writer.record.append_event({"type": "epoch", "epoch": 0})
    os.unlink(writer.dir / "events.jsonl")
    os.unlink(writer.dir / "summary.json")
    os.symlink(target, writer.dir / "summary.json")
    writer.record.write_summary({"status": "failed", "error": "x", **writer.identity})
    assert target.read_text() == "untouched\n" and not (writer.dir / "summary.json").is_symlink()


# --- 3. a record reads ok only once it holds everything ----------------------------------------------------------
STATUS_ROW = re.compile(r"^\s+status\s+\S+")


def test_a_run_stopped_once_its_ranks_are_done_never_keeps_ok_without_its_contention(tmp_path):
    """Rank 0 prints its summary table right after its final word; the launcher adds the contention it sampled once
    the ranks have ended. SIGKILL the launcher as soon as the table shows: the record must not read ok without
    `contention_sampled` (a reader would count it uncontended); left `running`, the next run marks it killed."""
    root = tmp_path / "r"
    proc = start([sys.executable, "-m", "ptbench", *SMOKE, f"results.root={root}"])
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if STATUS_ROW.match(line) or time.monotonic() > deadline:
                break
        at_table = json.loads((own_records(root)[0] / "summary.json").read_text())
    finally:
        kill_group(proc)
        proc.wait()
    assert not (at_table["status"] == "ok" and "contention_sampled" not in at_table), at_table["status"]
    (mine,) = own_records(root)
    records.mark_killed([root / "smoke"], at_table["point"], say=sys.stderr)
    final = json.loads((mine / "summary.json").read_text())
    assert final["status"] != "ok" or "contention_sampled" in final, final
    assert final["status"] in ("killed", "ok"), final["status"]
