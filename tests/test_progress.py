"""Batch logs show progress: a run whose stdout is a file (not a terminal, so no tqdm bar) prints a
line at step 1 and every trainer.log_every steps, and during validation, before its first epoch line; and
validation is capped by trainer.max_eval_batches, by default as many batches as trainer.max_steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers import REPO, events, kill_group, only_run

SMALL = ["experiment=smoke", "workload.vocab_size=256", "launcher.nprocs=2", "trainer.batch_size=4"]


def piped_run(tmp_path, *overrides: str) -> tuple[str, dict]:
    """`python -m ptbench` with stdout into a file, as under sbatch or `> log`; (the log, the epoch event)."""
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ptbench", *SMALL, *overrides, f"results.root={tmp_path / 'r'}"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # a batch log's buffering
            start_new_session=True,
        )
        try:
            assert proc.wait(timeout=300) == 0, log.read_text()
        finally:
            kill_group(proc)
    return log.read_text(), events(only_run(tmp_path / "r"))[0]


def test_piped_run_logs_progress_before_its_first_epoch_ends(tmp_path):
    # 256 samples / global batch 8 = 32 steps, capped at 24; 256 validation samples = 32 batches per rank,
    # capped by default at trainer.max_steps = 24 batches of 4 on each of 2 ranks
    text, event = piped_run(
        tmp_path, "data.train_samples=256", "data.val_samples=256", "trainer.max_steps=24", "trainer.log_every=10"
    )
    lines = text.splitlines()
    epoch_line = next(i for i, line in enumerate(lines) if line.startswith("epoch 0:"))
    steps = [int(m[1]) for line in lines[:epoch_line] if (m := re.match(r"progress: epoch 0 step (\d+)/24 ", line))]
    assert steps == [1, 10, 20, 24], text
    batches = [
        int(m[1])
        for line in lines[:epoch_line]
        if (m := re.match(r"progress: epoch 0 validation batch (\d+)/24 ", line))
    ]
    assert batches == [1, 10, 20, 24], text
    assert event["steps"] == 24
    assert event["val_samples"] == 24 * 4 * 2  # the default cap: trainer.max_steps batches per rank
    assert "\r" not in text  # no tqdm bar in a file


def test_log_every_zero_is_silent_and_max_eval_batches_zero_validates_all(tmp_path):
    text, event = piped_run(
        tmp_path, "data.val_samples=96", "trainer.max_steps=2", "trainer.log_every=0", "trainer.max_eval_batches=0"
    )
    assert "progress:" not in text, text
    assert event["val_samples"] == 96  # 0: the whole validation set, whatever trainer.max_steps says
