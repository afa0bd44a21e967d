"""The MFU cross-check: FLOPs counted by torch's FlopCounterMode (meta device) against the workloads'
formulas (ptbench.core.flops), and the summary's `flops_check` of a real run."""

from __future__ import annotations

import pytest
import yaml

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.flops import FLOPS_TOLERANCE, flops_check
from ptbench.workloads import build_workload
from tests.helpers import REPO, bench, only_run, summary


def workload(name: str, **over):
    c = yaml.safe_load((REPO / "conf" / "workload" / f"{name}.yaml").read_text())
    return build_workload(WorkloadConfig(**{**c, **over}), DataConfig())


@pytest.mark.parametrize("name", ["vgg16_tiny", "resnet50_tiny", "vgg16", "resnet50"])
def test_vision_counted_equals_formula_exactly(name):
    w = workload(name)
    counted = w.counted_flops()
    assert counted["forward"] == w.forward_flops_per_sample()
    assert counted["total"] == w.train_flops_per_sample()  # 3 x forward less the first conv's input gradient
    assert counted["backward"] < 2 * counted["forward"]  # the image's gradient is never computed


@pytest.mark.parametrize("name", ["gpt2_tiny", "gpt2_small"])
def test_gpt2_counted_equals_formula_full_attention(name):
    """The formula counts the full T x T attention (no causal discount), as FlopCounterMode does with
    SDPA's math form on the meta device: exact; the attention matmuls are a known part of the count."""
    w = workload(name)
    counted = w.counted_flops()
    assert counted["forward"] == w.forward_flops_per_sample()
    assert counted["total"] == w.train_flops_per_sample()
    c = w.gpt
    attention = 2 * 2 * c.n_layer * c.seq_len * c.seq_len * c.n_embd  # QK^T and AV, forward, per sample
    assert counted["by_op"]["aten.bmm"] / 2 == 3 * attention  # forward + backward, per batch of 2


def test_disagreement_over_tolerance_warns():
    ok = flops_check(100.0, 100.0 * (1 + FLOPS_TOLERANCE / 2))
    assert ok["warning"] is None and ok["ratio"] == pytest.approx(1 + FLOPS_TOLERANCE / 2)
    off = flops_check(100.0, 100.0 * (1 + 2 * FLOPS_TOLERANCE))
    assert "FlopCounterMode" in off["warning"] and "1.100" in off["warning"]


def test_run_summary_records_flops_check(tmp_path):
    proc = bench("experiment=smoke", "launcher.nprocs=1", results=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary(only_run(tmp_path))
    fc = s["flops_check"]
    assert fc["ratio"] == pytest.approx(1.0, abs=1e-9)
    assert fc["formula_train_flops_per_sample"] == s["plan"]["train_flops_per_sample"]
    assert not any("FlopCounterMode" in w for w in s["warnings"])
