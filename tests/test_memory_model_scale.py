"""The memory model against torch's memory trackers on the fake process group (`python -m ptbench.scale`), at points
small enough for the suite: what one tensor-parallel rank saves and torch's loss_parallel holds, FSDP2's padded unit
buffers in backward, BatchNorm kept whole, and the tracker's categories as compare.py reads them. The matrix at
64-1024 ranks is `make scale`."""

from __future__ import annotations

import dataclasses

import pytest

from ptbench.core import memory_model as mm
from ptbench.scale import compare


def _point(*overrides: str, world: int = 8) -> dict:
    from ptbench.scale.point import measure_point

    return measure_point(list(overrides), world, 0)


@pytest.mark.parametrize("adapter", ["tensor_parallel", "megatron"])
def test_one_tensor_parallel_rank_saves_what_its_local_block_saves(adapter):
    """TP 2 with attention dropout (the CPU's math attention keeps the s x s scores): torch TP, and Megatron's
    unfused local layer on a CPU, save what the harness block of one rank saves (`tp_local_block`, counted); torch's
    loss_parallel holds 16 s b V / t at its backward; Megatron's gradient buffer, which the tracker files under
    Activation, is its gradients."""
    p = _point(f"adapter={adapter}", "adapter.tensor_parallel=2", "workload=gpt2_tiny", "workload.dropout=0.1", world=8)
    parts = p["memory"]["parts"]
    assert p["tracker"]["at_peak"]["Activation"] > parts["saved_activations"]["tracker"]  # the buffer taken out
    if adapter == "tensor_parallel":
        for part in ("saved_activations", "total"):
            assert parts[part]["ratio"] == pytest.approx(1.0, abs=0.005), (part, parts[part])
    else:  # Megatron's attention keeps 2 s b h / t more per layer with dropout (its q, k, v layout)
        assert parts["saved_activations"]["ratio"] == pytest.approx(1.0, abs=0.03), parts["saved_activations"]
        assert parts["grads"]["ratio"] == pytest.approx(1.0, abs=0.01), parts["grads"]


def test_the_counted_block_of_one_rank_is_cut_by_columns_and_rows():
    import torch

    from ptbench.runner.compose import compose, typed
    from ptbench.workloads import build_workload

    cfg = typed(compose(["workload=gpt2_tiny"]))
    with torch.device("meta"):
        model = build_workload(cfg.workload, cfg.data).build_model()
    h = cfg.workload.n_embd
    block = mm.tp_local_block(model.blocks[0], 4)
    assert block.attn.c_attn.weight.shape == (3 * h // 4, h) and block.attn.c_proj.weight.shape == (h, h // 4)
    assert block.mlp.c_fc.weight.shape == (h, h) and block.mlp.c_proj.weight.shape == (h, h)
    assert model.blocks[0].attn.c_attn.weight.shape == (3 * h, h)  # a copy: the model is untouched
    whole, quarter = (mm.gpt2_saved_elements(model, cfg.workload.seq_len, tp=t) for t in (1, 4))
    assert quarter["tp"] == 4 and quarter["layer"] < whole["layer"]
    assert (quarter["embed"], quarter["head"]) == (whole["embed"], whole["head"])


@pytest.mark.parametrize("world", [8, 128])
def test_fsdp_backward_holds_the_padded_units_around_its_busiest(world):
    """ResNet-50 (widths / 8) under FSDP2: at the peak, in the backward of its busiest unit, the tracker holds that
    unit gathered, the next one prefetched and the previous one's reduce-scatter input, each padded to a multiple
    of W in dim 0 (at 128 ranks the 8-64 channel layers pad), beside the unit's gradients (Temp)."""
    p = _point("adapter=fsdp", "workload=resnet50_tiny", "trainer.batch_size=4", world=world)
    peak = p["tracker"]["at_peak"]
    held = sum(peak[c] for c in ("Unsharded Param", "All Gather", "Reduce Scatter", "Temp"))
    assert p["prediction"]["transient"] == pytest.approx(held, rel=0.03)
    # the model keeps every saved activation at that moment, where backward has freed the last units' already
    assert 1.0 <= p["memory"]["parts"]["total"]["ratio"] < 1.1


def test_fsdp_units_pad_per_tensor_and_batchnorm_kept_whole_is_replicated():
    """The model side of whole BatchNorm parameters (fsdp under bf16 keeps them out of sharding, all-reduced):
    whole on every rank in params, grads and optimizer state, and out of the units' gathered buffers."""
    import torch

    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = typed(compose(["adapter=fsdp", "workload=resnet50_tiny", "trainer.precision=bf16", "launcher.nprocs=8"]))
    plan = make_plan(cfg, "local", world_size=8, check=False)
    build = build_workload(cfg.workload, cfg.data).build_model
    with torch.device("meta"):
        model = build()
    facts = mm.run_facts(cfg.workload, plan.cost, model)
    norms = sum(mm.numel(facts.shapes[i]) for i in facts.norms)
    bn = [p for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()]
    assert norms == sum(p.numel() for p in bn) and len(facts.units) == 1 + 1 + 16 + 1  # conv1, bn1, blocks, fc

    assert plan.cost.whole_norm_params  # what the adapter states under bf16
    sharded_cost = dataclasses.replace(plan.cost, whole_norm_params=False)
    sharded = mm.predict_run(cfg, dataclasses.replace(plan, cost=sharded_cost), build, device="cpu")
    whole = mm.predict_run(cfg, plan, build, device="cpu")
    n = 8
    # rank 0 held a dim-0 chunk of each norm tensor (ceil(C / 8) rows, the busiest), now all of it
    chunk = sum(-(-mm.numel(facts.shapes[i]) // n) for i in facts.norms)
    assert whole["params"] - sharded["params"] == pytest.approx(4 * (norms - chunk))
    assert whole["optimizer"] - sharded["optimizer"] == pytest.approx(8 * (norms - chunk))
    assert whole["transient"] < sharded["transient"]  # the norms are not gathered with their units


def test_what_the_tracker_calls_activation_at_the_step_start_is_moved():
    """Memory allocated outside forward and backward that outlives them (the tracker's Activation when the
    optimizer step starts) is not an activation; it is the gradients where the gradient categories hold none."""
    prediction = {"grads": 100, "saved_activations": 900}
    start = {"Activation": 100, "Gradient": 0}
    tracked = {"step_start": start, "at_peak": {"Activation": 1000}, "peak_total": 2000}
    parts = compare.memory(prediction, tracked)["parts"]
    assert (parts["grads"]["tracker"], parts["saved_activations"]["tracker"]) == (100, 900)
    tracked["step_start"] = {**start, "Gradient": 40}  # a reduce bucket in .grad: the gradients stay the tracker's
    parts = compare.memory(prediction, tracked)["parts"]
    assert (parts["grads"]["tracker"], parts["saved_activations"]["tracker"]) == (40, 900)
