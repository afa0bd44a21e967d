"""`python -m ptbench.studies.overhead --whole-run`: a whole `python -m ptbench` run against a bare DDP program, each in its
own processes, and the ratio's interval (Welch's t on the logs)."""

import math
import re
import sys

import numpy as np
from scipy import stats

from ptbench.studies.overhead import log_ratio_interval, run_overrides
from tests.helpers import run


def test_ratio_interval_is_welchs_on_the_logs():
    """The interval equals scipy's Welch test on the logs, mapped back; with one run a side there is none."""
    harness, bare = [1.07, 1.02, 1.10, 1.05], [1.00, 0.97, 1.01]
    ratio, lo, hi = log_ratio_interval(harness, bare)
    ref = stats.ttest_ind(np.log(harness), np.log(bare), equal_var=False).confidence_interval(0.95)
    assert ratio == np.exp(np.mean(np.log(harness)) - np.mean(np.log(bare)))
    assert math.isclose(lo, math.exp(ref.low), rel_tol=1e-9) and math.isclose(hi, math.exp(ref.high), rel_tol=1e-9)
    assert lo < ratio < hi
    one = log_ratio_interval([1.1], [1.0])
    assert math.isclose(one[0], 1.1) and math.isnan(one[1]) and math.isnan(one[2])


def test_overrides_fit_the_steps_in_one_epoch():
    ov = run_overrides(45, 5, 2, 8, ["workload.vocab_size=256"])
    assert "data.train_samples=752" in ov and "trainer.max_steps=45" in ov and "trainer.untimed_steps=5" in ov
    assert "trainer.eval_every_epoch=false" in ov and ov[-1] == "workload.vocab_size=256"  # the caller's last


def test_one_pair_runs_both_programs_and_prints_the_ratio():
    """One pair at the smoke model's size: both sides run in their own processes and report a step time, and
    the ratio line closes the output (the interval needs two pairs)."""
    cmd = [
        sys.executable,
        "-m",
        "ptbench.studies.overhead",
        "--whole-run",
        "--pairs",
        "1",
        "--steps",
        "4",
        "--untimed",
        "1",
    ]
    proc = run([*cmd, "--batch", "2", "workload.vocab_size=256"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 rank(s), batch 2/rank, 4 steps (1 untimed)" in out, out
    pair = re.search(r"pair 1/1 \(harness first, bare second\): harness ([\d.]+)  bare ([\d.]+)  ratio ([\d.]+)", out)
    assert pair and float(pair[1]) > 0 and float(pair[2]) > 0, out
    # the step times are printed to 4 decimals: the ratio (of the unrounded times) within their rounding
    h, b, r, half = float(pair[1]), float(pair[2]), float(pair[3]), 5e-5
    assert (h - half) / (b + half) - 1e-4 <= r <= (h + half) / (b - half) + 1e-4, out
    assert re.search(r"bare [\d.]+ s/step, rank 0 alone [\d.]+", out), out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"whole-run ratio harness/bare = {pair[3]}, 95 % interval needs >= 2 pairs"), last
