"""CPU twins of the one-GPU path, tested where no GPU is: device counts are injected, nvidia-smi output is recorded."""

from __future__ import annotations

import os
import re
import sys

import pytest

from ptbench.core.errors import ConfigError
from ptbench.core.records import nvidia_smi
from ptbench.runner.checks import check_devices
from ptbench.runner.compose import compose, typed
from ptbench.smoke import main as smoke_main
from ptbench.smoke import smoke_point
from tests.helpers import check_ok, run

# `nvidia-smi topo -m` as printed on a 2 x H100 SXM node (driver 550.54.15)
TOPO = """\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\t0-55\t0
GPU1\tNV18\t X \t0-55\t0
"""


def test_more_ranks_than_gpus_is_refused_before_launch():
    with pytest.raises(ConfigError, match="3 rank\\(s\\) x 1 device\\(s\\) need 3 GPUs but this node has 2"):
        check_devices(3, 1, 2)
    with pytest.raises(ConfigError, match="need 2 GPUs but this node has 1"):  # gpipe: 2 partitions, 1 process
        check_devices(1, 2, 1)
    check_devices(2, 1, 2)  # one rank per GPU is fine
    check_devices(4, 1, 0)  # no GPU: CPU ranks share the cores


def test_cpu_default_is_two_ranks():
    assert typed(compose([])).launcher.nprocs == 2  # ${visible_gpus_or:2}: no GPU here


@pytest.mark.parametrize(
    "adapter, world, expected",
    [
        ("ddp", 1, ["launcher.nprocs=1"]),
        ("zero", 1, ["launcher.nprocs=1"]),
        ("fsdp", 1, ["launcher.nprocs=1"]),
        ("megatron", 1, ["launcher.nprocs=1", "adapter.tensor_parallel=1"]),
        ("megatron", 2, ["launcher.nprocs=2", "adapter.tensor_parallel=2"]),
        ("tensor_parallel", 1, ["launcher.nprocs=1", "adapter.tensor_parallel=1"]),
        ("gpipe", 1, ["launcher.nprocs=1", "adapter.pipeline_parallel=1"]),
        ("gpipe", 2, ["launcher.nprocs=1", "adapter.pipeline_parallel=2"]),
        ("pipeline", 2, ["launcher.nprocs=2"]),
    ],
)
def test_smoke_picks_the_largest_layout_that_fits(tmp_path, adapter, world, expected):
    overrides, why = smoke_point(adapter, world, tmp_path)
    assert overrides is not None, why
    assert all(e in overrides for e in expected), overrides


def test_smoke_skips_with_the_reason_when_nothing_fits(tmp_path, monkeypatch):
    from ptbench.adapters import get_adapter_class

    cls = get_adapter_class("megatron")
    # a layout that no world size <= 2 can take: TP=4 whatever the devices
    monkeypatch.setattr(
        cls, "smoke_overrides", classmethod(lambda c, n: [f"launcher.nprocs={n}", "adapter.tensor_parallel=4"])
    )
    overrides, why = smoke_point("megatron", 2, tmp_path)
    assert overrides is None and "cannot run on <= 2 device(s)" in why and "tensor_parallel=4" in why


def test_nvidia_smi_capture_from_recorded_output():
    """Only the `topo -m` matrix comes from nvidia-smi now; the driver and the GPU list come from NVML
    (records.nvml_gpus, nvidia-ml-py; its no-GPU path in tests/test_newcomer.py)."""
    asked = []

    def run(args):
        asked.append(args)
        return TOPO

    env = nvidia_smi(run)
    assert asked == [["topo", "-m"]] and set(env) == {"topology"}
    assert "NV18" in env["topology"]


def test_nvidia_smi_absent_or_broken_gives_nothing():
    def broken(args):
        raise OSError("no device")

    assert nvidia_smi(broken) == {}


def test_smoke_command_runs_an_adapter_and_reports_it(tmp_path):
    """`python -m ptbench.smoke ddp --world-size 1` end to end: one line per adapter, then the tally, exit 0.
    (`make test` no longer runs the whole smoke: see the Makefile's list of the tests covering each case.)"""
    proc = run(
        [sys.executable, "-m", "ptbench.smoke", "ddp", "--world-size", "1", "--timeout", "300"],
        timeout=360,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    check_ok(proc)
    lines = proc.stdout.strip().splitlines()
    assert re.match(r"smoke ddp +ok +gpt2_tiny x1 device\(s\) +step \d+\.\d{4}s +loss \d+\.\d{3}", lines[0]), lines
    assert lines[-1] == "smoke (world size <= 1): 1 passed, 0 skipped, 0 failed", lines


def test_smoke_refuses_an_unknown_adapter(capsys):
    assert smoke_main(["nosuch"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown adapter(s) nosuch: choose from ddp, ")


@pytest.mark.parametrize("ci, status", [("true", "FAILED"), ("", "skipped")])
def test_smoke_fails_a_missing_framework_only_under_ci(tmp_path, monkeypatch, ci, status):
    """README: an adapter whose framework is not installed is skipped with the reason, except under CI=true."""
    import ptbench.smoke as smoke

    monkeypatch.setattr(smoke, "framework_installed", lambda cls: False)
    monkeypatch.setenv("CI", ci)
    got, detail = smoke.run_one("zero", 2, tmp_path, timeout=10)
    assert (got, detail.split(" (")[0]) == (status, "deepspeed not installed"), detail
    assert list(tmp_path.iterdir()) == []  # nothing launched
