"""Data and scratch are ours or verified: what a second user in our Unix group (umask 002) can plant in a
shared dataset folder or a node's /tmp is never trained on, and a damaged first image is named, not a traceback.

- a token cache is keyed by its source's bytes (text and tokenizer, size and SHA-256) and read only from a
  handle that is a regular file only we (or root) can write: a planted, tampered or linked cache in a shared
  dataset's .bench_cache is named in one line and rebuilt in a folder of ours; a file renamed over a checked
  cache is refused by the reader (a DataLoader worker's copy of the dataset);
- slurm/stage_data.sh stages only into a folder it made or found as ours, in a folder no one else can swap it
  out of: a folder pre-made in /tmp with a forged marker, or a link, is refused in one line; a lock another
  user holds does not stop it; the staged copy is not writable by the group;
- the plan's memory check of data.cache_decoded treats a damaged first JPEG as the loader does.

The two-user cases run as two real uids (tests/conftest.py `two_users`), the scripts and readers for real.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ptbench.core.errors import ConfigError
from ptbench.workloads import data as D
from tests.helpers import REPO, bench

STAGE = REPO / "slurm" / "stage_data.sh"
JOB = "4242"


def _as(cmd: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")


def _read_argv(two_users, text: Path, tok: Path) -> list[str]:
    """`READ` as the victim, under umask 002. Not through TwoUsers' shell prefix: here the venv's interpreter
    links into a folder only root can enter, and a shell's exec of it as another uid is refused (setpriv's
    own exec of it runs)."""
    user = [f"--reuid={two_users.VICTIM}", f"--regid={two_users.GROUP}", f"--groups={two_users.GROUP}"]
    code = f"import os\nos.umask(0o002)\n{READ}"
    return ["setpriv", *user, sys.executable, "-c", code, str(text), str(tok)]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("warning:", "stage_data:", "error:", "ERROR"))]


# --- token caches ---------------------------------------------------------------------------------
# what a rank does with data=wikitext2 (workloads/gpt2.py `datasets`): the cache of the text, then its blocks
READ = (
    "import sys\nfrom ptbench.core.errors import ConfigError\nfrom ptbench.workloads import data as D\n"
    "try:\n    p = D.token_cache(sys.argv[1], sys.argv[2])\nexcept ConfigError as e:\n    sys.exit(f'ERROR {e}')\n"
    "print(p)\nprint(D.TokenBlocks(p, 8)[0][0].tolist())\n"
)
# the attacker's tokens: zeros, as many as the true cache holds, written by the shell (umask 002)
ZEROS = 'head -c "$2" /dev/zero > "$1"'


@pytest.fixture
def shared_text(two_users, data_root):
    """A group dataset folder holding 20 KB of Wikitext-2 and the GPT-2 tokenizer, as group members leave it
    (umask 002); the true first tokens of the text; the environment of either user (no BENCH_CACHE_DIR: the
    default cache folders)."""
    wt = two_users.shared(two_users.base / "datasets" / "wt")
    (two_users.base / "datasets").chmod(0o755)
    text = wt / "valid.txt"
    text.write_bytes((data_root / "wikitext-2" / "valid.txt").read_bytes()[:20_000])
    tok = two_users.shared(two_users.base / "datasets" / "tok")
    for name in D.TOKENIZER_FILES:
        shutil.copy(data_root / "gpt2-tokenizer" / name, tok / name)
    for p in (text, *tok.iterdir()):
        os.chown(p, two_users.VICTIM, two_users.GROUP)
        p.chmod(0o664)
    truth = D.gpt2_tokenizer(tok).encode(text.read_text(encoding="utf-8")).ids[:8]
    env = two_users.env()
    env.pop("BENCH_CACHE_DIR", None)
    return text, tok, truth, env


def _read_as_victim(two_users, text: Path, tok: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path, list]:
    proc = _as(_read_argv(two_users, text, tok), env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    path, tokens = proc.stdout.splitlines()[-2:]
    return proc, Path(path), eval(tokens)


@pytest.mark.parametrize("attack", ["planted", "tampered", "linked"])
def test_a_token_cache_others_could_write_in_a_shared_dataset_is_not_trained_on(two_users, shared_text, attack):
    """planted: the attacker's own file under the cache's name in .bench_cache; tampered: the victim's cache
    there, group-writable as a umask 002 left it, rewritten by the attacker; linked: a link under the cache's
    name to the attacker's file. Before: the victim's blocks were the attacker's tokens, without a word."""
    text, tok, truth, env = shared_text
    bench_cache = text.parent / ".bench_cache"
    # the cache's name follows from the text and the code, which anyone who can read them can work out
    real = D.token_cache(text, tok, cache_dir=str(two_users.base / "scratch"))
    planted, size = bench_cache / real.name, str(real.stat().st_size)
    if attack == "tampered":  # the victim's own cache, as a umask of 002 left it, then rewritten by a group member
        bench_cache.mkdir(mode=0o2775)
        shutil.copy(real, planted)
        for p, mode in ((bench_cache, 0o2775), (planted, 0o664)):
            os.chown(p, two_users.VICTIM, two_users.GROUP)
            p.chmod(mode)
        subprocess.run(two_users.attacker("sh", "-c", ZEROS, "sh", str(planted), size), check=True)
    elif attack == "planted":
        subprocess.run(two_users.attacker("mkdir", str(bench_cache)), check=True)
        subprocess.run(two_users.attacker("sh", "-c", ZEROS, "sh", str(planted), size), check=True)
    else:
        evil = two_users.base / "home" / "evil.u16"
        subprocess.run(two_users.attacker("sh", "-c", ZEROS, "sh", str(evil), size), check=True)
        subprocess.run(two_users.attacker("mkdir", str(bench_cache)), check=True)
        subprocess.run(two_users.attacker("ln", "-s", str(evil), str(planted)), check=True)
    assert np.fromfile(planted, dtype=np.uint16)[:8].tolist() != truth  # the attack is in place

    proc, path, tokens = _read_as_victim(two_users, text, tok, env)
    ours = Path(env["XDG_CACHE_HOME"]) / "trainbench"
    assert (tokens, path.parent) == (truth, ours), f"the victim's first block is {tokens}, from {path}"
    why = {
        "planted": f"owned by uid {two_users.ATTACKER}, not by this user",
        "tampered": "writable by its group (mode 664)",
        "linked": "a symbolic link",
    }[attack]
    assert _warnings(proc.stderr) == [
        f"warning: token cache {planted} is {why}: not used (whoever can write it chooses what is trained on); "
        f"building this user's own in {ours}"
    ], proc.stderr[-3000:]
    print(_warnings(proc.stderr)[0])
    assert path.name == planted.name
    assert path.stat().st_uid == two_users.VICTIM and path.stat().st_mode & 0o777 == 0o644  # umask 002 or not
    if attack != "planted":
        return
    # the next run takes the victim's own cache, silently: its mode passes the victim's own check
    again, path2, tokens2 = _read_as_victim(two_users, text, tok, env)
    assert (path2, tokens2, _warnings(again.stderr)) == (path, truth, [])
    # where no folder of ours can hold a cache, the planted one is still not used: one line, naming it
    env_no_home = {**env, "XDG_CACHE_HOME": "/proc/ptbench-no-cache"}
    refused = _as(_read_argv(two_users, text, tok), env_no_home)
    line = "ERROR data.cache_dir: no folder of ours for the token cache in /proc/ptbench-no-cache/trainbench ("
    assert refused.returncode == 1 and refused.stderr.startswith(line), refused.stderr[-3000:]
    (said,) = refused.stderr.strip().splitlines()
    assert said.endswith(
        f"{bench_cache} (owned by uid {two_users.ATTACKER}, not by this user); token cache {planted} is {why}: "
        "not used; set data.cache_dir=<a folder of yours>"
    ), said
    print(said)


def test_a_cache_is_keyed_by_its_text_not_its_size_and_mtime(data_root, tmp_path):
    """The text edited in place to the same size, its mtime put back (as `cp -p`, rsync -t or a tar restore
    leave it): before, the old cache was found by (size, mtime) and trained on."""
    tok = data_root / "gpt2-tokenizer"
    text = tmp_path / "wt" / "valid.txt"
    text.parent.mkdir()
    raw = (data_root / "wikitext-2" / "valid.txt").read_bytes()[:20_000]
    text.write_bytes(raw)
    first = D.token_cache(text, tok, cache_dir=str(tmp_path / "c"))
    st = text.stat()
    i = raw.index(b" the ")
    text.write_bytes(raw[:i] + b" THE " + raw[i + 5 :])
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (text.stat().st_size, text.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = D.token_cache(text, tok, cache_dir=str(tmp_path / "c"))
    assert second != first
    assert D.load_tokens(second).tolist() == D.gpt2_tokenizer(tok).encode(text.read_text(encoding="utf-8")).ids


def test_a_file_renamed_over_a_checked_cache_is_not_read_by_a_worker(data_root, tmp_path):
    """A DataLoader worker opens the cache by its path after the rank checked it: a file renamed into its place
    meanwhile (here another cache of the same user's, which passes every ownership check) is refused."""
    tok = data_root / "gpt2-tokenizer"
    raw = (data_root / "wikitext-2" / "valid.txt").read_bytes()
    paths = []
    for name, part in (("a", raw[:20_000]), ("b", raw[20_000:40_000])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "valid.txt").write_bytes(part)
        paths.append(D.token_cache(tmp_path / name / "valid.txt", tok, cache_dir=str(tmp_path / "c")))
    blocks = D.TokenBlocks(paths[0], 8)
    worker = pickle.loads(pickle.dumps(blocks))  # what a spawned DataLoader worker holds
    os.replace(paths[1], paths[0])
    with pytest.raises(ConfigError) as e:
        worker[0]
    assert str(e.value) == f"data.cache_dir: token cache {paths[0]} was replaced since it was checked: not read"


def test_a_second_builder_of_the_same_cache_keeps_the_first_file(data_root, tmp_path):
    """Two jobs sharing a cache folder both found no cache and both build it: the second to finish keeps the
    first's file, which the first job's workers read by the identity their rank checked (a rename over it
    would stop them, as above)."""
    from ptbench.workloads.token_cache import _write_cache

    text = tmp_path / "wt" / "valid.txt"
    text.parent.mkdir()
    text.write_bytes((data_root / "wikitext-2" / "valid.txt").read_bytes()[:20_000])
    path = D.token_cache(text, data_root / "gpt2-tokenizer", cache_dir=str(tmp_path / "c"))
    worker = pickle.loads(pickle.dumps(D.TokenBlocks(path, 8)))
    _write_cache(np.array(D.load_tokens(path)), path, path.with_name(".the-other-job.tmp"))  # what it publishes
    assert worker[0][0].tolist() == D.load_tokens(path)[:8].tolist()
    assert [p.name for p in (tmp_path / "c").iterdir()] == [path.name]


# --- stage_data.sh --------------------------------------------------------------------------------
@pytest.fixture
def node(two_users, data_root):
    """(the node's /tmp: sticky, everyone's; a group dataset folder, group-writable files as umask 002 leaves
    them; the job's environment for either user)."""
    tmp = two_users.base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    src = two_users.shared(two_users.base / "datasets")
    (src / "wikitext-2").mkdir()
    (src / "wikitext-2" / "valid.txt").write_bytes((data_root / "wikitext-2" / "valid.txt").read_bytes()[:20_000])
    for p in (src / "wikitext-2", src / "wikitext-2" / "valid.txt"):
        os.chown(p, two_users.VICTIM, two_users.GROUP)
        p.chmod(0o2775 if p.is_dir() else 0o664)
    env = {k: v for k, v in two_users.env().items() if not k.startswith("SLURM_")}
    return tmp, src, {**env, "SLURM_JOB_ID": JOB}


def _stage(two_users, env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _as(two_users.victim("bash", str(STAGE), *args), env, timeout)


def _forge(two_users, env: dict, folder: Path, src: Path) -> None:
    """The attacker's copy of the dataset with a marker that matches the job's (the source, its size, the job
    id: all guessable), in `folder`."""
    forge = (
        'mkdir -p "$1/wikitext-2" && echo poison > "$1/wikitext-2/valid.txt" && '
        'printf "src=%s\\nsize=%s\\njob=/%s\\n" "$2" "$(du -sb "$2" | cut -f1)" "$3" > "$1/.bench-staged"'
    )
    subprocess.run(two_users.attacker("sh", "-c", forge, "sh", str(folder), str(src), JOB), env=env, check=True)


@pytest.mark.parametrize("attack", ["folder", "link"])
def test_stage_data_refuses_a_folder_another_user_made_in_tmp(two_users, node, attack):
    """The attacker pre-makes /tmp/bench-data-<job> (or a link of that name to their folder) with a forged
    marker. Before: stage_data.sh said nothing and exited 0, and the ranks read the attacker's data."""
    tmp, src, env = node
    dest = tmp / f"bench-data-{JOB}"
    if attack == "folder":
        _forge(two_users, env, dest, src)
    else:
        _forge(two_users, env, tmp / "evil", src)
        subprocess.run(two_users.attacker("ln", "-s", str(tmp / "evil"), str(dest)), check=True)
    proc = _stage(two_users, env, str(src), str(dest))
    why = (
        f"owned by uid {two_users.ATTACKER}, not by this user (uid {two_users.VICTIM})"
        if attack == "folder"
        else "a symbolic link"
    )
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (
        1,
        [
            f"stage_data: not staging into {dest}: it is {why} (another user may have made or changed it); "
            "set STAGE_DIR=<a folder of yours on node-local disk>"
        ],
        "",
    )
    print(proc.stderr.strip())
    assert (dest / "wikitext-2" / "valid.txt").read_text() == "poison\n"  # theirs, left alone
    # --clean leaves it too, although its marker names this job
    clean = _stage(two_users, env, "--clean", str(dest))
    assert clean.returncode == 0 and "not removing" in clean.stderr and dest.is_dir()


def test_stage_data_copies_into_a_folder_of_ours_that_no_one_else_can_change(two_users, node):
    """The attacker holds a lock of the old name (DEST.lock, in /tmp) and waits to change the staged copy.
    Before: staging waited an hour for the lock; the copy kept the dataset's group-writable modes, so a group
    member could rewrite a file the ranks were reading."""
    tmp, src, env = node
    dest = tmp / f"bench-data-{JOB}"
    hold = 'umask 0; exec flock "$1" sleep 60'  # a lock file anyone may open, held
    holder = subprocess.Popen(two_users.attacker("sh", "-c", hold, "sh", f"{dest}.lock"), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not Path(f"{dest}.lock").exists():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.1)
        time.sleep(0.5)  # flock(1) has the lock once the file is there and the child sleeps
        proc = _stage(two_users, env, str(src), str(dest), timeout=20)
    finally:
        os.killpg(holder.pid, 9)
        holder.wait()
    assert proc.returncode == 0 and proc.stdout.startswith(f"staged {src} -> "), proc.stderr
    st = dest.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (two_users.VICTIM, 0o700)
    staged = dest / "wikitext-2" / "valid.txt"
    assert staged.read_bytes() == (src / "wikitext-2" / "valid.txt").read_bytes()
    assert not [p for p in dest.rglob("*") if p.lstat().st_mode & 0o022], "a staged file others can write"
    tamper = _as(two_users.attacker("sh", "-c", 'echo poison >> "$1"', "sh", str(staged)), env)
    assert tamper.returncode != 0 and b"poison" not in staged.read_bytes()
    # another task of the job reuses the copy, silently; --clean removes it (this job's, ours)
    again = _stage(two_users, env, str(src), str(dest))
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert _stage(two_users, env, "--clean", str(dest)).returncode == 0 and not dest.exists()


def test_stage_data_refuses_a_folder_others_can_swap_it_out_of(two_users, node):
    """STAGE_DIR in a group folder (setgid, group-writable, not sticky): a group member could rename the
    checked copy away and put their own in its place. Before: staged there without a word."""
    _, src, env = node
    group = two_users.shared(two_users.base / "group-scratch")
    dest = group / f"bench-data-{JOB}"
    proc = _stage(two_users, env, str(src), str(dest))
    assert (proc.returncode, proc.stderr.splitlines()) == (
        1,
        [
            f"stage_data: not staging into {dest}: {group} is writable by others (mode 2775), so another user "
            "could replace it after it is checked; set STAGE_DIR=<a folder of yours on node-local disk>"
        ],
    )
    assert not dest.exists()


# --- the first image of a split -------------------------------------------------------------------
def _damaged_first(data_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A 2-class ImageFolder of real CIFAR-10 JPEGs whose first file (in the order the check lists them) is
    a JPEG cut short."""
    root = tmp_path / "imgs"
    for cls in ("airplane", "automobile"):
        for split in ("train", "val"):
            (root / split / cls).mkdir(parents=True)
            for f in sorted((data_root / "cifar10-subset" / "train" / cls).iterdir())[:3]:
                shutil.copy(f, root / split / cls / f.name)
    cut = root / "train" / "airplane" / "0000.jpg"
    cut.write_bytes(cut.read_bytes()[:40])
    return root, cut


def test_a_damaged_first_image_is_what_the_loader_makes_of_it(data_root, tmp_path):
    root, cut = _damaged_first(data_root, tmp_path)
    proc = bench(
        "experiment=smoke",
        "workload=resnet50_tiny",
        "workload.num_classes=2",
        "data=cifar10",
        f"data.root={root}",
        "data.cache_decoded=true",
        "trainer.progress=false",
        "launcher.nprocs=1",
        results=tmp_path / "r",
        timeout=300,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"data.root: image {cut} cannot be decoded (" in line and line.endswith(
        "replace or remove the file, or set data.bad_images=skip to skip such files and count them in the record"
    ), line
    print(line)

    # the same line as the loader's for that file; with data.bad_images=skip the next file is measured
    with pytest.raises(D.BadImage) as loader:
        D.image_folder(root, "train", 32, bad_images="fail")[0]
    with pytest.raises(D.BadImage) as check:
        D.decoded_bytes_estimate(root / "train", "fail")
    assert str(check.value) == str(loader.value) and str(check.value).startswith(f"data.root: image {cut} cannot")
    assert D.decoded_bytes_estimate(root / "train", "skip") == 3 * 32 * 32 * 6  # the next file's size, x 6
    assert line == f"error: {check.value}"
