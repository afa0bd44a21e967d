"""The comm volume for one run: its inputs from a composed config and its run plan (`volume_run`, the runner's
and the dry run's entry point: the plan's layout and cost objects passed whole) and the volume as the record's
`comm_volume` field (`record_fields`)."""

from __future__ import annotations

import math

from ptbench.core.comm_volume.fsdp import fsdp_padded, norm_grad_all_reduce, norm_shapes, without
from ptbench.core.comm_volume.inputs import Activation, ElementBytes, Inputs
from ptbench.core.comm_volume.items import by_op, retotal
from ptbench.core.comm_volume.megatron import vocab_parallel
from ptbench.core.comm_volume.papers import compose

MODEL = "bench/core/comm_volume"  # what the records name as the model (its reference: README.md there)


def volume_run(cfg, plan, build_model, root_shapes=None, stage=None, stage_params=None) -> dict:
    """`compose` for a composed config (`BenchConfig`) and its run plan (`RunPlan`): the plan's layout and the
    adapter's cost inputs whole, the parameter count and dimensions of the model's facts the plan carries
    (`plan.facts`, counted once per launch, a padded vocabulary included; counted here from `build_model`, a
    no-argument callable returning the workload's model, when the plan has none), the micro-batch as the memory
    model's. FSDP2 (sharding fsdp, the plan's parameter shapes known): each parameter's dim 0 padded to a multiple
    of N, `root_shapes` (the root unit's parameter shapes, kept gathered from forward to backward; None: not
    known here) left out of the backward re-gather, and under bf16/fp16 the BatchNorm parameters kept whole and
    all-reduced (`fsdp`). `stage` (pp > 1): the pipeline stage whose sends are counted, first, inner or last;
    None, the run record's: the busiest (`Inputs.stage`); `stage_params`: the parameter elements that stage
    holds, what its data-parallel gradient sync carries (None: Ψ/p)."""
    layout, cost = plan.layout, plan.cost
    facts = getattr(plan, "facts", None) or _facts(cfg, cost, build_model)
    accum = int(cfg.trainer.grad_accum)
    language = cfg.workload.kind == "language"
    act = None
    if language and (layout.tp > 1 or layout.pp > 1):
        micro = math.ceil(plan.local_batch / layout.microbatches)  # as the memory model's
        act = Activation(layers=facts.layers, hidden=facts.hidden, seq_len=facts.seq_len, micro_batch=micro)
    inp = Inputs(
        layout=layout,
        cost=cost,
        params=int(facts.params),
        act=act,
        elem=ElementBytes.of(cfg.trainer.precision, cost),
        grad_accum=accum,
        label=cfg.adapter.name,
        stage=stage,
        stage_params=stage_params,
    )
    vol = compose(inp)
    notes = _notes(inp, language)
    if layout.tp > 1 and language and not cost.vocab_parallel_loss and not cost.sequence_parallel:
        notes += _vocab_parallel_items(vol, cfg.workload)
    if cost.sharding == "fsdp" and facts.shapes and layout.tp == layout.pp == 1:
        notes += _fsdp(vol, cost.whole_norm_params, facts.shapes, root_shapes, build_model)
    vol["notes"] = notes
    return vol


def _facts(cfg, cost, build_model):
    import torch

    from ptbench.core.memory_model import run_facts

    with torch.device("meta"):
        return run_facts(cfg.workload, cost, build_model())


def _notes(inp: Inputs, language: bool) -> list[str]:
    lay, notes = inp.layout, []
    if inp.grad_accum > 1 and inp.cost.sharding in ("zero0", "zero1", "zero2", "zero3", "fsdp"):
        notes.append(
            f"trainer.grad_accum={inp.grad_accum}: parameter gathers (and DeepSpeed's gradient reductions) repeat "
            "per micro-batch; counted once here"
        )
    if lay.devices_per_process > 1 and lay.pp > 1:
        notes.append("stages in one process: stage-to-stage traffic is device-to-device copies, not a collective")
    if not language and lay.pp > 1:
        notes.append(
            "vision pipeline: stage-to-stage activations are not modelled (no b x s x h); data-parallel traffic only"
        )
    return notes


def _fsdp(vol: dict, whole_norms: bool, shapes, root_shapes, build_model) -> list[str]:
    """FSDP2's padding and root unit, and the BatchNorm parameters the adapter keeps out of sharding (bf16/fp16)."""
    norms = []
    if whole_norms:
        import torch

        with torch.device("meta"):
            norms = norm_shapes(build_model())
    sharded = without(shapes, norms)
    root = None if root_shapes is None else without(root_shapes, norms)
    return fsdp_padded(vol, sharded, root) + norm_grad_all_reduce(vol, norms)


def _vocab_parallel_items(vol: dict, workload) -> list[str]:
    """torch tensor parallelism on the harness GPT-2 (a vocabulary-sharded embedding, the tied head
    column-parallel, loss_parallel): the embedding all-reduces its output, the head's input gradient is
    all-reduced, and the loss all-reduces 3 fp32 b x s tensors per micro-batch, as Megatron's vocab-parallel
    layers without sequence parallelism. Appended to `vol` in place."""
    item = next((it for it in vol["collectives"] if it["name"] == "tp_activation_all_reduce"), None)
    if item is None:
        return []
    notes: list[str] = []
    vol["collectives"] += vocab_parallel(item, vol, workload, False, notes)
    retotal(vol)
    return [n.replace("Megatron TP", "tensor parallel (vocabulary-sharded embedding and loss)") for n in notes]


def record_fields(vol: dict, backend: str | None = None) -> dict:
    """`volume(...)` as the record's `comm_volume` field (JSON-ready): bytes per optimizer step per
    rank in total, by op, and per collective with its formula, group, message size and phase."""
    phases = []
    for it in vol["collectives"]:
        phases += [p for p in it["phase"].split(",") if p not in phases]
    return dict(
        model=MODEL,
        unit="bytes per optimizer step per rank (nccl-tests bus volume)",
        backend=backend,
        adapter=vol["adapter"],
        sharding=vol["sharding"],
        world_size=vol["world_size"],
        dp=vol["dp"],
        tp=vol["tp"],
        pp=vol["pp"],
        bytes_per_elem=vol["bytes_per_elem"],
        params_per_rank=int(round(vol["params_per_rank"])),
        total_bytes=float(vol["total"]),
        by_op=by_op(vol["collectives"]),
        phases=phases,
        collectives=[dict(it) for it in vol["collectives"]],
        notes=list(vol.get("notes", [])),
    )
