"""A non-editable install runs from any directory: conf/ ships in the wheel, the Hydra launcher plugin
is found by Hydra's own plugin scan, and nothing needs PYTHONPATH.

The wheel is built from this checkout and installed (no dependencies) into a fresh venv whose only
link to the test venv is a .pth line naming its site-packages (for torch and the frameworks: a
second 6 GB install would prove nothing more). The runs start in an empty folder, far from the
checkout, with PYTHONPATH removed from the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel of this checkout, and what its build printed."""
    tmp = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(tmp.glob("ptbench-*.whl")), proc.stdout + proc.stderr


def test_the_build_is_quiet_and_ships_every_config(built):
    """No setuptools warning (it printed ~20 per install, each a screen long, about conf/'s yaml folders taken for
    packages), and every yaml of conf/ in the wheel: the package data is named by pyproject's globs alone."""
    wheel, printed = built
    assert "warn" not in printed.lower(), printed[-3000:]
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("ptbench/conf/")}
    want = {f"ptbench/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    assert want and want <= shipped, sorted(want - shipped)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, built) -> Path:
    tmp = tmp_path_factory.mktemp("pkg")
    wheel = built[0]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return venv / "bin/python"


def _run(python: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_installed_package_is_not_the_checkout(installed, tmp_path):
    proc = _run(
        installed,
        tmp_path,
        "-c",
        "import ptbench, hydra_plugins.ptbench_launcher as p; print(ptbench.__file__, p.__file__)",
    )
    assert proc.returncode == 0, proc.stderr
    assert str(REPO) not in proc.stdout and "site-packages" in proc.stdout, proc.stdout


def test_everything_installs_under_one_namespace(installed, tmp_path):
    """The wheel puts ptbench/ and Hydra's plugin folder in site-packages and nothing else: the folders'
    own names (bench, adapters, workloads, analysis) belong to other projects on the package index."""
    site = Path(
        _run(
            installed, tmp_path, "-c", "import ptbench, pathlib; print(pathlib.Path(ptbench.__file__).parents[1])"
        ).stdout.strip()
    )
    tops = sorted(p.name for p in site.iterdir() if p.name != "deps.pth" and not p.name.endswith(".dist-info"))
    assert tops == ["bin", "hydra_plugins", "ptbench"], tops  # bin/: pip --target puts the console script there
    assert sorted(p.name for p in (site / "bin").iterdir()) == ["ptbench"]
    assert sorted(p.name for p in (site / "hydra_plugins").iterdir()) == ["ptbench_launcher"]
    proc = _run(installed, tmp_path, "-c", "import ptbench.adapters, ptbench.workloads, ptbench.analysis, ptbench.conf")
    assert proc.returncode == 0, proc.stderr
    for bare in ("bench", "adapters", "workloads", "analysis"):
        proc = _run(installed, tmp_path, "-c", f"import {bare}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (bare, proc.stderr)


def test_smoke_run_from_any_directory(installed, tmp_path):
    proc = _run(installed, tmp_path, "-m", "ptbench", "experiment=smoke", "launcher.nprocs=1", "results.root=out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((tmp_path / "out").rglob("summary.json"))) == 1
    assert '"status": "ok"' in next((tmp_path / "out").rglob("summary.json")).read_text()
    # the record states the installed package's version; no git commit (a wheel is not a checkout)
    env = json.loads(next((tmp_path / "out").rglob("env.json")).read_text())
    assert env["package_version"] == "0.1.0" and env["git_sha"] is None and env["git_dirty"] is None, env


SBATCH = ("array.sbatch", "run.sbatch", "stage_data.sh", "local_cluster.sh", "README.md")


def test_sbatch_scripts_ship_and_an_installed_copy_finds_them(built, installed, tmp_path):
    """slurm/ is package data (ptbench.slurm): the wheel holds the scripts, and the installed copy's
    submission (`ptbench.sweep submit`) points sbatch at its own copy, jobs running from the submit folder."""
    wheel = built[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"ptbench/slurm/{name}" for name in SBATCH} <= names, sorted(n for n in names if "slurm" in n)
    proc = _run(
        installed,
        tmp_path,
        "-c",
        "from ptbench.runner.slurm import script_path, REPO, CHECKOUT; "
        "print(script_path('array.sbatch')); print(REPO); print(CHECKOUT)",
    )
    assert proc.returncode == 0, proc.stderr
    script, repo, checkout = proc.stdout.split()
    assert "site-packages" in script and str(REPO) not in script and Path(script).is_file(), script
    assert Path(script).read_text() == (REPO / "slurm" / "array.sbatch").read_text()
    assert repo == str(tmp_path) and checkout == "None", proc.stdout
    (tmp_path / "sweep.txt").write_text("adapter=ddp launcher.nprocs=1\n")
    proc = _run(installed, tmp_path, "-m", "ptbench.sweep", "submit", "sweep.txt", "--dry-run")
    assert proc.returncode == 0 and f" {script} " in proc.stdout, proc.stdout + proc.stderr


def test_ptbench_local_multirun_without_pythonpath(installed, tmp_path):
    proc = _run(
        installed,
        tmp_path,
        "-m",
        "ptbench",
        "-m",
        "hydra/launcher=ptbench_local",
        "experiment=smoke",
        "launcher.nprocs=1",
        "trainer.max_steps=2",
        "results.root=out",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = list((tmp_path / "out").rglob("summary.json"))
    assert len(summaries) == 1 and '"status": "ok"' in summaries[0].read_text()
    assert "deprecated" not in proc.stderr.lower(), proc.stderr


def test_plugin_is_scanned_and_its_config_typed(installed, tmp_path):
    """Hydra's plugin scan finds the launcher (Hydra instantiates only scanned plugins), and
    hydra/launcher=bench_slurm composes against the stock schema it extends: a misspelt field is refused."""
    proc = _run(
        installed,
        tmp_path,
        "-c",
        "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import "
        "Launcher; print([p.__name__ for p in Plugins.instance().discover(Launcher)])",
    )
    assert proc.returncode == 0 and "BenchSlurmLauncher" in proc.stdout, proc.stdout + proc.stderr
    proc = _run(
        installed, tmp_path, "-m", "ptbench", "hydra/launcher=bench_slurm", "--cfg", "hydra", "-p", "hydra.launcher"
    )
    assert proc.returncode == 0 and "BenchSlurmLauncher" in proc.stdout and "signal_delay_s: 120" in proc.stdout, (
        proc.stderr
    )
    proc = _run(
        installed,
        tmp_path,
        "-m",
        "ptbench",
        "hydra/launcher=bench_slurm",
        "hydra.launcher.gpus_per_nod=8",
        "--cfg",
        "hydra",
    )
    assert proc.returncode != 0 and "gpus_per_nod" in proc.stderr, proc.stderr
