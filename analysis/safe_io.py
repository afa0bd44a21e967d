"""Writing the report safely into a folder others may write too, and record text as data in it.

A results folder on a shared cluster is often a group folder (umask 002): another member can pre-make the
report's folder, or put links in it pointing at our own files. So every file the report writes is
- written into a folder checked as ours, by the check every record write makes (ptbench.core.readers.own_folder):
  reached without a link someone else made, opened once and its owner checked on that descriptor (`own_dir`); a
  missing folder is made by us, not writable by others;
- written to a new temporary file in that folder (O_EXCL: never an existing name, never through a link) and
  renamed over its name (os.replace replaces a link or another file there, it never writes through one).

Text from records goes into report.md as data: `md_text` turns the characters that make HTML, links, images,
code spans and table cells into character references, and `csv_cell` prefixes a quote to a CSV cell that a
spreadsheet would take for a formula.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pandas as pd

from ptbench.analysis.load import AnalysisError
from ptbench.core.readers import NotOurs, own_folder

# Character references: a renderer shows the character and never reads it as markup (HTML, links, images, code
# spans, table cells; `$`: math, in GitHub's markdown and in matplotlib's labels). None of them holds a character
# of the set, so escaping twice changes nothing (a table cell may come from an escaped frame).
MD_ESCAPES = str.maketrans({c: f"&#{ord(c)};" for c in "<>[]`\\|$"} | {"\n": " ", "\r": " "})
CSV_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # OWASP: a spreadsheet evaluates a cell starting so


# A table cell again, made by the report from escaped record text: its own code spans (`label`) stay code spans;
# a backtick only formats, it cannot make a link or markup.
MD_CELL_ESCAPES = {k: v for k, v in MD_ESCAPES.items() if k != ord("`")}


def md_text(text: str) -> str:
    """Record text as literal text in markdown (and in the HTML a renderer makes of it)."""
    return str(text).translate(MD_ESCAPES)


def md_cell(text: str) -> str:
    """A report-made table cell: `md_text` but for its backticks (see MD_CELL_ESCAPES)."""
    return str(text).translate(MD_CELL_ESCAPES)


def csv_cell(v):
    """A text cell a spreadsheet would evaluate, quoted as text ('=...); numbers and everything else as is."""
    return "'" + v if isinstance(v, str) and v.startswith(CSV_FORMULA_START) else v


OUT_FIX = "choose another output folder (--out DIR) or remove it"


def _map_text(df: pd.DataFrame, fn: Callable[[str], str], keep: tuple[str, ...] = ()) -> pd.DataFrame:
    """A copy of `df` with `fn` applied to its text cells (columns in `keep` as they are). Worked out once per
    distinct value: a study's text columns hold few (labels, statuses) over many rows."""
    out = df.copy()
    for col in out.columns:
        s = out[col]
        if col in keep or not (pd.api.types.is_object_dtype(s) or pd.api.types.is_string_dtype(s)):
            continue
        try:
            values = pd.unique(s)
        except TypeError:  # lists in the column: no distinct values to take
            values = s
        changed = {v: fn(v) for v in values if isinstance(v, str) and fn(v) != v}
        if changed:
            out[col] = s.map(lambda v, c=changed: c.get(v, v) if isinstance(v, str) else v)
    return out


def own_dir(path: str | Path, make: bool = True, fix: str = OUT_FIX) -> int:
    """An open descriptor of folder `path`, checked as ours (`own_folder`: each folder on the way opened from the
    one before it, a link on the way followed only if we or root made it, the folder itself owned by us, its owner
    read from the descriptor). Missing folders are made (by us, not writable by others). Refused in one line
    (AnalysisError) otherwise. The caller closes it."""
    path = Path(os.path.abspath(path))
    try:
        return own_folder(path, 0o755 if make else None)
    except NotOurs as e:
        raise AnalysisError(f"output folder {path} {e.why}: {fix}") from None
    except OSError as e:
        raise AnalysisError(f"output folder {path}: cannot open or make it ({e.strerror or e})") from None


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _new_file(dfd: int, name: str) -> tuple[int, str]:
    """A new file beside `name` in folder `dfd`: a name nothing had (O_EXCL, so never an existing file or link)."""
    while True:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, 0o600, dir_fd=dfd), tmp
        except FileExistsError:
            continue


def write_with(path: str | Path, write: Callable[[IO], None], binary: bool = False, fix: str = OUT_FIX) -> Path:
    """`write(file)` into a new temporary file in `path`'s folder (checked by `own_dir`), then renamed over
    `path`: a link or a file someone put at that name is replaced, never written through."""
    path = Path(path)
    dfd = own_dir(path.parent, fix=fix)
    try:
        fd, tmp = _new_file(dfd, path.name)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # what a plain open would have made
            with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                write(f)
            try:
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as e:  # a folder put at that name, say
                raise AnalysisError(f"cannot write {path} ({e.strerror or e}): {fix}") from None
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    return path


def write_text(path: str | Path, text: str, fix: str = OUT_FIX) -> Path:
    return write_with(path, lambda f: f.write(text), fix=fix)


def to_csv(df: pd.DataFrame, path: str | Path) -> Path:
    """`df` as CSV (no index), every text cell a spreadsheet would evaluate quoted (`csv_cell`)."""
    out = _map_text(df, csv_cell)
    return write_with(path, lambda f: out.to_csv(f, index=False))


def md_frame(df: pd.DataFrame, keep: tuple[str, ...] = ()) -> pd.DataFrame:
    """A copy of `df` whose text cells are `md_text` (the columns in `keep`, read back by code, as they are)."""
    return _map_text(df, md_text, keep)
