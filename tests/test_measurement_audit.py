"""The measurement audit: each way the numbers would mislead on a GPU cluster, and its fix; CPU twins where
the GPU path cannot run here.

Expected values are written out (vendor datasheets, hand-counted parameters), not recomputed with
the code under test.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from ptbench.core.dist import dist_timeout_s
from ptbench.core.errors import ConfigError
from ptbench.core.flops import math_dtype, mfu, peak_for
from ptbench.core.loaders import data_workers
from ptbench.core.optim import build_optimizer, param_groups
from ptbench.core.timing import PhaseTimer
from ptbench.runner.compose import compose, typed
from ptbench.runner.plan import make_plan
from tests.helpers import SMOKE, bench, check_ok, events, only_run, step_losses, summary

TINY = SMOKE  # experiment=smoke at vocabulary 256: the settings of the shared smoke_run (conftest)


# --- timing: marks resolved once, off the critical path --------------------------------------------
class FakeClock:
    """Marks are ticks of a counter; `elapsed` needs `synchronize` first, as CUDA events do."""

    name = "fake"

    def __init__(self):
        self.now, self.synced, self.syncs = 0.0, False, 0

    def mark(self):
        self.synced = False
        return self.now

    def elapsed(self, a, b):
        assert self.synced, "read before the clock was synchronized (a CUDA event would not be complete)"
        return b - a

    def synchronize(self):
        self.synced, self.syncs = True, self.syncs + 1


def test_event_timer_defers_resolution_and_adds_micro_batch_phases():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    for _ in range(3):  # three steps: data 1, two micro-batch forwards of 2 and 3, optimizer 4, 0.5 between
        timer.start_step()
        for phase, length in (("data", 1.0), ("forward", 2.0), ("forward", 3.0), ("optimizer", 4.0)):
            with timer.phase(phase):
                clock.now += length
            clock.now += 0.5
        assert timer.end_step() is None  # no host sync inside the step: values come later
    assert clock.syncs == 0
    steps = timer.steps
    assert clock.syncs == 1  # one device sync for all pending steps
    assert steps == [{"data": 1.0, "forward": 5.0, "optimizer": 4.0, "step": 12.0}] * 3
    assert timer.steps is steps and clock.syncs == 1  # resolved once
    assert timer.settings == {"clock": "fake", "phase_sync": False}


def test_host_clock_is_the_cpu_default_and_phase_sync_is_off():
    timer = PhaseTimer()
    assert timer.settings == {"clock": "host_perf_counter", "phase_sync": False}
    assert typed(compose([])).trainer.sync_timing is False  # the diagnostic is opt-in


# --- MFU against the right peak -----------------------------------------------------------------
@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "tf32", 378),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("AMD Instinct MI250X", "bf16", 191.5),  # per GCD: half the module's 383
    ],
)
def test_peak_table(name, dtype, tflops):
    assert peak_for(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_variants_and_modes_give_no_peak():
    assert peak_for("NVIDIA H100", "bf16") is None  # which H100? SXM, PCIe and NVL differ by 30 %
    assert peak_for("AMD Instinct MI250X", "tf32") is None  # no TF32 mode
    assert peak_for("Some GPU", "bf16") is None


def test_math_mode_follows_precision_and_tf32():
    assert math_dtype("fp32", tf32=False) == "fp32" and math_dtype("fp32", tf32=True) == "tf32"
    assert math_dtype("bf16", tf32=False) == "bf16" and math_dtype("fp16", tf32=True) == "fp16"


def test_mfu_above_one_is_never_reported():
    assert mfu(400e12, 989.4e12, 1) == (pytest.approx(400 / 989.4), None)
    value, note = mfu(600e12, 67e12, 2)  # fp32 peak while TF32 ran: 4.5 "MFU"
    assert value is None and "> 1" in note
    assert mfu(1e12, None, 1) == (None, None)


# --- LAMB clips only through trainer.grad_clip; trust ratios on whole tensors --------------------
def test_lamb_has_no_clipping_of_its_own():
    opt = build_optimizer(torch.nn.Linear(4, 4).parameters(), typed(compose(["optimizer=lamb"])).optimizer)
    assert opt.defaults["max_grad_norm"] is None  # timm's default is 1.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["adapter=megatron", "adapter.tensor_parallel=2", "optimizer=lamb"],
            "adapter=megatron with tensor_parallel=2",
        ),
        (["adapter=tensor_parallel", "optimizer=lars"], "adapter=tensor_parallel with tensor_parallel=2"),
        (["adapter=fsdp", "optimizer=lamb"], "adapter=fsdp shards every tensor"),
        (["adapter=zero2", "optimizer=lamb"], "per-layer trust ratio needs whole parameter tensors"),
    ],
)
def test_layerwise_optimizers_refused_on_sliced_tensors(tmp_path, overrides, message):
    cfg = typed(compose([*TINY, *overrides, "launcher.nprocs=2", f"results.root={tmp_path}"]))
    with pytest.raises(ConfigError, match=message) as e:
        make_plan(cfg, "local")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_lamb_without_clipping_pipeline_equals_single_process(tmp_path):
    """optimizer=lamb trainer.grad_clip=0: a 2-stage pipeline gives the 1-rank DDP losses (before the fix
    timm clipped each stage's gradients by that stage's norm: 6e-6 apart at step 2, 1.4e-5 at step 8)."""
    common = [
        *TINY,
        "optimizer=lamb",
        "trainer.grad_clip=0",
        "trainer.max_steps=8",
        "trainer.batch_size=8",
        "data.train_samples=128",
        "trainer.eval_every_epoch=false",
    ]
    check_ok(bench(*common, "adapter=ddp", "launcher.nprocs=1", results=tmp_path / "ddp"))
    check_ok(bench(*common, "adapter=pipeline", "launcher.nprocs=2", "adapter.microbatches=4", results=tmp_path / "pp"))
    ref, pp = step_losses(only_run(tmp_path / "ddp")), step_losses(only_run(tmp_path / "pp"))
    assert len(ref) == len(pp) == 8 and np.isfinite(ref).all() and ref[-1] < ref[0]
    np.testing.assert_allclose(pp, ref, atol=1e-5, rtol=0)


# --- one weight-decay rule -------------------------------------------------------------------------
def test_no_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(5, 3))
    groups = param_groups(list(model.parameters()), 0.1)
    decayed = {tuple(p.shape) for p in groups[0]["params"]}
    plain = {tuple(p.shape) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and decayed == {(3, 4), (5, 3)}  # linear and embedding matrices
    assert groups[1]["weight_decay"] == 0.0 and plain == {(3,)} and len(groups[1]["params"]) == 3  # bias, norm w+b


# --- epoch time: slowest rank, partial epochs flagged, steady mean ---------------------------------
@pytest.mark.slow
def test_partial_and_steady_epochs(tmp_path):
    # 48 samples / global batch 8 = 6 steps per epoch; 3 whole epochs, then a run cut to 2 steps per epoch
    whole = [
        *TINY,
        "data.train_samples=48",
        "trainer.max_steps=0",
        "trainer.epochs=3",
        "trainer.batch_size=4",
        "trainer.eval_every_epoch=false",
    ]
    check_ok(bench(*whole, results=tmp_path / "whole"))
    run = only_run(tmp_path / "whole")
    ev, s = events(run), summary(run)
    assert [e["partial"] for e in ev] == [False, False, False] and [e["steps"] for e in ev] == [6, 6, 6]
    assert s["epoch_time_steady_s"] == pytest.approx(np.mean([ev[1]["epoch_time_s"], ev[2]["epoch_time_s"]]))
    for e in ev:  # the record's epoch time is the slowest rank's
        assert e["epoch_time_s"] == max(r["epoch_time_s"] for r in e["ranks"]) and len(e["ranks"]) == 2
    check_ok(bench(*whole, "trainer.max_steps=2", "trainer.epochs=2", results=tmp_path / "cut"))
    s = summary(only_run(tmp_path / "cut"))
    assert [e["partial"] for e in events(only_run(tmp_path / "cut"))] == [True, True]
    assert s["epoch_time_steady_s"] is None and s["epoch_time_mean_includes_partial"] is True


# --- memory: host peak always, and what training added -------------------------------------------
@pytest.mark.slow
def test_cpu_memory_delta_recorded(smoke_run):
    """The shared smoke_run (conftest): TINY's settings, 2 ranks."""
    for r in events(smoke_run)[0]["ranks"]:
        m = r["memory"]
        assert 0 < m["peak_rss_delta"] < m["peak_rss"], m  # the interpreter (~700 MiB) is not the run's


# Horovod's gradient bytes equal DDP's: asserted on the runs of test_horovod.py::test_gpt2_horovodrun_and_srun_style_equal_ddp
# (no launches of its own here).


# --- the watchdog fires before the backend's timeout -----------------------------------------------
def test_process_group_timeout_follows_the_watchdog(tmp_path):
    t = typed(compose([])).trainer
    assert dist_timeout_s(t) == t.hang_timeout_s + 60
    cfg = typed(
        compose([*TINY, "trainer.dist_timeout_s=300", "trainer.hang_timeout_s=900", f"results.root={tmp_path}"])
    )
    with pytest.raises(ConfigError, match="must exceed trainer.hang_timeout_s=900"):
        make_plan(cfg, "local")


# --- input: workers from the CPUs per rank ----------------------------------------------------------
def test_data_workers_from_cpus_per_rank():
    assert data_workers(3, 8, env={}) == 3  # asked for
    assert data_workers(None, 1, env={"SLURM_CPUS_PER_TASK": "12"}) == 8  # capped
    assert data_workers(None, 4, env={"SLURM_CPUS_PER_TASK": "4"}) == 3  # one CPU is the rank's own
    assert data_workers(None, os.cpu_count() or 1, env={}) == 0  # one CPU per rank: no workers


# --- the record says what phases and precision meant -----------------------------------------------
@pytest.mark.slow
def test_record_states_phase_and_precision_semantics(smoke_run):
    s = summary(smoke_run)
    assert set(s["phase_semantics"]) == {"data", "forward", "backward", "optimizer"}
    assert "autocast" in s["precision_semantics"] and s["timing"]["phase_sync"] is False and s["tf32"] is False
    assert json.dumps(s)  # plain JSON
