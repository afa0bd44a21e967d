"""Checkpoint and resume: a 2-rank run stopped mid-epoch, run again with the same command, ends `ok`
in one record whose per-step losses equal an uninterrupted run's; a crash during a save leaves the
previous checkpoint usable; checkpoints are pruned to trainer.checkpoint_keep; adapters that cannot
checkpoint refuse checkpoint_every before launch.

The stop is deterministic (`trainer.inject_stop=0:3`: rank 0 is asked to stop after global step 3,
as SIGUSR1 would ask it, and the ranks agree at once with trainer.stop_check_every=1), so a busy
machine cannot move it. The signal path itself is tests/test_reliability.py's. Runs are tiny:
gpt2_tiny with a 256-token vocabulary, 64 samples, batch 4 x 2 ranks = 8 steps per epoch (the
2-stage pipeline is one replica: 16 steps of 4 samples).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ptbench.core import checkpoint as ckpt
from ptbench.core.errors import ConfigError
from ptbench.core.records import write_json
from tests.helpers import assert_losses_close, bench, check_ok, events, only_run, step_losses, summary

TINY = [
    "experiment=smoke",
    "workload.vocab_size=256",
    "data.train_samples=64",
    "trainer.max_steps=0",
    "trainer.stop_check_every=1",
    "trainer.progress=false",
]
ADAPTERS = {
    "ddp": ["adapter=ddp"],
    "zero3": ["adapter=zero3"],
    "fsdp": ["adapter=fsdp"],
    # megatron's dist_checkpointing with the weights split over 2 TP ranks
    "megatron_tp2": ["adapter=megatron", "adapter.tensor_parallel=2"],
    # torch.distributed.pipelining: 2 stages, each rank saves its own
    "pipeline": ["adapter=pipeline", "adapter.microbatches=4"],
}
STEPS = {"pipeline": 16}  # per epoch; else 8 = 64 samples / (4 x 2 ranks)
# also a save at step 2 that training continues after (a save must leave the live optimizer state alone)
SAVE_EVERY = {"megatron_tp2": ["trainer.checkpoint_every=2"], "pipeline": ["trainer.checkpoint_every=2"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of an uninterrupted run of each adapter (computed once, on first use)."""
    cache: dict[str, list[float]] = {}

    def get(name: str) -> list[float]:
        if name not in cache:
            root = tmp_path_factory.mktemp(f"ref-{name}")
            check_ok(bench(*TINY, *ADAPTERS[name], results=root))
            cache[name] = step_losses(only_run(root))
            assert len(cache[name]) == STEPS.get(name, 8)
        return cache[name]

    return get


def checkpoint_names(run_dir: Path) -> list[str]:
    base = run_dir / "checkpoints"
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_stopped_run_resumes_to_the_uninterrupted_losses(tmp_path, reference, name):
    command = [*TINY, *ADAPTERS[name], *SAVE_EVERY.get(name, []), "trainer.resume=auto", "trainer.inject_stop=0:3"]
    first = bench(*command, results=tmp_path)
    check_ok(first)
    run_dir = only_run(tmp_path)
    s = summary(run_dir)
    assert s["status"] == "preempted" and s["steps"] == 3 and s["stop_signal"] == "injected", s
    assert checkpoint_names(run_dir)[-1] == "step-000003"  # the checkpoint of the stop
    meta = ckpt.read_meta(run_dir / "checkpoints" / "step-000003")
    assert meta["step"] == 3 and meta["epoch"] == 0 and meta["step_in_epoch"] == 3 and meta["bytes"] > 0

    second = bench(*command, results=tmp_path)  # the same command again, as a requeued job runs it
    check_ok(second)
    assert "resum" in second.stdout
    resumed = only_run(tmp_path)  # one record for the point
    s = summary(resumed)
    steps = STEPS.get(name, 8)
    assert s["status"] == "ok" and s["steps"] == steps, s
    assert [(r["step"], r["attempt"], r["previous_status"]) for r in s["resumed_from"]] == [(3, 2, "preempted")]
    assert s["restart_gap_excluded"] and s["epochs_completed"] == 1
    evs = events(resumed)
    assert len(evs) == 1 and evs[0]["steps"] == steps and evs[0]["resumed"] and not evs[0]["partial"]
    assert_losses_close(step_losses(resumed), reference(name), atol=1e-5, what=f"{name} resumed vs uninterrupted")


def test_crash_during_a_save_keeps_the_previous_checkpoint_and_pruning_keeps_k(tmp_path, reference):
    command = [*TINY, *ADAPTERS["ddp"], "trainer.resume=auto", "trainer.checkpoint_every=2"]
    # rank 0 dies once every rank has written step 4's temp folder, before the rename
    crashed = bench(*command, results=tmp_path, env={"BENCH_CHECKPOINT_CRASH_AT": "4"})
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    run_dir = only_run(tmp_path)
    assert summary(run_dir)["status"] == "failed"
    assert checkpoint_names(run_dir) == [".tmp-step-000004", "step-000002"]
    assert [p.name for _, p in ckpt.complete(run_dir)] == ["step-000002"]

    resumed = bench(*command, results=tmp_path)
    check_ok(resumed)
    run_dir = only_run(tmp_path)
    s = summary(run_dir)
    assert s["status"] == "ok" and [(r["step"], r["previous_status"]) for r in s["resumed_from"]] == [(2, "failed")]
    assert_losses_close(step_losses(run_dir), reference("ddp"), atol=1e-5, what="ddp resumed after a crashed save")
    # saves at 4, 6, 8 after the resume; the newest trainer.checkpoint_keep=2 stay, the temp folder is gone
    assert checkpoint_names(run_dir) == ["step-000006", "step-000008"]
    assert [c["step"] for c in s["checkpoint"]["saved"]] == [2, 4, 6, 8]


# --- no ranks: refusals, commit, prune, lookup --------------------------------------------------------
def _cfg(*overrides: str):
    from ptbench.runner.compose import compose, typed

    return typed(compose(["experiment=smoke", *overrides]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["adapter=ddp", "trainer.resume=sometimes"], "choose auto or never"),
        (["adapter=ddp", "trainer.checkpoint_keep=0"], "must be >= 1"),
        (["adapter=ddp", "trainer.inject_stop=3"], "RANK:STEP"),
    ],
)
def test_bad_checkpoint_settings_are_refused_before_launch(overrides, message):
    from ptbench.adapters import get_adapter_class

    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError, match=message):
        get_adapter_class(cfg.adapter.name).validate(cfg, 2)


def test_adapters_that_cannot_checkpoint_say_so(monkeypatch):
    import torch

    from ptbench.adapters import get_adapter_class
    from ptbench.adapters.base import Adapter

    cfg = _cfg("adapter=ddp")
    assert Adapter.checkpoint_refusal(cfg)  # a new adapter refuses until its checkpoints are tested
    for name in ("ddp", "fsdp", "zero", "tensor_parallel", "horovod", "gpipe", "megatron", "pipeline"):
        assert get_adapter_class(name).checkpoint_refusal(cfg) is None, name
    # megatron on a GPU steps with Megatron's distributed optimizer, whose state is not checkpointed yet
    megatron = get_adapter_class("megatron")
    megatron.check_checkpointing(_cfg("adapter=megatron", "trainer.checkpoint_every=2"))  # CPU: fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="adapter=megatron cannot checkpoint .Megatron's distributed optimizer"):
        megatron.check_checkpointing(_cfg("adapter=megatron", "trainer.checkpoint_every=2"))
    megatron.check_checkpointing(_cfg("adapter=megatron", "optimizer=lamb", "trainer.checkpoint_every=2"))


def _fake_checkpoint(run_dir: Path, step: int, when: float) -> Path:
    tmp = ckpt.temp_path(run_dir, step)
    ckpt.prepare(tmp)
    (tmp / "state.pt").write_bytes(b"x" * 10)
    return ckpt.commit(tmp, {"step": step, "time": when})


def test_commit_prune_and_lookup(tmp_path):
    root = tmp_path / "smoke"
    ident = {"point": "p1", "adapter": "ddp", "world_size": 2}
    old, newer, done, other = (root / n for n in ("a", "b", "c", "d"))
    for d, status in ((old, "preempted"), (newer, "failed"), (done, "ok"), (other, "preempted")):
        d.mkdir(parents=True)
        write_json(d / "summary.json", {**ident, "status": status, **({"point": "p2"} if d is other else {})})
    now = time.time()
    for step in (1, 2, 3):
        _fake_checkpoint(old, step, now + step)
    assert [s for s, _ in ckpt.complete(old)] == [1, 2, 3]
    ckpt.prepare(ckpt.temp_path(old, 4))  # a save that never finished: not a checkpoint
    assert ckpt.latest(old).name == "step-000003"
    ckpt.prune(old, 2)
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert json.loads((old / "checkpoints" / "step-000003" / "meta.json").read_text())["bytes"] == 10

    _fake_checkpoint(newer, 1, now + 10)  # the newest checkpoint of the point wins
    _fake_checkpoint(done, 5, now + 20)  # finished: never resumed
    _fake_checkpoint(other, 5, now + 30)  # another point
    assert ckpt.find_resumable([root], "p1", "ddp", 2) == (
        newer.resolve(),
        newer.resolve() / "checkpoints" / "step-000001",
    )
    assert ckpt.find_resumable([root], "p1", "ddp", 2, exclude=newer)[0] == old.resolve()
    assert ckpt.find_resumable([root], "p1", "ddp", 4) is None  # another world size
    assert ckpt.find_resumable([root], "p1", "fsdp", 2) is None
    assert ckpt.find_resumable([root], None, "ddp", 2) is None

    fresh = root / "e"
    fresh.mkdir()
    (old / "events.jsonl").write_text('{"epoch": 0}\n')
    ckpt.adopt(old, fresh)
    assert not old.exists() and ckpt.latest(fresh).name == "step-000003"
    assert (fresh / "events.jsonl").read_text() == '{"epoch": 0}\n'


def test_sampler_resumes_at_a_step():
    import torch

    from ptbench.core.loaders import StepShardedSampler

    data = torch.utils.data.TensorDataset(torch.arange(64))
    whole = StepShardedSampler(data, 2, 1, 4, 1, seed=7)
    whole.set_epoch(3)
    part = StepShardedSampler(data, 2, 1, 4, 1, seed=7)
    part.set_position(3, 5)
    assert list(part) == list(whole)[5 * 4 :] and len(part) == 3 * 4
    part.set_epoch(4)
    assert len(list(part)) == 8 * 4
