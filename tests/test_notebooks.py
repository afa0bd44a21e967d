"""The notebooks run under papermill with `-p RESULTS_DIR` and analyse that folder, not results/demo: a relative
path is taken from the folder papermill was started in (as a user types it), and an empty folder stops the
notebook with one line naming the folder it looked in."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from tests.helpers import REPO
from tests.test_analysis import MIB, _two_epochs, write_run

NOTEBOOKS = sorted((REPO / "analysis").glob("*.ipynb"))


@pytest.fixture(scope="module")
def second(tmp_path_factory):
    """A results folder other than results/demo: two hand-written runs (1 and 2 devices), names of its own."""
    cwd = tmp_path_factory.mktemp("user")
    root = cwd / "second-results"
    for devices, time in ((1, 2.0), (2, 1.2)):
        write_run(
            root,
            f"nbcheck-run-{devices}",
            devices=devices,
            gb=8 * devices,
            epochs=_two_epochs(time, 10, 8 * devices, devices, peak=300 * MIB),
        )
    return cwd


def _papermill(nb, cwd, *params):
    out = cwd / f"out-{nb.stem}.ipynb"
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_RESULTS", "BENCH_FIGURES")}
    env["PWD"] = str(cwd)  # as a shell sets it for a command started in `cwd`
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", str(nb), str(out), "--kernel", "python3", *params],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


def _text(nb) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            parts.append(o.get("text", ""))
            parts.append((o.get("data") or {}).get("text/plain", ""))
            parts.extend(o.get("traceback", []))
            parts.append(o.get("evalue", ""))
    return "\n".join(parts)


def test_each_notebook_has_a_parameters_cell():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: one cell tagged `parameters`"
        assert "RESULTS_DIR =" in tagged[0].source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_papermill_runs_the_notebook_on_the_folder_given(second, path):
    proc, out = _papermill(path, second, "-p", "RESULTS_DIR", "second-results", "-p", "FIG_DIR", f"figs-{path.stem}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nb = nbformat.read(out, as_version=4)
    assert any(c.metadata.get("tags") == ["injected-parameters"] for c in nb.cells)
    text = _text(nb)
    assert f"records from {second / 'second-results'}" in text  # relative to where papermill ran
    assert "nbcheck-run-1" in text and "nbcheck-run-2" in text  # its rows, not results/demo's
    assert sorted(p.name for p in (second / f"figs-{path.stem}").glob("*.png"))  # the figures drawn from them


def test_papermill_on_an_empty_folder_names_it(second):
    (second / "empty").mkdir()
    proc, out = _papermill(REPO / "analysis" / "speedup.ipynb", second, "-p", "RESULTS_DIR", "empty")
    assert proc.returncode != 0
    assert f"no run records under {second / 'empty'}" in proc.stdout + proc.stderr
