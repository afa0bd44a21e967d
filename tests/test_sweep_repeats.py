"""`python -m ptbench.sweep run --repeats N` (issue 29): interleaved order, the repeat index and the seed in
each record, one point id over repeats, and --resume counting repeats. Real runs."""

import json
import re
import sys

import yaml
from helpers import check_ok, run, run_dirs, summary


def _sweep(tmp_path, res, *args):
    return run(
        [sys.executable, "-m", "ptbench.sweep", "run", str(tmp_path / "sweep.txt"), "--no-comm", *args, "--",
         "experiment=smoke", "launcher.nprocs=1", f"results.root={res}"],
        timeout=600,
    )  # fmt: skip


def _records(res):
    out = []
    for d in run_dirs(res / "smoke"):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        out.append(
            (summary(d)["point"], cfg["results"]["repeat"], cfg["trainer"]["seed"], cfg["trainer"]["batch_size"])
        )
    return sorted(out)


def test_repeats_interleave_keep_the_point_and_resume_counts_them(tmp_path):
    (tmp_path / "sweep.txt").write_text("trainer.batch_size=2\ntrainer.batch_size=4\n")
    res = tmp_path / "res"
    out = _sweep(tmp_path, res, "--repeats", "2", "--vary-seed")
    check_ok(out)
    order = re.findall(r"^\[\d/4\] point (\w+) repeat (\d): trainer.batch_size=(\d)", out.stdout, re.M)
    assert [(r, b) for _, r, b in order] == [("0", "2"), ("0", "4"), ("1", "4"), ("1", "2")]  # AB BA: rotated
    assert "sweep order (rotated per round): 0 1; 1 0" in out.stdout
    written = json.loads(next(tmp_path.glob("sweep.txt.order-*.json")).read_text())
    assert [(r["round"], r["point"]) for r in written["order"]] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    recs = _records(res)
    assert len(recs) == 4
    by_batch = {b: [(p, r, s) for p, r, s, bb in recs if bb == b] for b in (2, 4)}
    for rows in by_batch.values():
        assert len({p for p, _, _ in rows}) == 1  # one point id over its repeats
        assert sorted((r, s) for _, r, s in rows) == [(0, 1234), (1, 1235)]  # the seed varies per repeat
    assert by_batch[2][0][0] != by_batch[4][0][0]

    again = _sweep(tmp_path, res, "--repeats", "3", "--vary-seed", "--resume")
    check_ok(again)
    assert again.stdout.count("already ok") == 4  # repeats 0 and 1 of both points kept
    assert len(_records(res)) == 6  # only repeat 2 of each ran
    assert sorted(r for _, r, _, _ in _records(res)) == [0, 0, 1, 1, 2, 2]


def test_submit_and_the_paper_plan_give_each_repeat_its_own_task(tmp_path):
    """`sweep submit --repeats N` and `ptbench.paper plan --repeats N`: one line (array task) per repeat, interleaved
    ABAB, each with its results.repeat; the statistical-efficiency repeats vary the seed under one point id."""
    import json

    from ptbench.runner.points import point_id, read_points
    from ptbench.runner.slurm import with_repeats

    (tmp_path / "sweep.txt").write_text("launcher.nprocs=1\nlauncher.nprocs=2\n")
    out = run(
        [sys.executable, "-m", "ptbench.sweep", "submit", str(tmp_path / "sweep.txt"), "--repeats", "2", "--dry-run",
         "--no-comm", "--", "experiment=smoke"],
        timeout=300,
    )  # fmt: skip
    check_ok(out)
    assert "submit: 4 array tasks (2 repeats)" in out.stdout
    arrays = [line for line in out.stdout.splitlines() if "--array=" in line]
    assert "--array=0,2 " in arrays[0] and "--ntasks-per-node=1" in arrays[0], out.stdout  # rank 1: tasks 0, 2
    assert "--array=1,3 " in arrays[1] and "--ntasks-per-node=2" in arrays[1], out.stdout
    assert all(f"{tmp_path / 'sweep.repeats2.txt'} " in a for a in arrays)
    assert not (tmp_path / "sweep.repeats2.txt").exists()  # a dry run writes nothing

    points = [["experiment=smoke", "launcher.nprocs=1"], ["experiment=smoke", "launcher.nprocs=2"]]
    rep = with_repeats(points, 2)
    assert [p[-1] for p in rep] == ["results.repeat=0"] * 2 + ["results.repeat=1"] * 2
    assert [p[1] for p in rep] == ["launcher.nprocs=1", "launcher.nprocs=2"] * 2
    seeded = with_repeats(points[:1], 3, vary_seed=True)
    assert [o for o in seeded[2] if o.startswith("trainer.seed=")] == ["trainer.seed=1236"]  # the default 1234 + 2
    pins = {o.split("=", 1)[1] for p in seeded[1:] for o in p if o.startswith("results.point=")}
    assert pins == {point_id(seeded[0])}  # every repeat recorded under repeat 0's point id

    plan = tmp_path / "plan"
    out = run(
        [sys.executable, "-m", "ptbench.paper", "plan", "--workloads", "gpt2_small", "--adapters", "ddp", "--gpus",
         "1,2", "--repeats", "2", "--out", str(plan)],
        timeout=300,
    )  # fmt: skip
    check_ok(out)
    epoch = read_points(plan / "epoch.txt")
    assert len(epoch) == 4 and [p[-1] for p in epoch] == ["results.repeat=0"] * 2 + ["results.repeat=1"] * 2
    assert json.loads((plan / "plan.json").read_text())["repeats"] == 2
    # memory points repeated too: the memory claims need an interval where bytes are not exact (CPU RSS)
    memory = read_points(plan / "memory.txt")
    assert len(memory) == 4 and [p[-1] for p in memory] == ["results.repeat=0"] * 2 + ["results.repeat=1"] * 2
