"""`corrected`: the papers' formulas (a record's `comm_volume`) corrected where the framework moves other bytes,
each difference stated with the framework setting that causes it. Measured against the traces by
`python -m ptbench.studies.ledger` (2 ranks, CPU, DeepSpeed 0.19.8, megatron-core) and against the fake process group's
ledger by `python -m ptbench.scale` (8-1024 ranks)."""

from __future__ import annotations

from ptbench.core.comm_volume.items import by_op, item, rebytes
from ptbench.core.comm_volume.megatron import vocab_parallel


def corrected(fields: dict, cost, workload, root_params: int | None = None, stage: str | None = None) -> dict:
    """`record_fields(...)` corrected, the differences in `differences` (one line each). `cost`: the adapter's
    CostInputs (which corrections apply); `workload`: the workload config; `root_params`: the parameters of the
    root unit (not resharded after forward); `stage`: the pipeline stage the fields were counted for (first,
    inner, last; None: the busiest, `volume_run`'s `stage`): an inner stage holds no tied embedding."""
    items = [dict(c) for c in fields.get("collectives", [])]
    diffs: list[str] = []
    if cost.grad_bucket_all_reduce:
        _bucket_all_reduce(items, cost, diffs)
    # stage3_max_reuse_distance counts the elements fetched whole (a parameter's full ds_numel), so it is
    # compared with the model-parallel shard's parameters, not with them times the data-parallel ranks
    if fields.get("params_per_rank", 0) < cost.live_params_limit:
        items = _reused_gathers(items, diffs)
    if cost.vocab_parallel_loss:
        sp = bool(cost.sequence_parallel)
        layer_item = "tp_activation_all_gather" if sp else "tp_activation_all_reduce"  # the papers' per-layer one
        tp_item = next((it for it in items if it["name"] == layer_item), None)
        if tp_item is not None:
            items += vocab_parallel(tp_item, fields, workload, sp, diffs)
    if cost.root_unit_gathered and root_params and cost.reshard_after_forward:
        _root_unit(items, root_params, fields, diffs)
    tied = fields.get("pp", 1) > 1 and cost.tied_embedding_stages and workload.kind == "language"
    if tied and stage != "inner":
        items.append(_tied_embedding(fields, cost, workload, diffs))
    ops = by_op(items)
    return {
        **fields,
        "collectives": items,
        "by_op": ops,
        "total_bytes": float(sum(ops.values())),
        "differences": diffs,
        "uncorrected_total_bytes": fields.get("total_bytes"),
    }


def _bucket_all_reduce(items: list[dict], cost, diffs: list[str]) -> None:
    for it in items:
        if it["name"] == "dp_grad_reduce_scatter":
            it.update(op="all_reduce", name="dp_grad_all_reduce", formula="2(N-1)/N * Psi * B")
            rebytes(it)
            diffs.append(
                f"DeepSpeed ({cost.sharding}): zero_optimization.use_multi_rank_bucket_allreduce (default true) "
                "all-reduces the gradient buckets instead of reduce-scattering them: 2(N-1)/N instead of "
                "(N-1)/N x Psi x B, 1.5x the paper's total"
            )


def _reused_gathers(items: list[dict], diffs: list[str]) -> list[dict]:
    if not any(it["name"] == "dp_param_all_gather_bwd" for it in items):
        return items
    diffs.append(
        "DeepSpeed ZeRO-3: the model's parameters fit stage3_max_reuse_distance (default 1e9 elements), so "
        "a parameter gathered in forward is not released before its use in backward "
        "(runtime/zero/partitioned_param_coordinator.py __params_to_release): no backward re-gather (the "
        "formula's 3 (N-1)/N x Psi x B is 1.5x too high)"
    )
    return [it for it in items if it["name"] != "dp_param_all_gather_bwd"]


def _root_unit(items: list[dict], root_params: int, fields: dict, diffs: list[str]) -> None:
    for it in items:
        if it["name"] == "dp_param_all_gather_bwd":
            share = root_params / (fields["params_per_rank"] or 1)
            it["message_bytes"] -= root_params * it["bytes_per_elem"]
            it["formula"] = "(N-1)/N * (Psi - Psi_root) * B"
            rebytes(it)
            diffs.append(
                f"FSDP2: the root unit (embedding, final norm, head: {root_params} parameters, {100 * share:.1f} % "
                "of Psi) is wrapped with reshard_after_forward=False (as torchtitan), so backward re-gathers "
                "only the blocks"
            )


def _tied_embedding(fields: dict, cost, workload, diffs: list[str]) -> dict:
    t = fields.get("tp", 1)
    vocab = cost.padded_vocab or workload.vocab_size
    elems = vocab * workload.n_embd / t
    diffs.append(
        "tied embedding across pipeline stages: the first stage's token embedding and the last stage's output "
        "layer are one weight; after backward their gradients are all-reduced between the two stages "
        "(megatron-core's embedding group with share_embeddings_and_output_weights; adapters/_pipeline.py TiedPair)"
    )
    name, formula = "pp_tied_embedding_grad_all_reduce", "2(2-1)/2 * V*h/t * 4"
    return item(name, "all_reduce", "embedding", 2, elems * 4, 1, formula, "backward", 4)  # fp32 gradients
