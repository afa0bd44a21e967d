"""`python -m ptbench.sweep run --repeats N` (issue 29): interleaved order, the repeat index and the seed in
each record, one point id over repeats, and --resume counting repeats. Real runs."""

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
    assert [(r, b) for _, r, b in order] == [("0", "2"), ("0", "4"), ("1", "2"), ("1", "4")]  # ABAB, not AABB
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
