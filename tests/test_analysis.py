"""analysis/: the loader, each figure, the report CLI and the notebooks, on records the harness really wrote.

One module-scoped sweep (`python -m bench.demo` with ddp at 1 and 2 ranks and an unknown adapter the
demo records as failed), one run that fails after launch (the launcher writes its record), and one
folder with only config.yaml (a run that never got going) make the records tree.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.image as mpimg  # noqa: E402
import nbformat  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from analysis import load, ok, plots, runs  # noqa: E402
from analysis.load import find_runs  # noqa: E402
from tests.helpers import REPO, bench, events  # noqa: E402

NOTEBOOKS = sorted((REPO / "analysis").glob("*.ipynb"))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    demo = subprocess.run([sys.executable, "-m", "bench.demo", "--points", "ddp:1,ddp:2,nosuch:1", "--results", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    # fails inside the ranks (the data cannot fill one global batch): the launcher writes the record
    failed = bench("workload.seq_len=32", "workload.vocab_size=4096", "data.train_samples=16", "data.val_samples=16",
                   "trainer.batch_size=32", "launcher.nprocs=1", "trainer.progress=false", "results.experiment=demo",
                   "results.run_id=broken-run", results=root)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    first_ok = next(d for d in find_runs(root / "demo") if (d / "events.jsonl").exists())
    missing = root / "demo" / "missing-run"
    missing.mkdir()
    shutil.copy(first_ok / "config.yaml", missing / "config.yaml")
    return {"root": root / "demo", "demo_stdout": demo.stdout}


@pytest.fixture(scope="module")
def df(tree):
    return load(tree["root"])


def _run_dir(df, devices):
    return df[(df["status"] == "ok") & (df["devices"] == devices)]["run_dir"].iloc[0]


def test_loader_keeps_ok_failed_and_missing_runs(tree, df):
    per_run = runs(df).set_index("run_id")
    assert sorted(per_run["status"]) == ["failed", "failed", "missing", "ok", "ok"]
    okd = df[df["status"] == "ok"]
    # one row per run x epoch, config fields flattened
    assert sorted(okd.groupby("devices")["epoch"].apply(list).to_dict().items()) == [(1, [0.0, 1.0]), (2, [0.0, 1.0])]
    assert set(okd["adapter"]) == {"ddp"} and set(okd["workload"]) == {"gpt2_tiny"}
    # ddp has no ZeRO stage (each adapter has its own schema): the column is empty for it
    assert set(okd["batch_policy"]) == {"per_device"} and okd["stage"].isna().all()
    assert set(okd["tp"]) == {1} and set(okd["pp"]) == {1} and set(okd["kind"]) == {"language"}
    assert okd.groupby("devices")["global_batch"].first().to_dict() == {1: 8, 2: 16}
    assert okd.groupby("devices")["world_size"].first().to_dict() == {1: 1, 2: 2}
    # the numbers are the records' numbers
    for devices in (1, 2):
        run_dir = _run_dir(df, devices)
        ev = events(Path(run_dir))
        mine = okd[okd["run_dir"] == run_dir].sort_values("epoch")
        np.testing.assert_array_equal(mine["epoch_time_s"], [e["epoch_time_s"] for e in ev])
        np.testing.assert_array_equal(mine["val_metric"], [e["val_perplexity"] for e in ev])
        busiest = max(ev[-1]["ranks"], key=lambda r: r["memory"]["peak_rss"])
        assert mine["state_params"].iloc[-1] == busiest["state_bytes"]["params"]
        assert mine["state_bytes"].iloc[-1] == sum(busiest["state_bytes"].values())
    # runs without epochs: one row, their status and error, no numbers
    broken = per_run.loc["broken-run"]
    assert broken["status"] == "failed" and "fewer than one global batch" in broken["error"]
    assert math.isnan(broken["epoch_time_s"]) and broken["epochs"] == 0
    nosuch = per_run[per_run["adapter"] == "nosuch"].iloc[0]
    assert nosuch["status"] == "failed" and "unknown adapter 'nosuch'" in nosuch["error"]
    missing = per_run.loc["missing-run"]
    assert missing["status"] == "missing" and missing["adapter"] == "ddp" and missing["epochs"] == 0
    assert len(ok(df)) == 4


def _png_ok(path):
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100, img.shape
    assert img[..., :3].std() > 0.01, "blank image"


def _saved(out, name):
    for ext in ("png", "svg"):
        assert (out / f"{name}.{ext}").stat().st_size > 1000
    _png_ok(out / f"{name}.png")


def test_speedup_of_the_baseline_is_exactly_one(df, tmp_path):
    table = plots.speedup_table(df)
    base = table[table["devices"] == 1].iloc[0]
    assert base["speedup"] == 1.0 and base["efficiency"] == 1.0
    assert (table["baseline"] == "ddp on 1 device").all()
    r = runs(ok(df)).set_index("devices")
    t1 = r.loc[1, "epoch_time_s"] / r.loc[1, "samples_per_epoch"]
    t2 = r.loc[2, "epoch_time_s"] / r.loc[2, "samples_per_epoch"]
    two = table[table["devices"] == 2].iloc[0]
    assert two["speedup"] == pytest.approx(t1 / t2) and two["efficiency"] == pytest.approx(t1 / t2 / 2)
    fig = plots.speedup(df, out=tmp_path)
    _saved(tmp_path, "speedup")
    ax_speed, ax_eff = fig.axes[:2]
    assert "ddp on 1 device" in ax_speed.get_title()
    line = next(ln for ln in ax_speed.get_lines() if ln.get_label() == "ddp")
    np.testing.assert_allclose(line.get_ydata(), [1.0, two["speedup"]])
    line = next(ln for ln in ax_eff.get_lines() if ln.get_label() == "ddp")
    np.testing.assert_allclose(line.get_ydata(), [1.0, two["efficiency"]])
    assert ax_speed.get_xscale() == "log"


def test_speedup_against_a_named_baseline_and_a_wrong_name(df):
    table = plots.speedup_table(df, baseline="ddp")
    assert table.set_index("devices").loc[1, "speedup"] == 1.0
    with pytest.raises(ValueError, match="baseline 'zero' has no finished run.*choose one of: ddp"):
        plots.speedup_table(df, baseline="zero")


def test_epoch_time_plot_matches_the_frame(df, tmp_path):
    fig = plots.epoch_time(df, out=tmp_path)
    _saved(tmp_path, "epoch_time")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_scale() == "log"
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "ddp")
    means = ok(df).groupby("devices")["epoch_time_s"].mean()
    np.testing.assert_allclose(line.get_xdata(), [1, 2])
    np.testing.assert_allclose(line.get_ydata(), [means[1], means[2]])
    # the points that did not finish (failed x1, missing x2, broken x1) are marked
    assert any(ln.get_label() == "not finished (see report)" for ln in ax.get_lines())


@pytest.mark.parametrize("x", ["epoch", "wall_time_s"])
def test_validation_metric_plots_match_the_frame(df, tmp_path, x):
    fig = plots.val_metric(df, out=tmp_path, x=x)
    _saved(tmp_path, "val_metric_vs_epoch" if x == "epoch" else "val_metric_vs_time")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "perplexity" in ax.get_ylabel()
    for devices in (1, 2):
        mine = ok(df)[ok(df)["devices"] == devices].sort_values("epoch")
        line = next(ln for ln in ax.get_lines() if ln.get_label() == f"ddp x{devices}")
        xs = mine["epoch"] + 1 if x == "epoch" else mine["wall_time_s"]
        np.testing.assert_allclose(line.get_xdata(), xs)
        np.testing.assert_allclose(line.get_ydata(), mine["val_metric"])
        np.testing.assert_allclose(mine["val_metric"], np.exp(mine["val_loss"]), rtol=1e-9)


def test_memory_plot_splits_the_peak_into_states_and_the_rest(df, tmp_path):
    fig = plots.memory(df, out=tmp_path)
    _saved(tmp_path, "memory")
    data = fig.bench_data.set_index("devices")
    r = runs(ok(df)).set_index("devices")
    mib = 2**20
    for d in (1, 2):
        assert data.loc[d, "peak_mib"] == pytest.approx(r.loc[d, "peak_memory_max"] / mib)
        parts = data.loc[d, ["params_mib", "grads_mib", "optimizer_mib", "other_mib"]].sum()
        assert parts == pytest.approx(data.loc[d, "peak_mib"])  # the stack's top is the peak
    # DDP replicates the model: the same parameter bytes on every rank at 1 and 2 devices, Adam 2x that
    assert data.loc[1, "params_mib"] == data.loc[2, "params_mib"] > 0
    assert data.loc[1, "optimizer_mib"] == pytest.approx(2 * data.loc[1, "params_mib"], rel=1e-3)
    ax = fig.axes[0]
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    np.testing.assert_allclose(sorted(tops.values()), sorted(data["peak_mib"]), rtol=1e-9)


def test_breakdown_stacks_the_phases_of_a_step(df, tmp_path):
    fig = plots.breakdown(df, out=tmp_path)
    _saved(tmp_path, "breakdown")
    data = fig.bench_data.set_index("devices")
    r = runs(ok(df)).set_index("devices")
    for d in (1, 2):
        for p in ("data", "forward", "backward", "optimizer"):
            assert data.loc[d, f"{p}_ms"] == pytest.approx(r.loc[d, f"{p}_time_mean_s"] * 1e3)
        assert data.loc[d, "forward_ms"] > 0 and data.loc[d, "backward_ms"] > 0
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:4] == ["data", "forward", "backward", "optimizer"]
    heights = {}
    for bar in ax.patches:
        heights[round(bar.get_x() + bar.get_width() / 2)] = heights.get(round(bar.get_x() + bar.get_width() / 2), 0) + bar.get_height()
    totals = data[["data_ms", "forward_ms", "backward_ms", "optimizer_ms", "other_ms"]].sum(axis=1)
    np.testing.assert_allclose(sorted(heights.values()), sorted(totals), rtol=1e-9)
    assert (totals >= data["step_ms"] - 1e-9).all()


def test_report_cli_writes_figures_and_tables(tree, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis", "report", str(tree["root"]), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"report: {tmp_path / 'report.md'}"
    text = (tmp_path / "report.md").read_text()
    assert "Speedup baseline for gpt2_tiny: **ddp on 1 device**" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| gpt2_tiny | ddp |")]
    assert [ln.split(" | ")[2] for ln in rows] == ["1", "2"]
    assert rows[0].rstrip(" |").endswith("| 1 | 1")  # speedup and efficiency of the baseline
    assert "fewer than one global batch" in text and "unknown adapter 'nosuch'" in text and "| missing |" in text
    for name in ("epoch_time", "speedup", "val_metric_vs_epoch", "val_metric_vs_time", "memory", "breakdown"):
        assert f"](figures/{name}.png)" in text
        _saved(tmp_path / "figures", name)
    summary_csv = (tmp_path / "summary.csv").read_text().splitlines()
    assert len(summary_csv) == 3  # header + 2 points
    # the demo wrote the same report for its own sweep and said where
    assert f"report: {(tree['root'] / 'report' / 'report.md').resolve()}" in tree["demo_stdout"]
    assert (tree["root"] / "report" / "figures" / "speedup.png").exists()


def test_report_on_a_tree_with_no_finished_run_lists_the_failures(tree, tmp_path):
    src = tmp_path / "src"
    for d in find_runs(tree["root"]):
        if not (d / "events.jsonl").exists():
            shutil.copytree(d, src / d.name)
    proc = subprocess.run([sys.executable, "-m", "analysis", "report", str(src), "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "out" / "report.md").read_text()
    assert "fewer than one global batch" in text and "not drawn: no finished run" in text
    with pytest.raises(ValueError, match="no finished run"):
        plots.speedup(load(src))


def test_report_cli_on_a_missing_folder_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis", "report", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: results folder {tmp_path / 'nope'} does not exist; run `python -m bench ...` or `make demo` first"


def test_notebook_kernel_is_this_venv():
    from jupyter_client import KernelManager

    assert KernelManager(kernel_name="python3").format_kernel_cmd()[0] == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_headless(tree, tmp_path, monkeypatch, path):
    assert {p.stem for p in NOTEBOOKS} == {"speedup", "statistical_efficiency", "memory", "breakdown"}
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks without outputs"
    monkeypatch.setenv("BENCH_RESULTS", str(tree["root"]))
    monkeypatch.setenv("BENCH_FIGURES", str(tmp_path / "figs"))
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure shown"
    pngs = list((tmp_path / "figs").glob("*.png"))
    assert pngs
    for p in pngs:
        _png_ok(p)
