"""Loading a checkpoint from a folder other users may reach: held by a descriptor, checked where it is read,
unpickled with an allowlist.

A results folder is often a group's shared space, so a checked path can be swapped before it is loaded (a
group member renames the checked step folder away and renames in their own). A check by path loses that race;
these do not:

- `pin` opens the step folder once, O_NOFOLLOW, and checks the descriptor (`fstat`): ours, and no one else may
  write it. Then every entry beneath it is checked relative to that descriptor (ours, not a link, not
  group/other-writable) and, on the rank that verifies, every file against meta.json's manifest (size and
  SHA-256). Only our uid can change a tree that passes, and the loaders read it through the same descriptor
  (the working directory while they load, `Pinned`), never through the path again: what was checked is what
  is loaded. That hash is the only one a resume makes (rank 0's choice of a checkpoint compares sizes); the
  owner and mode checks also run once before the choice takes a record over (`unsafe_to_resume`), with the
  same refusal lines.
- `restricted_unpickling` makes every unpickling inside it an allowlisted one: torch.load is forced to
  weights_only (DeepSpeed and Megatron call it with weights_only=False) with the frameworks' own record types
  allowed, and DCP's `.metadata`, which torch reads with a plain pickle.load, goes through torch's
  allowlisting unpickler that admits DCP's metadata records only. A planted pickle is refused, never run.

Plumbing; O_PATH and os.fwalk: Linux, as the clusters it runs on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pickle
import stat
from pathlib import Path

from ptbench.core.errors import ConfigError

META = "meta.json"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class Pinned:
    """A checkpoint folder held open. Inside `with`, the process's working directory is that descriptor and
    `path` (".") is the folder as the loaders must read it: a relative path resolves from the directory held,
    never from its name, whatever is renamed meanwhile. (/proc/self/fd/N would do the same, but it is closed
    to a process that is not dumpable, as one started by setpriv or su from an unreadable python is.)
    `meta`: meta.json as read through it; `digest`: its SHA-256 (the ranks compare it)."""

    path = Path(".")

    def __init__(self, where: Path, fd: int, meta_bytes: bytes):
        self.where = Path(where)
        self.fd = fd
        self.meta = json.loads(meta_bytes)
        self.digest = hashlib.sha256(meta_bytes).hexdigest()
        self._cwd = -1

    def close(self) -> None:
        if self._cwd >= 0:
            os.fchdir(self._cwd)
            os.close(self._cwd)
            self._cwd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Pinned:
        self._cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        os.fchdir(self.fd)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pin(where: Path, verify: bool, expect: dict | None = None) -> Pinned:
    """Open checkpoint folder `where` and check it through the descriptor (see the module's docstring).
    `verify`: also hash every file against the manifest (one rank does; the others compare meta.json's
    digest with it): the one time a resume reads a checkpoint's files before loading them. `expect`:
    meta.json values it must hold (point, adapter, world size): a swapped-in checkpoint of another of our
    runs is refused too. Refusals raise ConfigError with one line."""
    fd = _open_folder(where)
    try:
        _check_owned(fd, where)
        try:
            pinned = Pinned(where, fd, _read(fd, META, where))
        except ValueError as e:  # our own file, cut short (a crash during a rewrite): not a checkpoint to load
            raise ConfigError(_refusal(where, f"{META} is not JSON ({e})")) from None
        _check_meta(pinned, verify, expect)
        return pinned
    except BaseException:
        os.close(fd)
        raise


def unsafe_to_resume(where: Path) -> str | None:
    """The pin's owner and mode checks alone, for rank 0 choosing a checkpoint before it takes a record over:
    one line refusing checkpoint `where` (itself, or a file or folder in it, not ours, a link, or writable by
    group or others: like ssh with a key file others can write), or None. The same checks, through the
    descriptor that is then read, are repeated where it is loaded (`pin`): a folder swapped in between is
    refused there."""
    try:
        fd = _open_folder(where)
        try:
            _check_owned(fd, where)
        finally:
            os.close(fd)
    except ConfigError as e:
        return str(e)
    return None


def _open_folder(where: Path) -> int:
    try:
        return os.open(where, _DIR_FLAGS)
    except OSError as e:
        raise ConfigError(_refusal(where, f"it cannot be opened as a folder ({e.strerror})")) from None


def _refusal(where: Path, why: str) -> str:
    return (
        f"not resuming from {where}: {why} (loading a checkpoint can run code); check who else can write its "
        "results folder, or set trainer.resume=never"
    )


def _check_owned(fd: int, where: Path) -> None:
    """The folder held by `fd` and every entry beneath it, by descriptor: ours, a plain file or folder, no one
    else's write. The first entry that fails is refused in one line naming it."""
    _check_ours(os.fstat(fd), where, where)
    for root, dirs, files, root_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
        for name in sorted((*dirs, *files)):
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            _check_ours(st, Path(where) / root / name, where)


def _check_ours(st: os.stat_result, entry: Path | str, where: Path) -> None:
    me = os.getuid()
    if st.st_uid != me:
        raise ConfigError(_refusal(entry, f"owned by uid {st.st_uid}, not you (uid {me})"))
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise ConfigError(_refusal(entry, "neither a file nor a folder"))
    if st.st_mode & 0o022:  # ours: the fix is ours to make, once we trust what is there
        raise ConfigError(
            f"not resuming from {entry}: mode {stat.S_IMODE(st.st_mode):04o}, writable by others (loading a "
            f"checkpoint can run code): chmod -R go-w {where} if you trust it, or set trainer.resume=never"
        )


def _read(fd: int, rel: str, where: Path) -> bytes:
    try:
        f = os.open(rel, _FILE_FLAGS, dir_fd=fd)
    except OSError as e:
        raise ConfigError(_refusal(where, f"{rel} cannot be opened ({e.strerror})")) from None
    with os.fdopen(f, "rb") as fh:
        return fh.read()


def _check_meta(pinned: Pinned, verify: bool, expect: dict | None) -> None:
    meta, where = pinned.meta, pinned.where
    if not isinstance(meta, dict) or not isinstance(meta.get("manifest"), dict):
        raise ConfigError(_refusal(where, f"{META} has no manifest"))
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            raise ConfigError(_refusal(where, f"{META} says {key}={meta.get(key)!r}, this run is {want!r}"))
    for rel, want in meta["manifest"].items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ConfigError(_refusal(where, f"its manifest names {rel!r}, outside the folder"))
        try:
            f = os.open(rel, _FILE_FLAGS, dir_fd=pinned.fd)
        except OSError as e:
            raise ConfigError(_refusal(where, f"{rel} cannot be opened ({e.strerror})")) from None
        with os.fdopen(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != want.get("bytes"):
                raise ConfigError(_refusal(where, f"{rel} has {size} bytes, the manifest says {want.get('bytes')}"))
            if verify and hashlib.file_digest(fh, "sha256").hexdigest() != want.get("sha256"):
                # its sizes matched when it was chosen: a changed file, not a save cut short
                raise ConfigError(
                    f"not resuming from {where}: {rel} does not match its checksum (changed since it was saved); "
                    f"remove {where} to resume from the checkpoint before it, or set trainer.resume=never"
                )


# --- unpickling with an allowlist ----------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata through an allowlist (the "Restricting Globals" recipe of Python's pickle docs): the
    record types DCP defines for metadata and plans, torch.Size, dtypes, layouts and paths; any other global is
    refused. torch's own
    weights-only unpickler cannot read it (DCP pickles with protocol 4 framing, which it refuses)."""

    _RECORDS = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")  # Megatron's plans
    _TYPES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        import torch

        if module in self._RECORDS and not name.startswith("__"):
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:  # its records and enums, nothing imported
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self._TYPES:
            return super().find_class(module, name)
        elif (module, name) == ("builtins", "getattr"):  # how an enum member is pickled: only that is allowed
            return _enum_member
        raise pickle.UnpicklingError(f"global {module}.{name} is not checkpoint metadata")


def _enum_member(cls, name: str):
    """getattr(cls, name) where `cls` is an allowlisted enum (find_class let it through) and `name` one of its
    members; anything else is refused."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an enum member of checkpoint metadata")


class _RestrictedPickle:
    """Stands in for the `pickle` module inside torch's DCP filesystem reader while loading: `load` is the
    allowlisting unpickler, everything else is pickle's."""

    def __init__(self, real, where: Path | None, refused: list):
        self._real = real
        self._where = where  # the checkpoint's name for messages (the loaders read it relative to a descriptor)
        self._refused = refused  # DCP turns a reader's error into text in its own: the caller finds it here

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, file, **_):
        try:
            return _MetadataUnpickler(file).load()
        except pickle.UnpicklingError as e:
            name = Path(self._where or "") / str(getattr(file, "name", file))
            refusal = ConfigError(
                f"checkpoint metadata {name} holds objects that are not checkpoint metadata: not loaded ({e}); "
                "set trainer.resume=never to start over"
            )
            self._refused.append(refusal)
            raise refusal from None


@contextlib.contextmanager
def restricted_unpickling(allow=(), where: Path | None = None):
    """Every unpickling of a checkpoint inside: weights-only torch.load (forced even where a framework asks
    for weights_only=False) and DCP's metadata through an allowlist of its records; `allow`: the framework's own
    record types (DeepSpeed's enums and loss scaler) that its files legitimately hold; `where`: the checkpoint,
    as refusals name it. Yields the list of the metadata refusals made inside (a framework may reword them)."""
    import torch
    from torch.distributed.checkpoint import filesystem

    saved_env = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    saved_pickle = filesystem.pickle
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # torch reads it at each torch.load
    refused: list[ConfigError] = []
    filesystem.pickle = _RestrictedPickle(saved_pickle, where, refused)
    try:
        with torch.serialization.safe_globals(list(allow)):
            yield refused
    finally:
        filesystem.pickle = saved_pickle
        if saved_env is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved_env
