"""Learning-rate schedules (bench/core/schedule.py, conf/lr_schedule/): each curve against hand-computed
values; DDP (2 ranks, stopped and resumed) and ZeRO-2 (DeepSpeed's wrapped optimizer) record the
expected lr of every step; the presets name the schedules of their references; bad values are refused."""

from __future__ import annotations

import math

import pytest
import torch

from ptbench.core.errors import ConfigError
from ptbench.core.schedule import Schedule, lr_factor
from ptbench.runner.checks import check_config
from ptbench.runner.compose import compose
from tests.helpers import bench, check_ok, events, only_run, summary


def curve(overrides: list[str], steps: int, steps_per_epoch: int, total: int) -> list[float]:
    """The lr of `steps` optimizer steps as a real LambdaLR sets it on a torch SGD (lr 1)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = Schedule(compose(overrides).lr_schedule, opt, steps_per_epoch, total)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.lr())
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "overrides, spe, total, expected",
    [
        (["lr_schedule=constant"], 3, 6, [1.0] * 6),
        # x0.1 every 2 epochs of 3 steps: changes after steps 6 and 12
        (["lr_schedule=step", "lr_schedule.step_size=2"], 3, 14, [1.0] * 6 + [0.1] * 6 + [0.01] * 2),
        # warm-up 2 steps ((k+1)/2), then (1 - (k-2)/4)^2 up to step 6, then end_factor 0
        (
            ["lr_schedule=warmup_poly", "lr_schedule.unit=step", "lr_schedule.warmup=2", "lr_schedule.total=6"],
            1,
            99,
            [0.5, 1.0, 1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0],
        ),
        # warm-up 1 epoch = 2 steps, cosine over the run's 6 steps to 0.1: 0.1 + 0.9 (1 + cos(pi p)) / 2
        (
            [
                "lr_schedule=warmup_cosine",
                "lr_schedule.unit=epoch",
                "lr_schedule.warmup=1",
                "lr_schedule.end_factor=0.1",
            ],
            2,
            6,
            [0.5, 1.0, 1.0, 0.868198, 0.55, 0.231802],
        ),
    ],
)
def test_each_curve_against_hand_computed_values(overrides, spe, total, expected):
    assert curve(overrides, len(expected), spe, total) == pytest.approx(expected, abs=1e-6)


def test_presets_follow_their_references():
    s = compose(["experiment=paper_vision"]).lr_schedule  # torchvision: x0.1 every 30 epochs
    assert (s.name, s.unit, s.step_size, s.gamma) == ("step", "epoch", 30, 0.1)
    assert [lr_factor(s, k, 100, 9000) for k in (2999, 3000, 6000)] == pytest.approx([1, 0.1, 0.01])
    s = compose(["experiment=paper_vision_mlperf"]).lr_schedule  # MLPerf: 5 warm-up epochs, poly power 2 to 1e-4
    assert (s.name, s.warmup, s.power) == ("warmup_poly", 5, 2.0)
    assert 5.0 * lr_factor(s, 10**6, 100, 9000) == pytest.approx(1e-4)
    for preset in ("paper_language", "paper_language_small"):  # Table III names none
        assert compose([f"experiment={preset}"]).lr_schedule.name == "constant"
    assert compose([]).lr_schedule.name == "constant"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lr_schedule.unit=epochs"], "lr_schedule.unit=epochs"),
        (["lr_schedule=warmup_poly", "lr_schedule.warmup=3", "lr_schedule.total=2"], "lr_schedule.total=2 must exceed"),
        (["lr_schedule=step", "lr_schedule.gamma=0"], "lr_schedule=step needs"),
    ],
)
def test_bad_schedules_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(compose(overrides))


TINY = ["experiment=smoke", "workload.vocab_size=256", "trainer.progress=false"]
COSINE = ["lr_schedule=warmup_cosine", "lr_schedule.unit=step", "lr_schedule.warmup=2", "lr_schedule.end_factor=0"]
# lr 1e-3 x: warm-up (k+1)/2, then (1 + cos(pi (k-2)/6)) / 2 over the run's 8 steps
COSINE_LRS = [1e-3 * f for f in (0.5, 1.0, 1.0, 0.933013, 0.75, 0.5, 0.25, 0.066987)]


def test_ddp_resumed_run_continues_the_schedule(tmp_path):
    """2 ranks, 8 steps, stopped after step 3 and resumed: the record's lr per step is the whole curve."""
    command = [
        *TINY,
        "data.train_samples=64",
        "trainer.max_steps=0",
        "trainer.stop_check_every=1",
        "trainer.resume=auto",
        "trainer.inject_stop=0:3",
        *COSINE,
    ]
    check_ok(bench(*command, results=tmp_path))
    assert summary(only_run(tmp_path))["status"] == "preempted"
    second = bench(*command, results=tmp_path)
    check_ok(second)
    run = only_run(tmp_path)
    s, evs = summary(run), events(run)
    assert s["status"] == "ok" and s["resumed_from"][0]["step"] == 3, s
    assert evs[0]["lrs"] == pytest.approx(COSINE_LRS, rel=1e-5)
    assert evs[0]["lr_epoch_start"] == pytest.approx(5e-4)


def test_zero_steps_deepspeeds_optimizer_on_the_schedule(tmp_path):
    """ZeRO-2 (DeepSpeed's flat-partition wrapper): x0.5 per epoch of 4 steps, 2 epochs."""
    check_ok(
        bench(
            *TINY,
            "adapter=zero2",
            "launcher.nprocs=1",
            "trainer.epochs=2",
            "lr_schedule=step",
            "lr_schedule.step_size=1",
            "lr_schedule.gamma=0.5",
            results=tmp_path,
        )
    )
    evs = events(only_run(tmp_path))
    assert [lr for e in evs for lr in e["lrs"]] == pytest.approx([1e-3] * 4 + [5e-4] * 4)
    assert not math.isnan(evs[-1]["train_loss"])


def test_a_schedule_is_part_of_the_point_and_the_default_keeps_old_ids():
    from ptbench.runner.points import point_id

    assert point_id([]) == point_id(["lr_schedule=constant", "lr_schedule.gamma=0.5"])  # constant: no schedule settings
    assert point_id(["lr_schedule=step"]) != point_id([]) != point_id(["lr_schedule=warmup_cosine"])
