"""The one reader of a results folder, which other users may write (a results root shared by a group, umask 002).

Every command and the report read through here, one function per kind of file a results folder holds:
    runs           `summaries` / `point_records` (summary.json of each record folder), `read_json` (env.json),
                   `read_yaml` (config.yaml), `jsonl` / `read_lines` (events.jsonl), `owner_gone` (a `running` one)
    comm reports   `comm_reports` (comm/*.json, what `python -m ptbench.comm --out` writes)
    predictions    `predictions` (predictions.jsonl, what `python -m ptbench.predict` writes)
    noise files    `noise_files` (noise/noise-*.json, what `python -m ptbench.sweep noise` writes)
and `own_folder` checks a folder as ours before anything is written into one.

A file beyond these bounds is not a record this harness wrote: the reader refuses it (`Unreadable`: why, and the
file when it was named), and a search of a tree skips it with one warning line (`skipped`), so that one hostile file
is never a RecursionError, a MemoryError or an open that waits forever (a FIFO) that stops the run reading it.

A leaf: it imports nothing of ptbench, so the analysis, which reads records only, reads them through it.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

# Far above any record the runner writes and below what hurts a login node: an epoch line holds about 30 bytes per
# step (its step time and loss), so a 64 MiB line is two million steps; documents nest a few levels.
MAX_JSON_BYTES = 64 * 2**20  # summary.json, env.json, config.yaml, a comm report, a noise file
MAX_EVENTS_BYTES = 512 * 2**20  # events.jsonl, predictions.jsonl
MAX_LINE_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64  # json.loads and every walk of a record recurse once per level
MAX_VALUES = 4_000_000  # values reached walking a document, YAML aliases counted each time they are reached
MAX_SCAN_DEPTH = 16  # folders below a searched root: records sit 1 to 4 down (sweeps nest)
COMM_TOOL = "ptbench.comm"  # the `tool` of a comm report


class Unreadable(ValueError):
    """A file a reader refuses (not a regular file, too large, nested too deep): `why`, in words, and the `path`
    it names first where the reader was given one (a caller that names the file itself reads `why`)."""

    def __init__(self, why: str, path=None):
        super().__init__(why)
        self.why, self.path = why, path

    def __str__(self) -> str:
        return self.why if self.path is None else f"{self.path}: {self.why}"


class NotJSON(Unreadable):
    """Not JSON at all, more often cut short (a crash mid-write, a full disk) than made so: `why` is the parser's."""

    def __str__(self) -> str:
        text = f"not JSON ({self.why[:120]})"
        return text if self.path is None else f"{self.path}: {text}"


# --- one file -------------------------------------------------------------------------------------------
def read_bytes(path, limit: int = MAX_JSON_BYTES, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file `path` (relative to `dir_fd` if given), at most `limit`. Opened without
    following a link and without waiting on a FIFO; its size is checked before a byte is read (a sparse 8 GiB file
    takes no disk and would take 8 GiB of memory), and no more than the bound is read if it grows meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unreadable("a symbolic link, not a file a run writes: not followed", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not a regular file", path)
        if st.st_size > limit:
            raise Unreadable(f"{st.st_size} bytes, over the {limit} a record file may hold", path)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Unreadable(f"grew past the {limit} bytes a record file may hold while being read", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_shape(doc: object, path=None) -> object:
    """`doc` if it nests at most MAX_JSON_DEPTH deep and holds at most MAX_VALUES values, else Unreadable. A loop,
    not a recursion: the depth is what it guards."""
    todo, values = [(doc, 1)] if isinstance(doc, (dict, list)) else [], 0
    while todo:
        node, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise Unreadable(f"nested deeper than {MAX_JSON_DEPTH} levels", path)
        values += len(node)
        if values > MAX_VALUES:
            raise Unreadable(f"more than {MAX_VALUES} values (counting each use of a YAML alias)", path)
        items = node.values() if isinstance(node, dict) else node
        todo.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return doc


def loads(text: bytes | str, path=None) -> object:
    """json.loads, refused when it is not JSON (NotJSON) or nests deeper than MAX_JSON_DEPTH (Unreadable)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")  # a stray byte in an error text is no reason to lose a record
    try:
        doc = json.loads(text)
    except RecursionError:
        raise Unreadable(f"nested deeper than {MAX_JSON_DEPTH} levels", path) from None
    except ValueError as e:
        raise NotJSON(str(e), path) from None
    return check_shape(doc, path)


def read_json(path, limit: int = MAX_JSON_BYTES, dir_fd: int | None = None) -> object:
    return loads(read_bytes(path, limit, dir_fd), path)


def read_yaml(path, limit: int = MAX_JSON_BYTES) -> object:
    """A YAML document (safe loader, libyaml's where PyYAML has it), bounded; Unreadable or yaml.YAMLError."""
    import yaml  # here: a rank never reads YAML

    text = read_bytes(path, limit).decode("utf-8", errors="replace")
    try:
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except RecursionError:
        raise Unreadable(f"nested deeper than {MAX_JSON_DEPTH} levels", path) from None
    return check_shape(doc, path)


def jsonl(path, limit: int = MAX_EVENTS_BYTES, dir_fd: int | None = None) -> Iterator[tuple[int, object]]:
    """(line number, its JSON value or the Unreadable saying why it is not one) per non-blank line of a jsonl file:
    a line cut short is one bad line. The file itself is refused as `read_bytes` refuses it."""
    for i, line in enumerate(read_bytes(path, limit, dir_fd).split(b"\n"), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            yield (
                i,
                Unreadable(f"a line of {len(line)} bytes, over the {MAX_LINE_BYTES} a line may hold", f"{path}:{i}"),
            )
            continue
        try:
            yield i, loads(line, f"{path}:{i}")
        except Unreadable as e:
            yield i, e


def read_lines(path, limit: int = MAX_EVENTS_BYTES, dir_fd: int | None = None) -> list:
    """The JSON values of a jsonl file (events.jsonl) the runner wrote itself: Unreadable at the first bad line."""
    out = []
    for _, value in jsonl(path, limit, dir_fd):
        if isinstance(value, Unreadable):
            raise value
        out.append(value)
    return out


def readable(path) -> dict | None:
    """The JSON object at `path`, or None where it is missing, unreadable, damaged or not an object."""
    try:
        out = read_json(path)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


# --- a tree of them --------------------------------------------------------------------------------------
_NAMED: set[str] = set()  # what this process already named: a run reads the same tree several times


def skipped(what: str, say=None) -> None:
    """One warning line for a file or folder a reader passed over (once per process)."""
    if what in _NAMED:
        return
    _NAMED.add(what)
    print(
        f"warning: skipped {what} (not a record this harness wrote): remove it or ask its owner to",
        file=say or sys.stderr,
        flush=True,
    )


def read_record(path: Path, say=None) -> dict | None:
    """The JSON object at `path`; None where it is missing or not ours to read (another user's private record),
    and None with one warning line (`skipped`) where it is damaged, hostile or not an object."""
    try:
        out = read_json(path)
    except Unreadable as e:
        return skipped(str(e), say)
    except OSError:
        return None
    if not isinstance(out, dict):
        return skipped(f"{path}: a JSON {type(out).__name__}, not an object", say)
    return out


def record_files(root: Path, pattern: str, parent: str | None = None, say=None) -> list[Path]:
    """The files matching `pattern` (in a folder called `parent`, if given) under `root`, in path order: Path.rglob
    without its recursion (a tree made thousands of folders deep is a RecursionError for it) and never further
    than MAX_SCAN_DEPTH folders down (the folder where it stops is named), never into a symlinked folder."""
    out, todo = [], [(Path(root), 0)]
    while todo:
        folder, depth = todo.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and depth < MAX_SCAN_DEPTH:
                todo.append((Path(e.path), depth + 1))
            elif is_dir:
                skipped(f"{e.path}: folders nest deeper than {MAX_SCAN_DEPTH} levels below {root}", say)
            elif fnmatch.fnmatchcase(e.name, pattern) and (parent is None or folder.name == parent):
                out.append(Path(e.path))
    return sorted(out)


def summaries(folders, say=None) -> Iterator[tuple[Path, dict]]:
    """(summary.json path, summary object) of every record under `folders`: each record folder once (the folders
    may nest), in path order. One that cannot be read (another user's private record) is passed over; one that
    is damaged or hostile too, named in one warning line to `say` (default stderr)."""
    seen = set()
    for root in map(Path, folders):
        for path in record_files(root, "summary.json", say=say) if root.is_dir() else []:
            try:
                run_dir = path.parent.resolve()
            except (OSError, RuntimeError):
                continue
            if run_dir in seen:
                continue
            seen.add(run_dir)
            s = read_record(path, say)
            if s is not None:
                yield path, s


def point_records(folders, point: str, say=None) -> Iterator[tuple[Path, dict]]:
    """(summary.json path, summary) of every record of `point` under `folders` (`summaries`)."""
    for path, s in summaries(folders, say):
        if s.get("point") == point:
            yield path, s


def comm_reports(root, folder: str = "comm", say=None) -> list[tuple[Path, dict]]:
    """(path, report) of every `python -m ptbench.comm --out` report in a `folder` folder under root (where a sweep
    stores them beside its records)."""
    found = ((p, read_record(p, say)) for p in record_files(root, "*.json", parent=folder, say=say))
    return [(p, rep) for p, rep in found if rep is not None and rep.get("tool") == COMM_TOOL]


def predictions(path, say=None) -> list[dict]:
    """The lines of predictions.jsonl that are JSON objects (one per predicted point); [] where there is none, or
    it cannot be read (said in one line). A line that is not an object is left out."""
    try:
        return [v for _, v in jsonl(path) if isinstance(v, dict)]
    except Unreadable as e:
        skipped(str(e), say)
    except OSError:
        pass
    return []


def noise_files(root, say=None) -> list[tuple[Path, dict]]:
    """(path, measurement) of every `python -m ptbench.sweep noise` file (noise/noise-*.json) under root, newest
    first."""
    found = []
    for path in record_files(root, "noise-*.json", parent="noise", say=say):
        try:
            found.append((path.stat().st_mtime, path))
        except OSError:
            continue
    read = ((p, read_record(p, say)) for _, p in sorted(found, reverse=True))
    return [(p, rec) for p, rec in read if rec is not None]


def owner_gone(owner) -> str | None:
    """Why a `running` record will never get its final status (its writer, on this host, is gone: no such
    pid, or the pid now belongs to a process started at another time), else None (still going, or written
    on another host or by a harness without `owner`: cannot tell)."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return None
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or not 0 < pid < 2**31 or not isinstance(started, (int, float, type(None))):
        return None  # not a record this harness wrote (`summaries` passes it over)
    try:
        import psutil

        p = psutil.Process(pid)
        if started is None or abs(p.create_time() - float(started)) < 1.0:
            return None  # the same process: still running
    except ImportError:
        return None
    except psutil.Error:
        pass
    return (
        f"no final status: the process that ran it (pid {pid} on {owner['host']}) is gone, killed "
        "outright (SIGKILL, the OOM killer)"
    )


# --- a folder to write in ------------------------------------------------------------------------------
# O_PATH: a folder we may pass through but not list (mode 711, as some clusters' home and scratch roots) can
# still be opened and used to reach the next one
PASS_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


class NotOurs(PermissionError):
    """A folder not ours to write in: `why` in words after its path. `at`: the folder or the link on the way to it
    that another user made (`uid`), `link` whether that is a symbolic link; both None where it cannot be reached."""

    def __init__(self, path: Path, why: str, at: Path | None = None, uid: int | None = None, link: bool = False):
        super().__init__(errno.EPERM, f"{path} {why}")
        self.path, self.why, self.at, self.uid, self.link = path, why, at, uid, link


def _trusted_link(st: os.stat_result) -> bool:
    """A link we made, or root did (/home -> /data/home): followed; any other user's is not."""
    return st.st_uid in (0, os.geteuid())


def _step(fd: int, name: str, here: Path, path: Path, mode: int | None, last: bool) -> int:
    """The descriptor of folder `name` (`here`, on the way to `path`) in folder `fd`, made with `mode` (less the
    umask) when missing and `mode` is given."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if mode is None:
            raise
        try:
            os.mkdir(name, mode, dir_fd=fd)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    flags = (os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if last else PASS_FLAGS
    if stat.S_ISLNK(st.st_mode):
        if not _trusted_link(st):
            how = "is" if here == path else f"is reached through {here},"
            raise NotOurs(path, f"{how} a symbolic link made by uid {st.st_uid}, not you", here, st.st_uid, True)
    else:
        flags |= os.O_NOFOLLOW  # swapped for a link since the stat: refused by the open
    try:
        return os.open(name, flags, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotOurs(path, f"cannot be reached: {here} is not a folder (or became a link while checked)") from None
        raise


def own_folder(path, mode: int | None = 0o777) -> int:
    """An open descriptor of folder `path`, checked as ours: each folder on the way is opened from the one before
    it, a link on the way is followed only if we or root made it, and the folder itself must be ours (its owner
    read from the descriptor, so it cannot be swapped after the check). A missing folder is made with `mode` (less
    the umask; None: FileNotFoundError). NotOurs (PermissionError) otherwise. The caller closes it."""
    path = Path(os.path.abspath(path))
    fd = os.open("/", PASS_FLAGS)
    try:
        here = Path("/")
        for i, name in enumerate(path.parts[1:], 2):
            here = here / name
            fd, old = _step(fd, name, here, path, mode, last=i == len(path.parts)), fd
            os.close(old)
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            why = f"belongs to uid {owner}, not you (uid {os.geteuid()}): someone else made it"
            raise NotOurs(path, why, path, owner)
        return fd
    except BaseException:
        os.close(fd)
        raise
