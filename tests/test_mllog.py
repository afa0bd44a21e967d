"""results.mllog=true: the MLPerf log of a real resnet50_tiny run, written by the MLCommons mlperf-logging
package, passes that package's compliance checker (training rules 4.0.0, the last with ResNet: common,
open_common, open_resnet); asked for without the package, the run is refused before launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ptbench.core import sinks
from ptbench.core.errors import ConfigError
from tests.helpers import bench, check_ok, only_run


def test_mllog_of_a_resnet50_run_passes_the_compliance_checker(tmp_path):
    proc = bench(
        "workload=resnet50_tiny",
        "launcher.nprocs=1",
        "trainer.epochs=2",
        "trainer.max_steps=4",
        "trainer.progress=false",
        "results.mllog=true",
        results=tmp_path / "r",
    )
    check_ok(proc)
    log = only_run(tmp_path / "r") / "mllog.txt"
    recs = sinks.read_mllog(log)
    assert [r["value"] for r in recs if r["key"] == "submission_benchmark"] == ["resnet"]
    assert [r["metadata"]["workload"] for r in recs if r["key"] == "submission_benchmark"] == ["resnet50_tiny"]
    assert all("lineno" in r["metadata"] for r in recs)  # MLLogger stamps every line with its caller
    checker = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlperf_logging.compliance_checker",
            "--usage",
            "training",
            "--ruleset",
            "4.0.0",
            "--log_output",
            str(tmp_path / "checker.log"),
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = checker.stdout + checker.stderr
    assert checker.returncode == 0 and "SUCCESS" in out, out
    assert "training_4.0.0/open_resnet.yaml" in out  # the benchmark's own rules ran too


def test_mllog_asked_for_without_the_package_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlperf_logging", None)
    with pytest.raises(ConfigError, match=r"results.mllog=true but mlperf_logging is not installed .*\.\[mllog\]"):
        sinks.check_sinks({"mllog": True})
    sinks.check_sinks({"mllog": False})  # not asked for: nothing needed
