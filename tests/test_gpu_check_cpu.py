"""`python -m ptbench.gpu_check --cpu`: the GPU check's own code run on the CPU (its twin): its budget over the
whole command, its rows kept as they finish, the sync counter it reads from the record, and the profiler window
its timings rely on (started before the first profiled step's timer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ptbench.adapters import available, get_adapter_class
from ptbench.core.timing import PhaseTimer
from ptbench.gpu_check import GLOBAL_BATCH, case_overrides, micro_checks, micro_line
from ptbench.runner.syncs import SyncCounter
from ptbench.smoke import framework_installed

pytestmark = pytest.mark.slow


def gpu_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ptbench.gpu_check", "--cpu", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def rows_of(root: Path) -> list[dict]:
    return [json.loads(ln) for ln in (root / "gpu_check.jsonl").read_text().splitlines()]


def test_gpu_check_cpu_runs_the_cases_and_prints_one_table(tmp_path):
    p = gpu_check("--adapters", "ddp,zero", "--workloads", "gpt2_tiny", "--skip-smoke", "--skip-micro",
                  "--root", str(tmp_path))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "global batch 8 for every row" in p.stdout and "2 warm-up excluded" in p.stdout
    rows = {r["adapter"]: r for r in rows_of(tmp_path)}
    assert set(rows) == {"ddp", "zero"}
    for r in rows.values():
        assert r["status"] == "ok" and r["global_batch"] == GLOBAL_BATCH
        assert r["step_mean_ms"] > 0 and r["step_p50_ms"] > 0 and r["rate"] > 0
        assert r["predicted_total"] > 0 and r["saved_counted"] > 0 and r["saved_predicted"] > 0
        assert len(r["syncs_implicit"]) == 2  # 4 steps, 2 of them warm-up
        assert Path(r["run_dir"]).is_dir()
    # DeepSpeed reads its gradient norm / overflow flag on the host every step; the sites name its files
    assert rows["zero"]["syncs_per_step"] >= 1
    assert any("deepspeed/" in site for site in rows["zero"]["sync_sites"])
    # torch.optim's step counters stay on the host on CUDA: they are not counted as syncs
    assert not any("torch/optim/optimizer.py" in site for r in rows.values() for site in r["sync_sites"])
    table = p.stdout[p.stdout.index("adapter  workload") :]
    assert table.count("\n") >= 3 and "ddp" in table and "zero" in table


def test_every_row_gets_the_same_global_batch(tmp_path):
    """gpipe and pipeline split a batch into micro-batches: their per-device batch is lowered to match."""
    for adapter in available():
        cls = get_adapter_class(adapter)
        if not framework_installed(cls):
            continue
        workload = "gpt2_tiny" if "language" in cls.kinds else "resnet50_tiny"
        overrides, why = case_overrides(adapter, workload, 1, tmp_path, cpu=True)
        assert overrides is not None, f"{adapter}: {why}"
        from ptbench.runner.compose import compose, typed
        from ptbench.runner.plan import make_plan

        plan = make_plan(typed(compose(overrides)), "local")
        assert plan.global_batch == GLOBAL_BATCH, (adapter, overrides)


def test_budget_spent_is_not_run_and_fails_only_under_ci(tmp_path):
    args = ("--adapters", "ddp", "--workloads", "gpt2_tiny", "--skip-smoke", "--skip-micro", "--budget", "0")
    p = gpu_check(*args, "--root", str(tmp_path / "a"), env={"CI": "false"})
    assert p.returncode == 0, p.stderr
    assert rows_of(tmp_path / "a")[0]["status"] == "not run (budget)"
    p = gpu_check(*args, "--root", str(tmp_path / "b"), env={"CI": "true"})
    assert p.returncode == 1
    assert rows_of(tmp_path / "b")[0]["status"] == "FAILED"
    assert "not run (budget)" in rows_of(tmp_path / "b")[0]["reason"]


def test_the_budget_bounds_the_whole_command_and_rows_print_as_they_finish(tmp_path):
    """--budget covers the smoke, the cases and the micro-checks together: the process ends inside it, a row it
    leaves no time for reads "not run (budget)" (never a timed-out FAILED), and each row is printed and in the
    jsonl while the command still runs."""
    budget = 45
    cmd = [sys.executable, "-u", "-m", "ptbench.gpu_check", "--cpu", "--budget", str(budget), "--adapters", "ddp"]
    t0 = time.monotonic()
    p = subprocess.Popen(
        [*cmd, "--out", str(tmp_path)], stdout=subprocess.PIPE, text=True, env={**os.environ, "CI": "false"}
    )
    seen = []  # (seconds since the start, line, rows in the jsonl at that moment)
    for line in p.stdout:
        rows = len((tmp_path / "gpu_check.jsonl").read_text().splitlines()) if line.startswith("[") else None
        seen.append((time.monotonic() - t0, line.rstrip(), rows))
    wall = time.monotonic() - t0
    assert p.wait() == 0
    print("\n".join(f"{t:5.1f}s | {line}" for t, line, _ in seen) + f"\nwall {wall:.1f}s against --budget {budget}s")
    assert wall <= budget + 1  # the start of the interpreter counted in; torch's teardown kept back
    progress = [(t, line, n) for t, line, n in seen if line.startswith("[")]
    assert all(n >= i for i, (_, _, n) in enumerate(progress, 1))  # each in the file by the time it was read
    assert progress[0][0] < wall - 10  # the first row came long before the end
    rows = rows_of(tmp_path)
    assert {r["kind"] for r in rows} == {"smoke", "case", "micro"} and rows[0]["kind"] == "smoke"
    assert any(r["status"] == "not run (budget)" for r in rows)
    assert not any(r.get("status") == "FAILED" or "error" in r for r in rows)
    assert "rows in" in seen[-1][1] and f"of --budget {budget}s" in seen[-1][1]


def test_a_cut_call_keeps_its_rows_and_a_second_call_runs_the_rest(tmp_path):
    """A call killed mid-way (the device tool's 10-minute limit) leaves every finished row in gpu_check.jsonl; a
    second call into the same --out keeps them and runs only the others."""
    args = ["--cpu", "--smoke", "none", "--skip-micro", "--adapters", "ddp", "--workloads", "gpt2_tiny,resnet50_tiny"]
    cmd = [sys.executable, "-u", "-m", "ptbench.gpu_check", *args, "--out", str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    for line in p.stdout:
        if "ddp gpt2_tiny: ok" in line:
            os.killpg(p.pid, signal.SIGKILL)  # cut while resnet50_tiny runs
            break
    p.wait()
    assert [(r["workload"], r["status"]) for r in rows_of(tmp_path)] == [("gpt2_tiny", "ok")]
    second = gpu_check(*args[1:], "--out", str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "ddp gpt2_tiny: ok" in second.stdout and "(kept from an earlier call)" in second.stdout
    assert [(r["workload"], r["status"]) for r in rows_of(tmp_path)] == [("gpt2_tiny", "ok"), ("resnet50_tiny", "ok")]


def test_micro_checks_on_cpu_measure_the_loss_path_and_see_the_start_environment():
    rows = {r["micro"]: r for r in micro_checks(cpu=True, timeout=300)}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["cdmc set before start"]["started_with"] == "1"
    assert rows["cdmc not set"]["started_with"] is None and rows["cdmc set late"]["started_with"] is None
    # bf16 logits -> fp32 copy -> log-softmax and its gradient: 12 bytes per token x vocabulary entry
    assert rows["loss peak"]["per_NV"] == pytest.approx(12, abs=0.5)
    assert rows["lm_head V"]["ms_V50257"] > 0 and rows["lm_head V"]["ms_V50304"] > 0
    assert {k for k in rows["resnet50 layouts"] if k.startswith("ms_")} == {
        "ms_nchw", "ms_channels_last", "ms_nchw_weights_cl_input", "ms_channels_last_cudnn_benchmark",
    }  # fmt: skip
    # StepPeak's profiler: steps timed before it ever ran, inside it (it saw their allocations) and after it exited
    cost = rows["StepPeak profiler"]
    assert cost["ms_before"] > 0 and cost["ms_inside"] > 0 and cost["ms_after"] > 0 and cost["steps"] >= 10
    assert cost["after_ratio"] == pytest.approx(cost["ms_after"] / cost["ms_before"], rel=0.05)
    assert cost["inside_ratio"] == pytest.approx(cost["ms_inside"] / cost["ms_before"], rel=0.05)
    assert cost["after_ratio_min"] == pytest.approx(cost["min_ms_after"] / cost["min_ms_before"], rel=0.05)
    assert 0 < cost["min_ms_before"] <= cost["ms_before"]
    assert cost["profiled_peak_bytes"] > 0
    line = micro_line(cost)
    print(line)
    assert f"(ratio {cost['after_ratio']})" in line and "after it exited" in line


def test_sync_counter_counts_host_reads_per_timed_step_with_their_lines():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())  # its step counters are host tensors: not counted
    timer = PhaseTimer()
    counter = SyncCounter(torch.device("cpu"), untimed_steps=1, optimizer=opt).install()
    timer.watch_steps(counter)
    try:
        for _ in range(3):
            timer.start_step()
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            opt.step()
            loss.detach().item(), float(loss.detach())  # two host reads per step
            timer.end_step()
        loss.detach().item()  # outside a step: not counted
        result = counter.result()
    finally:
        counter.uninstall()
    assert result["implicit_per_step"] == [2, 2] and result["explicit_per_step"] == [0, 0]
    (site, n), *_ = result["sites"].items()
    # 2 reads x 2 timed steps, at this file's line (from the checkout, or absolute where ptbench is installed)
    assert n == 4 and site.startswith("implicit ") and "tests/test_gpu_check_cpu.py:" in site, site
    assert torch.Tensor.item.__name__ == "item"  # uninstalled: torch's own method again


def test_the_cpu_profiler_prints_no_gpu_error():
    """torch.profiler's Kineto (StepPeak, trainer.profile) says "gpuGetDeviceCount failed" on every CPU start
    unless KINETO_LOG_LEVEL quiets it: a CPU run's console stays clean."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    p = subprocess.run([sys.executable, "-m", "ptbench.gpu_micro", "loss", "--cpu"], capture_output=True, text=True,
                       timeout=300, env=env)  # fmt: skip
    assert p.returncode == 0 and json.loads(p.stdout)["per_NV"] > 0, p.stderr
    assert "gpuGetDeviceCount" not in p.stderr and "profiler_start" not in p.stderr, p.stderr


def test_the_profiler_starts_before_the_first_profiled_step_s_timer(tmp_path):
    """trainer.profile=3:3: the profiler's start (Kineto's set-up) runs in `start_window`, which the trainer calls
    before global step 3's timer starts (it ran inside that step, which then measured 2.0-2.2x the median);
    `step()` only labels the profiled steps. The record's export note gives the start's seconds, out of the epoch's
    time as the export is."""
    import re
    import statistics

    from ptbench.core.dist import DistContext
    from ptbench.runner.profiling import StepProfiler
    from tests.helpers import bench, check_ok, events, only_run, summary

    prof = StepProfiler("3:3", DistContext(rank=0, world_size=1), tmp_path / "unit", 1, 1, 1, None)
    with prof.step(3):  # the step's context starts nothing
        assert not prof.active
    assert prof.start_window(2) == 0.0 and not prof.active
    assert prof.start_window(3) > 0 and prof.active
    started = prof.prof
    with prof.step(3):
        assert prof.prof is started
    assert prof.start_window(3) == 0.0  # once
    prof._stop()

    tiny = ["workload=gpt2_tiny", "data=synthetic", "workload.seq_len=32", "workload.vocab_size=4096"]
    window = ["trainer.profile=3:3", "trainer.max_steps=8", "trainer.eval_every_epoch=false", "trainer.progress=false"]
    proc = bench("adapter=ddp", *tiny, *window, "data.train_samples=256", results=tmp_path / "run")
    check_ok(proc)
    run = only_run(tmp_path / "run")
    times = events(run)[-1]["step_times_s"]  # global steps 2..7 (trainer.untimed_steps=2); 3, 4, 5 profiled
    note = summary(run)["profile"]["export"]["note"]
    print(
        f"step times {times}; first profiled / median of the other two: {times[1] / statistics.median(times[2:4]):.2f}"
    )
    print(note)
    start = re.search(r"so is starting it, before the first profiled step's timer \(rank 0: ([0-9.]+) s\)", note)
    assert start is not None and float(start.group(1)) > 0, note
