"""The users' own environments: the tested torch list against pyproject's ranges, the one-line warning an
untested torch gets before launch (and the record's torch, Python and frameworks), and the wheelhouse for a
target that already has most packages (.ci/wheelhouse_target.py, which `make wheelhouse TARGET_FREEZE=...` runs)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ptbench.core.torch_support import TESTED_TORCH, untested_torch
from tests.helpers import REPO, bench, check_ok, only_run, summary


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_pyproject_ranges_hold_every_tested_torch_and_python():
    """The range is what the matrix passes: every tested torch, its torchvision and its Pythons are inside."""
    project = _pyproject()["project"]
    deps = {Requirement(d).name: Requirement(d).specifier for d in project["dependencies"]}
    pythons = SpecifierSet(project["requires-python"])
    for minor, (torch_version, torchvision, tested_on) in TESTED_TORCH.items():
        assert torch_version.startswith(minor + ".")
        assert deps["torch"].contains(torch_version, prereleases=True), (minor, deps["torch"])
        assert deps["torchvision"].contains(torchvision, prereleases=True), (minor, deps["torchvision"])
        assert all(pythons.contains(p + ".0") for p in tested_on), (minor, tested_on, pythons)


@pytest.mark.parametrize(
    "version, tested",
    [
        ("2.11.0+cu130", True),  # the GPU machine's torch
        ("2.15.0", True),
        ("2.14.0a0+5228986c39.nv26.1", True),  # an NGC build keeps its release's minor
        ("2.10.0", False),
        ("2.16.0.dev20270101", False),
    ],
)
def test_untested_torch_is_one_line_naming_the_fix(version, tested):
    line = untested_torch(version)
    assert (line is None) is tested
    if line:
        assert "\n" not in line and version in line and "make test-torch" in line


# the real launcher in a fresh process, with the tested list emptied: the installed torch is then untested
RUN_UNTESTED = (
    "import sys; from ptbench.core import torch_support; torch_support.TESTED_TORCH.clear(); "
    "from ptbench.__main__ import main; sys.argv[0] = 'ptbench'; sys.exit(main())"
)
TINY = [
    "experiment=smoke",
    "workload=gpt2_tiny",
    "data=synthetic",
    "launcher.nprocs=1",
    "trainer.max_steps=1",
    "trainer.untimed_steps=0",
]


def test_untested_torch_warns_before_launch_and_the_record_names_the_environment(tmp_path):
    cmd = [sys.executable, "-c", RUN_UNTESTED, *TINY, f"results.root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    check_ok(proc)
    lines = [line for line in proc.stderr.splitlines() if "is not among the tested releases" in line]
    assert lines == [
        f"warning: torch {torch.__version__} is not among the tested releases (): the run goes on, but "
        "results and fixes are unverified on it; `make test-torch TORCH=<minor> PYTHON=<x.y>` tests it"
    ]
    assert "Traceback" not in proc.stderr
    run = only_run(tmp_path)
    assert lines[0].removeprefix("warning: ") in summary(run)["warnings"]
    env = json.loads((run / "env.json").read_text())
    assert env["python"] == platform.python_version()
    assert env["versions"]["torch"] == importlib.metadata.version("torch")  # torch.__version__ less its +cu label


def test_a_tested_torch_runs_without_the_warning(tmp_path):
    check_ok(proc := bench(*TINY, results=tmp_path))
    assert "tested releases" not in proc.stderr


# --- make wheelhouse TARGET_FREEZE=...: what the target has stays out ----------------------------------------
TARGET = ".ci/wheelhouse_target.py"


def _target(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TARGET, *map(str, args)], cwd=REPO, capture_output=True, text=True)


def test_target_versions_replace_the_pinned_ones_in_the_resolve(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# pip freeze\nnumpy==2.5.2\ntorch==2.11.0+cu130\nJinja2\n-e git+https://x/y#egg=z\n")
    pinned = tmp_path / "constraints.txt"
    pinned.write_text("# header\nhydra-core==1.3.8\njinja2==3.1.6\nnumpy==2.4.6\ntorch==2.14.1\n")
    proc = _target("constraints", pinned, freeze)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["hydra-core==1.3.8", "numpy==2.5.2", "torch==2.11.0"]


def test_the_wheelhouse_brings_only_what_the_target_lacks(tmp_path):
    installs = ["ptbench", "torch", "nvidia-cublas", "numpy", "hydra_core", "python-hostlist"]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": "1.0"}} for n in installs]}))
    freeze = tmp_path / "names.txt"
    freeze.write_text("numpy\nseaborn\n")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for wheel in ("ptbench-0.1.0-py3-none-any.whl", "python_hostlist-1.0-py3-none-any.whl", "numpy-2.4.6-cp312.whl"):
        (house / wheel).write_bytes(b"")
    proc = _target("pick", report, freeze, "0", "^(torch|torchvision|triton|nvidia-.*|cuda-.*)$", house)
    assert proc.returncode == 0, proc.stderr
    assert (house / "requirements.txt").read_text() == "hydra-core==1.0\npython-hostlist==1.0\n"
    assert sorted(p.name for p in house.glob("*.whl")) == [
        "ptbench-0.1.0-py3-none-any.whl",
        "python_hostlist-1.0-py3-none-any.whl",
    ]


@pytest.mark.parametrize("content, says", [(None, "no such file"), ("# nothing\n\n", "no package names in it")])
def test_a_missing_or_empty_target_freeze_is_one_line_from_make(tmp_path, content, says):
    """The Makefile's own first step, before any build or download (the venv's install stamp taken as fresh)."""
    freeze = tmp_path / "freeze.txt"
    if content is not None:
        freeze.write_text(content)
    venv = Path(sys.prefix)
    make = ["make", "-s", "-o", f"{venv}/.installed", f"VENV={venv}", "wheelhouse"]
    proc = subprocess.run(
        [*make, f"TARGET_FREEZE={freeze}", f"WHEELHOUSE={tmp_path / 'wh'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0].startswith(f"TARGET_FREEZE={freeze}: {says}; give the target's `pip freeze`")
    assert not list((tmp_path / "wh").glob("*.whl"))
