"""The layout object and the adapters' cost inputs (ptbench.core.layout): validated once, stated by each
adapter, carried in the plan, and the only thing the cost models read (no adapter names there)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ptbench.adapters import available, get_adapter_class
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout

REPO = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    from ptbench.runner.compose import compose, typed

    return typed(compose(["workload=gpt2_tiny", *overrides]))


def test_layout_invariant_and_record_form():
    assert Layout(world_size=4, dp=2, tp=2).devices == 4
    gpipe = Layout(world_size=1, dp=1, pp=4, devices_per_process=4, microbatches=16)  # one process, 4 devices
    assert gpipe.as_dict() == {
        "world_size": 1,
        "dp": 1,
        "tp": 1,
        "pp": 4,
        "devices_per_process": 4,
        "microbatches": 16,
        "devices": 4,
    }
    json.dumps(gpipe.as_dict())
    with pytest.raises(ConfigError, match=r"^layout: dp=2 x tp=2 x pp=1 = 4 does not equal the 6 device\(s\)"):
        Layout(world_size=6, dp=2, tp=2)
    with pytest.raises(ConfigError, match="layout: pp=0 must be an integer >= 1"):
        Layout(world_size=2, dp=2, pp=0)
    for bad in (dict(sharding="zero"), dict(schedule="looped"), dict(recompute="sometimes")):
        with pytest.raises(ConfigError, match="cost inputs: .* is not one of"):
            CostInputs(**bad)


@pytest.mark.parametrize(
    "overrides, world, want",
    [
        (["adapter=ddp"], 2, dict(dp=2, tp=1, pp=1, devices_per_process=1, microbatches=1)),
        (["adapter=zero3"], 4, dict(dp=4, tp=1, pp=1, devices_per_process=1, microbatches=1)),
        (["adapter=tensor_parallel", "adapter.tensor_parallel=2"], 4, dict(dp=2, tp=2, pp=1, microbatches=1)),
        (
            ["adapter=megatron", "adapter.tensor_parallel=2", "adapter.pipeline_parallel=2"],
            8,
            dict(dp=2, tp=2, pp=2, microbatches=8),
        ),
        (["adapter=pipeline", "adapter.pipeline_parallel=2"], 4, dict(dp=2, pp=2, microbatches=8)),
        (["adapter=pipeline", "adapter.microbatches=4"], 2, dict(dp=1, pp=2, microbatches=4)),
        (["adapter=gpipe", "adapter.pipeline_parallel=3"], 1, dict(dp=1, pp=3, devices_per_process=3, microbatches=12)),
    ],
)
def test_each_adapter_states_its_layout(overrides, world, want):
    cfg = _cfg(*overrides)
    layout = get_adapter_class(cfg.adapter.name).layout(cfg, world)
    assert {k: getattr(layout, k) for k in want} == want
    assert layout.dp * layout.tp * layout.pp == layout.devices == world * layout.devices_per_process


def test_a_layout_that_cannot_split_is_one_line():
    cfg = _cfg("adapter=megatron", "adapter.tensor_parallel=2", "adapter.pipeline_parallel=2")
    with pytest.raises(ConfigError, match="layout: dp=1 x tp=2 x pp=2 = 4 does not equal the 6 device"):
        get_adapter_class("megatron").layout(cfg, 6)


def test_cost_inputs_state_what_the_models_read():
    from ptbench.adapters.megatron import padded_vocab_size

    assert get_adapter_class("ddp").cost_inputs(_cfg("adapter=ddp")) == CostInputs()
    for stage in (0, 1, 2, 3):
        c = get_adapter_class("zero").cost_inputs(_cfg("adapter=zero", f"adapter.stage={stage}"))
        assert c.sharding == f"zero{stage}" and c.half_states
    fsdp = get_adapter_class("fsdp").cost_inputs(_cfg("adapter=fsdp", "adapter.reshard_after_forward=false"))
    assert (fsdp.sharding, fsdp.half_states, fsdp.half_gather, fsdp.reshard_after_forward) == (
        "fsdp",
        False,
        True,
        False,
    )
    hv = get_adapter_class("horovod").cost_inputs(_cfg("adapter=horovod", "adapter.fusion_threshold_mb=64"))
    assert hv.fusion_buffer_bytes == 64 * 2**20 and hv.grad_sync_phase == "optimizer"
    # Megatron's vocabulary padding: stated once, by its adapter (a multiple of 128 x TP)
    cfg = _cfg("adapter=megatron", "adapter.tensor_parallel=2", "workload.vocab_size=1000")
    mc = get_adapter_class("megatron").cost_inputs(cfg)
    assert mc.padded_vocab == padded_vocab_size(1000, 2, 128) == 1024 and mc.sharding == "distributed_optimizer"
    assert get_adapter_class("megatron").cost_inputs(_cfg("adapter=megatron", "optimizer=lamb")).sharding == "none"
    gp = get_adapter_class("gpipe").cost_inputs(_cfg("adapter=gpipe", "adapter.checkpoint=always"))
    assert (gp.schedule, gp.recompute) == ("gpipe", "always")
    pipe = get_adapter_class("pipeline").cost_inputs(_cfg("adapter=pipeline", "adapter.schedule=interleaved_1f1b"))
    assert (pipe.schedule, pipe.step_phase) == ("interleaved_1f1b", "forward_backward")


def test_the_plan_carries_layout_and_cost_and_records_them():
    from ptbench.runner.plan import make_plan

    cfg = _cfg("adapter=megatron", "adapter.tensor_parallel=2", "launcher.nprocs=2", "trainer.batch_size=4")
    plan = make_plan(cfg, "local", check=False)
    assert (plan.world_size, plan.dp_size, plan.devices, plan.microbatches, plan.devices_per_process) == (2, 1, 2, 1, 1)
    assert plan.global_batch == plan.local_batch * plan.grad_accum * plan.layout.dp
    d = plan.describe()
    json.dumps(d)
    assert d["layout"] == plan.layout.as_dict() and d["layout"]["tp"] == 2
    assert d["cost"]["padded_vocab"] == plan.cost.padded_vocab > 0
    assert (d["world_size"], d["dp_size"], d["devices"]) == (2, 1, 2)  # the plan's own names still read


def test_base_validate_always_runs_and_refusals_are_methods():
    cfg = _cfg("adapter=megatron", "workload=resnet50_tiny")
    with pytest.raises(ConfigError, match="adapter=megatron does not support vision workloads"):
        get_adapter_class("megatron").validate(cfg, 2)  # the base's check, before megatron's own
    for name in available():
        cls = get_adapter_class(name)
        assert "validate" not in vars(cls) or name == "base", f"{name} overrides validate; override check instead"
        for attr in ("checkpoint_unsupported", "compile_unsupported"):
            assert not hasattr(cls, attr), f"{name}.{attr}: use checkpoint_refusal / compile_refusal"
    refuses = get_adapter_class("tensor_parallel").compile_refusal(_cfg("adapter=tensor_parallel"))
    assert refuses and get_adapter_class("ddp").compile_refusal(_cfg("adapter=ddp")) is None


def _code_strings(path: Path) -> set[str]:
    """String constants of a module that are not docstrings (what code compares against)."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


@pytest.mark.parametrize(
    "module",
    [
        *(str(p.relative_to(REPO)) for p in sorted((REPO / "bench/core/memory_model").glob("*.py"))),
        *(str(p.relative_to(REPO)) for p in sorted((REPO / "bench/core/comm_volume").glob("*.py"))),
        "bench/runner/plan.py",
    ],
)
def test_cost_models_name_no_adapter(module):
    """Adding an adapter touches its own file, schema and YAML: the models compare against no adapter name."""
    from ptbench.core.layout import RECOMPUTE, SCHEDULES, SHARDING

    vocabulary = {*SHARDING, *SCHEDULES, *RECOMPUTE}  # cost-input values ("fsdp" sharding, "gpipe" schedule)
    named = {s for s in _code_strings(REPO / module) if s in set(available()) - vocabulary}
    assert not named, f"{module} compares against adapter names {sorted(named)}: read plan.layout / plan.cost"
