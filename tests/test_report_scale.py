"""`python -m ptbench.studies.report_scale`: the benchmark of the report on N synthetic records (a test of function at a
tiny N, not of speed): the records it writes are what `load` reads, and the report it times has every section."""

from __future__ import annotations

import json
import subprocess
import sys

from ptbench.analysis import load, runs
from ptbench.analysis.report import SECTIONS
from tests.helpers import REPO


def test_report_scale_writes_records_and_times_a_whole_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.studies.report_scale", "--records", "20", "--keep", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("report_scale:"))
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert fields["records"] == "20" and float(fields["seconds"]) > 0
    records, out = tmp_path / "20" / "records", tmp_path / "20" / "report"
    # schema-true records of a sweep: several adapters and device counts, the statuses the writer allows
    per_run = runs(load(records))
    assert len(per_run) == 20 and per_run["adapter"].nunique() >= 5 and per_run["devices"].nunique() >= 2
    assert json.loads((records / ".report_scale.json").read_text())["records"] == 20
    # the report it timed: every figure, the tables, every section
    assert int(fields["figures"]) == 6 and len(list((out / "figures").glob("*.svg"))) == 6
    assert {p.name for p in out.glob("*.csv")} >= {"epochs.csv", "runs.csv", "summary.csv"}
    md = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in md, section
    assert "## Which adapter" in (out / "report-details.md").read_text()
