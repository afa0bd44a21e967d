"""ptbench.core.comm_volume reads the run plan's layout and cost objects whole (the keyword form gives the same
numbers, and a layout that does not add up is refused once, by the layout); FSDP2 with bf16 keeps ResNet's
BatchNorm parameters out of sharding and all-reduces their gradients, as the fake process group's ledger shows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ptbench.core.comm_volume import Activation, ElementBytes, Inputs, compose, corrected, record_fields, volume
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout

# ResNet-50's 53 BatchNorms, channels: the stem 64; per stage, each bottleneck's three norms and one downsample norm
RESNET50_NORM_CHANNELS = 64 + (3 * 384 + 256) + (4 * 768 + 512) + (6 * 1536 + 1024) + (3 * 3072 + 2048)


def test_compose_takes_the_layout_and_cost_objects_and_the_keyword_form_agrees():
    lay = Layout(world_size=8, dp=2, tp=2, pp=2, microbatches=4)
    act = Activation(layers=24, hidden=1024, seq_len=512, micro_batch=4)
    inp = Inputs(lay, CostInputs(sharding="none"), params=350_000_000, act=act, elem=ElementBytes(2, 2, 2))
    vol = compose(inp)
    message = 4 * 512 * 1024 * 2  # b*s*h in bf16
    # [Megatron]: 4 all-reduces per layer of the 12 on a stage, per micro-batch, 2(t-1)/t = 1 at t = 2
    assert vol["bytes"]["tp_activation_all_reduce"] == 4 * 12 * 4 * message
    assert vol["bytes"]["dp_grad_all_reduce"] == 350e6 / 4 * 2  # 2(2-1)/2 x Psi/(t p) x B
    assert vol["bytes"]["pp_activation_send"] == 4 * message
    keywords = volume(
        "none",
        params=350_000_000,
        world_size=8,
        tp=2,
        pp=2,
        microbatches=4,
        layers=24,
        hidden=1024,
        seq_len=512,
        micro_batch=4,
        bytes_per_elem=2,
    )
    assert keywords == vol


def test_a_layout_that_does_not_add_up_is_refused_by_the_layout_in_one_line():
    with pytest.raises(ConfigError, match="does not equal the 6 device") as e:
        volume("none", params=1, world_size=6, tp=4, layers=2, hidden=8, seq_len=8, micro_batch=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        volume("none", params=1, world_size=2, sequence_parallel=True)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        volume("none", params=1, world_size=2, hidden_size=8)


def _fsdp_resnet50(precision: str) -> dict:
    from ptbench.core.comm_volume import volume_run
    from ptbench.runner.compose import compose as compose_cfg
    from ptbench.runner.compose import typed
    from ptbench.runner.plan import make_plan, meta_model
    from ptbench.workloads import build_workload

    cfg = typed(compose_cfg(["adapter=fsdp", "workload=resnet50", f"trainer.precision={precision}"]))
    plan = make_plan(cfg, "local", world_size=8, check=False)
    model = meta_model(build_workload(cfg.workload, cfg.data))
    return volume_run(cfg, plan, lambda: model)


def test_fsdp_bf16_all_reduces_the_batchnorm_gradients_and_gathers_the_rest():
    norm = 2 * RESNET50_NORM_CHANNELS  # a weight and a bias per channel
    assert norm == 53_120
    bf16, fp32 = _fsdp_resnet50("bf16"), _fsdp_resnet50("fp32")
    items = {it["name"]: it for it in bf16["collectives"]}
    assert items["dp_norm_grad_all_reduce"]["message_bytes"] == norm * 4  # fp32 gradients, whole tensors
    assert items["dp_norm_grad_all_reduce"]["bytes"] == pytest.approx(2 * 7 / 8 * norm * 4)
    # the gradients reduce-scattered in fp32 either way: bf16's lack exactly the norms' elements
    plain = {it["name"]: it for it in fp32["collectives"]}
    rs = plain["dp_grad_reduce_scatter"]["message_bytes"] - items["dp_grad_reduce_scatter"]["message_bytes"]
    assert rs == norm * 4
    assert "dp_norm_grad_all_reduce" not in plain and any("BatchNorm" in n for n in bf16["notes"])


def test_fsdp_bf16_vision_dry_run_ledger_equals_the_formula_per_collective():
    from ptbench.scale.point import measure_point

    p = measure_point(
        ["adapter=fsdp", "workload=resnet50_tiny", "trainer.precision=bf16", "trainer.batch_size=2"], 8, 0
    )
    by_op = p["comm"]["by_op"]
    assert by_op["all_reduce"]["count"] == 1  # the norms' one flattened all-reduce per step
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert by_op[op]["ratio"] == pytest.approx(1.0, abs=0.001), (op, by_op[op])


def test_a_pipeline_stage_counts_its_own_sends_and_the_default_is_the_busiest():
    # Narayanan et al. 2021: per micro-batch the first stage sends its output activation, the last its input
    # gradient, an inner stage both; a dry run at one rank compares its own stage, the record the busiest
    act = dict(layers=12, hidden=768, seq_len=1024, micro_batch=1)
    send = 8 * 1024 * 768 * 4  # m x b*s*h x 4 bytes
    sends = {
        stage: volume("none", params=1000, world_size=8, pp=8, microbatches=8, stage=stage, **act)["bytes"]
        for stage in (None, "first", "inner", "last")
    }
    assert sends["first"] == {"pp_activation_send": send}
    assert sends["last"] == {"pp_gradient_send": send}
    assert sends["inner"] == sends[None] == {"pp_activation_send": send, "pp_gradient_send": send}
    # the tied embedding's gradient all-reduce joins the first and the last stage only
    fields = record_fields(volume("none", params=1000, world_size=8, pp=8, microbatches=8, **act))
    cost, wl = CostInputs(tied_embedding_stages=True), SimpleNamespace(kind="language", n_embd=768, vocab_size=50257)
    tied = {s: corrected(fields, cost, wl, stage=s)["by_op"].get("all_reduce") for s in ("first", "inner", "last")}
    assert tied == {"first": 50257 * 768 * 4, "inner": None, "last": 50257 * 768 * 4}
    # the data-parallel all-reduce carries the stage's own parameters when they are known, else Psi/p
    dp = {
        held: volume("none", params=8000, world_size=16, pp=8, stage="first", stage_params=held, **act)["bytes"]
        for held in (None, 3000)
    }
    assert dp[None]["dp_grad_all_reduce"] == 8000 / 8 * 4 and dp[3000]["dp_grad_all_reduce"] == 3000 * 4
    with pytest.raises(ValueError, match="unknown pipeline stage 'middle'"):
        volume("none", params=1000, world_size=8, pp=8, stage="middle", **act)
    with pytest.raises(ValueError, match="pp=2 has no inner stage"):
        volume("none", params=1000, world_size=2, pp=2, stage="inner", **act)
