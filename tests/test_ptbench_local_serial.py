"""`hydra/launcher=ptbench_local` runs timing points one at a time by default (points side by side share the
cores): hydra_plugins.ptbench_launcher.BenchLocalLauncher, `hydra.launcher.array_parallelism` (1)."""

import json
import sys

from tests.helpers import SMOKE, check_ok, run, run_dirs


def test_ptbench_local_runs_points_one_after_another(tmp_path):
    proc = run(
        [sys.executable, "-m", "ptbench", "-m", "hydra/launcher=ptbench_local", *SMOKE, "launcher.nprocs=1",
         "trainer.max_steps=2", "trainer.seed=1,2", f"results.root={tmp_path}"],
        timeout=600, env=None,
    )  # fmt: skip
    check_ok(proc)
    spans = []
    for d in run_dirs(tmp_path):
        s = json.loads((d / "summary.json").read_text())
        assert s["status"] == "ok"
        spans.append(((d / "config.yaml").stat().st_mtime, (d / "summary.json").stat().st_mtime))  # start, end
    assert len(spans) == 2
    (start_a, end_a), (start_b, end_b) = sorted(spans)
    assert end_a <= start_b, spans  # the second point's record began after the first one's was final
