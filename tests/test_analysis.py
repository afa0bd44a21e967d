"""analysis/: the loader, each figure, the report CLI and the notebooks, on records the harness really wrote.

One module-scoped sweep (`python -m ptbench.demo` with ddp at 1 and 2 ranks and an unknown adapter the
demo records as failed), one run that fails after launch (the launcher writes its record), and one
folder with only config.yaml (a run that never got going) make the records tree.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.image as mpimg  # noqa: E402
import nbformat  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from ptbench.analysis import load, ok, plots, runs, tables  # noqa: E402
from ptbench.analysis.load import find_runs  # noqa: E402
from tests.helpers import REPO, bench, events, python_m  # noqa: E402

NOTEBOOKS = sorted((REPO / "analysis").glob("*.ipynb"))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    demo = python_m("ptbench.demo", "--points=ddp:1,ddp:2,nosuch:1", "--repeats=1", "--results", str(root), timeout=900)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    # fails inside the ranks (the data cannot fill one global batch): the launcher writes the record
    failed = bench(
        "workload.seq_len=32",
        "workload.vocab_size=4096",
        "data.train_samples=16",
        "data.val_samples=16",
        "trainer.batch_size=32",
        "launcher.nprocs=1",
        "trainer.progress=false",
        "results.experiment=demo",
        "results.run_id=broken-run",
        results=root,
    )
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
        assert mine["state_bytes"].iloc[-1] == sum(busiest["state_bytes"][k] for k in ("params", "grads", "optimizer"))
    # runs without epochs: one row, their status and error, no numbers
    broken = per_run.loc["broken-run"]
    assert broken["status"] == "failed" and "fewer than one global batch" in broken["error"]
    assert math.isnan(broken["epoch_time_s"]) and broken["epochs"] == 0
    nosuch = per_run[per_run["adapter"] == "nosuch"].iloc[0]
    assert nosuch["status"] == "failed" and "unknown adapter 'nosuch'" in nosuch["error"]
    missing = per_run.loc["missing-run"]
    assert missing["status"] == "missing" and missing["adapter"] == "ddp" and missing["epochs"] == 0
    assert len(ok(df)) == 4


def _legend_texts(fig) -> list[str]:
    """The entries of a figure's one legend (figure-level, outside the axes)."""
    assert len(fig.legends) == 1 and not [ax for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for t in fig.legends[0].get_texts()]


def _png_ok(path):
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100, img.shape
    assert img[..., :3].std() > 0.01, "blank image"


def _saved(out, name):
    for ext in ("png", "svg"):
        assert (out / f"{name}.{ext}").stat().st_size > 1000
    _png_ok(out / f"{name}.png")


DDP = "ddp gb=8/replica"  # the demo's series: ddp, trainer.batch_size=8 per replica


def _steady(run_dir):
    """(epoch time, samples) speedup must use, read from the record: the summary's epoch_time_steady_s,
    else the mean of the complete epochs after the first."""
    ev = [e for e in events(Path(run_dir)) if not e.get("partial")]
    later = [e for e in ev if e["epoch"] > 0]
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    t = summary.get("epoch_time_steady_s") or float(np.mean([e["epoch_time_s"] for e in later]))
    return t, float(np.mean([e["steps"] * e["global_batch"] for e in later]))


def test_speedup_of_the_baseline_is_exactly_one(df, tmp_path):
    table = tables.speedup_table(df)
    base = table[table["devices"] == 1].iloc[0]
    assert base["speedup"] == 1.0 and base["efficiency"] == 1.0
    assert (table["baseline"] == f"{DDP} on 1 device").all()
    (e1, n1), (e2, n2) = _steady(_run_dir(df, 1)), _steady(_run_dir(df, 2))
    t1, t2 = e1 / n1, e2 / n2
    two = table[table["devices"] == 2].iloc[0]
    assert two["speedup"] == pytest.approx(t1 / t2) and two["efficiency"] == pytest.approx(t1 / t2 / 2)
    fig = plots.speedup(df, out=tmp_path)
    _saved(tmp_path, "speedup")
    ax_speed, ax_eff = fig.axes[:2]
    assert f"{DDP} on 1 device" in ax_speed.get_title()
    line = next(ln for ln in ax_speed.get_lines() if ln.get_label() == DDP)
    np.testing.assert_allclose(line.get_ydata(), [1.0, two["speedup"]])
    line = next(ln for ln in ax_eff.get_lines() if ln.get_label() == DDP)
    np.testing.assert_allclose(line.get_ydata(), [1.0, two["efficiency"]])
    assert ax_speed.get_xscale() == "log"


def test_speedup_against_a_named_baseline_and_a_wrong_name(df):
    table = tables.speedup_table(df, baseline=DDP)
    assert table.set_index("devices").loc[1, "speedup"] == 1.0
    with pytest.raises(
        ValueError, match=f"baseline 'zero' has no finished run.*choose best or per-series, or a series: {DDP}"
    ):
        tables.speedup_table(df, baseline="zero")


def test_epoch_time_plot_matches_the_frame(df, tmp_path):
    fig = plots.epoch_time(df, out=tmp_path)
    _saved(tmp_path, "epoch_time")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_scale() == "log"
    line = next(ln for ln in ax.get_lines() if ln.get_label() == DDP)
    np.testing.assert_allclose(line.get_xdata(), [1, 2])
    np.testing.assert_allclose(line.get_ydata(), [_steady(_run_dir(df, d))[0] for d in (1, 2)])
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
        line = next(ln for ln in ax.get_lines() if ln.get_label() == f"{DDP} x{devices}")
        xs = mine["epoch"] + 1 if x == "epoch" else mine["wall_time_s"]
        np.testing.assert_allclose(line.get_xdata(), xs)
        np.testing.assert_allclose(line.get_ydata(), mine["val_metric"])
        np.testing.assert_allclose(mine["val_metric"], np.exp(mine["val_loss"]), rtol=1e-9)


def test_memory_plot_splits_the_peak_into_states_and_the_rest(df, tmp_path):
    fig = plots.memory(df, out=tmp_path)
    _saved(tmp_path, "memory")
    data = fig.bench_data.set_index("devices")
    mib = 2**20
    for d in (1, 2):
        # CPU: peak RSS minus RSS before the first step where the record has it, of the busiest rank and epoch
        mem = [r["memory"] for e in events(Path(_run_dir(df, d))) for r in e["ranks"]]
        key = "peak_rss_delta" if all(m.get("peak_rss_delta") is not None for m in mem) else "peak_rss"
        assert data.loc[d, "peak_mib"] == pytest.approx(max(m[key] for m in mem) / mib)
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
    legend = _legend_texts(fig)
    assert legend[:4] == ["data", "forward", "backward", "optimizer"]
    heights = {}
    for bar in ax.patches:
        heights[round(bar.get_x() + bar.get_width() / 2)] = (
            heights.get(round(bar.get_x() + bar.get_width() / 2), 0) + bar.get_height()
        )
    totals = data[["data_ms", "forward_ms", "backward_ms", "optimizer_ms", "other_ms"]].sum(axis=1)
    np.testing.assert_allclose(sorted(heights.values()), sorted(totals), rtol=1e-9)
    assert (totals >= data["step_ms"] - 1e-9).all()


def test_report_cli_writes_figures_and_tables(tree, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(tree["root"]), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"report: {tmp_path / 'report.md'}"
    text = _squash((tmp_path / "report.md").read_text())
    assert f"Speedup baseline for gpt2_tiny: **{DDP} on 1 device**" in text
    assert "Warning" not in text  # one series, one global batch per device count
    summary_section = text.split("## Summary (finished runs)")[1].split("\n#")[0]
    rows = [ln for ln in summary_section.splitlines() if ln.startswith(f"| gpt2_tiny | {DDP} |")]
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
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(src), "--out", str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "out" / "report.md").read_text()
    assert "fewer than one global batch" in text and "not drawn: no finished run" in text
    with pytest.raises(ValueError, match="no finished run"):
        plots.speedup(load(src))


def test_report_cli_on_a_missing_folder_says_so(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"error: results folder {tmp_path / 'nope'} does not exist; run `python -m ptbench ...` or `make demo` first"
    )


def test_report_cli_without_out_writes_into_the_results_folder(tmp_path):
    """`report DIR` alone: DIR/report; a missing DIR says so and makes no folder."""
    root = tmp_path / "r"
    write_run(root, "one", epochs=_two_epochs(1.0, 10, 8, 1, peak=100 * MIB))
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"report: {root / 'report' / 'report.md'}"
    assert "| wl | ddp gb=8/replica | 1 | 1 | 1 run: no interval |" in _squash(
        (root / "report" / "report.md").read_text()
    )
    assert "| one |" in _squash((root / "report" / "report-details.md").read_text())  # the claims' runs
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.analysis", "report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and f"results folder {tmp_path / 'nope'} does not exist" in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_notebook_kernel_is_this_venv():
    from jupyter_client import KernelManager

    assert KernelManager(kernel_name="python3").format_kernel_cmd()[0] == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_headless(tree, tmp_path, monkeypatch, path):
    assert {p.stem for p in NOTEBOOKS} == {"speedup", "statistical_efficiency", "memory", "breakdown"}
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code"), (
        "commit notebooks without outputs"
    )
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


# --- hand-built records: every number below is written here, so the expectations do not come from the
# analysis code's own formulas ---------------------------------------------------------------------------
MIB = 2**20


def _epoch(
    epoch,
    time,
    steps,
    gb,
    devices,
    partial=None,
    peak=None,
    delta=None,
    states=None,
    metric="peak_rss",
    ranks=None,
    **extra,
):
    ev = {
        "type": "epoch",
        "epoch": epoch,
        "steps": steps,
        "global_batch": gb,
        "devices": devices,
        "epoch_time_s": time,
        "step_time_mean_s": time / steps,
        "data_time_mean_s": 0.001,
        "forward_time_mean_s": 0.3 * time / steps,
        "backward_time_mean_s": 0.5 * time / steps,
        "optimizer_time_mean_s": 0.1 * time / steps,
        "samples_per_s": gb * steps / time,
        "val_loss": 2.0 - 0.1 * epoch,
        "val_perplexity": float(np.exp(2.0 - 0.1 * epoch)),
        "wall_time_s": 10.0 * (epoch + 1),
        "memory_metric": metric,
        **extra,
    }
    if partial is not None:
        ev["partial"] = partial
    if ranks is None and peak is not None:
        mem = (
            {"peak_rss": peak, "peak_allocated": None}
            if metric == "peak_rss"
            else {"peak_rss": None, "peak_allocated": peak}
        )
        if delta is not None:
            mem["peak_rss_delta"] = delta
        ranks = [{"rank": 0, "memory": mem, "state_bytes": states or {}}]
    if ranks is not None:
        ev["ranks"] = ranks
        ev["peak_memory_max"] = max((r.get("memory") or {}).get(metric) or 0 for r in ranks)
    return ev


def write_run(
    root,
    name,
    adapter="ddp",
    devices=1,
    status="ok",
    epochs=(),
    settings=None,
    batch_size=8,
    policy=None,
    gb=None,
    steady=None,
    config=True,
    trainer=None,
    error=None,
):
    """One run folder as the runner writes it: config.yaml, summary.json, events.jsonl."""
    d = Path(root) / name
    d.mkdir(parents=True)
    policy = policy or {"megatron": "linear", "pipeline": "fixed", "gpipe": "per_microbatch"}.get(adapter, "per_device")
    if config:
        cfg = {
            "workload": {"name": "wl", "kind": "language"},
            "adapter": {"name": adapter, "batch_policy": policy, **(settings or {})},
            "launcher": {"name": "local", "nprocs": devices},
            "trainer": {"batch_size": batch_size, "grad_accum": 1, "precision": "fp32", **(trainer or {})},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "data": {"source": "synthetic"},
            "results": {"experiment": "hand"},
        }
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = {
        "status": status,
        "run_id": name,
        "adapter": adapter,
        "workload": "wl",
        "experiment": "hand",
        "world_size": devices,
        "devices": devices,
        "error": error,
    }
    if gb is not None:
        summary["global_batch"] = gb
    if steady is not None:
        summary["epoch_time_steady_s"] = steady
    (d / "summary.json").write_text(json.dumps(summary))
    if epochs:
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
    return d


def _two_epochs(time, steps, gb, devices, **kw):
    """Epoch 0 three times slower (warm-up), epoch 1 the steady one."""
    return [
        _epoch(0, 3 * time, steps, gb, devices, partial=False, **kw),
        _epoch(1, time, steps, gb, devices, partial=False, **kw),
    ]


def _labels(root):
    return runs(load(root)).set_index("run_id")["label"].to_dict()


def test_labels_come_from_each_record_and_do_not_change_when_runs_are_added(tmp_path):
    root = tmp_path / "r"
    write_run(root, "z3", "zero", 2, settings={"stage": 3}, epochs=_two_epochs(2.0, 6, 16, 2))
    first = _labels(root)
    assert first == {"z3": "zero stage=3 gb=8/replica"}
    # more runs of the same adapter with other settings, and other adapters: z3 keeps its label
    write_run(root, "z1", "zero", 2, settings={"stage": 1}, epochs=_two_epochs(2.0, 6, 16, 2))
    write_run(root, "z3-bs16", "zero", 2, settings={"stage": 3}, batch_size=16, epochs=_two_epochs(2.0, 3, 32, 2))
    write_run(
        root, "z3-off", "zero", 2, settings={"stage": 3, "offload_optimizer": True}, epochs=_two_epochs(2.0, 6, 16, 2)
    )
    write_run(
        root, "ddp-acc", "ddp", 2, trainer={"grad_accum": 2, "precision": "bf16"}, epochs=_two_epochs(2.0, 3, 32, 2)
    )
    write_run(root, "mg", "megatron", 4, settings={"tensor_parallel": 2}, epochs=_two_epochs(2.0, 3, 32, 4))
    write_run(
        root, "pp", "pipeline", 2, settings={"schedule": "1f1b"}, batch_size=32, epochs=_two_epochs(2.0, 3, 32, 2)
    )
    write_run(root, "gp", "gpipe", 2, batch_size=4, epochs=_two_epochs(2.0, 3, 32, 2))
    write_run(root, "noconf", "fsdp", 2, status="failed", config=False, gb=16, error="boom")
    write_run(root, "nothing", "horovod", 2, status="failed", config=False, error="refused")
    labels = _labels(root)
    assert labels["z3"] == first["z3"]
    assert labels == {
        "z3": "zero stage=3 gb=8/replica",
        "z1": "zero stage=1 gb=8/replica",
        "z3-bs16": "zero stage=3 gb=16/replica",
        "z3-off": "zero stage=3 offload=optimizer gb=8/replica",
        "ddp-acc": "ddp precision=bf16 accum=2 gb=16/replica",
        "mg": "megatron gb=8/device",
        "pp": "pipeline schedule=1f1b gb=32",
        "gp": "gpipe gb=4/microbatch",
        "noconf": "fsdp gb=16",
        "nothing": "horovod gb=?",
    }
    # the per-row labels of the epoch frame are the same
    df = load(root)
    assert set(df.loc[df["run_id"] == "z3", "label"]) == {"zero stage=3 gb=8/replica"}


def test_mixed_global_batches_at_one_device_count_are_warned(tmp_path):
    root = tmp_path / "r"
    # one series (tensor_parallel, 8 per replica) at 4 devices: TP=2 gives 2 replicas (gb 16), TP=4 one (gb 8)
    write_run(root, "tp2", "tensor_parallel", 4, settings={"tensor_parallel": 2}, epochs=_two_epochs(2.0, 6, 16, 4))
    write_run(root, "tp4", "tensor_parallel", 4, settings={"tensor_parallel": 4}, epochs=_two_epochs(2.0, 12, 8, 4))
    # two series at 2 devices with different global batches (ddp 8 per replica = 16, pipeline fixed 32)
    write_run(root, "ddp2", "ddp", 2, epochs=_two_epochs(2.0, 6, 16, 2))
    write_run(
        root, "pp2", "pipeline", 2, settings={"schedule": "gpipe"}, batch_size=32, epochs=_two_epochs(2.0, 3, 32, 2)
    )
    # ddp at 1 device, alone there: no warning for it
    write_run(root, "ddp1", "ddp", 1, epochs=_two_epochs(3.0, 12, 8, 1))
    report = (write_report_(root, tmp_path / "out")).read_text()
    warnings_ = [ln for ln in report.splitlines() if ln.startswith("**Warning:**")]
    assert len(warnings_) == 2, warnings_
    assert "series `tensor_parallel gb=8/replica` at 4 devices" in warnings_[0] and "(8, 16)" in warnings_[0]
    assert "tp2" in warnings_[0] and "tp4" in warnings_[0]
    assert (
        "wl at 2 devices" in warnings_[1]
        and "`ddp gb=8/replica` 16" in warnings_[1]
        and "`pipeline schedule=gpipe gb=32` 32" in warnings_[1]
    )
    summary = pd.read_csv(tmp_path / "out" / "summary.csv").set_index(["label", "devices"])
    assert summary.loc[("tensor_parallel gb=8/replica", 4), "global_batch"] == "8; 16"


def _squash(text: str) -> str:
    """Markdown tables (DataFrame.to_markdown) pad cells to the column width: one space each, to compare rows."""
    return re.sub(r" {2,}", " ", text)


def write_report_(root, out, baseline="best"):
    from ptbench.analysis.report import write_report

    return write_report(root, out, baseline=baseline)


def _x_marks(ax):
    """(x, status text) of the red x marks on an axes."""
    xs = [float(x) for ln in ax.get_lines() if ln.get_marker() == "x" for x in ln.get_xdata()]
    texts = [t.get_text() for t in ax.texts if t.get_color() == "crimson"]
    return xs, texts


def test_points_that_did_not_finish_are_marked_on_every_figure(tmp_path):
    root = tmp_path / "r"
    states = {"params": 10 * MIB, "grads": 10 * MIB, "optimizer": 20 * MIB}
    for n, time, steps, peak, delta in ((1, 4.0, 12, 900, 60), (2, 2.5, 6, 950, 70)):
        epochs = _two_epochs(time, steps, 8 * n, n, peak=peak * MIB, delta=delta * MIB, states=states)
        write_run(root, f"ok{n}", "ddp", n, epochs=epochs)
    write_run(root, "oom4", "ddp", 4, status="oom", error="CUDA out of memory")
    write_run(root, "to8", "ddp", 8, status="timeout", error="no progress for 900 s")
    # never attempted (framework not installed): listed in the report, not drawn as a failure
    write_run(root, "sk16", "horovod", 16, status="skipped", config=False, error="horovod is not installed")
    df = load(root)
    expected = {(4, "oom"), (8, "timeout")}

    fig = plots.epoch_time(df)
    assert {(int(d), s) for d, s in zip(fig.bench_failed["devices"], fig.bench_failed["status"])} == expected
    xs, texts = _x_marks(fig.axes[0])
    assert sorted(xs) == [4, 8] and sorted(texts) == ["oom", "timeout"]

    fig = plots.speedup(df)
    for ax in fig.axes[:2]:
        xs, texts = _x_marks(ax)
        assert sorted(xs) == [4, 8] and sorted(texts) == ["oom", "timeout"]
        assert [int(t) for t in ax.get_xticks()] == [1, 2, 4, 8]

    fig = plots.memory(df)
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["1", "2", "4", "8"]
    xs, texts = _x_marks(ax)
    assert sorted(xs) == [2, 3] and sorted(texts) == ["oom", "timeout"]  # positions of "4" and "8"

    fig = plots.breakdown(df)
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == [f"ddp gb=8/replica x{d}" for d in (1, 2, 4, 8)]
    xs, texts = _x_marks(ax)
    assert sorted(xs) == [2, 3] and sorted(texts) == ["oom", "timeout"]
    assert _legend_texts(fig)[-1] == "not finished (see report)"

    for x in ("epoch", "wall_time_s"):
        fig = plots.val_metric(df, x=x)
        legend = _legend_texts(fig)
        assert (
            "ddp gb=8/replica x4: oom (not finished)" in legend
            and "ddp gb=8/replica x8: timeout (not finished)" in legend
        )

    report = _squash(write_report_(root, tmp_path / "out").read_text())
    section = report.split("## Runs that did not finish")[1].split("## Figures")[0]
    assert "| oom4 | ddp gb=8/replica | wl | 4 | oom | CUDA out of memory |" in section
    assert "| to8 | ddp gb=8/replica | wl | 8 | timeout |" in section
    assert "| sk16 | horovod gb=? | wl | 16 | skipped | horovod is not installed |" in section


def test_series_that_coincide_are_told_apart_and_the_legend_leaves_the_axes_whole(tmp_path):
    """ddp and fsdp on one validation curve (the same maths): different markers and dashes, fsdp's legend
    entry says it lies on ddp; zero (another curve) says nothing. With 7 series the legend sits outside the
    axes, below them, and the axes keep (nearly) the whole width of the figure."""
    root = tmp_path / "r"
    for name, adapter, shift in (("a", "ddp", 0.0), ("b", "fsdp", 0.0), ("c", "zero", 0.3)):
        epochs = [_epoch(e, 1.0, 10, 8, 1, val_perplexity=float(np.exp(2.0 - 0.1 * e + shift))) for e in (0, 1)]
        write_run(root, name, adapter=adapter, epochs=epochs)
    for i in range(4):  # more series, each a curve of its own: a long legend
        epochs = _two_epochs(1.0 + i, 10, 16 + i, 1, val_perplexity=3.0 + i)
        write_run(root, f"t{i}", adapter="ddp", batch_size=16 + i, epochs=epochs)
    fig = plots.val_metric(load(root), x="epoch")
    fig.draw_without_rendering()
    ddp, fsdp, zero = "ddp gb=8/replica x1", "fsdp gb=8/replica x1", "zero gb=8/replica x1"
    assert fig.bench_coincide == {fsdp: ddp}
    legend = _legend_texts(fig)
    assert f"{fsdp}  = {ddp}" in legend and zero in legend and ddp in legend
    assert "same values as series X" in fig.legends[0].get_title().get_text()
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    styles = {(lines[s].get_marker(), lines[s].get_linestyle()) for s in (ddp, fsdp, zero)}
    assert len(styles) == 3  # each drawn its own way
    ax_box, fig_box = fig.axes[0].get_window_extent(), fig.bbox
    legend_box = fig.legends[0].get_window_extent()
    assert ax_box.width > 0.7 * fig_box.width
    assert legend_box.y1 <= ax_box.y0  # below the axes, not over them


def test_preempted_runs_keep_their_status_and_are_not_counted_ok(tmp_path):
    root = tmp_path / "r"
    write_run(root, "ok1", "ddp", 1, epochs=_two_epochs(4.0, 12, 8, 1))
    # preempted after a complete epoch and part of the next: its numbers exist but it did not finish
    write_run(
        root,
        "pre2",
        "ddp",
        2,
        status="preempted",
        epochs=[_epoch(0, 6.0, 6, 16, 2, partial=False), _epoch(1, 0.5, 2, 16, 2, partial=True)],
    )
    df = load(root)
    per_run = runs(df).set_index("run_id")
    assert per_run.loc["pre2", "status"] == "preempted"
    assert set(ok(df)["run_id"]) == {"ok1"}
    table = tables.speedup_table(df)
    assert list(table["devices"]) == [1]  # the preempted point is not on the curve
    fig = plots.epoch_time(df)
    assert list(fig.bench_failed["status"]) == ["preempted"] and _x_marks(fig.axes[0]) == ([2.0], ["preempted"])
    report = _squash(write_report_(root, tmp_path / "out").read_text())
    assert "1 ok, 1 preempted (2 runs)" in report
    assert "| pre2 | ddp gb=8/replica | wl | 2 | preempted |" in report.split("## Runs that did not finish")[1]


def _baseline_tree(root):
    # time per sample of each point's steady epoch (epoch 1): written here as epoch time / (steps x gb)
    write_run(root, "a1", "ddp", 1, epochs=_two_epochs(10.0, 10, 8, 1))  # 10 / 80 = 0.125
    write_run(root, "a2", "ddp", 2, epochs=_two_epochs(6.0, 5, 16, 2))  # 6 / 80 = 0.075
    write_run(root, "b2", "zero", 2, settings={"stage": 2}, epochs=_two_epochs(4.0, 5, 16, 2))  # 4 / 80 = 0.05
    write_run(root, "b4", "zero", 4, settings={"stage": 2}, epochs=_two_epochs(3.0, 3, 32, 4))  # 3 / 96 = 0.03125


def test_speedup_baseline_best_and_per_series(tmp_path):
    root = tmp_path / "r"
    _baseline_tree(root)
    df = load(root)
    A, B = "ddp gb=8/replica", "zero stage=2 gb=8/replica"

    best = tables.speedup_table(df, "best").set_index(["label", "devices"])
    assert best.loc[(A, 1), "speedup"] == pytest.approx(1.0)
    assert best.loc[(A, 2), "speedup"] == pytest.approx(0.125 / 0.075)
    assert best.loc[(A, 2), "efficiency"] == pytest.approx(0.125 / 0.075 / 2)
    assert best.loc[(B, 2), "speedup"] == pytest.approx(0.125 / 0.05)
    assert best.loc[(B, 4), "speedup"] == pytest.approx(4.0) and best.loc[(B, 4), "efficiency"] == pytest.approx(1.0)
    assert set(best["baseline"]) == {f"{A} on 1 device"}
    assert tables.speedup_table(df, None).equals(tables.speedup_table(df, "best"))

    per = tables.speedup_table(df, "per-series").set_index(["label", "devices"])
    assert per.loc[(A, 2), "speedup"] == pytest.approx(0.125 / 0.075)
    assert per.loc[(B, 2), "speedup"] == pytest.approx(1.0) and per.loc[(B, 2), "efficiency"] == pytest.approx(1.0)
    assert per.loc[(B, 4), "speedup"] == pytest.approx(0.05 / 0.03125)
    assert per.loc[(B, 4), "efficiency"] == pytest.approx(0.05 / 0.03125 * 2 / 4)
    assert per.loc[(B, 4), "baseline"] == f"{B} on 2 devices"

    fig = plots.speedup(df, baseline="per-series")
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == B)
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.6])
    ideals = sorted(tuple(ln.get_xdata()) for ln in fig.axes[0].get_lines() if ln.get_label() == "ideal")
    assert ideals == [(1, 2, 4), (2, 4)]  # one ideal line per baseline device count

    proc = python_m(
        "ptbench.analysis", "report", str(root), "--out", str(tmp_path / "o"), "--baseline", "per-series", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    text = _squash((tmp_path / "o" / "report.md").read_text())
    assert "Speedup baseline for wl: **each series' own point at its fewest devices** (--baseline per-series)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| wl | {B} | 4 |"))
    assert row.rstrip(" |").endswith("| 1.6 | 0.8")


def test_steady_epoch_time_is_used_for_speedup_and_partial_epochs_are_left_out(tmp_path):
    root = tmp_path / "r"
    # summary's epoch_time_steady_s (4.5) wins over the events (epoch 1 took 4.0): it is what the runner measured
    write_run(
        root,
        "steady",
        "ddp",
        1,
        steady=4.5,
        epochs=[
            _epoch(0, 10.0, 10, 8, 1, partial=False),
            _epoch(1, 4.0, 10, 8, 1, partial=False),
            _epoch(2, 1.0, 2, 8, 1, partial=True),
        ],
    )
    # no steady field: mean of the complete epochs after the first (4 and 6 -> 5); the partial epoch 3 is out
    write_run(
        root,
        "fallback",
        "ddp",
        2,
        epochs=[
            _epoch(0, 12.0, 5, 16, 2, partial=False),
            _epoch(1, 4.0, 5, 16, 2, partial=False),
            _epoch(2, 6.0, 5, 16, 2, partial=False),
            _epoch(3, 0.5, 1, 16, 2, partial=True),
        ],
    )
    # one epoch only (and no partial flag, as older records): the first epoch
    write_run(root, "single", "ddp", 4, epochs=[_epoch(0, 7.0, 3, 32, 4)])
    df = load(root)
    r = runs(df).set_index("run_id")
    assert r.loc["steady", "epoch_time_used_s"] == 4.5
    assert r.loc["steady", "time_per_sample_used_s"] == pytest.approx(4.5 / 80)
    assert r.loc["steady", "epoch_time_source"] == "summary epoch_time_steady_s"
    assert r.loc["fallback", "epoch_time_used_s"] == pytest.approx(5.0)
    assert r.loc["fallback", "epoch_time_source"] == "mean of the epochs after the first"
    assert r.loc["single", "epoch_time_used_s"] == 7.0
    assert r.loc["single", "epoch_time_source"] == "the first epoch only (includes warm-up)"
    # means over epochs leave the partial ones out: (10 + 4) / 2, not (10 + 4 + 1) / 3
    assert r.loc["steady", "epoch_time_s"] == pytest.approx(7.0)
    assert r.loc["fallback", "epoch_time_s"] == pytest.approx((12 + 4 + 6) / 3)
    assert r.loc["steady", "partial_epochs"] == 1 and r.loc["single", "partial_epochs"] == 0
    sp = tables.speedup_table(df).set_index("devices")
    assert sp.loc[2, "speedup"] == pytest.approx((4.5 / 80) / (5.0 / 80))
    assert sp.loc[4, "speedup"] == pytest.approx((4.5 / 80) / (7.0 / 96))
    fig = plots.epoch_time(df)
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "ddp gb=8/replica")
    np.testing.assert_allclose(line.get_ydata(), [4.5, 5.0, 7.0])
    report = write_report_(root, tmp_path / "out").read_text()
    assert "summary epoch_time_steady_s (1 run)" in report and "mean of the epochs after the first (1 run)" in report
    assert "the first epoch only (includes warm-up) (1 run)" in report
    assert "Partial epochs (cut short by trainer.max_steps or preemption) are left out of every mean" in report
    assert "2 in steady (1), fallback (1)" in report


def test_every_epoch_partial_still_gives_a_time_per_sample(tmp_path):
    root = tmp_path / "r"
    # trainer.max_steps caps every epoch: all partial, time per sample still compares
    write_run(
        root, "capped", "ddp", 1, epochs=[_epoch(0, 3.0, 4, 8, 1, partial=True), _epoch(1, 1.0, 4, 8, 1, partial=True)]
    )
    r = runs(load(root)).iloc[0]
    assert r["epoch_time_used_s"] == 1.0 and r["time_per_sample_used_s"] == pytest.approx(1.0 / 32)
    assert r["epoch_time_source"] == "mean of the epochs after the first, every epoch partial"
    assert r["epoch_time_s"] == pytest.approx(2.0)


def test_memory_uses_the_cpu_delta_and_says_when_it_falls_back(tmp_path):
    states = {"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB}
    root = tmp_path / "delta"
    ranks = [
        {"rank": 0, "memory": {"peak_rss": 700 * MIB, "peak_rss_delta": 40 * MIB}, "state_bytes": states},
        {"rank": 1, "memory": {"peak_rss": 720 * MIB, "peak_rss_delta": 30 * MIB}, "state_bytes": states},
    ]
    write_run(
        root, "d", "ddp", 2, epochs=[_epoch(0, 2.0, 6, 16, 2, ranks=ranks), _epoch(1, 1.0, 6, 16, 2, ranks=ranks)]
    )
    data = tables.memory_table(load(root)).iloc[0]
    assert data["peak_mib"] == 40 and data["memory_metric"] == "peak_rss_delta"  # rank 0: the largest delta
    assert data["states_mib"] == 16 and data["other_mib"] == 24
    text = write_report_(root, tmp_path / "o1").read_text()
    assert "Memory metric: `peak_rss_delta`" in text and "falls back" not in text
    fig = plots.memory(load(root))
    assert "peak RSS - RSS before step 1" in fig.axes[0].get_ylabel()

    root = tmp_path / "rss"  # an older record: no delta
    write_run(root, "r", "ddp", 2, epochs=_two_epochs(1.0, 6, 16, 2, peak=700 * MIB, states=states))
    data = tables.memory_table(load(root)).iloc[0]
    assert data["peak_mib"] == 700 and data["memory_metric"] == "peak_rss"
    text = write_report_(root, tmp_path / "o2").read_text()
    assert "no `peak_rss_delta`: the memory figure falls back to `peak_rss`" in text


def test_memory_keeps_offloaded_state_out_of_device_memory(tmp_path):
    states = {"params": 10 * MIB, "grads": 10 * MIB, "optimizer": 40 * MIB}
    root = tmp_path / "r"
    # a GPU record of ZeRO-3 with the optimizer offloaded (config), and one whose states say where they are
    write_run(
        root,
        "off",
        "zero",
        2,
        settings={"stage": 3, "offload_optimizer": True},
        epochs=_two_epochs(1.0, 6, 16, 2, peak=100 * MIB, states=states, metric="peak_allocated"),
    )
    tagged = {**states, "device": {"params": "cuda:0", "grads": "cuda:0", "optimizer": "cpu"}}
    write_run(
        root,
        "tag",
        "zero",
        4,
        settings={"stage": 3},
        epochs=_two_epochs(1.0, 3, 32, 4, peak=90 * MIB, states=tagged, metric="peak_allocated"),
    )
    data = tables.memory_table(load(root)).set_index(["label", "devices"])
    off = data.loc[("zero stage=3 offload=optimizer gb=8/replica", 2)]
    assert off["optimizer_mib"] == 0 and off["host_mib"] == 40 and off["offload"] == "optimizer"
    assert off["states_mib"] == 20 and off["other_mib"] == 80
    tag = data.loc[("zero stage=3 gb=8/replica", 4)]
    assert tag["optimizer_mib"] == 0 and tag["host_mib"] == 40 and tag["params_mib"] == 10
    fig = plots.memory(load(root))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert any("offload=optimizer" in t and "optimizer held on CPU: not in the bars" in t for t in titles)
    text = write_report_(root, tmp_path / "o").read_text()
    assert "`zero stage=3 offload=optimizer gb=8/replica` x2: optimizer held in CPU memory (40 MiB)" in text


def test_memory_of_gpipe_sets_the_busiest_device_against_its_own_states(tmp_path):
    root = tmp_path / "r"
    part = [
        {"partition": 0, "device": "cuda:0", "params": 30 * MIB, "grads": 30 * MIB, "optimizer": 60 * MIB},
        {"partition": 1, "device": "cuda:1", "params": 10 * MIB, "grads": 10 * MIB, "optimizer": 20 * MIB},
    ]
    rank = {
        "rank": 0,
        "memory": {
            "peak_allocated": 200 * MIB,
            "per_device": [
                {"device": "cuda:0", "peak_allocated": 200 * MIB},
                {"device": "cuda:1", "peak_allocated": 80 * MIB},
            ],
        },
        "state_bytes": {"params": 40 * MIB, "grads": 40 * MIB, "optimizer": 80 * MIB, "per_partition": part},
    }
    write_run(
        root, "gp", "gpipe", 2, batch_size=4, epochs=[_epoch(0, 1.0, 3, 32, 2, metric="peak_allocated", ranks=[rank])]
    )
    # a record from before per-device memory: no states detail, ranks without memory: loads, no numbers invented
    write_run(
        root,
        "bare",
        "gpipe",
        4,
        batch_size=4,
        epochs=[_epoch(0, 1.0, 3, 64, 4, metric="peak_allocated", ranks=[{"rank": 0}])],
    )
    data = tables.memory_table(load(root)).set_index("devices")
    assert data.loc[2, "peak_mib"] == 200
    assert (data.loc[2, "params_mib"], data.loc[2, "grads_mib"], data.loc[2, "optimizer_mib"]) == (30, 30, 60)
    assert data.loc[2, "mem_note"] == "states of cuda:0, the busiest device of the rank"
    assert np.isnan(data.loc[4, "states_mib"])
