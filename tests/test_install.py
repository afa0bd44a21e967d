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
import json
import os
import re
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
    assert lines == [
        "error: adapter=zero needs deepspeed, which is not installed: pip install -e '.[deepspeed]' in the ptbench checkout"
    ], proc.stderr[-2000:]
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
        assert f"'.[{extra}]'" in out[name] and "\n" not in out[name], out[name]
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


# --- the offline route: make wheelhouse, its install.sh, make constraints --------------------------------------
def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A real wheel of one empty module (what pip installs from a wheelhouse), written with zipfile."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    files[f"{dist}/RECORD"] = "".join(f"{p},{digest(t)},{len(t.encode())}\n" for p, t in files.items())
    files[f"{dist}/RECORD"] += f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


def _wheelhouse(tmp_path: Path) -> Path:
    """A wheelhouse as make wheelhouse leaves it: install.sh beside the wheels. The stand-ins: a `ptbench` that
    needs PyYAML (the image's own, like its torch) and `imgdep<3` (like torch 2.11's setuptools<82), and the
    imgdep 2.0 the wheelhouse brings for it."""
    house = tmp_path / "wheelhouse"
    _wheel(house, "ptbench", "0.0.1", ("PyYAML>=5", "imgdep<3"))
    _wheel(house, "imgdep", "2.0")
    script = (REPO / ".ci" / "wheelhouse_install.sh").read_text()
    assert (
        "sed 's/@EXTRAS@/$(EXTRAS)/' .ci/wheelhouse_install.sh > $(WHEELHOUSE)/install.sh"
        in (REPO / "Makefile").read_text()
    )
    (house / "install.sh").write_text(script.replace("@EXTRAS@", "all"))
    return house


def _install_sh(house: Path, python: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env["PYTHON"] = python
    return subprocess.run(
        ["bash", str(house / "install.sh"), *args],
        cwd=house.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _pep668_python() -> str:
    """A base interpreter marked externally managed (Debian's /usr/bin/python3 here) that has PyYAML and pip."""
    code = (
        "import os, sys, sysconfig, yaml, pip\n"
        "sys.exit(0 if sys.prefix == sys.base_prefix and "
        "os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) else 1)"
    )
    for python in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(python).exists() and subprocess.run([python, "-c", code], capture_output=True).returncode == 0:
            return python
    pytest.skip("no externally managed (PEP 668) Python with PyYAML and pip on this machine")


def _versions(python: Path, *names: str) -> list[str]:
    code = "import importlib.metadata as m, sys; print(*(m.version(n) for n in sys.argv[1:]))"
    # from the interpreter's own folder: the checkout's ptbench.egg-info would answer from the current one
    out = subprocess.run([python, "-c", code, *names], cwd=Path(python).parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_install_sh_on_an_externally_managed_python_says_so_then_installs_into_a_venv_over_it(tmp_path):
    """PEP 668: without a folder, one line and exit 2, nothing installed; with one, a venv that sees the
    system's packages: its PyYAML kept ("Requirement already satisfied"), ptbench and imgdep installed there."""
    python, house = _pep668_python(), _wheelhouse(tmp_path)
    refused = _install_sh(house, python)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        f"install.sh: {python} is externally managed (PEP 668), pip will not install into it: give a venv folder, "
        f"bash {house / 'install.sh'} ptbench-venv (it sees {python}'s packages, its torch; then run "
        "ptbench-venv/bin/python -m ptbench)"
    ]
    done = _install_sh(house, python, "node-venv")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Requirement already satisfied: PyYAML>=5" in done.stdout, done.stdout
    venv = tmp_path / "node-venv" / "bin" / "python"
    assert _versions(venv, "ptbench", "imgdep") == ["0.0.1", "2.0"]
    assert subprocess.run([python, "-c", "import imgdep"], capture_output=True).returncode != 0  # the system untouched


def test_install_sh_over_an_image_whose_package_is_too_new_keeps_the_image_as_it_was(tmp_path):
    """The image (here a venv: its packages come through a .pth) has imgdep 3.0, which ptbench's `imgdep<3`
    refuses, as torch 2.11's setuptools<82 refuses a newer image's setuptools. The venv over it gets the
    wheelhouse's 2.0; the image keeps its 3.0 (pip: "Not uninstalling ... outside environment")."""
    house = _wheelhouse(tmp_path)
    image = tmp_path / "image"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    subprocess.run([base, "-m", "venv", "--without-pip", image], check=True)
    site = subprocess.run(
        [image / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    too_new = _wheel(tmp_path / "image-wheels", "imgdep", "3.0")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, too_new]
    subprocess.run(pip, check=True)
    done = _install_sh(house, str(image / "bin" / "python"), "node-venv")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _versions(tmp_path / "node-venv" / "bin" / "python", "ptbench", "imgdep") == ["0.0.1", "2.0"]
    assert _versions(image / "bin" / "python", "imgdep") == ["3.0"]


def _make_wheelhouse(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    venv = Path(sys.prefix)  # its install stamp taken as fresh: no reinstall
    make = ["make", "-s", "-o", f"{venv}/.installed", f"VENV={venv}", "wheelhouse", *args]
    return subprocess.run(make, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_wheelhouse_holding_another_pythons_wheels_is_refused_before_any_build(tmp_path):
    house = tmp_path / "wh"
    _wheel(house, "numpy", "2.4.6")
    (house / ".target").write_text("Python 3.11 on manylinux_2_28_x86_64\n")
    proc = _make_wheelhouse(tmp_path, f"WHEELHOUSE={house}", "PYTHON_VERSION=3.12")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"WHEELHOUSE={house} holds wheels for Python 3.11 on manylinux_2_28_x86_64, not Python 3.12 on "
        "manylinux_2_28_x86_64: name another folder (one per Python and platform, e.g. WHEELHOUSE=wh-py3.12) or remove it"
    )
    assert sorted(p.name for p in house.iterdir()) == [".target", "numpy-2.4.6-py3-none-any.whl"]


def test_the_wheelhouse_brings_what_a_target_package_bounds_from_above(tmp_path):
    """The target lists setuptools without a version and pins torch 2.11, whose requirement (as pip's report
    gives it) is setuptools<82: the resolved setuptools 81 comes along, said in one line. A bound inside an extra
    nobody asked for does not count; a package with only lower bounds stays out."""
    report = tmp_path / "report.json"
    items = [
        ("torch", "2.11.0", ["setuptools<82", "filelock", "sympy>=1.13.3"], []),
        ("setuptools", "81.0.0", [], []),
        ("fsspec", "2026.1.0", ['pandas<3.0.0; extra == "full"'], []),
        ("pandas", "3.1.1", [], []),
        ("sympy", "1.14.0", [], []),
        ("hydra-core", "1.3.8", [], []),
    ]
    report.write_text(
        json.dumps(
            {
                "install": [
                    {"metadata": {"name": n, "version": v, "requires_dist": r}, "requested_extras": e}
                    for n, v, r, e in items
                ]
            }
        )
    )
    freeze = tmp_path / "target.txt"
    freeze.write_text("torch==2.11.0+cu130\nsetuptools\nfilelock\nfsspec\npandas\nsympy\n")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    torch_re = "^(torch|torchvision|triton|nvidia-.*|cuda-.*)$"
    proc = subprocess.run(
        [sys.executable, ".ci/wheelhouse_target.py", "pick", report, freeze, "0", torch_re, house],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (house / "requirements.txt").read_text() == "hydra-core==1.3.8\nsetuptools==81.0.0\n"
    assert (
        f"{house}: + setuptools==81.0.0, listed on the target without a version: torch requires setuptools<82"
        in proc.stdout.splitlines()
    ), proc.stdout


def test_make_constraints_keeps_and_names_a_pin_of_a_package_not_installed(tmp_path):
    """A package not installed here (Horovod where it is not built; CI builds it, so a name no index has
    stands in there): its pin stays, and one line says so; a pin that differs from the venv is rewritten and
    counted."""
    try:
        importlib.metadata.version("horovod")
        absent = "ptbench-never-installed"
    except importlib.metadata.PackageNotFoundError:
        absent = "horovod"
    pinned = tmp_path / "constraints.txt"
    pinned.write_text(
        f"# header line\n{absent}==0.28.1\n" + f"pyyaml=={importlib.metadata.version('pyyaml')}\n" + "pytest==0.0.1\n"
    )
    proc = subprocess.run(
        [sys.executable, ".ci/constraints.py", pinned], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = pinned.read_text().splitlines()
    assert lines[0] == "# header line" and f"{absent}==0.28.1" in lines
    assert f"pytest=={importlib.metadata.version('pytest')}" in lines
    kept = [line for line in proc.stdout.splitlines() if line.startswith("constraints: kept ")]
    assert len(kept) == 1 and f"{absent}==0.28.1" in kept[0], proc.stdout
    assert absent != "horovod" or "make horovod" in kept[0], proc.stdout
    assert re.search(r"1 changed \(pytest==0\.0\.1 -> \S+\)", proc.stdout), proc.stdout
