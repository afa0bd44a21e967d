"""Launch paths (local spawn, torchrun, Slurm environment) and bad input caught before any rank starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ptbench.core.environments import SlurmEnvironment, TorchrunEnvironment, expand_nodelist, slurm_port
from ptbench.core.errors import ConfigError
from ptbench.runner.checks import rank_cpus, start_method
from ptbench.runner.compose import compose, typed
from ptbench.runner.plan import make_plan
from tests.helpers import (
    SMOKE,
    assert_losses_close,
    bench,
    check_ok,
    kill_group,
    only_run,
    run,
    start,
    step_losses,
    summary,
)

SMALL = ["experiment=smoke", "trainer.max_steps=3"]


def test_slurm_environment_16_nodes():
    nodelist = "gpu[001-004,010],cn7,big[08-12,100-104]"
    hosts = expand_nodelist(nodelist)
    assert len(hosts) == 16
    assert hosts[:6] == ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cn7"]
    assert hosts[6] == "big08" and hosts[-1] == "big104"
    assert expand_nodelist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    env = {
        "SLURM_PROCID": "37",
        "SLURM_NTASKS": "64",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "81234",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": "4(x16)",
    }
    assert SlurmEnvironment.detect(env, "slurm") and not SlurmEnvironment.detect(env, "local")
    ctx = SlurmEnvironment.context(env, "auto")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (37, 64, 1, 4)
    assert ctx.master_addr == "gpu001" and ctx.launcher == "slurm"
    assert ctx.master_port == slurm_port("81234") and 20000 <= ctx.master_port < 32768
    # two array tasks on one node are two jobs: their ports differ
    assert slurm_port("81234") != slurm_port("81235")
    # an explicit MASTER_ADDR/PORT (e.g. set by the sbatch script) wins
    ctx = SlurmEnvironment.context({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29999"}, "auto")
    assert (ctx.master_addr, ctx.master_port) == ("10.0.0.5", 29999)


def test_torchrun_env_is_honoured():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h1",
        "MASTER_PORT": "1234",
    }
    assert TorchrunEnvironment.detect(env, "local") and not TorchrunEnvironment.detect({}, "local")
    ctx = TorchrunEnvironment.context(env, "auto")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.master_addr, ctx.master_port) == (3, 8, 1, "h1", 1234)
    assert ctx.launcher == "torchrun"


@pytest.fixture
def local_small(smoke_run):
    """The shared SMOKE run (conftest), started the ordinary way (local spawn, 2 ranks): the reference for torchrun."""
    return smoke_run


def test_run_under_torchrun_equals_local_run(local_small, tmp_path):
    """torchrun starting the ranks changes who starts them, not the training: the same per-step losses."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "ptbench",
        "launcher=torchrun",
        *SMOKE,
        f"results.root={tmp_path}",
    ]
    proc = run(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    check_ok(proc)
    s = summary(only_run(tmp_path))
    assert s["status"] == "ok" and s["world_size"] == 2 and s["launcher"] == "torchrun"
    assert summary(local_small)["launcher"] == "local"
    local = step_losses(local_small)
    assert len(local) == 4
    assert_losses_close(step_losses(only_run(tmp_path)), local, atol=1e-6)
    assert s["val_loss"] == pytest.approx(summary(local_small)["val_loss"], abs=1e-6)


def test_forked_ranks_train_as_spawned_ranks(local_small, tmp_path):
    """launcher.start_method=auto forks the ranks on a CPU (they reuse the launcher's imports); a GPU
    machine spawns them, as the shared smoke_run does: the start method changes nothing in the training."""
    check_ok(bench(*SMOKE, results=tmp_path))
    forked = only_run(tmp_path)
    assert summary(forked)["plan"]["start_method"] == "fork"
    assert summary(local_small)["plan"]["start_method"] == "spawn"
    assert summary(forked)["frameworks_imported"] == []
    assert_losses_close(step_losses(forked), step_losses(local_small), atol=1e-6)
    assert summary(forked)["val_loss"] == pytest.approx(summary(local_small)["val_loss"], abs=1e-6)


def test_start_method_auto_forks_only_without_cuda():
    assert start_method("auto", cuda=False) == "fork" and start_method("auto", cuda=True) == "spawn"
    assert start_method("spawn", cuda=False) == "spawn" and start_method("fork", cuda=False) == "fork"
    with pytest.raises(ConfigError, match="forked ranks cannot use CUDA; use launcher.start_method=spawn"):
        start_method("fork", cuda=True)


def test_rank_cpus_split_the_launchers_cpus_in_local_rank_order():
    assert rank_cpus("none", 2, cpus={0, 1}) is None
    assert rank_cpus("cores", 2, cpus={0, 1}) == ((0,), (1,))
    assert rank_cpus("cores", 2, cpus={7, 3, 5}) == ((3,), (5,))  # sorted; the remainder (7) unused
    assert rank_cpus("cores", 3, cpus=range(16)) == (tuple(range(5)), tuple(range(5, 10)), tuple(range(10, 15)))
    assert rank_cpus("cores", 4, cpus={0, 1}) == ((0,), (1,), (0,), (1,))  # more ranks than CPUs: round-robin


def test_cpu_bind_cores_binds_each_spawned_rank(tmp_path):
    """launcher.cpu_bind=cores: while the run goes, each rank process (a forked child of the launcher with its
    command line, seen in two or more polls: not a subprocess the launcher forks, which execs at once) runs on
    its own CPUs, the ones the record's plan.rank_cpus names."""
    import time

    import psutil

    proc = start([sys.executable, "-m", "ptbench", *SMOKE, "launcher.cpu_bind=cores", f"results.root={tmp_path}"])
    seen: dict[int, tuple[int, ...]] = {}
    readings: dict[int, int] = {}
    try:
        launcher = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for child in launcher.children():
                    # the latest reading: a forked rank has the launcher's affinity until its first line binds it
                    if child.cmdline() == launcher.cmdline():
                        seen[child.pid] = tuple(sorted(child.cpu_affinity()))
                        readings[child.pid] = readings.get(child.pid, 0) + 1
            except psutil.Error:
                pass  # a child that ended between the listing and the question
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err[-2000:]
    planned = [tuple(c) for c in summary(only_run(tmp_path))["plan"]["rank_cpus"]]
    assert planned == list(rank_cpus("cores", 2)) and len(planned) == 2
    ranks = {pid: cpus for pid, cpus in seen.items() if readings[pid] >= 2}  # seen in 2+ polls
    assert sorted(ranks.values()) == sorted(planned), (seen, readings, planned)


def test_cpu_bind_is_refused_for_ranks_another_launcher_started(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = bench(*SMALL, "launcher=torchrun", "launcher.cpu_bind=cores", results=tmp_path / "r", timeout=120, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "launcher.cpu_bind=cores binds the ranks launcher=local spawns, but torchrun started these" in lines[0]
    assert "srun --cpu-bind=cores" in lines[0] and not (tmp_path / "r").exists()


def test_ddp_imports_no_other_framework(local_small):
    assert summary(local_small)["frameworks_imported"] == []


BAD = [
    (["adapter.name=nosuch"], "unknown adapter 'nosuch'"),
    (["trainer.batch_size=0"], "trainer.batch_size=0 must be > 0"),
    (["launcher.nprocs=-2"], "launcher.nprocs=-2 must be > 0"),
    (["trainer.untimed_steps=-1"], "trainer.untimed_steps=-1 must be >= 0"),
    (["workload.n_head=3"], "not divisible by workload.n_head=3"),
    (["data=cifar10"], "does not fit language workload"),
    (["data=wikitext2", "data.root=/nonexistent/wt2"], "/nonexistent/wt2"),
    (["workload=resnet50_tiny", "data=cifar10", "data.root=/nonexistent/c10"], "/nonexistent/c10"),
    (["trainer.precision=int3"], "trainer.precision=int3"),
    (["optimizer.name=adagrad"], "unknown optimizer.name 'adagrad'"),
    (["adapter.batch_policy=weird"], "adapter.batch_policy=weird"),
    (["trainer.inject_fault=bogus@0:1"], "trainer.inject_fault=bogus@0:1"),
    (["trainer.epochs=0"], "trainer.epochs=0 must be > 0"),
    (["trainer.grad_accum=0"], "trainer.grad_accum=0 must be > 0"),
    (["optimizer.lr=-0.1"], "optimizer.lr=-0.1 must be > 0"),
    (["launcher.start_method=forkserver"], "launcher.start_method=forkserver: choose auto, spawn, fork"),
    (["launcher.cpu_bind=sockets"], "launcher.cpu_bind=sockets: choose none, cores"),
    (["workload.seq_len=0"], "workload.seq_len=0 must be > 0"),
    # keys renamed in issue 26: the old name is refused with the new one
    (
        ["trainer.warmup_steps=3"],
        "trainer.warmup_steps was renamed trainer.untimed_steps: write trainer.untimed_steps=3",
    ),
    (["schedule=step"], "schedule was renamed lr_schedule: write lr_schedule=step"),
    (["schedule.warmup=2"], "schedule.warmup was renamed lr_schedule.warmup: write lr_schedule.warmup=2"),
    (["results.resume=true"], "results.resume was renamed results.skip_done: write results.skip_done=true"),
    (
        [
            "data=wikitext2",
            f"data.root={os.environ['BENCH_DATA_ROOT']}/wikitext-2",
            "data.tokenizer_dir=/nonexistent/tok",
        ],
        "data.tokenizer_dir: /nonexistent/tok has no",
    ),
]


def _refused(overrides: list[str], tmp_path) -> str:
    """The one-line message the pre-launch checks give (what `python -m ptbench` prints after `error: `)."""
    with pytest.raises(ConfigError) as e:
        make_plan(typed(compose([*SMALL, *overrides, f"results.root={tmp_path / 'r'}"])), "local")
    msg = str(e.value)
    assert "\n" not in msg and msg
    assert not (tmp_path / "r").exists(), "nothing may be written for a run that never started"
    return msg


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_refused_by_the_checks(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("BENCH_DATA_ROOT", "/nonexistent")
    assert message in _refused(overrides, tmp_path)


# End to end, as a user sees it: exit 2, one line on stderr, no record. A torchrun launcher without
# torchrun's environment (checked by the launcher, not the plan); fp16 on a machine without a GPU (no
# visible GPU, so it holds on a GPU runner too); a Hydra schema error (`python -m ptbench` pre-composes, so
# it is one line too); another adapter's key.
CLI = [
    (["launcher=torchrun"], "launcher=torchrun but RANK/WORLD_SIZE/LOCAL_RANK are not set", ""),
    (["trainer.precision=fp16"], "trainer.precision=fp16 needs a GPU", ""),
    (
        ["trainer.batchsize=3"],
        "trainer.batchsize: Key 'batchsize' not in 'TrainerConfig'",
        "python -m ptbench --cfg job",
    ),
    (["adapter=ddp", "adapter.stage=3"], "adapter.stage is not a key of adapter=ddp", "adapter=zero"),
]


@pytest.mark.parametrize("overrides, message, fix", CLI, ids=[" ".join(o) for o, _, _ in CLI])
def test_refused_with_one_line_and_nothing_running(tmp_path, overrides, message, fix):
    proc = bench(
        *SMALL,
        *overrides,
        results=tmp_path / "r",
        timeout=120,
        env={"BENCH_DATA_ROOT": "/nonexistent", "CUDA_VISIBLE_DEVICES": ""},
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and message in lines[0] and fix in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "r").exists(), "a refused run leaves no record, so none is left `running`"


def test_unwritable_results_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
        ro = tmp_path / "file"
        ro.write_text("x")
    for root in (ro / "sub", Path("/proc/forbidden")):
        with pytest.raises(ConfigError, match="not writable") as e:
            make_plan(typed(compose([*SMALL, f"results.root={root}"])), "local")
        assert str(e.value).startswith(f"results.root={root} is not writable")
        assert "set results.root=" in str(e.value) and "\n" not in str(e.value)
    assert not Path("/proc/forbidden").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.batch_size=abc", "trainer.batch_size=abc: Value 'abc'"),
        ("adapter=nosuch", "Could not find 'adapter/nosuch'; choose one of: ddp, fsdp"),
        ("workload=nosuch", "Could not find 'workload/nosuch'"),
        ("experiment=nosuch", "Could not find 'experiment/nosuch'"),
    ],
)
def test_schema_rejects_unknown_key_and_wrong_type(override, message):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_key_of_another_adapter_names_its_owner():
    for overrides, message, owner in [
        (
            ["adapter=ddp", "adapter.fusion_threshold_mb=64"],
            "adapter.fusion_threshold_mb is not a key of adapter=ddp",
            "adapter=horovod",
        ),
        (
            ["adapter=fsdp", "adapter.tensor_parallel=2"],
            "adapter.tensor_parallel is not a key of adapter=fsdp",
            "adapter=megatron / adapter=tensor_parallel",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            compose(overrides)
        assert message in str(e.value) and owner in str(e.value), str(e.value)


def test_the_plan_is_made_once_with_one_meta_model(tmp_path, monkeypatch):
    """`plan_run` (what `launch` runs and `python -m ptbench --plan` prints) builds the workload's model once,
    on the meta device, for both the memory prediction and the comm volume it puts in the plan."""
    import torch

    from ptbench.runner.plan import plan_run
    from ptbench.workloads.gpt2 import GPT2Workload

    devices = []
    build = GPT2Workload.build_model
    monkeypatch.setattr(
        GPT2Workload, "build_model", lambda self: devices.append(torch.get_default_device().type) or build(self)
    )
    cfg = typed(compose([*SMALL, "adapter=zero", "adapter.stage=3", "launcher.nprocs=2", f"results.root={tmp_path}"]))
    plan, prediction = plan_run(cfg, "local")
    assert devices == ["meta"]
    assert plan.predicted_memory["total"] == round(prediction["total"]) and plan.predicted_memory["fits"] is True
    assert plan.comm_volume["backend"] == "gloo" and set(plan.comm_volume["by_op"]) == {"all_gather", "reduce_scatter"}
    assert plan.start_method == start_method("auto", torch.cuda.is_available())
    assert not any(tmp_path.iterdir())  # planning writes nothing


def test_a_typed_config_is_typed_once():
    cfg = typed(compose(["adapter=zero"]))
    assert typed(cfg) is cfg  # already merged into its schema: returned as it is
    from omegaconf import OmegaConf

    again = typed(OmegaConf.to_container(cfg, resolve=True))  # a spawned rank's plain dict is typed
    assert again is not cfg and again.adapter.stage == cfg.adapter.stage
