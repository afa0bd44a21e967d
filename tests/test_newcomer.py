"""The newcomer's path, runner half (issue 31): messages that say what is true, commands that write only
under results/ (or the folder named), and the libraries that replaced hand-written code. Each runs the
command a user types, or the real function on this (CPU) machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # the oracle: what `-m` itself runs
from hydra.core.override_parser.overrides_parser import OverridesParser

from ptbench.core.environments import expand_nodelist
from ptbench.core.records import environment, nvml_gpus
from ptbench.runner.points import expand_grid
from tests.helpers import REPO, SMOKE, bench, check_ok, only_run, run, run_dirs, summary


def test_memory_study_records_of_a_folder_it_did_not_write_is_one_line(tmp_path):
    (tmp_path / "smoke" / "20260101-000000-ddp-gpt2_tiny-w2-abc").mkdir(parents=True)  # somebody else's run
    proc = run([sys.executable, "-m", "ptbench.studies.memory_study", "--records", str(tmp_path)], timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # no empty tables
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --records {tmp_path}: no memory_study records"), lines
    assert "--records results/memory_study" in lines[0]  # the fix


def test_paper_plan_dry_run_writes_nothing_and_its_default_folder_is_under_results(tmp_path):
    env = {**os.environ, "RESULTS": str(tmp_path / "results")}
    cmd = [sys.executable, "-m", "ptbench.paper", "plan", "--workloads", "gpt2_tiny", "--adapters", "ddp"]
    proc = run([*cmd, "--gpus", "1,2", "--dry-run"], timeout=300, env=env, cwd=tmp_path)
    check_ok(proc)
    assert "dry run: nothing written" in proc.stdout and "sbatch" in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))  # no paper/, no results/slurm/
    proc = run([*cmd, "--gpus", "1,2"], timeout=300, env=env, cwd=tmp_path)
    check_ok(proc)
    assert sorted(p.name for p in (tmp_path / "results" / "paper").iterdir()) == [
        "epoch.txt",
        "memory.txt",
        "plan.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["results"]


def test_smoke_preset_runs_with_the_pipeline_adapter(tmp_path):
    """`experiment=smoke adapter=pipeline`: the preset's batch of 4 was refused against 8 micro-batches."""
    proc = bench(*SMOKE, "adapter=pipeline", "trainer.max_steps=2", results=tmp_path)
    check_ok(proc)
    s = summary(only_run(tmp_path))
    assert s["status"] == "ok" and s["plan"]["microbatches"] == 4 and s["global_batch"] == 4, s["plan"]


def test_local_cluster_refuses_a_leftover_slurm_conf_at_once():
    """A SLURM_CONF exported by the two-node recipe made `make slurm-up` fail after 31 s ("slurmdbd did not
    come up"); now any one-node command refuses before it touches anything, naming the fix."""
    env = {**os.environ, "SLURM_CONF": "/var/run/trainbench-slurm-multi/etc/slurm.conf"}
    for args in (["start", "--accounting"], ["status"]):
        proc = subprocess.run(
            ["bash", str(REPO / "slurm" / "local_cluster.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "SLURM_CONF=" in lines[0] and "unset SLURM_CONF" in lines[0], lines


def test_nvml_without_a_gpu_gives_nothing_and_env_json_has_collect_env(tmp_path):
    """This machine has no NVIDIA driver: NVML (nvidia-ml-py) cannot start, and the record says nothing of
    GPUs instead of failing. torch.utils.collect_env's probes describe the system."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a GPU machine: the same function must list its GPUs
        pynvml.nvmlShutdown()
        gpus = nvml_gpus()
        assert gpus["driver"] and gpus["nvidia_smi_gpus"], gpus
        return
    assert nvml_gpus() == {}
    env = environment()
    assert "driver" not in env and "nvidia_smi_gpus" not in env
    system = env["system"]
    assert set(system) == {"os", "libc", "gcc", "cpu_info", "cuda_runtime", "nvidia_driver", "gpu_models", "cudnn"}
    assert system["os"] and system["libc"].startswith("glibc"), system
    assert system["nvidia_driver"] is None and system["gpu_models"] is None  # no GPU here


def test_grid_expands_as_hydras_own_sweeper():
    for overrides in (
        ["adapter=ddp,zero", "launcher.nprocs=1,2", "experiment=smoke"],
        ["a=1", "b=range(1,4)", "a=2,3", '+c="x,y"', "d='q r'", "e=choice(1,2)", "f=[1,2]"],
    ):
        parsed = OverridesParser.create().parse_overrides(overrides)
        assert expand_grid(overrides) == BasicSweeper.split_arguments(parsed, None)[0], overrides


def test_nodelist_expansion_by_python_hostlist():
    hosts = expand_nodelist("gpu[001-004,010],cn7,big[08-12,100-104]")
    assert hosts[:6] == ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cn7"] and len(hosts) == 16
    assert expand_nodelist("tbn[1-2]") == ["tbn1", "tbn2"]


def test_demo_replaces_only_its_own_runs(tmp_path):
    demo = tmp_path / "demo"
    old = demo / "20260101-000000-ddp-gpt2_tiny-w1-abcdef"
    old.mkdir(parents=True)
    (old / "summary.json").write_text(json.dumps({"status": "ok"}))
    (demo / "my_figure.png").write_bytes(b"\x89PNG")  # what a user saved there
    (demo / "notes").mkdir()
    (demo / "notes" / "a.txt").write_text("mine")
    proc = run(
        [sys.executable, "-m", "ptbench.demo", "--points", "ddp:1", "--repeats", "1", "--results", str(tmp_path), "--",
         "trainer.max_steps=2", "trainer.epochs=1", "workload.vocab_size=256"],
        timeout=600,
    )  # fmt: skip
    check_ok(proc)
    assert not old.exists()
    assert (demo / "my_figure.png").read_bytes() == b"\x89PNG" and (demo / "notes" / "a.txt").read_text() == "mine"
    assert len(run_dirs(demo)) == 1 and (demo / "report" / "report.md").is_file()


def test_ptbench_local_says_what_it_waits_for_and_leaves_no_literal_job_id_folder(tmp_path):
    proc = run(
        [sys.executable, "-m", "ptbench", "-m", "hydra/launcher=ptbench_local", *SMOKE, "launcher.nprocs=1",
         "trainer.max_steps=2", "trainer.seed=1,2", f"results.root={tmp_path}"],
        timeout=600,
    )  # fmt: skip
    check_ok(proc)
    assert "ptbench_local: waiting for 2 point(s) (job logs in " in proc.stdout, proc.stdout
    (sweep,) = {d.parent for d in run_dirs(tmp_path)}
    submitit = sweep / ".submitit"
    assert submitit.is_dir() and not any(p.name == "%j" for p in submitit.rglob("*")), list(submitit.rglob("*"))
    assert len(list(submitit.glob("*_0_log.out"))) == 2  # each point's log, named by its job id


def test_demo_plan_is_the_first_lines_the_readme_shows(tmp_path):
    """`python -m ptbench.demo --plan` on a fresh clone's install (make install: every framework but Horovod,
    which only `make horovod` builds; hidden here as a fresh clone lacks it): the plan's lines are the README's
    first lines of the demo's output, the runs it counts are the runs it makes, and it writes nothing."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['horovod'] = None\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(hide)}
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.demo", "--plan", "--results", str(tmp_path / "results")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(proc)
    assert not (tmp_path / "results").exists()  # a plan writes nothing
    readme = (REPO / "README.md").read_text().split("make demo   #", 1)[1]
    shown = readme.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    plan = proc.stdout.replace(f"{tmp_path / 'results'}/", "results/").splitlines()
    assert plan == shown[:2], (plan, shown[:2])
    assert shown[0].startswith("demo: 9 points x 2 repeat(s) = 18 runs, interleaved, into results/demo/")
    assert shown[1] == "  not run: horovod x2: horovod is not installed (`make horovod` builds it)"
    total = re.fullmatch(
        r"demo: (\d+)/(\d+) runs ok in (?:\d+|\.\.\.)s; not run: horovod x2 \(framework not installed\)", shown[-1]
    )
    assert total and total[2] == "18", shown[-1]  # the closing tally counts the runs the first line promised


def test_a_failed_runs_line_is_its_error_not_hydras_hint():
    """A run that fails inside Hydra's job ends its stderr with Hydra's hint about HYDRA_FULL_ERROR: the line
    the demo and the sweep print is the error before it (as Hydra printed it in a demo run on this machine)."""
    from ptbench.run_point import BenchRun

    stderr = (
        "Error executing job with overrides: ['adapter=fsdp']\n"
        "Traceback (most recent call last):\n"
        '  File "ptbench/runner/launch.py", line 41, in <module>\n'
        "ImportError: cannot import name 'lifeline' from 'ptbench.runner'\n"
        "\n"
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
    )
    run = BenchRun(command=["python", "-m", "ptbench"], returncode=1, run_dir=None, stderr=stderr)
    assert run.error_line == "ImportError: cannot import name 'lifeline' from 'ptbench.runner'"
