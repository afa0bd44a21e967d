"""The noise floor (how large a difference must be to be real): trainer.inject_fault=slow@FRACTION slows every
step by that fraction, and the A/A / A/B statistics of `python -m ptbench.sweep noise`
(ptbench.analysis.stats noise_result)."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from ptbench.analysis.stats import NOT_DISTINGUISHABLE, noise_result
from ptbench.core.config import TrainerConfig
from ptbench.core.errors import ConfigError
from ptbench.runner.checks import check_config
from ptbench.runner.faults import Faults
from ptbench.runner.points import compose_point


def _loop(faults, steps=12, work=0.02):
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if faults:
            faults.before_step(step)
        time.sleep(work)  # the step's own work
        times.append(time.perf_counter() - t0)
    return times[2:]


def test_slow_fault_slows_every_step_by_its_fraction():
    """Every step after the first spins `slow` x the previous step's own time: with a step of at least `work`
    (a sleep never returns early), each takes at least (1 + slow) x work. Only this lower bound is asserted: a
    shared CPU can make any step longer, never shorter (how close to 1.5 it comes on a quiet machine is the
    noise benchmark's to say: `python -m ptbench.sweep noise`)."""
    work = 0.02
    assert min(_loop(None, work=work)) >= work
    slow = _loop(Faults(TrainerConfig(inject_fault="slow@0.5"), rank=0), work=work)
    assert min(slow) >= 1.5 * work * 0.999, slow


def test_slow_fault_is_checked():
    check_config(compose_point(["experiment=smoke", "trainer.inject_fault=slow@0.15"]))
    with pytest.raises(ConfigError, match="slow@FRACTION"):
        check_config(compose_point(["experiment=smoke", "trainer.inject_fault=slow@fast"]))


def test_noise_result_known_answers(tmp_path):
    a = [0.100, 0.104, 0.098, 0.102, 0.101]
    slow = noise_result(a, [t * 1.15 for t in a], "A/B")
    assert slow["ratio"] == pytest.approx(1.15) and slow["verdict"] == "B is 15.0 % slower than A [15.0 %, 15.0 %]"
    aa = noise_result(a, [0.101, 0.099, 0.103, 0.100, 0.102])
    # the spread is one run's sd of log time, from the pairs (it does not shrink with more pairs), and plans repeats
    d = np.log([0.101, 0.099, 0.103, 0.100, 0.102]) - np.log(a)
    assert aa["verdict"] == NOT_DISTINGUISHABLE and aa["spread"] == pytest.approx(d.std(ddof=1) / np.sqrt(2))
    assert aa["repeats_for_margin"] >= 2 and slow["spread"] is None
    f = tmp_path / "noise.json"
    f.write_text(json.dumps({"kind": "A/B", "a": a, "b": [t * 1.15 for t in a], "b_overrides": ["x=1"]}))
    out = subprocess.run([sys.executable, "-m", "ptbench.analysis", "noise", str(f)], capture_output=True, text=True)
    assert out.returncode == 0 and "noise A/B (B: x=1): B/A step time 1.1500 [1.1500, 1.1500]" in out.stdout
    assert json.loads(f.read_text())["verdict"].startswith("B is 15.0 %")


def test_sweep_noise_runs_the_arms_in_abba_order_and_pairs_them_by_repeat(tmp_path):
    """`python -m ptbench.sweep noise`: A B, then B A (a drift of the machine favours neither arm), and the file
    holds one step time per arm and repeat."""
    point = ["experiment=smoke", "launcher.nprocs=1", "workload.vocab_size=256", "trainer.max_steps=3",
             f"results.root={tmp_path}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "ptbench.sweep", "noise", "--repeats", "2", "--", *point],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    order = [ln.split("]")[1].split()[0] for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert order == ["A", "B", "B", "A"], proc.stdout
    (saved,) = (tmp_path / "smoke" / "noise").glob("noise-*.json")
    record = json.loads(saved.read_text())
    assert record["kind"] == "A/A" and len(record["a"]) == len(record["b"]) == 2
