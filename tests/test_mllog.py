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


def test_mlflow_store_refused_in_one_line_and_the_readme_setting_logs(tmp_path, monkeypatch, capsys):
    """results.mlflow=true: MLflow 3 opens a local folder only with MLFLOW_ALLOW_FILE_STORE=true (and its default,
    a sqlite file, not at all with mlflow-skinny). Without it the run is refused before launch in one whole line
    naming what to set; with the README's setting it runs and logs; a sink failing after the run says the fix too."""
    pytest.importorskip("mlflow", exc_type=ImportError)
    from mlflow import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run = ["experiment=smoke", "workload.vocab_size=256", "launcher.nprocs=1", "trainer.max_steps=2"]
    proc = bench(*run, "results.mlflow=true", results=tmp_path / "r", env={"MLFLOW_TRACKING_URI": store})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert f"results.mlflow=true but MLflow cannot use the tracking store {store} " in lines[0], lines
    assert lines[0].endswith(f"{sinks.MLFLOW_FIX}; or set results.mlflow=false"), lines
    assert not (tmp_path / "r").exists()

    env = {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
    check_ok(bench(*run, "results.mlflow=true", results=tmp_path / "r", env=env))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read it back here
    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FINISHED"], runs

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # a store named after the pre-launch check, without the opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "later").as_uri())
    capsys.readouterr()
    out = sinks.write_sinks(only_run(tmp_path / "r"), mllog=False, mlflow=True)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert out["mlflow"].startswith("failed: RuntimeError: MLflow cannot use") and line.endswith(sinks.MLFLOW_FIX), line
