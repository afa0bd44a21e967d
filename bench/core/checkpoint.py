"""Checkpoints of a run, in its record folder: where they live, how they are committed, how resume finds them.

    RUN_DIR/checkpoints/step-000123/     one complete checkpoint (the step is the global optimizer step)
        meta.json                        written last, by rank 0: step, epoch, position, adapter, sizes
        trainer-rank{R}.pt               each rank's own: RNG states, sampler position, the epoch so far
        ...                              the adapter's files (DCP shards, DeepSpeed's tag folder, state.pt)
    RUN_DIR/checkpoints/.tmp-step-000123/  a save in progress: never read, removed by the next save

Atomic: every rank writes into the temp folder; after a barrier rank 0 writes meta.json there and
renames the folder to step-NNNNNN (one rename on one file system), then prunes to the newest K. A
crash at any point of a save leaves the previous checkpoints untouched and the temp folder
ignored. Only folders named step-* that hold meta.json count as checkpoints. meta.json carries the
manifest (each file's size and SHA-256). Resume chooses the newest checkpoint whose files are all there at
their sizes, passing over a damaged newer one (a save cut short) with one line that names it and why, and
hashes its files once, where they are loaded: through the descriptor the loaders read
(bench/core/checkpoint_load.py `pin`), so the checksums checked are those of what is loaded.

Resume (`trainer.resume=auto`): the newest verified checkpoint of a record of the same point
(results.point, bench/runner/points.py) under results.root/results.experiment (and results.dir) whose
status says it did not finish (RESUMABLE), with the same adapter and world size.

Plumbing: imports nothing of workloads, adapters or the runner (they hand in what they save).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import torch

from ptbench.core.checkpoint_load import unsafe_to_resume
from ptbench.core.errors import ConfigError
from ptbench.core.records import point_records, read_json, write_json

CHECKPOINTS = "checkpoints"
META = "meta.json"
RESUMABLE = ("preempted", "interrupted", "killed", "running", "failed", "timeout")  # a record that did not finish
RESUME_MODES = ("never", "auto")
_NAME = re.compile(r"step-(\d+)")


def check_config(cfg, adapter: str, unsupported: str | None) -> None:
    """One line per bad value of the trainer's checkpoint fields; `unsupported`: why the adapter cannot."""
    t = cfg.trainer
    if t.checkpoint_every < 0:
        raise ConfigError(f"trainer.checkpoint_every={t.checkpoint_every} must be >= 0 (steps; 0 = off)")
    if t.checkpoint_keep < 1:
        raise ConfigError(f"trainer.checkpoint_keep={t.checkpoint_keep} must be >= 1 (checkpoints kept)")
    if t.resume not in RESUME_MODES:
        raise ConfigError(f"trainer.resume={t.resume}: choose auto or never")
    if t.inject_stop is not None and not re.fullmatch(r"\d+:\d+", str(t.inject_stop)):
        raise ConfigError(
            f"trainer.inject_stop={t.inject_stop}: use RANK:STEP (that rank is asked to stop after "
            "that global step, as by a stop signal)"
        )
    if unsupported and t.checkpoint_every > 0:
        raise ConfigError(
            f"trainer.checkpoint_every={t.checkpoint_every}: adapter={adapter} cannot checkpoint "
            f"({unsupported}); set trainer.checkpoint_every=0"
        )


def enabled(cfg, unsupported: str | None) -> bool:
    """Whether this run writes checkpoints: asked for (every N steps, or resume=auto: on a stop signal)
    and the adapter can."""
    return unsupported is None and (cfg.trainer.checkpoint_every > 0 or cfg.trainer.resume == "auto")


# --- folders -------------------------------------------------------------------------------------
def folder(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def name(step: int) -> str:
    return f"step-{step:06d}"


def temp_path(run_dir: Path, step: int) -> Path:
    return folder(run_dir) / f".tmp-{name(step)}"


def complete(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    out = []
    base = folder(run_dir)
    if base.is_dir():
        for p in base.iterdir():
            m = _NAME.fullmatch(p.name)
            if m and (p / META).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest(run_dir: Path) -> Path | None:
    found = complete(run_dir)
    return found[-1][1] if found else None


def manifest(path: Path) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file of a checkpoint folder but meta.json."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file() and p.relative_to(path).as_posix() != META:
            out[p.relative_to(path).as_posix()] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damage(path: Path, checksums: bool = True) -> str | None:
    """Why checkpoint `path` cannot be loaded as written (a file missing, short, changed; meta.json
    unreadable), or None when every file of its manifest is there with its size and (`checksums`) its
    checksum. A checkpoint written before manifests existed is checked for its files' total size only."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return f"{META} unreadable ({type(e).__name__}: {e})"
    if not isinstance(meta, dict):
        return f"{META} is not a JSON object"
    files = meta.get("manifest")
    if files is None:
        if "bytes" in meta and tree_bytes(path) - (path / META).stat().st_size != meta["bytes"]:
            return (
                f"its files hold {tree_bytes(path) - (path / META).stat().st_size} bytes, {META} says {meta['bytes']}"
            )
        return None
    for rel, want in files.items():
        p = Path(path) / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {want['bytes']}"
        if checksums and _sha256(p) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def newest_verified(run_dir: Path, say=None) -> Path | None:
    """The newest checkpoint of `run_dir` whose files are all there at their manifest's sizes (`damage`
    without checksums: the rank that loads it hashes them once, through the descriptor it reads them by,
    checkpoint_load.pin); each damaged newer one is passed over with one line to `say` (default: stderr)
    naming it and why."""
    say = say or _stderr
    for _, p in reversed(complete(run_dir)):
        why = damage(p, checksums=False)
        if why is None:
            return p
        say(f"warning: checkpoint {p} is damaged ({why}): skipped, trying the next older one")
    return None


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def prepare(tmp: Path) -> None:
    """Rank 0, before a save: an empty temp folder (a crashed save's leftovers removed), mode 700 from the
    start: under umask 002 its files are group-writable until the commit, and a group member who opened one
    for writing in that window could change it after its checksum (an open descriptor outlives a chmod)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(tmp.parent.stat().st_mode)
    if mode & 0o022:  # no one else renames a checkpoint away or in
        tmp.parent.chmod(mode & ~0o022)
    tmp.mkdir(mode=0o700)
    tmp.chmod(0o700)  # mkdir's mode passes through the umask


def commit(tmp: Path, meta: dict) -> Path:
    """Rank 0, after every rank wrote into `tmp`: meta.json with the manifest (every file's size and
    SHA-256), written last, then one rename. Returns the checkpoint."""
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    files = manifest(tmp)
    meta = {**meta, "bytes": sum(f["bytes"] for f in files.values()), "files": len(files) + 1, "manifest": files}
    write_json(tmp / META, meta)
    make_private(tmp)
    _fsync_tree(tmp)
    if final.exists():  # the same step saved before (a resumed run stopped again at once): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Rank 0: remove all but the newest `keep` complete checkpoints, and stale temp folders."""
    removed = []
    for _, p in complete(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    base = folder(run_dir)
    for p in base.glob(".tmp-*") if base.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [*sorted(p for p in Path(path).rglob("*") if p.is_dir()), Path(path)]:
        _fsync_dir(d)


def crash_hook(step: int) -> None:
    """Test hook: BENCH_CHECKPOINT_CRASH_AT=STEP ends rank 0 hard once the temp folder of that step's
    save is complete and before it is committed (a crash during a save)."""
    at = os.environ.get("BENCH_CHECKPOINT_CRASH_AT")
    if at and int(at) == step:
        os._exit(3)


# --- each rank's own state -----------------------------------------------------------------------
def rng_state() -> dict:
    """Every RNG's state as tensors, lists and numbers only, so that the file loads with weights_only=True
    (numpy's key array as a list: an ndarray would need numpy's reconstructors allowlisted)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def save_rank_state(path: Path, rank: int, state: dict) -> None:
    torch.save(state, Path(path) / f"trainer-rank{rank}.pt")


def load_rank_state(path: Path, rank: int) -> dict:
    """This rank's own state: tensors, lists, dicts and numbers (`rng_state`), so weights-only: a pickle
    planted in a results folder (often a group's shared space) is refused, never run."""
    import pickle

    file = Path(path) / f"trainer-rank{rank}.pt"
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message is a page on how to load it unsafely: one line instead
        raise ConfigError(
            f"checkpoint {file} holds objects other than tensors, lists and numbers (an older ptbench's "
            f"numpy RNG state, or something planted): not loaded ({str(e).split('. ')[0]}); set "
            "trainer.resume=never to start over"
        ) from None


def open_to_everyone(run_dir: Path, roots) -> str | None:
    """One line refusing a resume when a folder from `run_dir` up to the results root it was found under may
    be written by every user of the machine without the sticky bit (anyone could rename our record away and
    theirs in), or None. A group-writable folder passes: a group member's swap is refused where the checkpoint
    is loaded (bench/core/checkpoint_load.py), through the descriptor that is read."""
    tops = {Path(r).resolve() for r in roots}
    p = Path(run_dir).resolve()
    while True:
        st = p.stat()
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return (
                f"not resuming from {run_dir}: {p} (mode {stat.S_IMODE(st.st_mode):04o}) may be written by every user "
                f"without the sticky bit, so anyone can swap a record in it: chmod o-w {p} (or +t), or set "
                "trainer.resume=never"
            )
        if p in tops or p.parent == p:
            return None
        p = p.parent


def make_private(path: Path) -> None:
    """Group and others lose write access to a committed checkpoint (a umask of 002, usual in shared group
    folders, would leave them writable and `unsafe_to_resume` would refuse the run's own checkpoint)."""
    for p in [Path(path), *Path(path).rglob("*")]:
        mode = p.lstat().st_mode
        if mode & 0o022 and not stat.S_ISLNK(mode):
            p.chmod(stat.S_IMODE(mode) & ~0o022)


def read_meta(path: Path) -> dict:
    return read_json(Path(path) / META)


# --- resume ----------------------------------------------------------------------------------------
def find_resumable(
    folders, point: str | None, adapter: str, world_size: int, exclude: Path | None = None, say=None
) -> tuple[Path, Path] | None:
    """(record folder, its newest checkpoint that verifies) of the newest unfinished record of `point`,
    or None. Records of another adapter or world size are passed over; a damaged checkpoint is skipped
    with one line to `say` (default: stderr) saying which and why; one that someone else could have written
    is refused (`unsafe_to_resume`, the pin's own checks) before its record is taken over."""
    if not point:
        return None
    best = None
    for path, s in point_records(folders, point):
        run_dir = path.parent.resolve()
        if exclude is not None and run_dir == Path(exclude).resolve():
            continue
        if s.get("status") not in RESUMABLE or s.get("adapter") != adapter or s.get("world_size") != world_size:
            continue
        if latest(run_dir) is None:
            continue
        ckpt = newest_verified(run_dir, say)
        if ckpt is None:
            (say or _stderr)(
                f"warning: record {run_dir} ({s.get('status')}) has no checkpoint that verifies: it is kept as "
                "it is, and this run starts from step 0 in a record of its own"
            )
            continue
        refusal = unsafe_to_resume(ckpt) or open_to_everyone(run_dir, folders)
        if refusal:
            raise ConfigError(refusal)
        when = read_meta(ckpt).get("time", 0)
        if best is None or when > best[0]:
            best = (when, run_dir, ckpt)
    return (best[1], best[2]) if best else None


def adopt(old: Path, new: Path) -> None:
    """Move an unfinished record's checkpoints and event log into the fresh record `new` (made by the
    launcher before the ranks started), then remove `old`: one record per point. Each step leaves a
    resumable state: the checkpoints move in one rename, so a crash leaves them in exactly one folder."""
    from ptbench.core.records import atomic_write

    events = Path(old) / "events.jsonl"
    if events.exists():
        atomic_write(Path(new) / "events.jsonl", events.read_text())
    try:  # the earlier record's outcome goes into the new one: an attempt that fails still names it
        before = read_json(Path(old) / "summary.json")
        current = read_json(Path(new) / "summary.json")
        keys = ("run_id", "status", "error", "steps", "epochs_completed")
        write_json(Path(new) / "summary.json", {**current, "previous_record": {k: before.get(k) for k in keys}})
    except (OSError, ValueError):
        pass
    if folder(new).exists():
        shutil.rmtree(folder(new))
    os.rename(folder(old), folder(new))
    shutil.rmtree(old, ignore_errors=True)


def attempt() -> dict:
    """Who ran this attempt (for `resumed_from`)."""
    import socket

    env = os.environ
    return {
        "host": socket.gethostname(),
        "time": time.time(),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_restart_count": env.get("SLURM_RESTART_COUNT"),
    }
