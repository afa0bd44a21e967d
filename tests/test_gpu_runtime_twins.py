"""CPU twins of the GPU runtime's settings and failure paths: CUDA_DEVICE_MAX_CONNECTIONS in a rank's
environment from its start (the local launcher, slurm/run.sbatch), a failing rank that never waits in its
process group's teardown, trainer.profile's trace export outside the timed steps, DeepSpeed's own host
syncs in zero's phase semantics, cudnn.benchmark for vision, and a host whose nvidia-smi lists GPUs that
torch cannot see."""

from __future__ import annotations

import datetime
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import require_or_skip
from tests.helpers import REPO, bench, check_ok, events, only_run, summary

TINY = [
    "workload=gpt2_tiny",
    "data=synthetic",
    "workload.seq_len=32",
    "workload.vocab_size=4096",
    "data.train_samples=64",
    "data.val_samples=16",
    "trainer.progress=false",
]


# --- CUDA_DEVICE_MAX_CONNECTIONS before the rank starts ----------------------------------------------
def test_megatron_tp2_ranks_start_with_cuda_device_max_connections(tmp_path):
    """A real local 2-rank megatron TP=2 run (gloo): each rank has the variable from its first instruction,
    put there by the launcher (this test's environment has none), and the record says what rank 0 started
    with, read before anything in the rank could start CUDA."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    cmd = [sys.executable, "-m", "ptbench", "adapter=megatron", "adapter.tensor_parallel=2", *TINY]
    proc = subprocess.run(
        [*cmd, "trainer.max_steps=2", f"results.root={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    check_ok(proc)
    s = summary(only_run(tmp_path))
    assert s["rank_environment"] == {
        "required": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        "at_start": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    }


def _sbatch_exports(tmp_path: Path, *overrides: str) -> str:
    """slurm/run.sbatch itself, run by bash with a recording `srun` first on PATH: what srun's ranks inherit."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    srun = fake / "srun"
    srun.write_text('#!/bin/sh\necho "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}"\n')
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env.update(PATH=f"{fake}:{env['PATH']}", REPO=str(REPO), PYTHON=sys.executable, RESULTS=str(tmp_path / "r"))
    proc = subprocess.run(
        ["bash", str(REPO / "slurm" / "run.sbatch"), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_run_sbatch_exports_cuda_device_max_connections_for_megatron_tp_only(tmp_path):
    assert _sbatch_exports(tmp_path, "adapter=megatron", "adapter.tensor_parallel=2") == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    # one CUDA work queue would serialise the streams ddp overlaps its all-reduce on: not for other adapters
    assert _sbatch_exports(tmp_path, "adapter=ddp") == "CUDA_DEVICE_MAX_CONNECTIONS=unset"


# --- a failing rank never waits in its process group's teardown ----------------------------------------
def _rank_with_work_in_flight(rank: int, cfg_dict: dict, plan, port: int, run_dir: str) -> None:
    """One rank of a real 2-rank gloo job running the production `run_rank`. Rank 1 first starts an
    all-reduce its peer never joins (work in flight, as NCCL work queued on a GPU stream), then fails by
    trainer.inject_fault while rank 0 waits inside the step's gradient all-reduce."""
    import torch.distributed as dist

    from ptbench.core.dist import DistContext, init_process_group
    from ptbench.runner.compose import typed
    from ptbench.runner.rank import run_rank

    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2, master_port=port)
    init_process_group(ctx, 120)  # run_rank keeps the started group
    side = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
    if rank == 1:
        dist.all_reduce(torch.ones(4), group=side, async_op=True)
    run_rank(typed(cfg_dict), plan, ctx, Path(run_dir))


def test_failing_rank_with_a_collective_in_flight_exits_at_once_with_its_error(tmp_path):
    """destroy_process_group waits for the in-flight all-reduce until the group's timeout (120 s here): the
    failing rank must record its error and leave within seconds instead."""
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from ptbench.core.dist import free_port
    from ptbench.core.records import RunWriter
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan, run_dir_of
    from ptbench.runner.rank import packages

    fault = ["trainer.max_steps=4", "trainer.inject_fault=raise@1:1", f"results.root={tmp_path}"]
    cfg = typed(compose(["adapter=ddp", *TINY, *fault]))
    plan = make_plan(cfg, "local", 2, check=False)
    writer = RunWriter(run_dir_of(cfg, plan), plan.identity())
    writer.start(OmegaConf.to_yaml(cfg), packages())
    procs = mp.start_processes(
        _rank_with_work_in_flight,
        args=(OmegaConf.to_container(cfg, resolve=True), plan, free_port(), str(writer.dir)),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    failing = procs.processes[1]
    try:
        deadline = time.time() + 240  # start-up on a busy 2-core box; the bound that matters is below
        while failing.is_alive() and time.time() < deadline:
            errors = writer.record.rank_errors()
            if any(e["rank"] == 1 for e in errors):
                break
            time.sleep(0.2)
        error = next(e for e in writer.record.rank_errors() if e["rank"] == 1)
        failing.join(timeout=60)
        left = time.time()
        assert not failing.is_alive(), "the failing rank still waits in its process group's teardown"
        assert failing.exitcode != 0
        assert left - error["time"] < 30, f"the failing rank left {left - error['time']:.0f}s after its error"
        assert error["error"] == "RuntimeError: injected fault on rank 1 at step 1"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()


# --- trainer.profile: the trace export outside the timed steps ------------------------------------------
def test_profile_export_is_not_in_the_window_s_last_step(tmp_path):
    """The window's last step (global step 5) ends before the profiler stops and writes the trace: it takes
    about what the other profiled steps take, not that plus the export the record states."""
    window = ["trainer.profile=3:3", "trainer.max_steps=8", "trainer.eval_every_epoch=false", "data.train_samples=256"]
    proc = bench("adapter=ddp", *TINY, *window, results=tmp_path)
    check_ok(proc)
    run = only_run(tmp_path)
    export = summary(run)["profile"]["export"]
    assert export["in_step_times"] is False and export["in_epoch_time"] is False
    assert len(export["seconds"]) == 2 and min(export["seconds"]) > 0
    times = events(run)[-1]["step_times_s"]  # global steps 2..7 (trainer.untimed_steps=2)
    others, last = times[1:3], times[3]  # profiled: 3, 4 and 5 (the last)
    assert last - statistics.median(others) < 0.5 * min(export["seconds"]), (times, export)


# --- DeepSpeed's own host syncs, stated in zero's phase semantics ----------------------------------------
def test_zero_phase_semantics_name_the_host_syncs_deepspeed_makes():
    """The record's text (ZeroAdapter.phase_semantics) and the installed DeepSpeed's code it describes."""
    try:
        from deepspeed.runtime import bf16_optimizer
        from deepspeed.runtime.zero import stage3, stage_1_and_2
    except ImportError as e:
        require_or_skip("deepspeed", str(e))
    from ptbench.adapters.zero import ZeroAdapter

    stated = ZeroAdapter.phase_semantics
    assert "is_invalid_grad_norm" in stated["optimizer"] and ".item()" in stated["optimizer"]
    assert "independent_gradient_partition_epilogue" in stated["backward"]
    z12, z3 = stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3
    assert "is_invalid_grad_norm" in _method(z12, "step") and "is_invalid_grad_norm" in _method(z3, "step")
    assert "is_invalid_grad_norm" in _method(bf16_optimizer.BF16_Optimizer, "step")
    assert "overflow_gpu[0].item()" in _method(z12, "has_overflow")
    assert "synchronize()" in _method(z12, "independent_gradient_partition_epilogue")
    assert "reduce_and_partition_stream.synchronize()" in _method(z3, "independent_gradient_partition_epilogue")


def _method(cls, name: str) -> str:
    """The source of method `name` as written in `cls` (DeepSpeed wraps some in NVTX ranges)."""
    src = inspect.getsource(cls)
    start = src.index(f"    def {name}(")
    end = src.find("\n    def ", start + 1)
    return src[start : end if end > 0 else None]


# --- cudnn.benchmark for vision ------------------------------------------------------------------------
def test_vision_sets_and_records_cudnn_benchmark():
    from ptbench.core.config import DataConfig, WorkloadConfig
    from ptbench.workloads import build_workload
    from ptbench.workloads.vision import use_cudnn_benchmark

    assert use_cudnn_benchmark(None, "cuda") is True and use_cudnn_benchmark(None, "cpu") is False
    assert use_cudnn_benchmark(False, "cuda") is False
    cfg = dict(name="resnet50_tiny", kind="vision", arch="resnet50", num_classes=10, image_size=32, width_div=8)
    before = torch.backends.cudnn.benchmark
    try:
        for knob, applied in ((True, True), (None, torch.cuda.is_available()), (False, False)):
            workload = build_workload(WorkloadConfig(**cfg, cudnn_benchmark=knob), DataConfig())
            workload.build_model()
            assert torch.backends.cudnn.benchmark is applied
            assert workload.describe()["cudnn_benchmark"] is applied
    finally:
        torch.backends.cudnn.benchmark = before


# --- nvidia-smi lists GPUs, torch sees none ------------------------------------------------------------
FAKE_SMI = """#!/bin/sh
# recorded on a host with driver 550.54.15 (CUDA 12.4) and two H100s
if [ "$1" = "-L" ]; then
  echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8a1c2f7e-5b3d-4c1e-9f0a-1b2c3d4e5f60)"
  echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-8a1c2f7e-5b3d-4c1e-9f0a-1b2c3d4e5f61)"
  exit 0
fi
cat <<'EOF'
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
EOF
"""


@pytest.fixture
def smi_path(tmp_path) -> dict:
    """An environment whose PATH finds a real `nvidia-smi` executable printing recorded output."""
    folder = tmp_path / "smi"
    folder.mkdir()
    (folder / "nvidia-smi").write_text(FAKE_SMI)
    (folder / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize("command", [["-m", "ptbench", "adapter=ddp", *TINY], ["-m", "ptbench.smoke", "ddp"]])
def test_gpus_torch_cannot_see_stop_a_plain_run_and_the_smoke_in_one_line(tmp_path, smi_path, command):
    results = tmp_path / "results"
    extra = [f"results.root={results}"] if command[1] == "ptbench" else []
    proc = subprocess.run(
        [sys.executable, *command, *extra], cwd=REPO, env=smi_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "nvidia-smi lists 2 GPU(s) (GPU 0: NVIDIA H100 80GB HBM3)" in lines[0]
    if torch.version.cuda:  # this torch is built for a CUDA newer than the recorded driver's 12.4
        assert f"driver/CUDA mismatch: torch.version.cuda={torch.version.cuda}" in lines[0]
    assert not results.exists()  # nothing ran, nothing recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_gpus_hidden_on_purpose_are_no_error(smi_path, monkeypatch):
    from ptbench.core.environments import unseen_gpus_line

    monkeypatch.setenv("PATH", smi_path["PATH"])
    assert "nvidia-smi lists 2 GPU(s)" in unseen_gpus_line({})
    assert unseen_gpus_line({"CUDA_VISIBLE_DEVICES": ""}) is None
    monkeypatch.setenv("PATH", "/nonexistent")  # a CPU host: no nvidia-smi
    assert unseen_gpus_line({}) is None


def test_schema_knows_the_new_record_fields():
    """The schema knows the new record fields (a record with them passes the closed-field check)."""
    from ptbench.core.schema import unknown

    rec = {
        "rank_environment": {"required": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "at_start": {}},
        "profile": {"export": {"seconds": [0.5], "in_step_times": False, "in_epoch_time": False, "note": ""}},
    }
    assert unknown(json.loads(json.dumps(rec))) == []
