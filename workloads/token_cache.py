"""Wikitext -> GPT-2 BPE token ids, cached once per source as a uint16 file, and the blocks a workload reads.

A token cache decides what a run trains on, and it may sit where others can write (a dataset folder's
.bench_cache, a shared data.cache_dir). So a cache is found by a key made from its source's bytes (the
text and the tokenizer files, each by size and SHA-256, and how they are encoded: `ENCODING`), and a cache
file is read only if, on the very handle it is read from, it is a regular file (no link followed) that only
we or root can write (`open_cache`). One that is not is named in one line and a cache of ours is built.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import stat
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ptbench.core.errors import ConfigError

TOKENIZER_FILES = ("vocab.json", "merges.txt")
# How the bytes become the cached ids, part of every key: a change here must give new caches.
ENCODING = "gpt2 byte-level BPE, add_prefix_space=false, no special tokens, uint16 little-endian"


def gpt2_tokenizer(tokenizer_dir: str | os.PathLike):
    """GPT-2 byte-level BPE from local vocab.json + merges.txt ("Hello world" -> [15496, 995])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = Path(tokenizer_dir)
    tok = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _tokenizer_from(files: dict[str, bytes]):
    """The tokenizer of exactly the bytes that were hashed into the key (a private copy: the shared files may
    change between hashing and loading)."""
    with tempfile.TemporaryDirectory(prefix="ptbench-tokenizer-") as d:
        for name, data in files.items():
            Path(d, name).write_bytes(data)
        return gpt2_tokenizer(d)


def cache_key(text_path: Path, text: bytes, tokenizer: dict[str, bytes]) -> str:
    """<folder>.<file>.<digest>: the digest covers the size and SHA-256 of the text and of each tokenizer file,
    and `ENCODING`; edited text (even at the same size and mtime) or another tokenizer gives another key."""
    parts = [ENCODING, f"text {len(text)} {hashlib.sha256(text).hexdigest()}"]
    parts += [f"{name} {len(data)} {hashlib.sha256(data).hexdigest()}" for name, data in sorted(tokenizer.items())]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    return f"{text_path.parent.name}.{text_path.name}.{digest}"


# A chunk may end at "\n" only where the next line starts with an optional space and then a
# non-space: GPT-2's pre-tokenizer regex cannot match across such a point, so encoding the
# chunks separately gives exactly the ids of encoding the file whole (checked on Wikitext-2),
# and `encode_batch` can use every core.
_SAFE_LINE_START = re.compile(r" ?\S")


def encode_text(tok, text: str, chunk_chars: int = 1 << 16) -> np.ndarray:
    """Text -> uint16 token ids, identical to `tok.encode(text).ids`, encoded in parallel chunks."""
    chunks, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if cur and n >= chunk_chars and _SAFE_LINE_START.match(line):
            chunks.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if cur:
        chunks.append("".join(cur))
    if tok.get_vocab_size() > 65535:
        raise ConfigError(f"data.tokenizer_dir: vocabulary of {tok.get_vocab_size()} does not fit the uint16 cache")
    parts = [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(chunks, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# --- what may be read and where we write ----------------------------------------------------------
def distrust(st: os.stat_result) -> str | None:
    """Why a cache file with this status is not read, or None: whoever can write it chooses the tokens a run
    trains on, so only a regular file that only we (or root) can write is read."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"writable by {'its group' if st.st_mode & 0o020 else 'others'} (mode {st.st_mode & 0o777:o})"
    return None


def _open_unfollowed(path: str | os.PathLike) -> tuple[int, os.stat_result | None, str | None]:
    """(fd, its status, None) of a cache file opened without following a link (nor blocking on a FIFO) and
    checked on that handle, or (-1, status or None, why it is not read). FileNotFoundError when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        return -1, None, "a symbolic link" if e.errno == errno.ELOOP else f"not readable ({e.strerror})"
    st = os.fstat(fd)
    why = distrust(st)
    if why:
        os.close(fd)
        return -1, st, why
    return fd, st, None


def open_cache(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """(fd, its status) of a cache file we may read: what is checked is what is read, whatever is renamed
    into its place meanwhile. ConfigError naming the file when it is not to be read."""
    fd, st, why = _open_unfollowed(path)
    if why:
        raise ConfigError(f"data.cache_dir: token cache {path} is {why}: not read; remove it")
    return fd, st


def _writable_dir(d: Path) -> bool:
    return _unwritable(d) is None


def _unwritable(d: Path) -> OSError | None:
    """Why no file can be made in `d` (made if missing, writable by us alone whatever the umask), or None if one can."""
    try:
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
        return None
    except OSError as e:
        return e


def _not_ours(d: Path) -> str | None:
    """Why the data folder's .bench_cache is no place for our cache: another user's folder there may hold what
    they like next to it and remove ours at will."""
    try:
        st = d.lstat()
    except FileNotFoundError:
        return None  # `_unwritable` makes it, ours
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user"
    return None


def _user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainbench"


def cache_dirs(text_path: Path, cache_dir: str | None) -> list[Path]:
    """Where the cache may live, in order: data.cache_dir, $BENCH_CACHE_DIR, the user's cache folder
    ($XDG_CACHE_HOME/trainbench, default ~/.cache/trainbench: never into a dataset folder, which may be
    shared), <root>/.bench_cache (only when the user's cache folder is not writable, and where
    an older version left a cache)."""
    if cache_dir:
        return [Path(cache_dir)]
    if os.environ.get("BENCH_CACHE_DIR"):
        return [Path(os.environ["BENCH_CACHE_DIR"])]
    return [_user_cache_dir(), text_path.parent / ".bench_cache"]


def _target_dir(candidates: list[Path], refused: list[tuple[Path, str]], in_data: Path) -> Path:
    """The first candidate folder we can write, in order (a later one is not made needlessly), and ours if it
    is `in_data` (the data folder's .bench_cache). If none is, ConfigError: one line naming each folder and
    why, and the caches refused."""
    why, others = {}, False
    for d in candidates:
        e = (d == in_data and _not_ours(d)) or _unwritable(d)
        if e is None:
            return d
        others |= isinstance(e, str)
        why[d] = e if isinstance(e, str) else (e.strerror or str(e))
    said = ", ".join(f"{d} ({e})" for d, e in why.items())
    bad = "".join(f"; token cache {p} is {w}: not used" for p, w in refused)
    if others:
        raise ConfigError(
            f"data.cache_dir: no folder of ours for the token cache in {said}{bad}; "
            "set data.cache_dir=<a folder of yours>"
        )
    raise ConfigError(f"data.cache_dir: no file can be made in {said}{bad}; set data.cache_dir=<a writable folder>")


# --- the cache ------------------------------------------------------------------------------------
def token_cache(
    text_path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    cache_dir: str | None = None,
    local_rank: int = 0,
    wait_s: float | None = None,
    say=None,
) -> Path:
    """Path of the uint16 token-id file for `text_path`, building it if needed.

    The name is `cache_key` (the text's and the tokenizer's bytes, hashed: a few MB per run for Wikitext-2)
    and ends with the token count it was written with (KEY.N.u16): a file of ours whose size is not 2 N bytes
    (cut short by a full disk, a copy, a crash of the file system) is rebuilt, with one line to `say`
    (default: stderr) saying so, instead of training on part of the text. A file of that name that others
    could have written (`distrust`) is never read: it is named in one line and ours is built. `local_rank` 0
    builds (temp file, then an atomic rename, so concurrent builders on a shared file system are harmless);
    other ranks wait for a complete file, at most `wait_s` seconds (default 300 s + 2 s per MB of text, env
    BENCH_DATA_WAIT_S overrides).
    """
    text_path = Path(text_path)
    text = text_path.read_bytes()  # read once: the bytes hashed into the key are the bytes encoded
    tokenizer = {name: (Path(tokenizer_dir) / name).read_bytes() for name in TOKENIZER_FILES}
    key = cache_key(text_path, text, tokenizer)
    candidates = cache_dirs(text_path, cache_dir)

    found, damaged, refused = _cached(candidates, key)
    if found is not None:
        return found
    if local_rank != 0:
        return _wait_for_cache(candidates, key, local_rank, wait_s, len(text))
    say = say or _stderr
    for path, tokens in damaged:
        say(
            f"warning: token cache {path} holds {path.stat().st_size} bytes, not the {2 * tokens} of its "
            f"{tokens} tokens (cut short after it was written): rebuilding it from {text_path}"
        )
        path.unlink(missing_ok=True)
    target_dir = _target_dir(candidates, refused, text_path.parent / ".bench_cache")
    for path, why in refused:
        say(
            f"warning: token cache {path} is {why}: not used (whoever can write it chooses what is trained on); "
            f"building this user's own in {target_dir}"
        )
    ids = encode_text(_tokenizer_from(tokenizer), read_utf8(text_path, text))
    final = target_dir / f"{key}.{ids.size}.u16"
    _write_cache(ids, final, target_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    return final


def _write_cache(ids: np.ndarray, final: Path, tmp: Path) -> None:
    """`ids` into `final` through `tmp` (made new, mode 644 whatever the umask: `distrust` refuses a cache
    others can write); a storage that refuses (a full disk, a quota, a read-only file system) ends in one
    line naming the file, its size and the fix, the partial file removed."""
    from ptbench.core.records import storage_error

    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        made = True
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o644)
            f.write(memoryview(ids))  # not ids.tofile: a full disk would be an OSError without its errno
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, final, ids.nbytes)
    except OSError as e:
        size = f"{ids.nbytes / 2**20:.1f} MiB" if ids.nbytes >= 2**20 else f"{-(-ids.nbytes // 1024)} KiB"
        fix = f"or set data.cache_dir=<a folder with {size} free> (the token cache)"
        raise storage_error(e, final, fix) from e
    finally:
        if made:
            tmp.unlink(missing_ok=True)


def _publish(tmp: Path, final: Path, nbytes: int) -> None:
    """`tmp` as `final`, appearing whole (a link, else an atomic rename). A good cache another builder (a job
    sharing the folder) put there first is kept: ranks and their DataLoader workers may be reading it, and a
    worker reads only the very file its rank checked (`TokenBlocks`)."""
    try:
        os.link(tmp, final)
        return
    except FileExistsError:
        try:
            fd, st, why = _open_unfollowed(final)
        except FileNotFoundError:
            why = "gone"
        if not why:
            os.close(fd)
            if st.st_size == nbytes:
                return
    except OSError:
        pass  # a file system without hard links
    os.replace(tmp, final)


def _cached(candidates: list[Path], key: str) -> tuple[Path | None, list[tuple[Path, int]], list[tuple[Path, str]]]:
    """(the first cache file of `key` we may read whose size matches the token count in its name, or None;
    [(file, its count)] of ours that do not; [(file, why)] of those `open_cache` refuses)."""
    pattern = re.compile(re.escape(key) + r"\.(\d+)\.u16")
    damaged, refused = [], []
    for d in candidates:
        for path in sorted(d.glob(f"{glob.escape(key)}.*.u16")) if d.is_dir() else []:
            m = pattern.fullmatch(path.name)
            if not m:
                continue
            try:
                fd, st, why = _open_unfollowed(path)
            except FileNotFoundError:  # replaced by another builder meanwhile
                continue
            if why:
                refused.append((path, why))
                continue
            os.close(fd)
            if st.st_size == 2 * int(m.group(1)):
                return path, [], refused
            damaged.append((path, int(m.group(1))))
    return None, damaged, refused


def _wait_for_cache(candidates: list[Path], key: str, local_rank: int, wait_s: float | None, text_bytes: int) -> Path:
    if wait_s is None:
        wait_s = float(os.environ.get("BENCH_DATA_WAIT_S", 300 + 2 * text_bytes / 1e6))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        found, _, _ = _cached(candidates, key)
        if found is not None:
            return found
    raise TimeoutError(
        f"local rank {local_rank} waited {wait_s:.0f} s for the token cache {key}.*.u16 "
        f"(built by local rank 0) in {', '.join(map(str, candidates))}"
    )


def read_utf8(path: Path, data: bytes | None = None) -> str:
    """The text of `path` (its bytes `data`, when read already), strict UTF-8. Invalid bytes end the run with
    one line naming the file and the byte offset, rather than being decoded with replacement characters:
    WikiText is UTF-8, so such a byte means a damaged or a wrong file, and replacing it would train, silently,
    on other tokens than the dataset's (a benchmark's token count and loss would no longer compare with
    anyone's)."""
    data = path.read_bytes() if data is None else data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"data.root: {path} is not valid UTF-8 at byte {e.start} (line {line}, byte 0x{data[e.start]:02x}): "
            "restore the file, or convert it to UTF-8 (iconv -f <its encoding> -t utf-8)"
        ) from None


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def blank_text(path: str | os.PathLike, probe: int = 1 << 16) -> bool:
    """The text file holds nothing to tokenize: empty, or (when small) only whitespace."""
    size = os.path.getsize(path)
    if size > probe:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def load_tokens(path: str | os.PathLike, same_as: tuple[int, int, int] | None = None) -> np.ndarray:
    """The token ids of a cache file as a read-only uint16 memmap of the handle `open_cache` checked.
    `same_as`: (st_dev, st_ino, st_size) of the file checked earlier; another file in its place is refused."""
    fd, st = open_cache(path)
    with os.fdopen(fd, "rb") as f:
        if same_as is not None and (st.st_dev, st.st_ino, st.st_size) != same_as:
            raise ConfigError(f"data.cache_dir: token cache {path} was replaced since it was checked: not read")
        if st.st_size == 0:
            return np.zeros(0, dtype=np.uint16)
        return np.memmap(f, dtype=np.uint16, mode="r")  # maps this handle's file, which outlives its closing


class TokenBlocks(Dataset):
    """Non-overlapping blocks of seq_len + 1 tokens: input = block[:-1], target = block[1:] (int64).

    Holds only the cache path and the identity of the file checked here; each process (DataLoader workers
    included) opens its own memmap, so nothing large is pickled when workers are spawned, and reads only
    that same file (`load_tokens`), whatever another user renames into its place.
    """

    def __init__(self, cache_path: str | os.PathLike, seq_len: int, source: str | os.PathLike | None = None):
        self.path, self.seq_len = str(cache_path), seq_len
        fd, st = open_cache(self.path)
        os.close(fd)
        self._checked = (st.st_dev, st.st_ino, st.st_size)
        self.num_tokens = st.st_size // 2
        self.n = self.num_tokens // (seq_len + 1)
        self._tokens = None
        if self.n == 0:
            raise ConfigError(
                f"data.root: {source or self.path} holds {self.num_tokens} tokens, fewer than "
                f"workload.seq_len + 1 = {seq_len + 1}; lower workload.seq_len or use a longer file"
            )

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self._tokens is None:
            self._tokens = load_tokens(self.path, self._checked)
        L = self.seq_len + 1
        block = torch.from_numpy(self._tokens[i * L : (i + 1) * L].astype(np.int64))
        return block[:-1], block[1:]
