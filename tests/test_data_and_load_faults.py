"""The data path checks what it reads, and nothing the harness reads runs code: real faults.

A token cache cut short is rebuilt, saying so; text that is not UTF-8 is one line naming the file and
the byte; a damaged image (a JPEG cut short, a file of garbage) ends the run in one line naming it, or
with data.bad_images=skip is skipped and counted; a DataLoader worker killed by a signal is named with
its signal; a rank's own state loads weights-only, and a checkpoint folder others can write is refused
before a pickle planted in it is read.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ptbench.core import checkpoint as ckpt
from ptbench.core.errors import ConfigError
from ptbench.core.loaders import WorkerDied, train_loader
from ptbench.core.records import read_json, write_json
from ptbench.workloads import data as D
from tests.helpers import SMOKE, bench, check_ok, kill_group, only_run, start, summary
from tests.test_checkpoint import TINY as CHECKPOINT_TINY


# --- token cache and text -------------------------------------------------------------------------
@pytest.fixture
def tokenizer_dir(data_root) -> Path:
    return data_root / "gpt2-tokenizer"


def test_a_truncated_token_cache_is_rebuilt_saying_so(data_root, tokenizer_dir, tmp_path):
    text = data_root / "wikitext-2" / "valid.txt"
    path = D.token_cache(text, tokenizer_dir, cache_dir=str(tmp_path))
    assert path.name.endswith(".258659.u16") and D.load_tokens(path).size == 258_659  # the README's figure
    with open(path, "r+b") as f:  # cut short after it was written (a full disk, a copy, a crash)
        f.truncate(100_000)
    said = []
    again = D.token_cache(text, tokenizer_dir, cache_dir=str(tmp_path), say=said.append)
    assert said == [
        f"warning: token cache {path} holds 100000 bytes, not the 517318 of its 258659 tokens (cut short after "
        f"it was written): rebuilding it from {text}"
    ]
    assert again == path and D.load_tokens(again).size == 258_659
    assert D.token_cache(text, tokenizer_dir, cache_dir=str(tmp_path), say=said.append) == path and len(said) == 1


def test_another_rank_never_takes_a_truncated_cache(data_root, tokenizer_dir, tmp_path):
    text = data_root / "wikitext-2" / "valid.txt"
    path = D.token_cache(text, tokenizer_dir, cache_dir=str(tmp_path))
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(TimeoutError):  # it waits for local rank 0 to rebuild it
        D.token_cache(text, tokenizer_dir, cache_dir=str(tmp_path), local_rank=1, wait_s=0.6)


def test_text_that_is_not_utf8_is_one_line_naming_the_file_and_byte(data_root, tokenizer_dir, tmp_path):
    raw = (data_root / "wikitext-2" / "valid.txt").read_bytes()
    bad = tmp_path / "wt" / "valid.txt"
    bad.parent.mkdir()
    bad.write_bytes(raw[:5000] + b"caf\xe9" + raw[5000:])  # Latin-1 e-acute: a byte UTF-8 cannot start with
    with pytest.raises(ConfigError) as e:
        D.token_cache(bad, tokenizer_dir, cache_dir=str(tmp_path / "c"))
    line = raw[:5003].count(b"\n") + 1
    assert str(e.value) == (
        f"data.root: {bad} is not valid UTF-8 at byte 5003 (line {line}, byte 0xe9): restore the file, or "
        "convert it to UTF-8 (iconv -f <its encoding> -t utf-8)"
    )
    assert not list((tmp_path / "c").glob("*.u16"))


def test_real_runs_rebuild_a_cut_cache_and_name_a_bad_byte(data_root, tokenizer_dir, tmp_path):
    wt, cache = tmp_path / "wt", tmp_path / "cache"
    wt.mkdir()
    raw = (data_root / "wikitext-2" / "valid.txt").read_bytes()
    (wt / "train.txt").write_bytes(raw[:60_000])
    (wt / "valid.txt").write_bytes(raw[:20_000])
    overrides = [
        *SMOKE,
        "data=wikitext2",
        f"data.root={wt}",
        f"data.tokenizer_dir={tokenizer_dir}",
        f"data.cache_dir={cache}",
        "workload.vocab_size=50257",
        "launcher.nprocs=1",
        "trainer.max_steps=2",
    ]
    check_ok(bench(*overrides, results=tmp_path / "a"))
    (train_cache,) = cache.glob("wt.train.txt.*.u16")
    with open(train_cache, "r+b") as f:
        f.truncate(1000)
    again = bench(*overrides, results=tmp_path / "b")
    check_ok(again)
    rebuilt = [line for line in again.stderr.splitlines() if line.startswith("warning: token cache")]
    assert rebuilt == [
        f"warning: token cache {train_cache} holds 1000 bytes, not the {2 * D.load_tokens(train_cache).size} of "
        f"its {D.load_tokens(train_cache).size} tokens (cut short after it was written): rebuilding it from "
        f"{wt / 'train.txt'}"
    ], again.stderr[-3000:]
    assert summary(only_run(tmp_path / "b"))["status"] == "ok"
    print("REBUILD:", rebuilt[0], "STATUS: ok")

    (wt / "train.txt").write_bytes(raw[:30_000] + b"\xff" + raw[30_000:60_000])
    bad = bench(*overrides, results=tmp_path / "c")
    s = summary(only_run(tmp_path / "c"))
    line = raw[:30_000].count(b"\n") + 1
    assert bad.returncode != 0 and s["status"] == "failed", s
    assert bad.stderr.strip().splitlines() == [
        f"run failed: rank 0: ConfigError: data.root: {wt / 'train.txt'} is not valid UTF-8 at byte 30000 (line "
        f"{line}, byte 0xff): restore the file, or convert it to UTF-8 (iconv -f <its encoding> -t utf-8)"
    ], bad.stderr[-3000:]
    print("UTF-8:", bad.stderr.strip(), "STATUS:", s["status"])


# --- images -----------------------------------------------------------------------------------------
def _damaged_folder(data_root: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A 2-class ImageFolder of real CIFAR-10 JPEGs, with one JPEG cut short and one file of garbage."""
    root = tmp_path / "imgs"
    for cls in ("airplane", "automobile"):
        src = sorted((data_root / "cifar10-subset" / "train" / cls).iterdir())[:4]
        for split in ("train", "val"):
            (root / split / cls).mkdir(parents=True)
            for f in src:
                shutil.copy(f, root / split / cls / f.name)
    cut = root / "train" / "airplane" / "0001.jpg"
    cut.write_bytes(cut.read_bytes()[:40])
    junk = root / "train" / "automobile" / "0002.jpg"
    junk.write_bytes(os.urandom(500))
    return root, cut, junk


@pytest.mark.parametrize("decoder", ["torchvision", "pil"])
def test_a_damaged_image_fails_in_one_line_naming_it(data_root, tmp_path, decoder):
    root, cut, _ = _damaged_folder(data_root, tmp_path)
    ds = D.image_folder(root, "train", 32, decoder=decoder)
    loader = DataLoader(ds, batch_size=8, num_workers=1)  # raised in a worker, re-made in this process
    with pytest.raises(D.BadImage) as e:
        next(iter(loader))
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"data.root: image {cut} cannot be decoded (") and line.endswith(
        "replace or remove the file, or set data.bad_images=skip to skip such files and count them in the record"
    ), line


@pytest.mark.parametrize("decoder,cache", [("torchvision", False), ("torchvision", True), ("pil", False)])
def test_damaged_images_are_skipped_and_counted(data_root, tmp_path, capfd, decoder, cache):
    root, cut, junk = _damaged_folder(data_root, tmp_path)
    ds = D.image_folder(root, "train", 32, decoder=decoder, cache_decoded=cache, bad_images="skip")
    loader = DataLoader(ds, batch_size=8, num_workers=0 if cache else 2)
    (x, y) = next(iter(loader))
    assert x.shape == (8, 3, 32, 32) and torch.isfinite(x).all()
    assert y.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # 0001.jpg's item is 0002.jpg, an airplane too
    assert ds.skipped() == 2 and sorted(ds.skipped_files()) == sorted([str(cut), str(junk)])
    warnings = [w for w in capfd.readouterr().err.splitlines() if w.startswith("warning: image ")]
    assert sorted(w.split(" cannot")[0] for w in warnings) == sorted(f"warning: image {p}" for p in (cut, junk))
    with pytest.raises(ConfigError, match="data.bad_images=maybe: choose fail or skip"):
        D.image_folder(root, "train", 32, decoder=decoder, bad_images="maybe")


def test_a_damaged_image_ends_a_real_run_with_its_line_in_the_record(data_root, tmp_path):
    root, cut, junk = _damaged_folder(data_root, tmp_path)
    overrides = [
        "experiment=smoke",
        "workload=resnet50_tiny",
        "workload.num_classes=2",
        "data=cifar10",
        f"data.root={root}",
        "data.cache_decoded=false",
        "data.num_workers=1",
        "trainer.progress=false",
        "launcher.nprocs=1",
    ]
    proc = bench(*overrides, results=tmp_path / "r")
    assert proc.returncode != 0, proc.stderr[-3000:]
    s = summary(only_run(tmp_path / "r"))
    (line,) = proc.stderr.strip().splitlines()  # the first damaged file the shuffle reaches
    assert s["status"] == "failed" and line == f"run failed: rank 0: {s['error']}", proc.stderr[-3000:]
    assert any(s["error"].startswith(f"BadImage: data.root: image {p} cannot be decoded (") for p in (cut, junk))
    print("STDERR:", proc.stderr, "STATUS:", s["status"])

    skipped = bench(*overrides, "data.bad_images=skip", "trainer.max_steps=2", results=tmp_path / "s")
    check_ok(skipped)
    s = summary(only_run(tmp_path / "s"))
    pipe = s["data_pipeline"]
    assert s["status"] == "ok" and pipe["bad_images"] == "skip" and pipe["images_skipped"] >= 1, pipe
    print("SKIP STATUS:", s["status"], pipe["images_skipped"], pipe["images_skipped_files"])


# --- DataLoader workers -----------------------------------------------------------------------------
class KillsItsWorker(Dataset):
    """Item `at` SIGKILLs the worker process that loads it, as the OOM killer would."""

    def __init__(self, at: int):
        self.at = at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([float(i)]), torch.tensor(i)


def test_a_killed_worker_is_named_with_its_signal():
    loader, sampler = train_loader(KillsItsWorker(at=21), 1, 0, 4, 1, 0, 2, "cpu")
    sampler.set_epoch(0)
    order = list(sampler)
    worker = (order.index(21) // 4) % 2  # batches go round-robin to the workers
    with pytest.raises(WorkerDied) as e:
        for _ in loader:
            pass
    line = str(e.value)
    assert line.startswith(f"DataLoader worker {worker} (pid ") and "killed by signal SIGKILL (Killed)" in line, line


def _loader_worker(proc, timeout: float = 120.0):
    """The DataLoader worker of the run `proc` started: a fork of its rank (the same command line), which
    the launcher forked."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                parent = p.parent()
                if parent.ppid() == proc.pid and p.cmdline() == parent.cmdline():  # launcher -> rank -> worker
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no DataLoader worker appeared: {proc.communicate(timeout=5)}")


def test_a_worker_killed_from_outside_ends_the_run_with_a_final_record(tmp_path):
    cmd = [sys.executable, "-m", "ptbench", *SMOKE, "data.num_workers=1", "launcher.nprocs=1"]
    proc = start([*cmd, "trainer.max_steps=100000", "data.train_samples=100000", f"results.root={tmp_path}"])
    try:
        worker = _loader_worker(proc)
        time.sleep(2)  # training
        os.kill(worker.pid, signal.SIGKILL)  # as the OOM killer does
        _, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    s = summary(only_run(tmp_path))
    assert proc.returncode != 0 and s["status"] == "failed", (s, err[-3000:])
    named = (  # ours (the loader's wait sees it), or torch's own SIGCHLD check when that runs first
        f"WorkerDied: DataLoader worker 0 (pid {worker.pid}) was killed by signal SIGKILL (Killed)",
        f"RuntimeError: DataLoader worker (pid {worker.pid}) is killed by signal: Killed.",
    )
    assert s["error"].startswith(named), s["error"]
    assert err.strip().splitlines()[-1] == f"run failed: rank 0: {s['error']}", err[-3000:]
    print("STDERR:", err.strip().splitlines()[-1], "STATUS:", s["status"])


# --- nothing read runs code -------------------------------------------------------------------------


class Planted:
    """Unpickling it writes a marker file: code that a checkpoint would run when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_rank_state_round_trips_weights_only(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    ckpt.save_rank_state(tmp_path, 0, {"rng": ckpt.rng_state(), "global_step": 7, "losses": [1.5]})
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = ckpt.load_rank_state(tmp_path, 0)
    ckpt.set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want and state["global_step"] == 7


def test_a_planted_rank_state_never_runs(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"rng": Planted(marker)}, tmp_path / "trainer-rank0.pt")
    with pytest.raises(ConfigError) as e:
        ckpt.load_rank_state(tmp_path, 0)
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'trainer-rank0.pt'} holds objects other than tensors, lists and numbers (an "
        "older ptbench's numpy RNG state, or something planted): not loaded (Weights only load failed); set "
        "trainer.resume=never to start over"
    )
    assert not marker.exists()


TINY = [*CHECKPOINT_TINY, "trainer.resume=auto", "trainer.checkpoint_every=2", "results.point=planted"]


def test_a_checkpoint_others_can_write_is_refused_before_its_pickle_runs(tmp_path):
    first = bench(*TINY, "trainer.inject_stop=0:4", results=tmp_path)
    check_ok(first)
    run_dir = only_run(tmp_path)
    step = ckpt.latest(run_dir)
    metadata = step / "dcp" / ".metadata"  # DCP reads it with pickle
    marker = tmp_path / "planted-ran"
    metadata.write_bytes(pickle.dumps(Planted(marker)))
    meta = read_json(step / "meta.json")  # a planter rewrites the manifest too: the checksums pass
    files = ckpt.manifest(step)
    write_json(step / "meta.json", {**meta, "manifest": files, "bytes": sum(f["bytes"] for f in files.values())})
    assert ckpt.damage(step) is None
    step.chmod(0o757)  # a group's shared space: others can write here

    again = bench(*TINY, results=tmp_path)
    assert again.returncode != 0 and not marker.exists(), again.stderr[-3000:]
    refusal = (
        f"not resuming from {step}: mode 0757, writable by others (loading a checkpoint can run code): "
        f"chmod -R go-w {step} if you trust it, or set trainer.resume=never"
    )
    assert again.stderr.strip().splitlines() == [f"run failed: rank 0: ConfigError: {refusal}"], again.stderr[-3000:]
    records = {d: summary(d) for d in sorted(p.parent for p in tmp_path.rglob("summary.json"))}
    assert records.pop(run_dir)["status"] == "preempted"  # the checkpoint's record is left as it was
    ((_, new),) = records.items()
    assert new["status"] == "failed" and new["error"] == f"ConfigError: {refusal}", new
    print("STDERR:", again.stderr, "STATUS:", new["status"])

    # once only the user can write the folder, the owner and mode checks pass; the allowlisting unpickler
    # still refuses the plant (Planted is not a DCP metadata record), in one line
    step.chmod(0o755)
    assert ckpt.unsafe_to_resume(step) is None
    third = bench(*TINY, results=tmp_path)
    assert third.returncode != 0 and not marker.exists(), third.stderr[-3000:]
    assert re.fullmatch(
        rf"run failed: rank \d: ConfigError: checkpoint metadata {tmp_path}/\S+/checkpoints/{step.name}/dcp/.metadata "
        r"holds objects that are not checkpoint metadata: not loaded \(global pathlib\.\w*Path\.write_text is not "
        r"checkpoint metadata\); set trainer.resume=never to start over",
        third.stderr.strip().splitlines()[-1],
    ), third.stderr[-3000:]


def test_a_saved_checkpoint_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # usual in group folders
    try:
        tmp = ckpt.temp_path(tmp_path, 2)
        ckpt.prepare(tmp)
        (tmp / "dcp").mkdir()
        (tmp / "dcp" / ".metadata").write_bytes(b"x")
        final = ckpt.commit(tmp, {"step": 2, "time": 1.0})
    finally:
        os.umask(old)
    assert ckpt.unsafe_to_resume(final) is None
    (final / "dcp").chmod(0o775)
    assert f"not resuming from {final / 'dcp'}: mode 0775, writable by others" in ckpt.unsafe_to_resume(final)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-n", "0"]))
