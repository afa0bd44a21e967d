"""The analysis's words for the records' one reader (ptbench.core.readers): the same bounds, refusals and walks.

Results folders are often group folders on a shared cluster: any member can leave a file in one. The reader refuses
what no run writes (a link, a FIFO, a file over its bound, a document nested or aliased past its bound) with
`Unreadable`. Here the caller names the file, so an error says only why, in words; a file that is not JSON at all is
a plain ValueError (a record cut short: the analysis calls it `damaged`, not hostile); and `skipped` is the one
line that says a file was passed over and why.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import ptbench.core.readers as readers
from ptbench.core.readers import NotJSON, Unreadable


def skipped(path: str | Path, why: str | BaseException) -> None:
    """The one line that says a record file was skipped and why."""
    print(f"warning: skipped {path}: {why}", file=sys.stderr)


def _why(e: Unreadable) -> ValueError:
    """`e` saying only why: the caller names the file."""
    return ValueError(e.why) if isinstance(e, NotJSON) else Unreadable(e.why)


def read_json(path: str | Path, limit: int = readers.MAX_JSON_BYTES) -> object:
    """A JSON document, bounded; Unreadable or ValueError (not JSON) when it cannot be read."""
    try:
        return readers.read_json(path, limit)
    except Unreadable as e:
        raise _why(e) from None


def read_yaml(path: str | Path, limit: int = readers.MAX_JSON_BYTES) -> object:
    """A YAML document (safe loader), bounded; Unreadable or yaml.YAMLError when it cannot be read."""
    try:
        return readers.read_yaml(path, limit)
    except Unreadable as e:
        raise _why(e) from None


def read_jsonl(path: str | Path, limit: int = readers.MAX_EVENTS_BYTES) -> Iterator[tuple[int, object]]:
    """(line number, its JSON value or the ValueError saying why it is not one) per non-blank line."""
    try:
        lines = list(readers.jsonl(path, limit))
    except Unreadable as e:
        raise _why(e) from None
    for i, value in lines:
        yield i, _why(value) if isinstance(value, Unreadable) else value
