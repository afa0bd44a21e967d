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
    formula = _formula(cfg, plan, run["root_shapes"])
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


def _formula(cfg, plan, root_shapes) -> dict:
    """The comm formula's record fields for the plan, the FSDP2 root unit's shapes given."""
    from ptbench.core.comm_volume import corrected, record_fields, volume_run
    from ptbench.runner.plan import meta_model
    from ptbench.workloads import build_workload

    model = meta_model(build_workload(cfg.workload, cfg.data))
    fields = record_fields(volume_run(cfg, plan, lambda: model, root_shapes=root_shapes), "fake")
    # what the frameworks move beyond the papers' formulas (ZeRO-3's reuse distance, DeepSpeed's bucket
    # all-reduce, Megatron's vocab-parallel loss), as the traced ledger compares; FSDP2's root unit is in
    # fsdp_padded already (root_params not given again)
    return corrected(fields, plan.cost, cfg.workload)


def _memory_prediction(cfg, plan) -> dict:
    """The memory model for what the fake world runs: a CPU's optimizer and attention, and the GPT-2 loss that
    fake tensors take (F.cross_entropy, as on CUDA: the chunked in-place loss runs on real CPU tensors only)."""
    from ptbench.core.memory_model import predict_run
    from ptbench.runner.plan import meta_model
    from ptbench.workloads import build_workload

    model = meta_model(build_workload(cfg.workload, cfg.data))
    return predict_run(cfg, plan, lambda: model, device="cpu", loss_in_place=False)
