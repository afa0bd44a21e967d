"""Launch paths (local spawn, torchrun, Slurm environment) and bad input caught before any rank starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.core.environments import SlurmEnvironment, TorchrunEnvironment, expand_nodelist, slurm_port
from tests.helpers import REPO, bench, check_ok, only_run, summary

SMALL = ["experiment=smoke", "trainer.max_steps=3"]


def test_slurm_environment_16_nodes():
    nodelist = "gpu[001-004,010],cn7,big[08-12,100-104]"
    hosts = expand_nodelist(nodelist)
    assert len(hosts) == 16
    assert hosts[:6] == ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cn7"]
    assert hosts[6] == "big08" and hosts[-1] == "big104"
    assert expand_nodelist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    env = {"SLURM_PROCID": "37", "SLURM_NTASKS": "64", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "81234",
           "SLURM_JOB_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": "4(x16)"}
    assert SlurmEnvironment.detect(env, "slurm") and not SlurmEnvironment.detect(env, "local")
    ctx = SlurmEnvironment.context(env, "auto")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (37, 64, 1, 4)
    assert ctx.master_addr == "gpu001" and ctx.launcher == "slurm"
    assert ctx.master_port == slurm_port("81234") and 20000 <= ctx.master_port < 60000
    # two array tasks on one node are two jobs: their ports differ
    assert slurm_port("81234") != slurm_port("81235")
    # an explicit MASTER_ADDR/PORT (e.g. set by the sbatch script) wins
    ctx = SlurmEnvironment.context({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29999"}, "auto")
    assert (ctx.master_addr, ctx.master_port) == ("10.0.0.5", 29999)


def test_torchrun_env_is_honoured():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "1234"}
    assert TorchrunEnvironment.detect(env, "local") and not TorchrunEnvironment.detect({}, "local")
    ctx = TorchrunEnvironment.context(env, "auto")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.master_addr, ctx.master_port) == (3, 8, 1, "h1", 1234)
    assert ctx.launcher == "torchrun"


def test_run_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench", "launcher=torchrun", *SMALL, f"results.root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    check_ok(proc)
    s = summary(only_run(tmp_path))
    assert s["status"] == "ok" and s["world_size"] == 2 and s["launcher"] == "torchrun"


def test_ddp_imports_no_other_framework(tmp_path):
    check_ok(bench(*SMALL, results=tmp_path))
    assert summary(only_run(tmp_path))["frameworks_imported"] == []


BAD = [
    (["adapter.name=nosuch"], "unknown adapter 'nosuch'"),
    (["trainer.batch_size=0"], "trainer.batch_size=0 must be > 0"),
    (["launcher.nprocs=-2"], "launcher.nprocs=-2 must be > 0"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps=-1 must be >= 0"),
    (["workload.n_head=3"], "not divisible by workload.n_head=3"),
    (["data=cifar10"], "does not fit language workload"),
    (["data=wikitext2", "data.root=/nonexistent/wt2"], "/nonexistent/wt2"),
    (["workload=resnet50_tiny", "data=cifar10", "data.root=/nonexistent/c10"], "/nonexistent/c10"),
    (["launcher=torchrun"], "launcher=torchrun but RANK/WORLD_SIZE/LOCAL_RANK are not set"),
    (["trainer.precision=fp16"], "trainer.precision=fp16 needs a GPU"),
    (["trainer.precision=int3"], "trainer.precision=int3"),
    (["optimizer.name=adagrad"], "unknown optimizer.name 'adagrad'"),
    (["adapter.batch_policy=weird"], "adapter.batch_policy=weird"),
    (["trainer.inject_fault=bogus@0:1"], "trainer.inject_fault=bogus@0:1"),
    (["trainer.epochs=0"], "trainer.epochs=0 must be > 0"),
    (["trainer.grad_accum=0"], "trainer.grad_accum=0 must be > 0"),
    (["optimizer.lr=-0.1"], "optimizer.lr=-0.1 must be > 0"),
    (["workload.seq_len=0"], "workload.seq_len=0 must be > 0"),
    (["data=wikitext2", f"data.root={os.environ['BENCH_DATA_ROOT']}/wikitext-2", "data.tokenizer_dir=/nonexistent/tok"],
     "data.tokenizer_dir: /nonexistent/tok has no"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_line_before_launch(tmp_path, overrides, message):
    proc = bench(*SMALL, *overrides, results=tmp_path / "r", env={"BENCH_DATA_ROOT": "/nonexistent"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0]
    assert not (tmp_path / "r").exists(), "nothing may be written for a run that never started"


def test_unwritable_results_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
        ro = tmp_path / "file"
        ro.write_text("x")
    proc = bench(*SMALL, results=ro / "sub")
    assert proc.returncode == 2 and "results.root" in proc.stderr and "not writable" in proc.stderr, proc.stderr


def test_schema_rejects_unknown_key_and_wrong_type(tmp_path):
    for override, message in [("trainer.batchsize=3", "trainer.batchsize: Key 'batchsize' not in 'TrainerConfig'"),
                              ("trainer.batch_size=abc", "trainer.batch_size=abc: Value 'abc'"),
                              ("adapter=nosuch", "Could not find 'adapter/nosuch'; choose one of: ddp, fsdp"),
                              ("workload=nosuch", "Could not find 'workload/nosuch'"),
                              ("experiment=nosuch", "Could not find 'experiment/nosuch'")]:
        proc = bench(override, results=tmp_path)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


# Each adapter owns its schema: another adapter's key is refused by Hydra, naming the key and its adapter;
# an unwritable results root is refused before launch. One line each, no traceback, no record left.
REFUSED = [
    (["adapter=ddp", "adapter.stage=3"], "adapter.stage is not a key of adapter=ddp", "adapter=zero"),
    (["adapter=ddp", "adapter.fusion_threshold_mb=64"], "adapter.fusion_threshold_mb is not a key of adapter=ddp",
     "adapter=horovod"),
    (["adapter=fsdp", "adapter.tensor_parallel=2"], "adapter.tensor_parallel is not a key of adapter=fsdp",
     "adapter=megatron / adapter=tensor_parallel"),
    (["results.root=/proc/forbidden"], "results.root=/proc/forbidden is not writable", "set results.root="),
]


@pytest.mark.parametrize("overrides, message, fix", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_refused_with_one_line_and_nothing_running(tmp_path, overrides, message, fix):
    cmd = [sys.executable, "-m", "bench", *SMALL, *overrides]
    if not any(o.startswith("results.root=") for o in overrides):
        cmd.append(f"results.root={tmp_path}")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and message in lines[0] and fix in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not list(tmp_path.rglob("summary.json")), "a refused run leaves no record, so none is left `running`"
