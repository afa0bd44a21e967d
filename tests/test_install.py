"""How the harness installs where users run it (issue 27): frameworks as extras, each adapter refusing in one
line naming its extra when its framework is missing; torch a tested range that keeps the environment's own
torch (local and NGC pre-release versions); constraints.txt the exact tested set; records stating the
package version and the checkout's commit.

The missing framework is made missing for real in a child interpreter: a sitecustomize on its PYTHONPATH
sets sys.modules[NAME] = None before anything runs, which is what Python does for a module that cannot be
imported (find_spec returns None, `import NAME` raises ModuleNotFoundError).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# adapter -> (its framework's distribution, the import names to hide, the extra its refusal names)
FRAMEWORKS = {
    "zero": ("deepspeed", ["deepspeed"], "deepspeed"),
    "megatron": ("megatron-core", ["megatron", "megatron.core"], "megatron"),
    "gpipe": ("torchgpipe", ["torchgpipe"], "gpipe"),
    "horovod": ("horovod", ["horovod"], "horovod"),
}


def _hiding(tmp_path: Path, modules: list[str]) -> dict:
    """An environment whose interpreters cannot import `modules`."""
    site = tmp_path / "hide"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules), encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


def test_missing_framework_is_refused_in_one_line_naming_the_extra(tmp_path):
    """`python -m ptbench adapter=zero` without DeepSpeed: exit 2 before any rank starts, one line on stderr."""
    env = _hiding(tmp_path, ["deepspeed"])
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench", "adapter=zero", "experiment=smoke", f"results.root={tmp_path / 'out'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "warn" not in line.lower()]
    assert proc.returncode == 2, proc.stderr[-2000:]  # a refused configuration, as every ConfigError
    assert lines == ["error: adapter=zero needs deepspeed, which is not installed: pip install 'ptbench[deepspeed]'"], (
        proc.stderr[-2000:]
    )
    assert not list((tmp_path / "out").rglob("summary.json"))


def test_every_framework_adapter_names_its_extra_and_torch_adapters_still_plan(tmp_path):
    """All four frameworks missing at once (megatron through its parent package, as when it is not
    installed): each adapter's plan is refused with its own extra, the smoke driver lists them as not
    installed (the dotted megatron.core included), and the torch-only adapters plan as before."""
    hidden = [m for _, mods, _ in FRAMEWORKS.values() for m in mods]
    code = (
        "from ptbench.core.errors import ConfigError\n"
        "from ptbench.adapters import get_adapter_class\n"
        "from ptbench.runner.compose import compose, typed\n"
        "from ptbench.runner.plan import make_plan\n"
        "from ptbench.smoke import framework_installed\n"
        "import sys\n"
        "for name in sys.argv[2:]:\n"
        "    cls = get_adapter_class(name)\n"
        "    over = ['experiment=smoke', 'adapter=' + name, *cls.smoke_overrides(2), 'results.root=' + sys.argv[1]]\n"
        "    try:\n"
        "        make_plan(typed(compose(over)), 'local')\n"
        "        print(name, 'PLANNED', framework_installed(cls))\n"
        "    except ConfigError as e:\n"
        "        print(name, 'REFUSED', framework_installed(cls), e)\n"
    )
    names = [*FRAMEWORKS, "ddp", "fsdp", "pipeline"]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out"), *names],
        cwd=tmp_path,
        env=_hiding(tmp_path, hidden),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for name, (dist, _, extra) in FRAMEWORKS.items():
        assert out[name].startswith(f"REFUSED False adapter={name} needs {dist}, which is not installed: "), out[name]
        assert f"'ptbench[{extra}]'" in out[name] and "\n" not in out[name], out[name]
    assert out["horovod"].count("horovod_build.sh") == 1, out["horovod"]
    for name in ("ddp", "fsdp", "pipeline"):
        assert out[name] == "PLANNED True", out[name]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


def test_requirements_are_ranges_and_constraints_pin_a_set_inside_them():
    """torch and torchvision are ranges (a cluster's own torch is kept); the frameworks are extras, not
    dependencies; constraints.txt (make install, CI) pins every requirement of .[dev] (so .[all] and the
    frameworks) to a version its range allows, and does not pin the project itself."""
    project = _pyproject()["project"]
    deps = {Requirement(d).name: Requirement(d) for d in project["dependencies"]}
    assert not {"deepspeed", "megatron-core", "torchgpipe", "horovod"} & set(deps)
    extras = project["optional-dependencies"]
    assert {"deepspeed", "megatron", "gpipe", "horovod", "all", "dev"} <= set(extras)
    assert extras["all"] == ["ptbench[deepspeed,megatron,gpipe]"] and "ptbench[all]" in extras["dev"]
    for name in ("torch", "torchvision"):
        ops = {s.operator for s in deps[name].specifier}
        assert ops == {">=", "<"}, deps[name]
    pins = _constraints()
    assert "ptbench" not in pins
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for key in ("deepspeed", "megatron", "gpipe", "dev") for r in extras[key]]
    for req in reqs:
        if req.name == "ptbench":
            continue
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])


@pytest.mark.parametrize(
    "version, accepted",
    [
        ("2.14.1+cu130", True),  # the PyPI wheel (its local label)
        ("2.11.0+cu130", True),  # the oldest tested: the GPU machine's torch
        ("2.13.0a0+5228986c39.nv25.10", True),  # NGC containers: a pre-release of the release they track
        ("2.15.0a0+5228986c39.nv26.4", True),
        ("2.10.0", False),  # below the tested range
        ("2.16.0a0+5228986c39.nv26.8", False),  # a 2.16 pre-release is not < 2.16 (PEP 440)
        ("2.8.0a0+5228986c39.nv25.8", False),
    ],
)
def test_torch_range_accepts_local_and_ngc_versions(version, accepted):
    """pip keeps an installed torch whose version the specifier contains with pre-releases allowed (its
    resolver checks installed candidates that way), so an NGC build of a tested release is kept, never replaced."""
    (torch,) = [Requirement(d) for d in _pyproject()["project"]["dependencies"] if d.startswith("torch>")]
    assert SpecifierSet(str(torch.specifier)).contains(version, prereleases=True) is accepted


def test_record_states_package_version_and_commit():
    """env.json: the package version, and in a git checkout its commit and dirty flag (as git says them)."""
    from ptbench.core import schema
    from ptbench.core.records import environment

    env = environment()
    schema.check(env, schema.ENV, "env.json")
    assert env["package_version"] == importlib.metadata.version("ptbench")
    if not (REPO / ".git").exists():
        assert env["git_sha"] is None and env["git_dirty"] is None
        return
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    assert env["git_sha"] == head.stdout.strip()
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert env["git_dirty"] is bool(status.stdout.strip())
