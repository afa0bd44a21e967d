"""Run records under results/<experiment>/<run_id>/, written atomically.

    config.yaml    the resolved config
    env.json       versions, host, devices, git sha, Slurm ids
    events.jsonl   one line per epoch (appended; each append rewrites the file via temp + rename)
    summary.json   status (ok / failed / oom / timeout / preempted / interrupted / killed / diverged / running) and the run's totals

Every key of those files is listed in bench/core/schema.py; a key it does not list is refused here.

A crash at any point leaves every file either in its previous state or its new one, never half. Every file
is strict JSON (a non-finite number is written null and named in `nonfinite`); a write that fails for
want of space is tried once more after releasing the record's reserve (RESERVE), so a run on a full disk
still ends with its error and a final status.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import json
import math
import os
import platform
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptbench.core import readers, schema
from ptbench.core.readers import MAX_EVENTS_BYTES, NotOurs, read_bytes, read_json, read_lines, readable

# Reading a results folder is the readers' (a leaf, which the analysis reads through too); named here as well for
# the commands that read and write records.
owner_gone, point_records, summaries = readers.owner_gone, readers.point_records, readers.summaries

# versions every record states; the runner adds each adapter's framework (from the adapter registry)
BASE_PACKAGES = ("torch", "torchvision", "hydra-core", "nvtx")
# skipped: a driver never ran the point (its framework is not installed); the rest are a run's own outcomes
# diverged: the training loss became non-finite (the step is in diverged_at_step); interrupted: stopped by
# SIGINT (Ctrl-C); killed: left `running` by a launcher killed outright, so marked by the next run of the point
STATUSES = ("running", "ok", "failed", "oom", "timeout", "preempted", "interrupted", "killed", "diverged", "skipped")


def atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise storage_error(e, path) from e
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise storage_error(e, path) from e
        raise


# what the storage under a run refuses (a full disk, a quota, a read-only mount, no permission): the run's
# fault only in where it writes, so its one line names the path and what to change
STORAGE_ERRNOS = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space in your quota there (quota -s)",
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "make it writable for this user",
    errno.EPERM: "make it writable for this user",
}


def storage_error(e: OSError, path: Path, fix: str = "or choose another results.root=PATH") -> OSError:
    """`e` as one line naming `path` and the fix when the storage refused the write (STORAGE_ERRNOS, errno
    kept: a full disk is still told apart), else `e` itself. A message already named is kept as it is."""
    what = STORAGE_ERRNOS.get(e.errno)
    if what is None or str(e.strerror).startswith("cannot write "):
        return e
    return OSError(e.errno, f"cannot write {path} ({e.strerror or e}): {what}, {fix}")


def write_json(path: Path, obj) -> None:
    atomic_write(path, dumps(obj, indent=2) + "\n")


def dumps(obj, indent: int | None = None) -> str:
    """Strict JSON (RFC 8259): a non-finite float (NaN, inf) is written null; `nonfinite` finds them first."""
    return json.dumps(finite(obj)[0], indent=indent, sort_keys=True, default=str, allow_nan=False)


def finite(obj, path: str = "") -> tuple[object, list[str]]:
    """(`obj` with every non-finite float replaced by None, the dotted paths of those replaced)."""
    if isinstance(obj, float):
        return (obj, []) if math.isfinite(obj) else (None, [path])
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite(v, f"{path}.{k}" if path else str(k))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        items = [finite(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return [v for v, _ in items], [p for _, b in items for p in b]
    if type(obj).__module__ == "numpy" and getattr(obj, "shape", None) == ():
        return finite(obj.item(), path)
    return obj, []


def flag_nonfinite(record: dict) -> dict:
    """`record` with `nonfinite` listing the fields whose non-finite values the writer will write null."""
    bad = [p for p in finite({k: v for k, v in record.items() if k != "nonfinite"})[1]]
    return {**record, "nonfinite": sorted(set(bad))} if bad else record


def results_folder(results) -> Path:
    """The folder a run's record folder goes in (`results`: the config's results group): results.dir
    (a sweep's folder) or else results.root/results.experiment."""
    return Path(results.dir or Path(results.root) / results.experiment)


def command_root(command: str) -> Path:
    """Where a measuring command's runs go without --root: results/<command>-<time>/ under the working directory,
    beside every other record (never the system's temporary folder, which a cluster cleans and a laptop fills)."""
    return Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def point_folders(results) -> set[Path]:
    """Where earlier records of a point may be (`results`: the config's results group):
    results.root/results.experiment, and results.dir (a sweep's folder) or else results.root."""
    return {Path(results.root) / results.experiment, Path(results.dir or results.root)}


def new_run_id(adapter: str, workload: str, world_size: int) -> str:
    """Unique across array tasks, requeues and Slurm restarts: time + host + random, never the job id alone."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    slurm = f"-j{job}" + (f"_{task}" if task else "") if job else ""
    return f"{stamp}-{adapter}-{workload}-w{world_size}{slurm}-{secrets.token_hex(3)}"


# Bytes set aside in every record folder (RESERVE) while the run is on: when a write fails for want of space
# (a full disk, a quota), the reserve is released and the write tried once more, so the record still gets
# its error and its final status. Every other rank keeps a smaller one of its own (RESERVE.rank<r>) for its
# error file: ranks that fill one disk at once would otherwise race for rank 0's. All are removed when the
# final summary is written.
RESERVE = ".space-reserve"
RESERVE_BYTES = 256 * 1024
RANK_RESERVE_BYTES = 64 * 1024  # an error file with its traceback: a few KiB
_FULL = (errno.ENOSPC, errno.EDQUOT)


class NotOurFolder(PermissionError):
    """A record folder that is not this user's to write in (another user's, or their link): one line."""


def _not_ours(path: Path, what: str) -> str:
    return (
        f"cannot write {path}: it is {what}, not a folder of this user's: a record is never written where someone "
        "else can redirect it; remove it (or ask its owner to), or choose another results.run_id or results.root"
    )


def own_folder(path: Path) -> int:
    """A descriptor of the folder `path`, made if missing, which must be ours (readers.own_folder: reached through no
    link another user made, and owned by us; PermissionError, one line, otherwise), and made private (no group/other
    write) where it is not: under umask 002 a member of the group could plant files or links in it. Every write of a
    record goes through such a descriptor, so a folder renamed away or replaced by a link after this check gets none
    of them."""
    try:
        fd = readers.own_folder(path)
    except NotOurs as e:
        if e.at is None:  # a file where a folder should be, or a link swapped in while it was checked
            raise NotADirectoryError(errno.ENOTDIR, f"cannot write {path}: it {e.why}") from None
        if e.link and e.at == e.path:
            what = f"a symbolic link (to {_link_target(e.at)}) made by uid {e.uid}"
        elif e.link:
            what = f"reached through {e.at}, a symbolic link made by uid {e.uid}"
        else:
            what = f"another user's folder (uid {e.uid})"
        raise NotOurFolder(errno.EPERM, _not_ours(path, what)) from None
    except OSError as e:
        raise storage_error(e, path) from e
    st = os.fstat(fd)
    if st.st_mode & 0o022:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    return fd


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def write_at(dir_fd: int, name: str, text: str, shown: Path) -> None:
    """`name` in the folder `dir_fd`, atomically: a new temp file (O_EXCL and O_NOFOLLOW: never an existing file or
    a link) renamed onto it (a link there is replaced, not followed). `shown`: the path an error names."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise storage_error(e, shown) from e
    try:
        with open(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(e, OSError):
            raise storage_error(e, shown) from e
        raise


# A launcher of ours completes the final summary of the ranks it started (with the contention it sampled while they
# ran) and writes it as the record's one final write: until then a rank's final word waits in STAGED and summary.json
# reads `running`, so a launcher stopped in between leaves no `ok` without its contention verdict (the next run of
# the point marks it killed). SETTLER_ENV names that launcher (pid) and the record folder: a rank of any other run,
# or one whose launcher is gone, writes summary.json itself.
STAGED = ".summary.final.json"
SETTLER_ENV = "BENCH_RECORD_SETTLER"


def settler_environment(run_dir: Path) -> dict[str, str]:
    """The variable a launcher gives the ranks it starts so that it, not they, writes their final summary."""
    return {SETTLER_ENV: f"{os.getpid()} {run_dir}"}


class RunRecord:
    """One record folder. Every write goes through a descriptor of the folder checked as ours (`own_folder`) and
    never follows a link; reads are bounded (`read_bytes`)."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)

    @contextlib.contextmanager
    def _opened(self):
        fd = own_folder(self.dir)
        try:
            yield fd
        finally:
            os.close(fd)

    def _reserve_name(self, rank: int) -> str:
        return RESERVE if rank == 0 else f"{RESERVE}.rank{rank}"

    def reserve(self, rank: int = 0) -> None:
        """Set bytes aside for `rank` (real blocks: zeros written, not a sparse file); never fails a run."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with (
                self._opened() as folder,
                open(os.open(self._reserve_name(rank), flags, 0o600, dir_fd=folder), "wb") as f,
            ):
                f.write(b"\0" * (RESERVE_BYTES if rank == 0 else RANK_RESERVE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self.release(rank)

    def release(self, rank: int = 0) -> bool:
        try:
            with self._opened() as folder:
                os.unlink(self._reserve_name(rank), dir_fd=folder)
            return True
        except OSError:
            return False

    def release_all(self) -> None:
        if not self.dir.is_dir():
            return
        with self._opened() as folder:
            for name in os.listdir(folder):
                if name == RESERVE or name.startswith(f"{RESERVE}.rank"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=folder)

    def _write_json(self, name: str, obj, rank: int = 0) -> None:
        """write_at; on a full disk, once more after releasing the writing rank's reserve (rank 0's as well when
        that one is gone)."""
        text = dumps(obj, indent=2) + "\n"
        with self._opened() as folder:
            try:
                write_at(folder, name, text, self.dir / name)
            except OSError as e:
                if e.errno not in _FULL or not (self.release(rank) or (rank != 0 and self.release())):
                    raise
                write_at(folder, name, text, self.dir / name)

    def _read(self, name: str):
        try:
            return read_json(self.dir / name)
        except FileNotFoundError:
            return None

    def create(self, config_yaml: str, packages: tuple[str, ...] = ()) -> None:
        with self._opened() as folder:
            write_at(folder, "config.yaml", config_yaml, self.dir / "config.yaml")
        self._write_json("env.json", environment(packages))

    def append_event(self, event: dict) -> None:
        event = flag_nonfinite(event)
        schema.check(event, schema.EPOCH_EVENT, "events.jsonl")
        line = dumps(event) + "\n"
        with self._opened() as folder:
            try:
                old = read_bytes("events.jsonl", MAX_EVENTS_BYTES, folder).decode()
            except FileNotFoundError:
                old = ""
            write_at(folder, "events.jsonl", old + line, self.dir / "events.jsonl")

    def events(self) -> list[dict]:
        try:
            return read_lines(self.dir / "events.jsonl")
        except FileNotFoundError:
            return []

    def summary(self) -> dict | None:
        """The record's newest word: summary.json, or while that reads `running`, a final summary STAGED for the
        launcher to complete."""
        current = self._read("summary.json")
        if current is None or current.get("status") == "running":
            return self._read(STAGED) or current
        return current

    def write_summary(self, summary: dict, name: str = "summary.json") -> None:
        assert summary.get("status") in STATUSES, summary.get("status")
        summary = flag_nonfinite(summary)
        schema.check(summary, schema.SUMMARY, "summary.json")
        self._write_json(name, summary)
        if name == "summary.json" and summary["status"] != "running":  # final: nothing is staged any more
            with self._opened() as folder, contextlib.suppress(FileNotFoundError):
                os.unlink(STAGED, dir_fd=folder)

    def write_rank_error(self, rank: int, error: dict) -> None:
        self._write_json(f"error-rank{rank}.json", error, rank)

    def rank_errors(self) -> list[dict]:
        return [read_json(p) for p in sorted(self.dir.glob("error-rank*.json"))]


class RunWriter:
    """The one writer of a run's summary.json: `start` (status running), `fail`, `finish`, and for the launcher of
    the ranks `settle`. Every summary carries the run's identity (RunPlan.identity()) and run_id, whatever its
    status; `complete` (the launcher's: its sampled contention) is applied to every final summary this process
    writes, in the same write."""

    def __init__(self, run_dir: Path, identity: dict):
        self.record = RunRecord(run_dir)
        self.identity = {"run_id": Path(run_dir).name, **identity}
        self.complete = None

    @property
    def dir(self) -> Path:
        return self.record.dir

    def _claim(self) -> bool:
        """Make the record folder (private), or accept one of ours already there; True when made here. A folder
        another user made, or a link, is refused in one line: our record would go where they can redirect it."""
        from ptbench.core.errors import ConfigError

        self.dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.dir)  # then without group/other write (own_folder), whatever the umask
            made = True
        except FileExistsError:
            made = False
        try:
            os.close(own_folder(self.dir))  # ours, and private even under umask 002, before a file is in it
        except NotOurFolder as e:
            raise ConfigError(f"results.run_id={self.dir.name}: {e.strerror}") from None
        return made

    def start(self, config_yaml: str, packages: tuple[str, ...] = ()) -> None:
        """A new record: refused (one line, nothing written) when the folder already holds one or is not ours."""
        from ptbench.core.errors import ConfigError

        made = False
        try:
            made = self._claim()
            held = [n for n in ("summary.json", "events.jsonl", "config.yaml") if (self.dir / n).exists()]
            if held:
                status = (readable(self.dir / "summary.json") or {}).get("status", "unknown")
                raise ConfigError(
                    f"results.run_id={self.dir.name}: {self.dir} already holds a record (status {status}); it is "
                    "never overwritten: choose another results.run_id, or leave it unset for a new one"
                )
            self.record.create(config_yaml, packages)
            self.record.write_summary({"status": "running", **self.identity, "owner": owner()})
        except OSError as named:  # a full disk, a read-only folder: one line, no empty record folder left behind
            e = named.__cause__ if isinstance(named.__cause__, OSError) else named  # as the system said it
            if made:
                shutil.rmtree(self.dir, ignore_errors=True)
            blocker = next((p for p in (self.dir, *self.dir.parents) if p.exists() and not p.is_dir()), None)
            fix = (
                "free space there"
                if e.errno in _FULL
                else f"{blocker} is a file, not a folder: move it"
                if blocker
                else f"{e.filename or self.dir} must be writable"
            )
            raise ConfigError(
                f"cannot write the record {self.dir} ({e.strerror or e}): {fix}, or choose another results.root=PATH"
            ) from None
        self.record.reserve()

    def _by_launcher(self) -> bool:
        """This process is a rank whose launcher (alive) completes and writes its final summary (SETTLER_ENV)."""
        pid, _, where = os.environ.get(SETTLER_ENV, "").partition(" ")
        if where != str(self.dir) or not pid.isdigit() or int(pid) == os.getpid():
            return False
        if int(pid) == os.getppid():  # a forked rank's launcher: reparented at once when it dies
            return True
        try:
            import psutil

            return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE  # killed, not yet reaped: gone
        except Exception:  # noqa: BLE001 - no such process, or psutil missing: no launcher to wait for
            return False

    def _final(self, summary: dict) -> None:
        """A final summary: staged for the launcher (a rank it started), else completed and written in one write."""
        if self._by_launcher():
            self.record.write_summary(summary, STAGED)
            return
        if self.complete is not None:
            self.complete(summary)
        self.record.write_summary(summary)
        self.record.release_all()

    def settle(self) -> None:
        """The launcher, once its ranks have ended: a final summary one of them staged, completed and written."""
        staged = self.record._read(STAGED)
        current = self.record._read("summary.json") or {}
        if isinstance(staged, dict) and current.get("status") in (None, "running"):
            self._final(staged)

    def fail(self, status: str, error: str, failed_rank: int | None = None, **extra) -> None:
        """A failed outcome; the first word wins: an outcome already written (or staged by rank 0) is kept."""
        current = self.record.summary() or {}
        if current.get("status") not in (None, "running"):
            # final already (rank 0 wrote it, then was ended before it released the reserve: a second Ctrl-C)
            if not self._by_launcher():
                self.settle()
                self.record.release_all()
            return
        current.pop("owner", None)  # a running record's writer: this one, now final
        self._final({**current, **self.identity, "status": status, "error": error, "failed_rank": failed_rank, **extra})

    def finish(self, summary: dict) -> None:
        self._final({**summary, **self.identity})


def provenance() -> dict:
    """The harness's own version: the installed package version, and at launch the checkout's commit and
    whether tracked files differ from it. git_* are None when this copy is not a git checkout of the
    harness (an installed wheel, even one inside some other repository)."""
    try:
        version = importlib.metadata.version("ptbench")
    except importlib.metadata.PackageNotFoundError:
        version = None
    sha = dirty = None
    root = Path(__file__).resolve().parents[2]  # a checkout: bench/core/records.py under it
    if (root / "bench" / "core" / "records.py").is_file() and (root / ".git").exists():
        try:

            def git(*args):
                return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

            out = git("rev-parse", "HEAD")
            if out.returncode == 0 and out.stdout.strip():
                sha = out.stdout.strip()
                status = git("status", "--porcelain", "--untracked-files=no")
                dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"package_version": version, "git_sha": sha, "git_dirty": dirty}


def owner() -> dict:
    """Who writes a running record's final status: this process (host, pid, its start time), so that a
    reader can tell a run still going from one whose launcher was killed outright (SIGKILL, the OOM killer)."""
    try:
        import psutil

        started = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing or refused: the reader then cannot tell
        started = None
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started}


def mark_killed(folders, point: str | None, say=None) -> list[Path]:
    """Before a new run of `point`: every record of it left `running` by a launcher that is gone (`owner_gone`)
    gets its final status `killed` with that line as its error, and loses its space reserve; one line to `say`
    (default: stderr) per record. Returns their folders. Never fails the run that asks; another user's record is
    never written (`own_folder`)."""
    marked = []
    for path, s in point_records(folders, point, say) if point else ():
        why = s.get("status") == "running" and owner_gone(s.get("owner"))
        if not why:
            continue
        record = RunRecord(path.parent)
        try:
            record.write_summary({**{k: v for k, v in s.items() if k != "owner"}, "status": "killed", "error": why})
        except (OSError, ValueError, AssertionError):
            continue
        record.release_all()
        marked.append(path.parent)
        print(f"warning: record {path.parent} was left running: {why}; marked killed", file=say or sys.stderr)
    return marked


def environment(packages: tuple[str, ...] = ()) -> dict:
    versions = {}
    for name in dict.fromkeys((*BASE_PACKAGES, *packages)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env = {
        "python": platform.python_version(),
        "versions": versions,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "system": system_info(),
        **provenance(),
        "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k in SLURM_KEYS},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env.update(gpu_environment(torch))
    except ImportError:
        pass
    return schema.check(env, schema.ENV, "env.json")


def gpu_environment(torch) -> dict:
    """What a GPU user needs to compare runs: versions (driver, CUDA, cuDNN, NCCL), the GPUs (name,
    memory, count), the topology (`nvidia-smi topo -m`), NCCL_* / CUDA_* variables, TF32 flags. The GPUs are
    named by NVML where it can tell the visible ones: the launcher writes this, and it must not hold a CUDA
    context on GPU 0 beside the ranks for the whole run."""
    gpus = visible_gpus_nvml()
    if gpus is None:
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        gpus = [(p.name, int(p.total_memory)) for p in props]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    out = {
        "gpus": [name for name, _ in gpus],
        "gpu_count": len(gpus),
        "gpu_memory_bytes": [total for _, total in gpus],
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "gpu_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "CUDA_"))},
    }
    out.update(nvml_gpus())
    out.update(nvidia_smi())
    return out


def visible_gpus_nvml() -> list[tuple[str, int]] | None:
    """(name, total bytes) of each GPU this process may use, in CUDA's order, from NVML (no CUDA context);
    None where NVML is missing or CUDA_VISIBLE_DEVICES names devices NVML cannot map (MIG instances)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no package, no library, no driver
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        else:
            handles = [_nvml_handle(pynvml, d.strip()) for d in visible.split(",") if d.strip()]
        if any(h is None for h in handles):
            return None
        return [(_text(pynvml.nvmlDeviceGetName(h)), int(pynvml.nvmlDeviceGetMemoryInfo(h).total)) for h in handles]
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_handle(pynvml, device: str):
    if device.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(device))
    if device.startswith("GPU-"):
        return pynvml.nvmlDeviceGetHandleByUUID(device)
    return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def system_info() -> dict:
    """The machine as torch's own environment report describes it (torch.utils.collect_env, the functions
    behind `python -m torch.utils.collect_env`): OS, libc, compiler, CPU model (lscpu), CUDA runtime,
    driver, GPU models, cuDNN. Its pip and conda listings are left out (0.6 s a run; `versions` holds the
    packages that matter). {} where torch or a probe is unavailable."""
    try:
        from torch.utils import collect_env as ce
    except ImportError:
        return {}
    probes = {
        "os": lambda: ce.get_os(ce.run),
        "libc": ce.get_libc_version,
        "gcc": lambda: ce.get_gcc_version(ce.run),
        "cpu_info": lambda: ce.get_cpu_info(ce.run),
        "cuda_runtime": lambda: ce.get_running_cuda_version(ce.run),
        "nvidia_driver": lambda: ce.get_nvidia_driver_version(ce.run),
        "gpu_models": lambda: ce.get_gpu_info(ce.run),
        "cudnn": lambda: ce.get_cudnn_version(ce.run),
    }
    out = {}
    for key, probe in probes.items():
        try:
            out[key] = probe()
        except Exception:  # noqa: BLE001 - a probe the machine lacks (no lscpu, no gcc) is not an error of the run
            out[key] = None
    return out


def nvml_gpus() -> dict:
    """Driver version and the GPUs (name, total memory, PCI bus id) from NVML through nvidia-ml-py, imported
    here only; {} without the package, without the NVML library or a driver (a CPU machine), or on an NVML
    error: a record is never refused for what it cannot describe."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}

    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "memory": f"{pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20} MiB",
                    "bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                }
            )
        return {"driver": _text(pynvml.nvmlSystemGetDriverVersion()), "nvidia_smi_gpus": gpus}
    except pynvml.NVMLError:
        return {}
    finally:
        pynvml.nvmlShutdown()


def nvidia_smi(run=None) -> dict:
    """The `nvidia-smi topo -m` matrix (text, as a reader compares it; NVML has only per-pair levels), when
    nvidia-smi is on PATH. `run(args) -> stdout` is injectable (tests feed recorded output)."""
    import shutil

    if run is None:
        if not shutil.which("nvidia-smi"):
            return {}

        def run(args):
            return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout

    try:
        topo = run(["topo", "-m"]).strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"topology": topo} if topo else {}


SLURM_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
    "SLURM_JOB_PARTITION",  # compare lists a partition change among the environment differences
)
