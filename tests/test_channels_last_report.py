"""The report says what a vision run's memory layout did: a point run with and without workload.channels_last gets
its step-time ratio with its interval (contended runs left out, as in every verdict), and series compared in the
answers that ran in different layouts (ddp NHWC, fsdp NCHW weights / NHWC activations) get one line saying so, so
that a layout difference is not read as a framework difference. Real CPU runs of resnet50_tiny, one rank each."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from ptbench.analysis.report import write_report
from ptbench.analysis.stats import ratio_interval
from ptbench.analysis.tables import LAYOUTS
from tests.helpers import bench, check_ok, events, run_dirs, summary

pytestmark = pytest.mark.slow

VISION = [
    "workload=resnet50_tiny",
    "data=synthetic",
    "data.train_samples=64",
    "launcher.nprocs=1",
    "trainer.batch_size=4",
    "trainer.epochs=1",
    "trainer.max_steps=6",
    "trainer.untimed_steps=2",
    "trainer.eval_every_epoch=false",
    "trainer.progress=false",
]
RUNS = [("ddp", False, 0), ("ddp", False, 1), ("ddp", True, 0), ("ddp", True, 1), ("fsdp", True, 0), ("fsdp", False, 0)]
DDP, FSDP = "`ddp gb=4/replica`", "`fsdp gb=4/replica`"
NCHW, NHWC, MIXED = LAYOUTS[(False, False)], LAYOUTS[(True, True)], LAYOUTS[(True, False)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    for adapter, channels_last, repeat in RUNS:
        layout = f"workload.channels_last={str(channels_last).lower()}"
        check_ok(bench(*VISION, f"adapter={adapter}", layout, f"trainer.seed={repeat}", results=root))
    runs = {}
    for d in run_dirs(root):
        s = summary(d)
        # contention depends on whatever else shares this machine's cores now: cleared, so that each test
        # decides which run warns of it
        s["warnings"] = [w for w in s.get("warnings") or [] if not w.startswith("contention:")]
        (d / "summary.json").write_text(json.dumps(s))
        runs.setdefault((s["adapter"], s["data_pipeline"]["channels_last"]), []).append(d)
    return root, runs


def _copy(made, tmp_path, keep=None):
    root, runs = made
    dest = tmp_path / "results"
    for key, dirs in runs.items():
        for d in dirs if keep is None or key in keep else []:
            shutil.copytree(d, dest / d.relative_to(root))
    return dest


def _median_steps(dirs) -> list[float]:
    return [statistics.median(events(d)[-1]["step_times_s"]) for d in dirs]


def _answers(text: str, workload: str = "resnet50_tiny") -> list[str]:
    """The lines of one workload's block under "## Answers"."""
    block = text.split("## Answers")[1].split("\n## ")[0].split(f"### {workload}\n")[1].split("\n### ")[0]
    return block.splitlines()


def _layout_line(lines: list[str]) -> str:
    found = [ln for ln in lines if ln.startswith(f"- **Layout** {DDP} x1: {NHWC} / {NCHW}")]
    assert len(found) == 1, "\n".join(lines)
    return found[0]


def test_a_point_run_in_two_layouts_gets_its_step_time_ratio_and_interval(made, tmp_path):
    _, runs = made
    assert {summary(d)["data_pipeline"]["channels_last_weights"] for d in runs[("fsdp", True)]} == {False}
    text = write_report(_copy(made, tmp_path), tmp_path / "out").read_text()
    lines = _answers(text)
    line = _layout_line(lines)
    print(line)
    expected = ratio_interval(_median_steps(runs[("ddp", True)]), _median_steps(runs[("ddp", False)]))
    assert expected.finite
    assert f"median step time {expected.value:.3g} [{expected.lo:.3g}, {expected.hi:.3g}] (95 %" in line
    assert "n=2 vs 2" in line and "left out" not in line
    assert lines.index(line) < next(i for i, ln in enumerate(lines) if ln.startswith("- **Paper claims**"))
    assert (tmp_path / "out" / "layouts.csv").is_file()
    # fsdp's two layouts: NHWC activations over NCHW weights, one run each: a ratio without an interval
    fsdp = [ln for ln in lines if ln.startswith(f"- **Layout** {FSDP} x1: {MIXED} / {NCHW}")]
    assert len(fsdp) == 1 and "no interval: one repeat, n=1 vs 1" in fsdp[0], lines


def test_a_contended_run_is_left_out_of_the_layout_ratio_unless_asked(made, tmp_path):
    _, runs = made
    root = _copy(made, tmp_path)
    busy, quiet = sorted(runs[("ddp", True)])
    path = root / busy.relative_to(made[0]) / "summary.json"
    s = json.loads(path.read_text())
    s["warnings"] = ["contention: during the run other processes kept 1.6 CPU(s) busy: times are not comparable"]
    path.write_text(json.dumps(s))
    line = _layout_line(_answers(write_report(root, tmp_path / "out").read_text()))
    print(line)
    alone = ratio_interval(_median_steps([quiet]), _median_steps(runs[("ddp", False)]))
    assert (
        f"median step time {alone.value:.3g} (no interval: one repeat, n=1 vs 2); 1 contended run(s) left out" in line
    )
    kept = _layout_line(_answers(write_report(root, tmp_path / "kept", include_contended=True).read_text()))
    assert "n=2 vs 2" in kept and "left out" not in kept


def test_series_compared_in_different_layouts_are_said_to_differ(made, tmp_path):
    text = write_report(_copy(made, tmp_path, keep={("ddp", True), ("fsdp", True)}), tmp_path / "out").read_text()
    differ = [ln for ln in _answers(text) if ln.startswith("- **Layouts differ**")]
    assert len(differ) == 1, text
    print(differ[0])
    assert f"{DDP} {NHWC}" in differ[0] and f"{FSDP} {MIXED}" in differ[0]
    assert "not only the framework's" in differ[0] and "averages them" not in differ[0]
    assert text.count(differ[0]) == 2  # and beside the claims' "fastest framework" comparison
    # one series in two layouts: its runs are averaged in the answers, and the line says so
    mixed = write_report(_copy(made, tmp_path / "m"), tmp_path / "out_m").read_text()
    assert f"{DDP} {NCHW} + {NHWC}" in mixed and "averages them here" in mixed


def test_series_in_one_layout_get_no_layout_line(made, tmp_path):
    text = write_report(_copy(made, tmp_path, keep={("ddp", False), ("fsdp", False)}), tmp_path / "out").read_text()
    assert "### resnet50_tiny" in text
    assert "**Layout" not in text
