"""ptbench's Hydra launchers live under ptbench's own names and are found by every install mode.

- `hydra/launcher=ptbench_local` (BenchLocalLauncher) and `hydra/launcher=bench_slurm` (BenchSlurmLauncher) pass
  Hydra's own launcher test suites (hydra.test_utils.launcher_common_tests), run as hydra-submitit-launcher runs
  them for its launchers; bench_slurm's against the local Slurm cluster (slurm/local_cluster.sh, marker `slurm`).
- Installing ptbench changes no other Hydra app: a separate small app asking for `hydra/launcher=submitit_local`
  gets the stock LocalLauncher, whose jobs run side by side.
- pip's default editable install (the README's notebook route) finds the launcher plugin, ptbench.conf and
  ptbench.slurm: a Slurm dry run names an sbatch script that exists, and a ptbench_local multirun runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

from tests.helpers import REPO
from tests.test_slurm import slurm  # noqa: F401 - the module-scoped cluster fixture

STOCK_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
# bench_slurm.yaml lies in ptbench's own config package, not in Hydra's test apps: put it on their search path
PTBENCH_CONF = "hydra.searchpath=[pkg://ptbench.conf]"


# --- Hydra's launcher suites ---------------------------------------------------------------------------
@pytest.mark.parametrize("launcher_name, overrides", [("ptbench_local", ["hydra.launcher.timeout_min=2"])])
class TestPtbenchLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=ptbench_local",
           "hydra.launcher.gpus_per_node=0", "hydra.launcher.timeout_min=1"])],
)  # fmt: skip
class TestPtbenchLocalLauncherIntegration(IntegrationTestSuite):
    pass


# a time limit well past bench_slurm's signal_delay_s (120 s): with timeout_min=1 or 2, Slurm signals the job
# (USR2, submitit's timeout handling) as it starts, and a job slower than that on a busy machine fails
SLURM_LIMIT = "hydra.launcher.timeout_min=10"


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm")
@pytest.mark.parametrize("launcher_name, overrides", [("bench_slurm", [SLURM_LIMIT, PTBENCH_CONF])])
class TestBenchSlurmLauncher(LauncherTestSuite):
    pass


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm")
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=bench_slurm",
           PTBENCH_CONF, SLURM_LIMIT])],
)  # fmt: skip
class TestBenchSlurmLauncherIntegration(IntegrationTestSuite):
    pass


# --- another Hydra app in the same environment ---------------------------------------------------------
# Each job says which launcher ran it and whether the sweep's other jobs were running at the same time: it
# announces itself in a shared folder and waits (up to cfg.wait s) until all cfg.peers jobs have.
APP = """
import json, os, time
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    hc, start = HydraConfig.get(), time.time()
    open(os.path.join(cfg.out, f"started-{hc.job.num}"), "w").close()
    while len([p for p in os.listdir(cfg.out) if p.startswith("started-")]) < cfg.peers and time.time() - start < cfg.wait:
        time.sleep(0.1)
    together = len([p for p in os.listdir(cfg.out) if p.startswith("started-")]) == cfg.peers
    with open(os.path.join(cfg.out, f"job-{hc.job.num}.json"), "w") as f:
        json.dump(dict(choice=hc.runtime.choices["hydra/launcher"], target=hc.launcher._target_,
                       together=together, start=start, end=time.time()), f)

main()
"""


def _app(tmp_path: Path, launcher: str, jobs: int, wait: float) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (tmp_path / "app.py").write_text(APP)
    out = tmp_path / f"out-{launcher}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the app sees the venv, not the checkout
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", f"hydra/launcher={launcher}", f"+out={out}", f"+peers={jobs}",
         f"+wait={wait}", f"+n={','.join(map(str, range(jobs)))}", f"hydra.sweep.dir=sweep-{launcher}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, [json.loads(p.read_text()) for p in sorted(out.glob("job-*.json"))]


def test_another_app_gets_the_stock_submitit_local_and_ptbench_local_beside_it(tmp_path):
    proc, jobs = _app(tmp_path, "submitit_local", 3, wait=120)
    print("stock:", jobs)
    assert [j["target"] for j in jobs] == [STOCK_LOCAL] * 3, jobs
    # the stock launcher runs the sweep's jobs side by side: each saw all three started, none ended before that
    assert all(j["together"] for j in jobs) and max(j["start"] for j in jobs) < min(j["end"] for j in jobs), jobs
    assert "waiting for" not in proc.stdout, proc.stdout  # ptbench's launcher did not run it
    # ...while the same app in the same environment also sees ptbench's own launcher, under its own name
    proc, jobs = _app(tmp_path, "ptbench_local", 2, wait=2)
    print("ptbench_local:", jobs)
    assert [j["target"] for j in jobs] == ["hydra_plugins.ptbench_launcher.BenchLocalLauncher"] * 2, jobs
    assert not jobs[0]["together"] and jobs[0]["end"] <= jobs[1]["start"], jobs  # one at a time
    assert "ptbench_local: waiting for 2 point(s)" in proc.stdout, proc.stdout


# --- the README's notebook install: pip's default editable mode ------------------------------------------
# A copy of the checkout (pip writes its egg-info there) installed with `pip install -e ".[notebooks]"` into a fresh
# venv, without the strict mode `make install` uses. Offline: --no-deps, the dependencies coming from the test
# venv's site-packages through a .pth line (as tests/test_packaging.py does), and --no-build-isolation, its
# setuptools building the editable wheel.
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "results", "wheelhouse", "outputs", "multirun", ".submitit", "*.egg-info",
    "__pycache__", ".pytest_cache", ".ipynb_checkpoints", "*.log", "slurm-*.out",
)  # fmt: skip


@pytest.fixture(scope="module")
def notebook_install(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("notebook")
    checkout = tmp / "checkout"
    shutil.copytree(REPO, checkout, ignore=COPY_IGNORE)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", ".[notebooks]"],
        cwd=checkout, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    editable = [p.name for p in Path(site).iterdir() if p.name.startswith("__editable__")]
    assert any(name.endswith("_finder.py") for name in editable), editable  # the default mode, not the strict one
    print(proc.stdout.strip().splitlines()[-1])
    return python, checkout


def _in(python: Path, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_notebook_install_finds_plugin_conf_and_sbatch_scripts(notebook_install, tmp_path):
    python, checkout = notebook_install
    proc = _in(
        python, tmp_path, "-c",
        "import ptbench, ptbench.conf, ptbench.slurm, hydra_plugins.ptbench_launcher as p; "
        "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
        "print(ptbench.__file__, ptbench.conf.__file__, ptbench.slurm.__file__, p.__file__); "
        "print(*sorted(c.__name__ for c in Plugins.instance().discover(Launcher)))",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    files, plugins = proc.stdout.splitlines()
    assert all(f.startswith(str(checkout)) for f in files.split()), files  # the editable copy, not the test venv's
    assert {"BenchLocalLauncher", "BenchSlurmLauncher"} <= set(plugins.split()), plugins  # Hydra's plugin scan
    print(plugins)


def test_notebook_install_then_a_slurm_dry_run(notebook_install, tmp_path):
    python, checkout = notebook_install
    proc = _in(
        python, tmp_path, "-c", "from ptbench.runner.slurm import script_path; print(script_path('array.sbatch'))"
    )
    assert proc.returncode == 0, proc.stderr
    script = Path(proc.stdout.strip())
    assert script == checkout / "slurm" / "array.sbatch" and script.is_file(), script
    (tmp_path / "sweep.txt").write_text("adapter=ddp launcher.nprocs=1\n")
    proc = _in(python, tmp_path, "-m", "ptbench.sweep", "submit", "sweep.txt", "--dry-run")
    assert proc.returncode == 0 and f" {script} " in proc.stdout, proc.stdout + proc.stderr
    print(proc.stdout.strip())


def test_notebook_install_runs_a_ptbench_local_multirun(notebook_install, tmp_path):
    """The launcher is instantiated through Hydra's plugin registry ("Unknown plugin class" when not scanned)."""
    python, _ = notebook_install
    proc = _in(
        python, tmp_path, "-m", "ptbench", "-m", "hydra/launcher=ptbench_local", "experiment=smoke",
        "workload.vocab_size=256", "launcher.nprocs=1", "trainer.max_steps=2", "trainer.progress=false",
        "results.root=out", timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = list((tmp_path / "out").rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["status"] == "ok", summaries
