"""The spine end to end: config -> launcher -> ranks -> workload -> DDP -> trainer -> records."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import bench, check_ok, events, only_run, step_losses, summary

TINY_GPT = ["workload=gpt2_tiny", "workload.seq_len=32", "data.train_samples=256", "data.val_samples=64"]


def test_ddp_two_ranks_equal_one_rank_same_global_batch_gpt2(tmp_path):
    """2 ranks x batch 4 must train exactly like 1 rank x batch 8 (DDP averages gradients)."""
    common = TINY_GPT + ["trainer.max_steps=8", "trainer.epochs=1", "trainer.progress=false"]
    one = bench(*common, "launcher.nprocs=1", "trainer.batch_size=8", results=tmp_path / "one")
    two = bench(*common, "launcher.nprocs=2", "trainer.batch_size=4", results=tmp_path / "two")
    check_ok(one)
    check_ok(two)
    a, b = step_losses(only_run(tmp_path / "one")), step_losses(only_run(tmp_path / "two"))
    assert len(a) == len(b) == 8
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert a[-1] < a[0], "loss should fall over 8 Adam steps"


def test_ddp_two_ranks_equal_one_rank_resnet50_cifar(tmp_path, data_root):
    """ResNet-50 at 32 px on real CIFAR images. BatchNorm normalizes per replica, so the 1-rank
    reference accumulates 2 micro-batches of 4: the sampler gives it exactly the 2 ranks' micro-batches."""
    common = ["workload=resnet50", "workload.num_classes=10", "workload.image_size=32", "data=cifar10",
              f"data.root={data_root}/cifar10-subset", "data.augment=false", "optimizer=sgd",
              "trainer.max_steps=8", "trainer.max_eval_batches=2", "trainer.batch_size=4", "trainer.progress=false"]
    one = bench(*common, "launcher.nprocs=1", "trainer.grad_accum=2", results=tmp_path / "one")
    two = bench(*common, "launcher.nprocs=2", results=tmp_path / "two")
    check_ok(one)
    check_ok(two)
    a, b = step_losses(only_run(tmp_path / "one")), step_losses(only_run(tmp_path / "two"))
    assert len(a) == len(b) == 8
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_wikitext_two_epochs_perplexity_falls(tmp_path, data_root):
    proc = bench("workload=gpt2_tiny", "workload.seq_len=32", "data=wikitext2", f"data.root={data_root}/wikitext-2",
                 f"data.tokenizer_dir={data_root}/gpt2-tokenizer", f"data.cache_dir={tmp_path}/cache",
                 "trainer.epochs=2", "trainer.max_steps=30", "trainer.batch_size=8", "trainer.max_eval_batches=8",
                 "optimizer.lr=3e-3", "launcher.nprocs=2", "trainer.progress=false", results=tmp_path / "r")
    check_ok(proc)
    ev = events(only_run(tmp_path / "r"))
    ppl = [e["val_perplexity"] for e in ev]
    assert len(ppl) == 2 and ppl[1] < ppl[0] < 50257, ppl
    assert ev[0]["val_samples"] == 8 * 8 * 2  # every validation sample counted exactly once


def test_cifar_accuracy_rises_above_chance(tmp_path, data_root):
    proc = bench("workload=vgg16_tiny", "data=cifar10", f"data.root={data_root}/cifar10-subset", "data.augment=false",
                 "optimizer=adamw", "optimizer.lr=3e-4", "optimizer.weight_decay=1e-4", "trainer.epochs=2",
                 "trainer.max_steps=100", "trainer.batch_size=16", "launcher.nprocs=2", "trainer.progress=false",
                 results=tmp_path / "r")
    check_ok(proc)
    ev = events(only_run(tmp_path / "r"))
    assert ev[-1]["val_samples"] == 1000  # the whole val split, no padded duplicates
    # chance is 0.10 and its standard deviation over 1000 samples 0.0095: 0.13 is > 3 sigma above it
    assert ev[-1]["val_accuracy"] > 0.13, [e["val_accuracy"] for e in ev]


def test_record_folder_and_summary(tmp_path):
    proc = bench(*TINY_GPT, "trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.epochs=2", "launcher.nprocs=2",
                 "results.experiment=recordtest", results=tmp_path)
    check_ok(proc)
    run = only_run(tmp_path)
    assert run.parent.name == "recordtest"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "env.json", "events.jsonl", "summary.json"]
    s = summary(run)
    assert s["status"] == "ok" and s["world_size"] == 2 and s["adapter"] == "ddp"
    assert s["global_batch"] == 16 and s["steps"] == 12 and s["epochs_completed"] == 2
    assert s["step_time_mean_s"] > 0 and s["samples_per_s"] > 0 and s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 32)
    ev = events(run)
    assert ev[0]["warmup_steps_excluded"] == 2 and ev[0]["timed_steps"] == 4
    assert ev[1]["warmup_steps_excluded"] == 0 and ev[1]["timed_steps"] == 6
    for e in ev:
        assert e["step_time_p50_s"] <= e["step_time_p95_s"]
        assert [r["rank"] for r in e["ranks"]] == [0, 1]
        for r in e["ranks"]:
            assert r["memory"]["peak_rss"] > 50 * 2**20  # torch alone is bigger than this
            # DDP keeps full parameters, gradients and (Adam) 2 moments per rank
            sb = r["state_bytes"]
            assert sb["grads"] == sb["params"] and sb["optimizer"] >= 2 * sb["params"]
        assert e["flops_per_s"] == pytest.approx(e["samples_per_s"] * e["train_flops_per_sample"])
        assert e["mfu"] is None  # no peak known for a CPU
    env = json.loads((run / "env.json").read_text())
    assert env["versions"]["torch"] and env["python"]
    assert "summary" not in proc.stderr
    assert "step time" in proc.stdout  # the printed summary table


def test_default_run_needs_no_arguments(tmp_path):
    """`python -m bench` alone: tiny GPT-2, synthetic data, DDP, 2 ranks, one epoch."""
    proc = bench(results=tmp_path, timeout=300)
    check_ok(proc)
    s = summary(only_run(tmp_path))
    assert s["status"] == "ok" and s["world_size"] == 2 and s["workload"] == "gpt2_tiny"
    assert s["val_perplexity"] < 50257  # learned something from the synthetic Markov chain
