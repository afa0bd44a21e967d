"""A results folder that holds dry runs (`python -m ptbench.scale`) beside real runs: the report shows the dry runs
in their own section and nowhere else (no time, so no table, figure or verdict), and never as runs that did not
finish."""

import sys

import pandas as pd

from tests.helpers import bench, check_ok, python_m, run


def test_dry_runs_get_their_own_section_and_stay_out_of_the_run_tables(tmp_path):
    results = tmp_path / "results"
    check_ok(bench("launcher.nprocs=1", "trainer.max_steps=2", "results.experiment=mix", results=results))
    dry = python_m(
        "ptbench.scale", "adapter=ddp", "workload=gpt2_tiny", "results.experiment=mix", f"results.root={results}",
        "--world-size", "8",
    )  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    out = tmp_path / "report"
    proc = run([sys.executable, "-m", "ptbench.analysis", "report", str(results), "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (out / "report.md").read_text()
    section = text.split("## At scale (dry run)", 1)[1]
    assert "1 dry run(s)" in section and "| ddp " in section and "| 8 " in section, section[:800]
    assert "| dry_run" not in text.split("## At scale (dry run)", 1)[0]  # not a run that did not finish
    assert pd.read_csv(out / "runs.csv")["status"].tolist() == ["ok"]  # the one real run
