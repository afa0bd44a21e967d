"""The report on a shared cluster: what a second user of the group (another uid, umask 002, a shared results folder)
can do to `python -m ptbench.analysis report` and what it does instead.

- A `report/` folder they made, or links they put in ours: nothing of the victim's is written through them; a
  folder of theirs is refused in one line (two real uids, real links).
- Text in a record is data: HTML, JavaScript and markdown links land in report.md as text; a CSV cell a spreadsheet
  would evaluate is quoted.
- A bad record is one bad record: an 8 GiB sparse events.jsonl, a deeply nested summary.json, a FIFO, an over-long
  line, fields of the wrong type: each named in one line, the report made for the rest.
"""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from test_analysis import _two_epochs, write_run

from ptbench.analysis.__main__ import main as analysis_main
from ptbench.analysis.report import write_report
from tests.helpers import REPO

REFUSED = "choose another output folder (--out DIR) or remove it"


def _records(root: Path) -> Path:
    """Two finished runs and one that failed, as the runner writes them."""
    write_run(root, "ddp1", "ddp", 1, epochs=_two_epochs(2.0, 6, 8, 1))
    write_run(root, "ddp2", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    write_run(root, "broken", "ddp", 1, status="failed", error="rank 0 failed")
    return root


# --- two users ----------------------------------------------------------------------------------------
def _warm(tmp_path: Path) -> None:
    """One report as root first: the victim's fork below cannot import what it has not (the interpreter's
    own library is under /root, closed to other uids)."""
    assert analysis_main(["report", str(_records(tmp_path / "warm")), "--out", str(tmp_path / "warm-out")]) == 0


def _as_victim(users, *argv: str) -> tuple[int, str]:
    """`python -m ptbench.analysis *argv` as the victim (uid, group, umask 002), in a fork of this warm
    interpreter: (exit status, its output)."""
    out, env = users.base / "victim.out", users.env()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
            os.setgroups([users.GROUP])
            os.setresgid(users.GROUP, users.GROUP, users.GROUP)
            os.setresuid(users.VICTIM, users.VICTIM, users.VICTIM)
            os.umask(0o002)
            os.environ.update(env)
            code = analysis_main(list(argv))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text()


def _setup(users, tmp_path: Path) -> tuple[Path, Path]:
    """(the victim's records in a group folder, a folder of the victim's own outside it: notes, a figure, a report)."""
    _warm(tmp_path)
    shared = users.shared(users.base / "shared")
    exp = _records(shared / "exp")
    subprocess.run(["chown", "-R", f"{users.VICTIM}:{users.GROUP}", str(exp)], check=True)
    subprocess.run(["chmod", "-R", "g+w", str(exp)], check=True)  # as the victim's runs make them, umask 002
    mine = users.base / "victim"
    mine.mkdir(mode=0o700)
    (mine / "notes.txt").write_text("the victim's own notes\n")
    (mine / "speedup.png").write_bytes(b"the victim's own figure")
    (mine / "report.md").write_text("the victim's own report\n")
    for p in (mine, *mine.iterdir()):
        os.chown(p, users.VICTIM, users.VICTIM)
    return exp, mine


def _attacker(users, script: str) -> None:
    subprocess.run(users.attacker("sh", "-c", script), check=True, env=users.env())


def _group_writable_folder(path: Path, users) -> None:
    """The victim's folder as a run or report under umask 002 makes it in a group folder."""
    path.mkdir()
    os.chown(path, users.VICTIM, users.GROUP)
    path.chmod(0o2775)


def _untouched(mine: Path) -> None:
    assert (mine / "notes.txt").read_text() == "the victim's own notes\n"
    assert (mine / "speedup.png").read_bytes() == b"the victim's own figure"
    assert (mine / "report.md").read_text() == "the victim's own report\n"
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "report.md", "speedup.png"]


@pytest.mark.parametrize("made", ["their folder", "their link to ours"])
def test_a_report_folder_another_user_made_is_refused_in_one_line(two_users, tmp_path, made):
    exp, mine = _setup(two_users, tmp_path)
    report = exp / "report"
    if made == "their folder":  # with links in it to the victim's own files
        links = " ".join(f"&& ln -s {mine}/notes.txt {report}/{n}" for n in ("report.md", "runs.csv", "epochs.csv"))
        _attacker(two_users, f"mkdir -m 2777 {report} {links} && ln -s {mine} {report}/figures")
        why = f"belongs to uid {two_users.ATTACKER}, not you (uid {two_users.VICTIM}): someone else made it"
    else:  # the report would land in the victim's own folder, over its report.md
        _attacker(two_users, f"ln -s {mine} {report}")
        why = f"is a symbolic link made by uid {two_users.ATTACKER}, not you"
    code, said = _as_victim(two_users, "report", str(exp))
    _untouched(mine)  # first: before the fix, the victim's own files were written through the links
    assert code == 2, said
    assert said.strip() == f"error: output folder {report} {why}: {REFUSED}"


def test_links_put_in_our_own_report_folder_are_replaced_never_written_through(two_users, tmp_path):
    exp, mine = _setup(two_users, tmp_path)
    report = exp / "report"  # made by an earlier report: the group may add entries to it
    _group_writable_folder(report, two_users)
    names = ("report.md", "report-details.md", "runs.csv", "epochs.csv", "summary.csv")
    _attacker(two_users, " && ".join(f"ln -s {mine}/notes.txt {report}/{name}" for name in names))
    code, said = _as_victim(two_users, "report", str(exp))
    _untouched(mine)  # first: before the fix, the victim's own files were written through the links
    assert code == 0, said
    assert said.strip().splitlines()[-1] == f"report: {report}/report.md"
    for name in names:  # each link replaced by the victim's own file
        st = (report / name).lstat()
        assert not (report / name).is_symlink() and st.st_uid == two_users.VICTIM, name
    assert (report / "report.md").read_text().startswith(f"# Benchmark report: {exp}")


def test_a_figures_link_in_our_report_folder_is_refused_in_one_line(two_users, tmp_path):
    exp, mine = _setup(two_users, tmp_path)
    report = exp / "report"
    _group_writable_folder(report, two_users)
    _attacker(two_users, f"ln -s {mine} {report}/figures")
    code, said = _as_victim(two_users, "report", str(exp))
    _untouched(mine)  # first: before the fix, the victim's own files were written through the links
    assert code == 2, said
    assert said.strip() == (
        f"error: output folder {report}/figures is a symbolic link made by uid {two_users.ATTACKER}, not you: {REFUSED}"
    )


# --- record text is data ------------------------------------------------------------------------------
SCRIPT = "<script>alert(document.cookie)</script>"
LINK = "[click here](http://evil.example/login)"
IMAGE = "![](http://evil.example/pixel.png)"
FORMULA = '=HYPERLINK("http://evil.example","open")'


def test_text_from_records_is_escaped_in_the_report_and_quoted_in_the_csv(tmp_path):
    root = _records(tmp_path / "r")
    write_run(root, "evil-error", "ddp", 2, status="failed", error=f"{SCRIPT} {LINK} {IMAGE} `x` | y")
    write_run(root, "[run](http://evil.example)", "ddp", 1, status="failed", error=FORMULA)
    d = write_run(root, "labelled", "ddp", 2, epochs=_two_epochs(1.3, 6, 16, 2))
    s = json.loads((d / "summary.json").read_text())
    # a `$` pair is maths to GitHub's markdown and to matplotlib, whose parser stopped the whole report on it
    (d / "summary.json").write_text(json.dumps({**s, "label": f"<img src=x onerror=alert(1)> {LINK} $\\frac{{a $"}))
    events = [{**e, "val_loss": -1.5} for e in _two_epochs(1.3, 6, 16, 2)]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    write_report(root, tmp_path / "out")
    for name in ("report.md", "report-details.md"):
        text = (tmp_path / "out" / name).read_text()
        for raw in ("<script", "<img", "](http://evil", "![](http", "`x`"):
            assert raw not in text, (name, raw)
    text = (tmp_path / "out" / "report.md").read_text()
    assert (
        "&#60;script&#62;alert(document.cookie)&#60;/script&#62; &#91;click here&#93;(http://evil.example/login)"
        in text
    )
    label = (
        "&#60;img src=x onerror=alert(1)&#62; &#91;click here&#93;(http://evil.example/login) &#36;&#92;frac{a &#36;"
    )
    assert f"`{label} gb=8/replica`" in text  # the label, in the answers and tables
    assert "_not drawn" not in text  # every figure drawn, the label in its legends
    with open(tmp_path / "out" / "runs.csv", newline="") as f:
        rows = {r["run_id"]: r for r in csv.DictReader(f)}
    assert rows["[run](http://evil.example)"]["error"] == "'" + FORMULA  # a spreadsheet shows it as text
    with open(tmp_path / "out" / "epochs.csv", newline="") as f:
        losses = [r["val_loss"] for r in csv.DictReader(f) if r["run_id"] == "labelled"]
    assert losses == ["-1.5", "-1.5"]  # numbers stay numbers


# --- a bad record is one bad record -------------------------------------------------------------------
def _limit_memory():
    # what a login node gives one user: an 8 GiB read ends in MemoryError, not in swapping this machine
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def test_each_bad_record_is_named_in_one_line_and_the_report_is_made_for_the_rest(tmp_path):
    root = _records(tmp_path / "r")
    sparse = write_run(root, "sparse", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    subprocess.run(["truncate", "-s", "8G", str(sparse / "events.jsonl")], check=True)  # 0 bytes on disk
    deep = write_run(root, "deep", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    (deep / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    deep_line = write_run(root, "deep-line", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    with open(deep_line / "events.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    long_line = write_run(root, "long-line", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    with open(long_line / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "note", "text": "x" * (65 << 20)}) + "\n")
    fifo = write_run(root, "fifo", "ddp", 2)
    (fifo / "summary.json").unlink()
    os.mkfifo(fifo / "summary.json")  # no writer: a plain open waits forever
    typed = write_run(root, "typed", "ddp", 2, epochs=_two_epochs(1.2, 6, 16, 2))
    wrong = {"status": {"ok": 1}, "run_id": "typed", "error": 7, "warnings": "contention", "layout": [1]}
    (typed / "summary.json").write_text(json.dumps(wrong))
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_memory,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: skipped")]
    assert said == [
        f"warning: skipped {deep}/summary.json: nested deeper than 64 levels",
        f"warning: skipped {deep_line}/events.jsonl:3: nested deeper than 64 levels",
        f"warning: skipped {fifo}/summary.json: not a regular file",
        f"warning: skipped {long_line}/events.jsonl:3: a line of 68157468 bytes, over the 67108864 a line may hold",
        f"warning: skipped {sparse}/events.jsonl: 8589934592 bytes, over the 536870912 a record file may hold",
    ], proc.stderr[-3000:]
    text = (root / "report" / "report.md").read_text()
    runs = {r["run_id"]: r for r in csv.DictReader(open(root / "report" / "runs.csv", newline=""))}
    for name in ("ddp1", "ddp2"):  # the good records: in the report, finished
        assert runs[name]["status"] == "ok" and f"| {name} " not in text
    for name, why in (
        ("sparse", "events.jsonl cannot be read: 8589934592 bytes"),
        ("deep", "summary.json cannot be read: nested deeper than 64 levels"),
        ("deep-line", "events.jsonl:3 is not a JSON object (nested deeper than 64 levels)"),
        ("long-line", "events.jsonl:3 is not a JSON object (a line of 68157468 bytes, over the 67108864"),
        ("fifo", "summary.json cannot be read: not a regular file"),
    ):
        assert runs[name]["status"] == "damaged" and runs[name]["error"].startswith(why), (name, runs[name]["error"])
    assert runs["typed"]["status"] == '{"ok": 1}' and runs["typed"]["error"] == "7"  # shown as text, never keyed on
