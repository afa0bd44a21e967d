"""One dry-run point assembled: the measurements of run.py beside the models, as compare.py sets them."""

from __future__ import annotations


def measure_point(overrides: list[str], world_size: int, rank: int) -> dict:
    """`dry_run` at (W, R), then the comm formula (with the FSDP2 root unit the adapter built) and the memory
    model for what the fake world runs, and their ratios to the ledger and the tracker."""
    from ptbench.scale import compare
    from ptbench.scale.run import STEPS, dry_run
    from ptbench.scale.standins import STANDINS

    run = dry_run(overrides, world_size, rank)
    cfg, plan = run["cfg"], run["plan"]
    formula = _formula(cfg, plan, run["root_shapes"], rank)
    prediction = _memory_prediction(cfg, plan)
    return dict(
        cfg=cfg,
        plan=plan,
        adapter=plan.adapter,
        workload=plan.workload,
        world_size=world_size,
        rank=rank,
        layout=f"dp={plan.layout.dp} tp={plan.layout.tp} pp={plan.layout.pp}",
        steps=STEPS,
        seconds=run["seconds"],
        standins=run["standins"],
        standin_reasons={k: STANDINS[k] for k in run["standins"]},
        # what the adapter's describe() read, for the record as a real run's (bench/scale/__main__.py)
        **({"adapter_settings": run["adapter_settings"]} if "adapter_settings" in run else {}),
        ledger=run["ledger"],
        formula=formula,
        comm=compare.comm(formula, run["ledger"][-1]),
        memory=compare.memory(prediction, run["memory"]),
        tracker=run["memory"],
        prediction={k: v for k, v in prediction.items() if isinstance(v, (int, float))},
    )


def _formula(cfg, plan, root_shapes, rank: int) -> dict:
    """The comm formula's record fields for the plan at `rank`, the FSDP2 root unit's shapes given: a pipeline's
    sends are those of the rank's own stage (the ledger is the rank's), not the busiest stage's the run record
    keeps."""
    from ptbench.core.comm_volume import corrected, record_fields, volume_run
    from ptbench.runner.plan import meta_model
    from ptbench.workloads import build_workload

    workload = build_workload(cfg.workload, cfg.data)
    model = meta_model(workload)
    stage = _pipeline_stage(cfg, plan, rank)
    held = _stage_params(cfg, plan, workload, model, rank) if stage else None
    vol = volume_run(cfg, plan, lambda: model, root_shapes=root_shapes, stage=stage, stage_params=held)
    fields = record_fields(vol, "fake")
    # what the frameworks move beyond the papers' formulas (ZeRO-3's reuse distance, DeepSpeed's bucket
    # all-reduce, Megatron's vocab-parallel loss), as the traced ledger compares; FSDP2's root unit is in
    # fsdp_padded already (root_params not given again)
    return corrected(fields, plan.cost, cfg.workload, stage=stage)


def _pipeline_stage(cfg, plan, rank: int) -> str | None:
    """first, inner or last: the stage adapter=pipeline gives `rank` (stage rank r % pp of replica r // pp,
    adapters/pipeline.py). None (the busiest) for other adapters, whose rank order differs, and for the
    interleaved schedule, whose several stages per rank the formula does not model."""
    pp = plan.layout.pp
    if pp == 1 or plan.adapter != "pipeline" or cfg.adapter.get("schedule") == "interleaved_1f1b":
        return None
    pp_rank = rank % pp
    return "first" if pp_rank == 0 else "last" if pp_rank == pp - 1 else "inner"


def _stage_params(cfg, plan, workload, model, rank: int) -> int:
    """The parameter elements of `rank`'s stage, split as adapter=pipeline splits `workload.sequential` (its own
    `check_split`): each layer's parameters, a weight tied across stages counted in each (the head keeps its own
    copy of the embedding, adapters/pipeline.py), as the stage's DDP all-reduces them."""
    from ptbench.adapters import _pipeline as P

    layers = list(workload.sequential(model).children())
    balance = P.check_split(cfg.adapter.balance, len(layers), plan.layout.pp, cfg.workload.name, "adapter.balance")
    mine = layers[P.stage_slices(balance)[rank % plan.layout.pp]]
    return sum(p.numel() for layer in mine for p in layer.parameters())


def _memory_prediction(cfg, plan) -> dict:
    """The memory model for what the fake world runs: a CPU's optimizer and attention, and the GPT-2 loss that
    fake tensors take (F.cross_entropy, as on CUDA: the chunked in-place loss runs on real CPU tensors only)."""
    from ptbench.core.memory_model import predict_run
    from ptbench.runner.plan import meta_model
    from ptbench.workloads import build_workload

    model = meta_model(build_workload(cfg.workload, cfg.data))
    return predict_run(cfg, plan, lambda: model, device="cpu", loss_in_place=False)
