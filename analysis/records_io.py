"""Reading one record file with bounds, so that a bad record is one bad record.

Results folders are often group folders on a shared cluster: any member can leave a file in one. Every reader in
analysis/ reads through here: a file must be a regular file (not a link, a FIFO or a device), hold at most a set
number of bytes (checked before reading: a sparse 8 GiB file takes no disk and would take 8 GiB of memory), and
parse to JSON or YAML no deeper and no larger than a record ever is (a deep document costs a RecursionError, a
YAML alias bomb an exponential walk). What fails raises `Unreadable` (a ValueError) saying why, in words; the
caller names the file and skips it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

# Bounds far above any record the runner writes and below what hurts a login node: an epoch line holds about
# 30 bytes per step (its step time and loss), so 64 MiB is two million steps; documents nest a few levels.
MAX_FILE_BYTES = 512 * 2**20  # events.jsonl, predictions.jsonl
MAX_DOC_BYTES = 64 * 2**20  # summary.json, env.json, config.yaml, a comm or noise report
MAX_LINE_BYTES = 64 * 2**20
MAX_DEPTH = 64
MAX_VALUES = 4_000_000  # values reached walking a document, aliases counted each time they are reached

# libyaml's parser where PyYAML has it (the pure-Python one is most of a large study's load time)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Unreadable(ValueError):
    """Why a record file cannot be read, in words (the caller names the file)."""


def skipped(path: str | Path, why: str | BaseException) -> None:
    """The one line that says a record file was skipped and why."""
    print(f"warning: skipped {path}: {why}", file=sys.stderr)


def read_bytes(path: str | Path, limit: int = MAX_DOC_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, opened without following a link."""
    try:
        # O_NONBLOCK: opening a FIFO planted in place of a record must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unreadable("a symbolic link, not a file a run writes: not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{st.st_size} bytes, over the {limit} a record file may hold")
        chunks, size = [], 0
        while size <= limit:  # the size may change after fstat: read no more than the bound either way
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Unreadable(f"grew past the {limit} bytes a record file may hold while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | Path, limit: int = MAX_DOC_BYTES) -> str:
    return read_bytes(path, limit).decode("utf-8", errors="replace")


def check_shape(doc: object) -> object:
    """`doc` if it nests at most MAX_DEPTH deep and holds at most MAX_VALUES values, else Unreadable. Iterative:
    a deep document must not cost the walk its own stack."""
    todo, values = [(doc, 1)], 0
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise Unreadable(f"nested deeper than {MAX_DEPTH} levels")
        items = node.values() if isinstance(node, dict) else node
        values += len(node)
        if values > MAX_VALUES:
            raise Unreadable(f"more than {MAX_VALUES} values (counting each use of a YAML alias)")
        todo.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return doc


def parse_json(text: str | bytes) -> object:
    try:
        doc = json.loads(text)
    except RecursionError:
        raise Unreadable(f"nested deeper than {MAX_DEPTH} levels") from None
    return check_shape(doc) if isinstance(doc, (dict, list)) else doc


def read_json(path: str | Path, limit: int = MAX_DOC_BYTES) -> object:
    """A JSON document, bounded; Unreadable or ValueError (not JSON) when it cannot be read."""
    return parse_json(read_text(path, limit))


def read_yaml(path: str | Path, limit: int = MAX_DOC_BYTES) -> object:
    """A YAML document (safe loader), bounded; Unreadable or yaml.YAMLError when it cannot be read."""
    try:
        doc = yaml.load(read_text(path, limit), Loader=YAML_LOADER)
    except RecursionError:
        raise Unreadable(f"nested deeper than {MAX_DEPTH} levels") from None
    return check_shape(doc) if isinstance(doc, (dict, list)) else doc


def read_jsonl(path: str | Path, limit: int = MAX_FILE_BYTES) -> Iterator[tuple[int, object]]:
    """(line number, its JSON value or the ValueError saying why it is not one) per non-blank line."""
    for i, line in enumerate(read_bytes(path, limit).split(b"\n")):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            yield i + 1, Unreadable(f"a line of {len(line)} bytes, over the {MAX_LINE_BYTES} a line may hold")
            continue
        try:
            yield i + 1, parse_json(line.decode("utf-8", errors="replace"))
        except ValueError as e:
            yield i + 1, e
