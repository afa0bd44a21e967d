"""`python -m ptbench.compare`: points matched by what they measure, a verdict per point with its interval,
environment differences, saved baselines, exit codes, and the simulated error rates of its rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ptbench.analysis import compare as cmp
from ptbench.analysis.compare import main
from tests.helpers import REPO

STEPS = 10
ENV = {"python": "3.11.7", "versions": {"torch": "2.14.1", "deepspeed": "0.19.8"}, "host": "n1", "git_sha": "a" * 40,
       "git_dirty": False, "cuda": "13.0", "slurm": {}, "time": "2026-12-01T00:00:00+0000"}  # fmt: skip


def write_run(root: Path, name: str, step: float, devices: int = 2, bucket: float = 25.0, repeat: int = 0,
              state: int = 7_000_000, env: dict | None = None, contended: bool = False, seed: int = 1234) -> Path:  # fmt: skip
    """One run folder as the runner writes it (config.yaml, summary.json, events.jsonl, env.json): its timed
    steps spread 1 % around `step`."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {
        "workload": {"name": "gpt2_tiny", "kind": "language", "n_layer": 2},
        "adapter": {"name": "ddp", "batch_policy": "per_device", "bucket_cap_mb": bucket},
        "launcher": {"name": "local", "nprocs": devices, "master_port": 29500 + repeat},
        "trainer": {"batch_size": 4, "grad_accum": 1, "precision": "fp32", "seed": seed, "progress": False},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "data": {"source": "synthetic", "root": f"/scratch/{name}"},
        "results": {"experiment": "smoke", "repeat": repeat, "root": str(root)},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    warnings = ["contention: other processes kept 1.7 CPU(s) busy"] if contended else []
    summary = {"status": "ok", "run_id": name, "adapter": "ddp", "workload": "gpt2_tiny", "experiment": "smoke",
               "world_size": devices, "devices": devices, "hosts": ["n1"] * devices, "warnings": warnings}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    steps = list(step * (1 + 0.01 * np.linspace(-1, 1, STEPS)))
    ranks = [{"rank": r, "memory": {"peak_rss": 5 * 10**8}, "state_bytes": {"params": state, "grads": 0,
              "optimizer": 0}} for r in range(devices)]  # fmt: skip
    ev = {"type": "epoch", "epoch": 0, "steps": STEPS, "global_batch": 4 * devices, "devices": devices,
          "epoch_time_s": step * STEPS, "samples_per_s": 4 * devices / step, "step_times_s": steps,
          "step_time_p50_s": step, "val_loss": 2.0, "val_perplexity": 7.389, "memory_metric": "peak_rss",
          "ranks": ranks, "partial": False}  # fmt: skip
    (d / "events.jsonl").write_text(json.dumps(ev) + "\n")
    (d / "env.json").write_text(json.dumps(env or ENV))
    return d


def sweep(root: Path, steps: dict[int, list[float]], **kw) -> Path:
    """A sweep's folder: per device count, one run per step time given (repeat i)."""
    for devices, times in steps.items():
        for i, t in enumerate(times):
            write_run(root, f"r{devices}-{i}", t, devices=devices, repeat=i, **kw)
    return root


def run(*args: str, capsys) -> tuple[int, list[str], str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out.strip().splitlines(), out.err.strip()


AA = [0.100, 0.102, 0.099, 0.101, 0.100]


def test_not_identity_is_what_a_point_id_leaves_out():
    from ptbench.runner.points import _NOT_PART_OF_POINT

    assert cmp.NOT_IDENTITY == _NOT_PART_OF_POINT


def test_a_real_slowdown_is_a_regression_and_exits_1(tmp_path, capsys):
    base = sweep(tmp_path / "base", {1: AA, 2: [0.2 * x / 0.1 for x in AA]})
    new = sweep(tmp_path / "new", {1: [1.10 * x for x in AA[::-1]], 2: [0.2 * x / 0.1 for x in AA[1:] + AA[:1]]})
    rc, lines, _ = run(str(base), str(new), capsys=capsys)
    assert rc == 1
    assert lines[-1] == "compare: 2 points, 1 regressions, 0 improvements, 1 same, 0 undecided"
    t = cmp.compare(cmp.side(base), cmp.side(new))["table"].set_index(["point", "metric"])
    slow = t.loc[("gpt2_tiny ddp gb=4/replica x1", "step_time")]
    assert slow["verdict"] == "regression" and slow["lo"] > 1.05 and abs(slow["ratio"] - 1.10) < 1e-9
    assert slow["p_holm"] >= slow["p"]  # Holm across the two points
    assert t.loc[("gpt2_tiny ddp gb=4/replica x2", "step_time"), "verdict"] == "same"
    out = tmp_path / "new" / "compare"
    assert {p.name for p in out.iterdir()} == {"compare.md", "compare.csv", "compare.png", "compare.svg"}
    md = (out / "compare.md").read_text()
    assert lines[-1] in md and "| regression |" in md and "environment differences: none" in md


def test_aa_is_same_and_exits_0_and_strict_fails_undecided(tmp_path, capsys):
    base = sweep(tmp_path / "base", {2: AA})
    rc, lines, _ = run(str(base), str(sweep(tmp_path / "aa", {2: AA[::-1]})), capsys=capsys)
    assert (rc, lines[-1]) == (0, "compare: 1 points, 0 regressions, 0 improvements, 1 same, 0 undecided")
    noisy = sweep(tmp_path / "noisy", {2: [0.08, 0.13, 0.10]})
    rc, lines, _ = run(str(base), str(noisy), capsys=capsys)
    assert (rc, lines[-1]) == (0, "compare: 1 points, 0 regressions, 0 improvements, 0 same, 1 undecided")
    assert any("runs per side would decide ±5 %" in line for line in lines)
    assert run(str(base), str(noisy), "--strict", capsys=capsys)[0] == 1


def test_vary_matches_across_a_key_and_no_point_in_common_says_which(tmp_path, capsys):
    base = sweep(tmp_path / "base", {2: AA})
    small = sweep(tmp_path / "small", {2: [1.3 * x for x in AA]}, bucket=0.001)
    rc, lines, err = run(str(base), str(small), capsys=capsys)
    assert rc == 2 and lines == [] and len(err.splitlines()) == 1
    assert "no point in common" in err and "adapter.bucket_cap_mb (25.0 vs 0.001)" in err and "--vary" in err
    rc, lines, _ = run(str(base), str(small), "--vary", "adapter.bucket_cap_mb", capsys=capsys)
    assert rc == 1 and "adapter.bucket_cap_mb: 25.0 -> 0.001" in "\n".join(lines)
    rc, _, err = run(str(base), str(small), "--vary", "adapter.nope", capsys=capsys)
    assert rc == 2 and "--vary adapter.nope: no record" in err


def test_bytes_compare_exactly_and_a_metric_no_record_has_is_bad_input(tmp_path, capsys):
    base = write_run(tmp_path / "base", "one", 0.1).parent
    same = write_run(tmp_path / "same", "one", 0.1).parent
    big = write_run(tmp_path / "big", "one", 0.1, state=8_000_000).parent
    t = cmp.compare(cmp.side(base), cmp.side(same), ["state_bytes", "peak_memory", "step_time"])["table"]
    t = t.set_index("metric")
    assert t.loc["state_bytes", "verdict"] == "same" and t.loc["state_bytes", "exact"]  # counted: one run is exact
    assert not t.loc["peak_memory", "exact"] and t.loc["peak_memory", "verdict"] == "undecided"  # measured: 1 run
    assert t.loc["step_time", "verdict"] == "undecided" and "one run" in t.loc["step_time", "note"]
    rc, lines, _ = run(str(base), str(big), "--metrics", "state_bytes", capsys=capsys)
    assert rc == 1 and "exact" in "\n".join(lines)
    rc, _, err = run(str(base), str(big), "--metrics", "comm_exposed", capsys=capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "no record on either side holds comm_exposed" in err


def test_environment_differences_are_listed_above_the_table(tmp_path, capsys):
    base = sweep(tmp_path / "base", {2: AA})
    env = {**ENV, "versions": {**ENV["versions"], "torch": "2.15.0"}, "nccl": "2.23.4", "gpus": ["NVIDIA H200"]}
    new = sweep(tmp_path / "new", {2: AA}, env=env)
    rc, lines, _ = run(str(base), str(new), capsys=capsys)
    at = lines.index("environment differences (baseline -> new):")
    assert {"  version torch: 2.14.1 -> 2.15.0", "  NCCL: - -> 2.23.4", "  GPUs: - -> NVIDIA H200"} <= set(lines[at:])
    assert at < next(i for i, line in enumerate(lines) if line.lstrip().startswith("point"))
    assert rc == 0


def test_contended_runs_are_left_out_unless_kept(tmp_path, capsys):
    base = sweep(tmp_path / "base", {2: AA})
    new = sweep(tmp_path / "new", {2: AA})
    for i in range(3):
        write_run(new, f"busy{i}", 0.2 * (1 + i / 100), contended=True, repeat=5 + i)
    rc, lines, _ = run(str(base), str(new), capsys=capsys)
    assert rc == 0 and any("left out: 3 run(s)" in line for line in lines) and " 1 same, " in lines[-1]
    rc, lines, _ = run(str(base), str(new), "--include-contended", "--out", str(tmp_path / "o"), capsys=capsys)
    assert " 0 same, 1 undecided" in lines[-1]  # the busy runs' doubled times now count: no longer the same


def test_baseline_file_round_trip_size_and_version(tmp_path, capsys):
    results = sweep(tmp_path / "sweep", {d: AA[:3] for d in range(1, 21)})  # 20 points x 3 repeats
    rc, lines, _ = run("--save-baseline", str(tmp_path / "b.json"), str(results), capsys=capsys)
    size = (tmp_path / "b.json").stat().st_size
    assert rc == 0 and lines == [f"baseline: {tmp_path / 'b.json'}: 20 points, {size} bytes (format "
                                 f"{cmp.FORMAT} version {cmp.VERSION})"] and size < 100_000  # fmt: skip
    from_file = cmp.compare(cmp.side(tmp_path / "b.json"), cmp.side(results))["table"]
    from_folder = cmp.compare(cmp.side(results), cmp.side(results))["table"]
    assert from_file.drop(columns="note").equals(from_folder.drop(columns="note"))
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["points"][0]["env"]["version torch"] == "2.14.1" and doc["points"][0]["date"]
    (tmp_path / "v2.json").write_text(json.dumps({**doc, "version": 2}))
    rc, _, err = run(str(tmp_path / "v2.json"), str(results), capsys=capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "is version 2; this ptbench reads version 1" in err
    (tmp_path / "other.json").write_text("{}")
    assert "not a ptbench.compare baseline" in run(str(tmp_path / "other.json"), str(results), capsys=capsys)[2]


def test_the_command_is_its_own_process_with_its_exit_status(tmp_path):
    """`python -m ptbench.compare`, as a CI job types it: the verdict's exit status and last line come back."""
    import subprocess
    import sys

    base = sweep(tmp_path / "base", {2: AA})
    new = sweep(tmp_path / "new", {2: [1.2 * x for x in AA]})
    cmd = [sys.executable, "-m", "ptbench.compare", str(base), str(new)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "compare: 1 points, 1 regressions, 0 improvements, 0 same, 0 undecided"
    proc = subprocess.run([*cmd[:3], str(base)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: name two sides, BASELINE NEW (got 1)")


@pytest.mark.parametrize("repeats", [3, 5])
def test_false_alarms_on_aa_data_stay_under_5_percent(repeats):
    for spread in (0.02, 0.03):
        assert cmp.simulate(repeats, spread, 0.0, trials=1000, seed=repeats)["regression"] <= 0.05


def test_power_to_catch_a_10_percent_slowdown_at_5_repeats():
    r = cmp.simulate(5, 0.03, 0.10, trials=1000, seed=1)
    assert r["regression"] >= 0.8 and r["same"] == 0.0


def test_a_real_record_compared_with_its_own_baseline(smoke_run, tmp_path, capsys):
    results = smoke_run.parent
    assert run("--save-baseline", str(tmp_path / "b.json"), str(results), capsys=capsys)[0] == 0
    rc, lines, _ = run(str(tmp_path / "b.json"), str(results), "--include-contended", "--out", str(tmp_path / "o"),
                       "--metrics", "step_time,state_bytes,comm_bytes", capsys=capsys)  # fmt: skip
    assert rc == 0 and lines[-1].startswith("compare: 1 points, 0 regressions")
    t = cmp.compare(
        cmp.side(tmp_path / "b.json"), cmp.side(results), ["state_bytes", "comm_bytes"], include_contended=True
    )
    assert list(t["table"]["verdict"]) == ["same", "same"] and t["table"]["exact"].all() and not t["env"]
