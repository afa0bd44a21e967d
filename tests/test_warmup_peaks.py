"""Recorded peaks leave the warm-up steps out: the warm-up's own peak (cuDNN autotuning, compilation, the memory
ledger's step) is read and kept as its own field, then the peaks are reset, so the epoch's peak, the one set
against the memory model, is the steady steps'. CPU twin: VmHWM, reset through /proc/self/clear_refs."""

from __future__ import annotations

import pytest
import torch

from ptbench.core import memory
from tests.helpers import GPT2_REFERENCE, bench, check_ok, events, only_run, summary

CPU = torch.device("cpu")


def test_reset_method_per_device_type():
    assert memory.reset_method("cuda") == "allocator"  # torch.cuda.reset_peak_memory_stats
    assert memory.reset_method("cpu") == "vmhwm"


def test_end_warmup_keeps_the_warmup_peak_and_resets_it_on_cpu():
    memory.reset_peak(CPU)
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB touched in the "warm-up", then freed
    del big
    warm = memory.end_warmup([CPU])
    if not warm["reset"]:
        pytest.skip("/proc/self/clear_refs cannot be written here: VmHWM cannot be reset")
    steady = memory.peak(CPU)["peak_rss"]
    assert warm["peak_rss"] - steady > 48 * 2**20, (warm, steady)  # the warm-up's 64 MiB stays in its own reading
    assert "outside_allocator" not in warm  # an epoch-end reading, not a peak


def test_an_epoch_of_warmup_steps_only_keeps_the_warmup_peak():
    # the reset came after the epoch's last step: the epoch-end reading alone would miss every step it ran
    mem = {"peak_allocated": None, "peak_reserved": None, "peak_rss": 100, "peak_rss_delta": 10}
    warm = {"peak_allocated": None, "peak_reserved": None, "peak_rss": 150, "reset": True}
    assert memory.with_warmup(mem, warm) == {**mem, "peak_rss": 150, "peak_rss_delta": 60}
    assert memory.with_warmup(mem, {**warm, "peak_rss": 90})["peak_rss"] == 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the allocator's peak reset")
def test_end_warmup_resets_the_cuda_allocator_peak():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(dev)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    del big
    warm = memory.end_warmup([dev])
    assert warm["reset"] and warm["peak_allocated"] >= 256 * 2**20, warm
    assert torch.cuda.max_memory_allocated(dev) < 64 * 2**20  # the steady peak starts from what is alive now


def test_a_run_records_the_warmup_peak_beside_the_steady_one(tmp_path):
    # 2 epochs of 3 steps, 4 untimed: epoch 0 is all warm-up (its peak holds it), the warm-up ends in epoch 1
    overrides = [o for o in GPT2_REFERENCE if not o.startswith(("trainer.max_steps", "trainer.epochs"))]
    proc = bench(
        *overrides, "trainer.max_steps=3", "trainer.epochs=2", "trainer.untimed_steps=4", results=tmp_path, timeout=300
    )
    check_ok(proc)
    run = only_run(tmp_path)
    first, second = [e for e in events(run) if e.get("type") == "epoch"]
    assert first["memory_metric"] == "peak_rss"
    assert first["peak_memory_after_warmup"] is False and "warmup_peak_memory_max" not in first
    assert all("memory_warmup" not in r for r in first["ranks"])
    warm = [r["memory_warmup"] for r in second["ranks"]]
    assert len(warm) == 2 and all(w["reset"] and w["peak_rss"] > 0 for w in warm), warm
    assert second["peak_memory_after_warmup"] is True
    assert second["warmup_peak_memory_max"] == max(w["peak_rss"] for w in warm)
    s = summary(run)
    assert s["peak_memory_after_warmup"] is True and s["peak_memory_max"] == second["peak_memory_max"]
    assert s["warmup_peak_memory_max"] == second["warmup_peak_memory_max"]
    assert s["memory_ledger"]["counted_saved_bytes"]  # the ledger's step (the last untimed one) still counted
