"""CPU twins of GPU paths a CPU run never takes: the GPU CI cannot pass on a CPU fallback, gpipe's
phase timers on every partition's device, Triton's toolchain checked on CUDA too, threads per
rank honoured on GPU, ZeRO offload in the cost inputs and the `--plan` memory verdict."""

from __future__ import annotations

import pytest
import torch

from ptbench.core.errors import ConfigError

SMI_HEADER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


# the GPU CI asserts CUDA in one line and fails every skip under CI=true
def test_cuda_error_line_names_the_driver_cuda_mismatch():
    from ptbench.gpu_check import cuda_error_line, nvidia_smi_versions

    assert nvidia_smi_versions(lambda: SMI_HEADER) == ("550.54.15", "12.4")
    assert nvidia_smi_versions(lambda: (_ for _ in ()).throw(OSError("no driver"))) == (None, None)
    assert cuda_error_line(True, "2.14.1", "13.0", "550.54.15", "12.4") is None
    line = cuda_error_line(False, "2.14.1", "13.0", "550.54.15", "12.4")
    assert "\n" not in line and "driver/CUDA mismatch: torch.version.cuda=13.0 but driver 550.54.15" in line
    assert "install a torch build for CUDA <= 12.4" in line
    assert "CPU-only build" in cuda_error_line(False, "2.14.1+cpu", None, None, None)
    assert "no NVIDIA driver" in cuda_error_line(False, "2.14.1", "13.0", None, None)
    assert "CUDA_VISIBLE_DEVICES" in cuda_error_line(False, "2.14.1", "12.4", "580.1", "13.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback this guards against")
def test_gpu_ci_fails_here_in_one_line_without_cuda(capsys):
    from ptbench.gpu_check import main as gpu_check_main
    from ptbench.smoke import main as smoke_main

    assert gpu_check_main(["--assert-cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: CUDA required but torch.cuda.is_available() is False"), err
    assert smoke_main(["--require-cuda", "ddp"]) == 2
    assert capsys.readouterr().err.startswith("error: CUDA required")


@pytest.mark.parametrize("ci, status", [("true", "FAILED"), ("", "skipped")])
def test_a_skipped_adapter_fails_under_ci(tmp_path, monkeypatch, ci, status):
    """A layout that cannot run, or Horovod's Gloo-only build on GPUs (its check refuses it), is a skip
    for a user and a failure under CI=true, in the smoke and in gpu-check's table."""
    import ptbench.smoke as smoke
    from ptbench.gpu_check import ci_skip

    monkeypatch.setenv("CI", ci)
    gloo = "adapter=horovod on GPUs needs Horovod built with NCCL (this build has Gloo only)"
    monkeypatch.setattr(smoke, "smoke_point", lambda name, world, root: (None, gloo))
    got, detail = smoke.run_one("ddp", 1, tmp_path, timeout=10)
    assert got == status and gloo in detail
    row = ci_skip({"adapter": "horovod", "workload": "resnet50", "status": "skipped", "reason": gloo})
    assert row["status"] == status
    na = {"adapter": "megatron", "workload": "resnet50", "status": "n/a", "reason": "adapter supports language"}
    assert ci_skip(na)["status"] == "n/a"


# gpipe on >= 2 GPUs timed cuda:0 only
class _ScriptedClock:
    """A device's clock in the CPU twin: the marks are the times that device reaches them."""

    name = "scripted"

    def __init__(self, times):
        self.times, self.synced = iter(times), 0

    def mark(self):
        return next(self.times)

    def elapsed(self, a, b):
        return b - a

    def synchronize(self):
        self.synced += 1


def test_phase_timer_times_every_partition_device():
    from ptbench.core.timing import CudaEventClock, DeviceEventClock, HostClock, PerDeviceClock, PhaseTimer

    # use_devices: events on each distinct GPU (GPipe's partitions), nothing changes for one GPU or on CPU
    timer = PhaseTimer(clock=CudaEventClock())
    timer.use_devices([torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)])
    assert isinstance(timer.clock, PerDeviceClock) and timer.settings["clock"] == "cuda_events_per_device"
    assert [c.device for c in timer.clock.clocks] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert all(isinstance(c, DeviceEventClock) for c in timer.clock.clocks)
    for devices in (["cuda:0"], ["cpu", "cpu"]):
        one = PhaseTimer(clock=CudaEventClock())
        one.use_devices(devices)
        assert type(one.clock) is CudaEventClock
    cpu = PhaseTimer(clock=HostClock())
    cpu.use_devices(["cuda:0", "cuda:1"])
    assert isinstance(cpu.clock, HostClock)

    # a phase lasts as long as its longest device span: partition 1 finishes the forward 3 s after partition 0
    # (marks: step start, forward start, forward end, step end)
    dev0, dev1 = _ScriptedClock([0, 1, 2, 3]), _ScriptedClock([0, 1, 5, 6])
    timer = PhaseTimer(clock=HostClock())
    timer.start_step()
    timer.use_clock(PerDeviceClock([dev0, dev1]))  # set during a step (gpipe's train_step): from the next step
    with timer.phase("forward"):
        pass
    first = timer.end_step()
    assert set(first) == {"forward", "step"}  # the host clock's own step, marks never mixed
    timer.start_step()
    with timer.phase("forward"):
        pass
    assert timer.end_step() is None  # device marks resolve later
    assert timer.steps[1] == {"forward": 4, "step": 6}
    assert dev0.synced == dev1.synced == 1


# Triton's C compiler and Python headers checked on CUDA too
def test_triton_toolchain_checked_on_cuda(tmp_path, monkeypatch):
    import shutil
    import sysconfig

    from ptbench.runner.checks import check_config
    from ptbench.runner.compose import compose, typed

    megatron = typed(compose(["adapter=megatron"]))
    compiled = typed(compose(["adapter=ddp", "trainer.compile=true", "trainer.untimed_steps=1"]))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    check_config(megatron)  # on CPU: megatron's fusions are off, no Triton
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cfg, what in ((megatron, "adapter=megatron"), (compiled, "trainer.compile=true (inductor)")):
        with pytest.raises(ConfigError) as e:
            check_config(cfg)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{what}") and "gcc or clang not found" in msg, msg
        assert f"{tmp_path}/Python.h" in msg and "apt-get install gcc python3-dev" in msg
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    check_config(megatron)


# GPU ranks ran 1 thread whatever launcher.threads_per_rank said
def test_threads_per_rank_are_honoured_on_gpu(monkeypatch):
    from ptbench.core.dist import set_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert set_cpu_threads(2) == 2 and torch.get_num_threads() == 2
        import os

        assert os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


# ZeRO offload reaches the memory model through the cost inputs, or the memory check counts offloaded states on the GPU
def test_zero3_offload_config_predicts_host_resident_states():
    from ptbench.core import memory_model as mm
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    def predict(*extra):
        base = ["adapter=zero", "adapter.stage=3", "launcher.nprocs=2", "workload=gpt2_tiny", "trainer.batch_size=4"]
        cfg = typed(compose([*base, *extra]))
        plan = make_plan(cfg, "local", check=False)  # offload refuses on CPU: the GPU's plan, unchecked
        return plan, mm.predict_run(cfg, plan, build_workload(cfg.workload, cfg.data).build_model, device="cuda")

    _, on = predict()
    plan, off = predict("adapter.offload_optimizer=true", "adapter.offload_params=true")
    assert plan.cost.offload_optimizer and plan.cost.offload_params
    assert on["optimizer"] > 0 and on["master"] > 0 and on["params"] > 0
    assert off["optimizer"] == off["master"] == off["params"] == 0
    assert off["total"] < on["total"]


@pytest.mark.parametrize(
    "mode, verdict",
    [
        ("warn", "does NOT fit (a warning; trainer.memory_check=refuse refuses)"),
        ("refuse", "does NOT fit (refused: trainer.memory_check=refuse)"),
    ],
)
def test_plan_memory_verdict_follows_memory_check(monkeypatch, capsys, tmp_path, mode, verdict):
    import signal

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    from ptbench.__main__ import _plan  # its import blocks SIGUSR1 and SIGTERM, as the command's start does

    signal.pthread_sigmask(signal.SIG_SETMASK, before)  # not for the processes this test worker starts later
    from ptbench.core import memory_model as mm

    monkeypatch.setattr(mm, "device_bytes", lambda *a, **k: (1.0, "a 1-byte stand-in device"))
    assert _plan(["adapter=ddp", f"trainer.memory_check={mode}", f"results.root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"per rank {verdict} within 90 %" in out, out


# NCCL buffers and the CUDA context sit outside the allocator's peaks: unrecorded, a GPU rank's memory reads low
def test_cuda_memory_outside_the_allocator_is_recorded(monkeypatch):
    from ptbench.core import memory

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 4 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (74 * gib, 80 * gib))  # (free, total)
    got = memory.peak(torch.device("cuda", 0))
    assert got["peak_reserved"] == 4 * gib and got["outside_allocator"] == 2 * gib  # 6 GiB used, 4 reserved
    assert "outside_allocator" not in memory.peak(torch.device("cpu"))
    assert memory.used_outside_allocator(free=10, total=8, reserved=0) == 0


# megatron pads GPT-2's vocabulary (50257 -> 50304); FLOPs count the workload's for every adapter, or MFUs differ
def test_megatron_padded_vocabulary_is_recorded_and_flops_count_the_same_vocabulary():
    from ptbench.adapters.megatron import padded_vocab_size
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan

    plans = {
        a: make_plan(typed(compose([f"adapter={a}", "workload=gpt2_small", "launcher.nprocs=1"])), "local", check=False)
        for a in ("ddp", "megatron")
    }
    assert plans["megatron"].cost.padded_vocab == padded_vocab_size(50257, 1) == 50304
    assert plans["ddp"].cost.padded_vocab == 0
    assert plans["megatron"].train_flops_per_sample == plans["ddp"].train_flops_per_sample
    assert plans["megatron"].tokens_per_sample == plans["ddp"].tokens_per_sample
