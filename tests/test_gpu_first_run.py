"""CPU twins of what would make the first GPU run fail or skew: each test runs the path a GPU run
takes (real process groups and frameworks) with the GPU-only setting forced on, or calls the function that
decides it with a GPU-shaped input."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.conftest import require_or_skip
from tests.helpers import bench, check_ok, only_run, step_losses, summary

VISION = [
    "experiment=smoke",
    "workload=resnet50_tiny",
    "launcher.nprocs=2",
    "trainer.max_steps=2",
    "trainer.untimed_steps=0",
]


@pytest.fixture(scope="module")
def nchw_ddp_first_loss(tmp_path_factory) -> float:
    """2-rank DDP, resnet50_tiny, NCHW: the first step's loss every per-device adapter must give."""
    root = tmp_path_factory.mktemp("nchw_ddp")
    check_ok(bench(*VISION, "adapter=ddp", "workload.channels_last=false", results=root))
    return step_losses(only_run(root))[0]


# workload.channels_last (on by default under CUDA) crashed zero 0-3, fsdp, horovod and pipeline
@pytest.mark.parametrize(
    "adapter, weights",
    [
        (["adapter=ddp"], True),
        (["adapter=zero", "adapter.stage=0"], False),
        (["adapter=zero", "adapter.stage=1"], False),
        (["adapter=zero", "adapter.stage=2"], False),
        (["adapter=zero", "adapter.stage=3"], False),
        (["adapter=fsdp"], False),
        (["adapter=horovod"], False),
        (["adapter=pipeline", "trainer.batch_size=16"], True),
        (["adapter=gpipe"], True),
    ],
    ids=["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "horovod", "pipeline", "gpipe"],
)
def test_channels_last_trains_under_every_vision_adapter(tmp_path, nchw_ddp_first_loss, adapter, weights):
    if adapter == ["adapter=horovod"] and importlib.util.find_spec("horovod") is None:
        require_or_skip("Horovod", "not installed: run `make horovod`")
    check_ok(bench(*VISION, *adapter, "workload.channels_last=true", results=tmp_path))
    run = only_run(tmp_path)
    # what was applied is recorded: weights too where the framework accepts strided parameters, else the
    # activations only (ZeRO, FSDP2 and Horovod flatten, shard or broadcast contiguous buffers)
    assert summary(run)["data_pipeline"]["channels_last"] is True
    assert summary(run)["data_pipeline"]["channels_last_weights"] is weights
    losses = step_losses(run)
    assert all(math.isfinite(v) for v in losses), losses
    if adapter[0] == "adapter=zero":  # DeepSpeed's timers off, as the engine resolved its config
        settings = summary(run)["adapter_settings"]
        assert settings["throughput_timer"] is False and settings["wall_clock_breakdown"] is False
    if adapter[0] not in ("adapter=pipeline", "adapter=gpipe"):  # same data and math as the NCHW DDP run
        assert losses[0] == pytest.approx(nchw_ddp_first_loss, abs=2e-3)


# megatron + optimizer=sgd on CUDA went to Megatron's DistributedOptimizer, which asserts Adam
def test_megatron_sgd_steps_a_torch_optimizer_on_gpu_too(tmp_path):
    from ptbench.adapters import get_adapter_class
    from ptbench.runner.compose import compose, typed

    cls = get_adapter_class("megatron")
    sgd = typed(compose(["adapter=megatron", "optimizer=sgd"]))
    adamw = typed(compose(["adapter=megatron", "optimizer=adamw"]))
    assert not cls.distributed_optimizer(sgd, cuda=True)  # was True: AssertionError in DistributedOptimizer
    assert cls.distributed_optimizer(adamw, cuda=True) and not cls.distributed_optimizer(adamw, cuda=False)
    assert cls.checkpoint_refusal(sgd) is None
    # the path SGD now takes on a GPU, run here: torch SGD stepping Megatron's main_grad buffers
    check_ok(bench("experiment=smoke", "adapter=megatron", "optimizer=sgd", "launcher.nprocs=2", results=tmp_path))
    s = summary(only_run(tmp_path))
    assert s["adapter_settings"]["optimizer"] == "torch sgd"
    assert all(math.isfinite(v) for v in step_losses(only_run(tmp_path)))


# adapter=pipeline took fp16 with no gradient scaler (gpipe has one: one process, one optimizer)
def test_pipeline_refuses_fp16_in_one_line_gpipe_scales():
    from ptbench.adapters import get_adapter_class
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose, typed

    cfg = typed(compose(["adapter=pipeline", "trainer.precision=fp16", "trainer.batch_size=16"]))
    with pytest.raises(ConfigError, match=r"^trainer.precision=fp16: adapter=pipeline has no gradient scaler"):
        get_adapter_class("pipeline").check(cfg, 2)  # what validate runs on a GPU host
    get_adapter_class("pipeline").check(typed(compose(["adapter=pipeline", "trainer.precision=bf16"])), 2)


def test_fsdp_bf16_keeps_batchnorm_fp32_and_equals_ddp_autocast(tmp_path):
    """bf16 FSDP2 on a BatchNorm network: the norms' fp32 parameters stay whole on every rank, out of
    sharding, their gradients averaged as DDP's are (batch_norm refuses bf16 weights beside fp32 running
    statistics; a fully_shard per norm would cost ResNet-50 142 all-gathers + 71 reduce-scatters a step,
    against 36 + 18 and one all-reduce). With clipping on (one norm over the sharded and the whole
    gradients), the losses equal DDP's under bf16 autocast. Measured (2026-12-02, CPU, 8 steps): equal to
    the last bit, clipped and not; one fully_shard per norm differed from DDP by 0.25-0.35."""
    # 8 steps: the former per-norm units agreed with DDP for the first 4 and drifted after
    steps = [o for o in VISION if not o.startswith("trainer.max_steps=")] + ["trainer.max_steps=8"]
    bf16 = [*steps, "trainer.precision=bf16", "trainer.grad_clip=1.0"]
    check_ok(bench(*bf16, "adapter=fsdp", results=tmp_path / "fsdp"))
    check_ok(bench(*bf16, "adapter=ddp", results=tmp_path / "ddp"))
    fsdp = only_run(tmp_path / "fsdp")
    settings = summary(fsdp)["adapter_settings"]
    # a weight and a bias for each norm: the stem, 3 per bottleneck block (16), 4 downsample norms
    assert settings["param_dtype"] == "bfloat16" and settings["batchnorm_fp32_replicated"] == 2 * 53
    assert "BatchNorm parameters and math in fp32" in summary(fsdp)["precision_semantics"]
    assert step_losses(fsdp) == pytest.approx(step_losses(only_run(tmp_path / "ddp")), abs=1e-5)


# LOCAL_RANK was the node-local rank; DeepSpeed calls set_device(LOCAL_RANK)
def test_local_rank_is_the_device_index_among_visible_devices():
    from ptbench.core.dist import device_index, exported_local_rank
    from ptbench.core.environments import SlurmEnvironment

    # srun --ntasks-per-node=4 --gpus-per-task=1: task 3 of a node sees one GPU (physical 3) as cuda:0
    env = {
        "SLURM_PROCID": "7",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_ID": "42",
        "SLURM_LOCALID": "3",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "CUDA_VISIBLE_DEVICES": "3",
    }
    ctx = SlurmEnvironment.context(env, "nccl")
    assert ctx.local_rank == 3  # node-local rank (data caches, local world) unchanged
    assert exported_local_rank(ctx.local_rank, env) == 0  # was 3: an invalid ordinal for DeepSpeed
    # every GPU of the node visible to every task (torchrun, srun without binding): the node-local rank
    assert exported_local_rank(3, {**env, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 3
    assert exported_local_rank(3, {**env, "CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == 1
    assert device_index(3, 0) == 3  # no GPU: LOCAL_RANK stays the node-local rank


# DeepSpeed's throughput timer (on by default) synchronized the device twice per micro-batch
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_config_turns_its_timers_off(stage):
    from deepspeed.runtime.config import get_wall_clock_breakdown
    from deepspeed.utils.config import get_timers_config

    from ptbench.adapters.zero import deepspeed_config
    from ptbench.runner.compose import compose, typed

    cfg = typed(compose(["adapter=zero", f"adapter.stage={stage}", "trainer.precision=bf16"]))
    config = deepspeed_config(cfg, micro_batch=4, cuda=True)
    assert config["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    # DeepSpeed's own readers of those keys (DeepSpeedConfig calls them; the engine's ThroughputTimer obeys)
    assert get_timers_config(config).enabled is False and get_wall_clock_breakdown(config) is False
    assert get_timers_config({}).enabled is True  # DeepSpeed's default, which the config used to leave on


# the memory check refused CUDA runs from an estimate that counted every leaf module's output
def test_memory_check_warns_by_default_and_refuses_only_when_asked(capsys):
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan, meta_model, predicted_memory
    from ptbench.workloads import build_workload

    big = ["adapter=ddp", "launcher.nprocs=1", "workload=gpt2_medium", "trainer.batch_size=4096"]

    def predict(*extra):
        cfg = typed(compose([*big, *extra]))
        plan = make_plan(cfg, "local", check=False)
        return predicted_memory(cfg, plan, meta_model(build_workload(cfg.workload, cfg.data)))

    assert typed(compose([])).trainer.memory_check == "warn"
    record, _ = predict()  # the default: one warning line with the numbers, the run goes on
    err = capsys.readouterr().err
    assert record["fits"] is False and record["check"] == "warn"
    assert err.startswith("warning: predicted memory per rank ") and "running anyway" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"exceeds 90% of the .* \(trainer.memory_check=refuse\)"):
        predict("trainer.memory_check=refuse")
    record, _ = predict("trainer.memory_check=off")
    assert record["check"] == "off" and capsys.readouterr().err == ""
    from ptbench.runner.checks import check_config

    with pytest.raises(ConfigError, match=r"^trainer.memory_check=maybe: choose warn, refuse, off$"):
        check_config(typed(compose(["trainer.memory_check=maybe"])))


def test_vision_activations_count_what_autograd_saves():
    import torch
    from torch import nn

    from ptbench.core.memory_model import activation_elements
    from ptbench.workloads.vision import build_vision_model

    with torch.device("meta"):
        resnet = build_vision_model("resnet50", 1000)
        vgg = build_vision_model("vgg16", 1000)
    # the leaf-output count gave 32.0 M and 28.7 M elements per sample (1.5x: refusals of runs that fit)
    assert activation_elements(resnet, (3, 224, 224)) / 1e6 == pytest.approx(21.50, abs=0.01)
    assert activation_elements(vgg, (3, 224, 224)) / 1e6 == pytest.approx(18.34, abs=0.01)
    with torch.device("meta"):
        small = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(256, 10))
    # the conv saves its input (3x8x8), the in-place ReLU its output, which the Flatten view and the linear share
    assert activation_elements(small, (3, 8, 8)) == 3 * 8 * 8 + 4 * 8 * 8


# the stop check's gloo group was created at the first check (step 10), inside the timed loop
def _stop_group_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from ptbench.core.stopping import StopFlag

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a backend that is not plain "gloo" (as nccl is on a GPU): the stop check needs its own CPU group
    dist.init_process_group("cpu:gloo", rank=rank, world_size=2)
    stop = StopFlag()
    stop.prepare()  # what run_rank does right after the process group starts
    before = c10d._world.group_count
    agreed = stop.agreed()  # the first check in the loop
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{before} {c10d._world.group_count} {agreed} {stop._group is not dist.group.WORLD}")
    dist.destroy_process_group()


def test_stop_check_group_exists_before_the_timed_loop(tmp_path):
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    mp.spawn(_stop_group_rank, args=(free_port(), str(tmp_path / "r")), nprocs=2)
    for rank in (0, 1):
        before, after, agreed, own = (tmp_path / f"r.{rank}").read_text().split()
        assert before == after and agreed == "False" and own == "True"  # no group created by the check


# megatron's GPU settings, on CPU: no device sync per p2p, one CUDA queue for TP, one GELU
def test_megatron_gpu_settings_and_one_gelu(tmp_path):
    import torch
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    from ptbench.adapters import get_adapter_class
    from ptbench.adapters.megatron import gelu_tanh
    from ptbench.runner.compose import compose, typed

    cls = get_adapter_class("megatron")
    tp2 = typed(compose(["adapter=megatron", "adapter.tensor_parallel=2"]))
    assert cls.rank_environment(tp2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert cls.rank_environment(typed(compose(["adapter=megatron"]))) == {}
    # the CPU activation is the fused GPU kernel's math (Megatron's bias_gelu: the tanh approximation)
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    assert torch.allclose(gelu_tanh(x), bias_gelu(torch.zeros(()), x), atol=1e-7)
    assert not torch.allclose(gelu_tanh(x), torch.nn.functional.gelu(x), atol=1e-4)  # the exact GELU differs
    check_ok(
        bench(
            "experiment=smoke",
            "adapter=megatron",
            "adapter.tensor_parallel=2",
            "launcher.nprocs=2",
            "trainer.max_steps=2",
            results=tmp_path,
        )
    )
    s = summary(only_run(tmp_path))["adapter_settings"]
    assert s["batch_p2p_sync"] is False and s["cuda_device_max_connections"] == "1"
    assert s["gelu"].startswith("tanh approximation")


def test_memory_model_leaves_offloaded_states_on_the_host():
    from ptbench.core import memory_model as mm

    kw = dict(params=10**9, world_size=4, kind="language", precision="bf16", optimizer="adamw")
    on = mm.predict("zero2", **kw)
    off = mm.predict("zero2", offload_optimizer=True, **kw)
    assert on["optimizer"] == 8e9 / 4 and on["master"] == 4e9 / 4  # adam moments + fp32 master, over dp
    assert off["optimizer"] == off["master"] == 0 and off["params"] == on["params"]
    z3 = mm.predict("zero3", offload_optimizer=True, offload_params=True, **kw)
    assert z3["params"] == 0 and z3["model_states"] == z3["grads"]
