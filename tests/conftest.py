"""Shared test setup: the repo on sys.path, data roots from the environment, and the one rule for
missing prerequisites.

BENCH_DATA_ROOT defaults to <repo>/../shared/data (the offline data next to the repo); CI or a
user points it elsewhere. BENCH_CACHE_DIR defaults to <repo>/.pytest_cache/bench_cache so that
token caches built by tests never land inside the data folder (git ignores .pytest_cache): every
test that reads WikiText shares that one cache, so the corpus is tokenized once per checkout.

A test that cannot run because something outside the repo is missing (the data, Horovod, a Slurm
cluster) calls `require_or_skip(what, reason)`: it skips with the reason, except under CI (CI set
to 1, true, yes or on, any case), where the prerequisite must be there and its absence fails.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("BENCH_DATA_ROOT", str((REPO.parent / "shared" / "data").resolve()))
os.environ.setdefault("BENCH_CACHE_DIR", str(REPO / ".pytest_cache" / "bench_cache"))

_TRUTHY = ("1", "true", "yes", "on")


def in_ci(env=None) -> bool:
    """CI is set to a truthy value (1/true/yes/on, case and surrounding blanks ignored)."""
    return (os.environ if env is None else env).get("CI", "").strip().lower() in _TRUTHY


def require_or_skip(what: str, reason: str):
    """`what` (a prerequisite) is missing because of `reason`: fail under CI, skip otherwise. Never returns."""
    if in_ci():
        pytest.fail(f"CI needs {what}: {reason}", pytrace=False)
    pytest.skip(f"{what} unavailable: {reason}")


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The folder holding wikitext-2/, gpt2-tokenizer/, cifar10-subset/ (skip if absent; fail under CI)."""
    root = Path(os.environ["BENCH_DATA_ROOT"])
    missing = [
        p
        for p in ("wikitext-2/train.txt", "gpt2-tokenizer/vocab.json", "cifar10-subset/val")
        if not (root / p).exists()
    ]
    if missing:
        require_or_skip("the test data (BENCH_DATA_ROOT)", f"{root} lacks {', '.join(missing)}")
    return root


# --- shared reference runs ------------------------------------------------------------------------
# Several files assert different things about the same run: each is launched once per session and
# returned as its run folder; the test workers share it (pytest-xdist's recipe: the first worker to need
# it makes it under the session's common temp folder while holding a file lock, the others wait and read
# it). Tests only read these folders.
def shared_run(tmp_path_factory, name: str, *overrides: str) -> Path:
    from filelock import FileLock

    from tests.helpers import bench, check_ok, only_run

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the folder every worker's basetemp is in
    root = base / name
    with FileLock(f"{root}.lock"):
        made = base / f"{name}.made"
        if not made.exists():  # a failed attempt leaves no mark: the next worker tries (and fails) on its own
            shutil.rmtree(root, ignore_errors=True)
            check_ok(bench(*overrides, results=root))
            made.touch()
    return only_run(root)


@pytest.fixture(scope="session")
def ddp_gpt2_reference(tmp_path_factory) -> Path:
    """2-rank DDP with helpers.GPT2_REFERENCE (gpt2_tiny, 8 AdamW steps of 4 sequences per rank, clipping
    off): what 1-rank DDP (test_spine), ZeRO 0-3 and FSDP (test_sharded) and Horovod (test_horovod) equal."""
    from tests.helpers import GPT2_REFERENCE

    return shared_run(tmp_path_factory, "ddp_gpt2_reference", *GPT2_REFERENCE, "adapter=ddp", "launcher.nprocs=2")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """`python -m ptbench` with helpers.SMOKE (experiment=smoke at vocabulary 256: DDP, 2 local ranks, 4
    steps): the good record of test_reliability, the local twin of test_launch's torchrun run, and the
    record whose fields test_measurement_audit reads. Its ranks are spawned, as on a GPU machine (the other local
    runs of the suite fork them: launcher.start_method=auto on a CPU)."""
    from tests.helpers import SMOKE

    return shared_run(tmp_path_factory, "smoke_run", *SMOKE, "launcher.start_method=spawn")


# --- workers (pytest-xdist: `make test` runs -n $(TEST_WORKERS)) ---------------------------------
# A file's tests stay on one worker (its module-scoped reference runs are made once). The files that
# start a local Slurm cluster share one scope: one cluster at a time (the one-node and the two-node
# cluster cannot run side by side). xdist hands out the scopes with the most tests first; handing out
# the longest files first instead was measured slower (930 s against 885 s for the whole suite: two
# heavy multi-rank files side by side contend for the 2 cores more than a heavy one beside light
# ones). xdist's own `--dist loadgroup` reads a node id attribute that pytest 9.2 no longer uses, so
# the scopes are set here, through xdist's scheduler hook and its LoadScopeScheduling._split_scope.
SLURM_SCOPE = "local-slurm-cluster"
SLURM_FILES = ("tests/test_hydra_launchers.py", "tests/test_multinode.py", "tests/test_paper.py", "tests/test_slurm.py")


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SLURM_SCOPE if path in SLURM_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByFile(config, log)


# --- two users on one machine ----------------------------------------------------------------------
class TwoUsers:
    """A victim and an attacker who share a group, as two members of one project on a cluster: uids and
    gids above any real account's (setpriv takes numbers, no passwd entry needed). `victim(cmd)` and
    `attacker(cmd)` are argv prefixes; the victim runs under umask 002, as in a group folder. `base` is a
    folder both can enter (pytest's own folders are root's, mode 700); `shared(path)` makes a group folder
    there (setgid, mode 2775, the group's)."""

    GROUP, VICTIM, ATTACKER = 61000, 61001, 61002

    def __init__(self, base: Path):
        self.base = base

    def _as(self, uid: int, gid: int, groups: str, umask: str) -> list[str]:
        # the umask is set before setpriv: an unprivileged process cannot exec our python (under /root, mode 700)
        # a second time, setpriv's own exec can
        return [
            "sh",
            "-c",
            f'umask {umask}; exec "$@"',
            "sh",
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            f"--groups={groups}",
        ]

    def victim(self, *cmd: str) -> list[str]:
        return [*self._as(self.VICTIM, self.GROUP, str(self.GROUP), "002"), *cmd]

    def attacker(self, *cmd: str) -> list[str]:
        return [*self._as(self.ATTACKER, self.ATTACKER, str(self.GROUP), "002"), *cmd]

    def shared(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.VICTIM, self.GROUP)
        path.chmod(0o2775)
        return path

    def env(self, **extra) -> dict:
        """The environment for either user: HOME and caches in `base` (root's are not theirs)."""
        home = self.base / "home"
        home.mkdir(exist_ok=True)
        home.chmod(0o1777)
        return {
            **os.environ,
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "PYTHONUNBUFFERED": "1",
            **extra,
        }


@pytest.fixture
def two_users():
    """TwoUsers in a fresh folder under /tmp, removed afterwards; skipped (failed under CI) without root and
    setpriv."""
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        require_or_skip("root and setpriv", "the two-user attacks run as two uids")
    base = Path(tempfile.mkdtemp(prefix="ptbench-two-users-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield TwoUsers(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
