"""The memory model as a package: the model's facts counted once per launch and carried on the plan (the comm
volume reads them too), predict composing grouped inputs, and every adapter-specific input coming through the
plan's layout and cost inputs, never the adapter's config."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ptbench.core import memory_model as mm
from ptbench.core.layout import CostInputs, Layout

REPO = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    from ptbench.runner.compose import compose, typed

    return typed(compose(["workload=gpt2_tiny", "trainer.batch_size=4", *overrides]))


def _counting(monkeypatch, module, name: str) -> list:
    """Wrap the real `module.name` so that its calls are counted (it still runs)."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_launch_counts_the_model_once_for_both_predictions(monkeypatch):
    from ptbench.core.memory_model import facts, run
    from ptbench.runner.plan import plan_run

    counted_facts = _counting(monkeypatch, facts, "model_facts")
    counted_gpt2 = _counting(monkeypatch, run, "gpt2_saved_elements")
    cfg = _cfg("adapter=megatron", "adapter.tensor_parallel=2", "launcher.nprocs=2")
    plan, pred = plan_run(cfg, "local", check=False, refuse=False, backend="gloo")
    # Megatron builds its own GPT-2, whose unfused layer on a CPU saves what the harness block of one TP rank saves
    assert (len(counted_facts), len(counted_gpt2)) == (1, 1)
    assert pred["inputs"]["layer_saved_elements"]["tp"] == 2
    cfg = _cfg("adapter=ddp", "launcher.nprocs=2")
    plan, pred = plan_run(cfg, "local", check=False, refuse=False, backend="gloo")
    assert (len(counted_facts), len(counted_gpt2)) == (2, 2)  # one more launch: once each
    w = cfg.workload
    assert (plan.facts.layers, plan.facts.hidden, plan.facts.seq_len) == (w.n_layer, w.n_embd, w.seq_len)
    assert pred["inputs"]["params"] == plan.facts.params == plan.comm_volume["params_per_rank"]
    json.dumps(plan.describe())  # the facts stay out of the record's plan


def test_megatron_facts_hold_its_padded_vocabulary():
    from ptbench.core.comm_volume import volume_run
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = _cfg("adapter=megatron", "adapter.pipeline_parallel=2", "launcher.nprocs=2", "workload.vocab_size=1000")
    plan = make_plan(cfg, "local", check=False)
    build = build_workload(cfg.workload, cfg.data).build_model
    import torch

    with torch.device("meta"):
        facts = mm.run_facts(cfg.workload, plan.cost, build())
    assert facts.vocab == plan.cost.padded_vocab == 1024
    assert facts.params == sum(p.numel() for p in build().parameters()) + 24 * cfg.workload.n_embd
    vol = volume_run(cfg, plan, build)
    assert vol["params_per_rank"] < facts.params  # a stage's share of the padded count
    assert mm.predict_run(cfg, plan, build, device="cpu")["inputs"]["vocab"] == 1024


def test_predict_composes_the_grouped_inputs_as_the_keyword_form():
    shapes = [(1000, 64), (64,), (64, 256), (256,)]
    kw = dict(params=sum(mm.numel(s) for s in shapes), world_size=4, precision="bf16", device="cpu")
    flat = mm.predict("zero3", shapes=shapes, zero3_settings={"param_persistence_threshold": 100}, **kw)
    grouped = mm.compose(
        mm.Inputs(
            layout=Layout(world_size=4, dp=4),
            cost=CostInputs(
                sharding="zero3", half_states=True, schedule="1f1b", param_persistence_threshold=100,
                prefetch_bucket_size=50_000_000, live_params_limit=1_000_000_000,
            ),
            model=mm.ModelFacts(params=kw["params"], shapes=shapes),
            training=mm.Training(precision="bf16", device="cpu"),
        )
    )  # fmt: skip
    assert grouped == flat and "64 persistent elements" in flat["formula"]["params"]
    with pytest.raises(TypeError, match="unexpected keyword argument.*stages"):
        mm.predict("none", params=1, world_size=1, stages=2)


@pytest.mark.parametrize("threshold, persistent", [(100_000, True), (0, False)])
def test_stage3_rules_come_from_the_adapters_cost_inputs(threshold, persistent):
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = _cfg("adapter=zero3", "launcher.nprocs=2", f"adapter.param_persistence_threshold={threshold}")
    plan = make_plan(cfg, "local", check=False)
    assert (plan.cost.param_persistence_threshold, plan.cost.prefetch_bucket_size) == (
        threshold,
        cfg.adapter.allgather_bucket_size,
    )
    pred = mm.predict_run(cfg, plan, build_workload(cfg.workload, cfg.data).build_model, device="cpu")
    assert pred["inputs"]["zero3_settings"]["param_persistence_threshold"] == threshold
    assert ("(0 persistent elements" not in pred["formula"]["params"]) is persistent


def test_the_model_reads_no_adapter_config():
    """Adapter-specific inputs come through plan.layout / plan.cost: no `cfg.adapter` in the package."""
    for path in sorted((REPO / "bench/core/memory_model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "adapter" and getattr(node.value, "id", "") == "cfg":
                pytest.fail(f"{path.name}:{node.lineno} reads cfg.adapter: state it in the adapter's cost_inputs")


def _whole_forward_saved_bytes(cfg) -> float:
    """What the whole harness GPT-2 forward (embeddings, every block, head; the loss aside) saves on CUDA under
    bf16 autocast, counted at once on fake "cuda" tensors: the sum the model composes from one block."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ptbench.core.memory import SavedTensorLedger
    from ptbench.core.memory_model.counting import _cuda_autocast, _flash_attention
    from ptbench.workloads import build_workload

    b, s = cfg.trainer.batch_size, cfg.workload.seq_len
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        model = build_workload(cfg.workload, cfg.data).build_model()
        idx = torch.zeros((b, s), dtype=torch.int64, device="cuda")
        with _cuda_autocast(torch.bfloat16), _flash_attention(), torch.enable_grad():
            with SavedTensorLedger([model]) as ledger:
                model(idx)
                return ledger.total


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_cuda_autocast_activations_are_counted_in_bytes(dropout):
    """On CUDA under bf16 autocast LayerNorm saves fp32, each linear a bf16 copy of its weight, dropout a 1-byte
    mask: the model counts a block that way (fake "cuda" tensors) instead of halving a CPU fp32 count, which
    was 8.5-20 % under. Measured (2026-12-02, gpt2_small, batch 8): one block 242.0 MiB counted, the halved CPU
    count 216.1 MiB at dropout 0.1; 230.0 vs 192.3 at 0."""
    from ptbench.core.memory_model.activations import loss_bytes
    from ptbench.core.memory_model.run import predict_run
    from ptbench.runner.plan import plan_run
    from ptbench.workloads import build_workload

    cfg = _cfg("workload=gpt2_small", "trainer.batch_size=8", "trainer.precision=bf16", f"workload.dropout={dropout}")
    plan, _ = plan_run(cfg, "local", check=False, refuse=False, backend="gloo")
    build = build_workload(cfg.workload, cfg.data).build_model
    pred = predict_run(cfg, plan, build, device="cuda")
    # the loss aside: on CUDA F.cross_entropy saves its fp32 log-softmax of the logits
    loss_saved = loss_bytes(8 * cfg.workload.seq_len, cfg.workload.vocab_size, False, 2)[1]
    saved_model = pred["saved_activations"] - loss_saved
    counted = _whole_forward_saved_bytes(cfg)
    assert saved_model == pytest.approx(counted, rel=0.01), (saved_model / 2**30, counted / 2**30)
    assert pred["inputs"]["layer_saved_elements"]["unit"] == "bytes"
    cpu = predict_run(cfg, plan, build, device="cpu")
    assert "unit" not in cpu["inputs"]["layer_saved_elements"]  # a CPU run: fp32 elements, as measured there
