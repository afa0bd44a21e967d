"""Bounded readers of files that other users may write (a results root shared by a group, under umask 002).

A file beyond these bounds is not a record this harness wrote: the reader refuses it (`Unreadable`, one line naming
it), and a search of a tree (`record_files`, `read_record`) skips it with one warning line, so that one hostile file
is never a RecursionError, a MemoryError or an open that waits forever (a FIFO) that stops the run reading it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path

MAX_JSON_BYTES = 32 * 2**20
MAX_JSON_DEPTH = 64  # a record nests a few levels; json.loads and every walk of a record recurse once per level
MAX_LINE_BYTES = 16 * 2**20  # one events.jsonl line: an epoch with its per-step losses
MAX_EVENTS_BYTES = 512 * 2**20
MAX_SCAN_DEPTH = 16  # folders below a searched root: records sit 1 to 4 down (sweeps nest)


class Unreadable(ValueError):
    """A file a reader refuses (not a regular file, too large, nested too deep, not JSON): one line naming it."""


def read_bytes(path: Path, limit: int = MAX_JSON_BYTES, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file `path` (relative to `dir_fd` if given), at most `limit`. Opened without
    following a symlink and without waiting on a FIFO; its size is checked before a byte is read (a sparse file
    takes no disk and any amount of memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unreadable(f"{path}: a symbolic link, not a file") from None
        raise
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path}: not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{path}: {st.st_size} bytes, more than the {limit} a record file may hold")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unreadable(f"{path}: more than the {limit} bytes a record file may hold")
    return data


def loads(text: bytes | str, path) -> object:
    """json.loads, refused (Unreadable naming `path`) when it is not JSON or nests deeper than MAX_JSON_DEPTH."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise Unreadable(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise Unreadable(f"{path}: not JSON ({str(e)[:120]})") from None
    todo = [(obj, 1)]
    while todo:  # a loop, not a recursion: the depth is what it guards
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            if d > MAX_JSON_DEPTH:
                raise Unreadable(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
            todo += [(v, d + 1) for v in (o.values() if isinstance(o, dict) else o)]
    return obj


def read_json(path: Path, limit: int = MAX_JSON_BYTES):
    return loads(read_bytes(path, limit), path)


def read_lines(path: Path, limit: int = MAX_EVENTS_BYTES, dir_fd: int | None = None) -> list[dict]:
    """The JSON objects of a jsonl file (events.jsonl), each line at most MAX_LINE_BYTES; Unreadable otherwise."""
    out = []
    for i, line in enumerate(read_bytes(path, limit, dir_fd).splitlines(), 1):
        if len(line) > MAX_LINE_BYTES:
            raise Unreadable(f"{path}: line {i} is longer than {MAX_LINE_BYTES} bytes")
        if line.strip():
            out.append(loads(line, f"{path} line {i}"))
    return out


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
    import fnmatch

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
