"""`volume` / `compose`: the papers' bytes per optimizer step per rank, by collective: the data-parallel gradient
sync and parameter gathers ([ZeRO] Sec. 7), the tensor-parallel activation all-reduces ([Megatron] Sec. 3,
[SP] Sec. 4.2.2) and the pipeline's stage-to-stage sends (Narayanan et al. 2021, Sec. 3.2). The references are
in README.md here; the ring factors make every number nccl-tests' bus volume."""

from __future__ import annotations

from ptbench.core.comm_volume.inputs import Inputs
from ptbench.core.comm_volume.items import item, phase

# state sharding (an adapter's cost inputs) -> how gradients are synchronised across data-parallel ranks.
# Megatron's distributed optimizer is counted as an all-reduce (on CUDA it reduce-scatters the gradients and
# all-gathers the parameters: the same bytes).
DP_SYNC = {
    "none": "all_reduce",
    "distributed_optimizer": "all_reduce",
    "zero0": "all_reduce",
    "zero1": "zero12",
    "zero2": "zero12",
    "zero3": "zero3",
    "fsdp": "zero3",
}
_PSI = "(N-1)/N * Psi * B"
# a pipeline stage -> the stage-to-stage sends it makes per micro-batch: the first sends its output activation,
# the last its input gradient, an inner stage both
STAGES = {
    "first": ("pp_activation_send",),
    "inner": ("pp_activation_send", "pp_gradient_send"),
    "last": ("pp_gradient_send",),
}


def volume(sharding: str = "none", **fields) -> dict:
    """Per-rank communication bytes of one optimizer step for a model whose states are split by `sharding`
    (ptbench.core.layout.SHARDING, what an adapter's `cost_inputs` states), from the inputs by name
    (`Inputs.of`: params=, world_size=, tp=, pp=, layers=, hidden=, seq_len=, micro_batch= ...):
    `compose(Inputs.of(sharding, **fields))`. The runner builds `Inputs` from its plan (`volume_run`)."""
    return compose(Inputs.of(sharding, **fields))


def compose(inp: Inputs) -> dict:
    """{adapter (the label), sharding, world_size (devices), dp, tp, pp, bytes_per_elem, params_per_rank,
    collectives: [{name, op, group, group_size, message_bytes, calls, bytes, formula, phase, bytes_per_elem}]
    (phase: the timed phase(s) it runs in, comma-separated), bytes: {name: bytes}, total}: bytes per rank per
    optimizer step in nccl-tests' bus volume."""
    _check(inp)
    items = dp_items(inp) + tp_items(inp) + pp_items(inp)
    per = {it["name"]: it["bytes"] for it in items}
    lay = inp.layout
    return dict(
        adapter=inp.label or inp.cost.sharding,
        sharding=inp.cost.sharding,
        world_size=lay.devices,
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        bytes_per_elem=inp.elem.params,
        params_per_rank=inp.params_per_rank,
        collectives=items,
        bytes=per,
        total=sum(per.values()),
    )


def _check(inp: Inputs) -> None:
    """What the layout alone cannot say: tensor and pipeline parallelism need the b x s x h activation."""
    lay, act = inp.layout, inp.act
    if inp.stage is not None and inp.stage not in STAGES:
        raise ValueError(f"unknown pipeline stage {inp.stage!r}; known: {', '.join(STAGES)} (None: the busiest)")
    if inp.stage == "inner" and lay.pp < 3:
        raise ValueError(f"pp={lay.pp} has no inner stage (one needs pp >= 3); use stage first or last")
    if act is None:
        return
    if (lay.tp > 1 or lay.pp > 1) and not act.elements:
        raise ValueError("tp > 1 or pp > 1 needs hidden, seq_len and micro_batch (the b x s x h activation)")
    if lay.tp > 1 and not act.layers:
        raise ValueError("tp > 1 needs layers (4 all-reduces per transformer layer)")


def dp_items(inp: Inputs) -> list[dict]:
    """Once per optimizer step over the dp group: [ZeRO] 7.1 (all-reduce = reduce-scatter + all-gather, 2(N-1)/N
    Psi B), 7.2.1 (P_os+g: gradient reduce-scatter + parameter all-gather, the same total) and 7.2.2 (P_os+g+p
    and FSDP: parameters gathered in forward and again in backward, gradients reduce-scattered: 1.5x DDP). The
    paper rounds (N-1)/N to 1; the exact ring factor is kept here."""
    N, cost, e = inp.layout.dp, inp.cost, inp.elem
    if N == 1:
        return []
    full, gfull = inp.params_per_rank * e.params, inp.params_per_rank * e.grads

    def add(name, op, message, formula, elem):
        return item(name, op, "dp", N, message, 1, formula, phase(name, cost), elem)

    style = DP_SYNC[cost.sharding]
    if style == "all_reduce":
        return [add("dp_grad_all_reduce", "all_reduce", gfull, "2(N-1)/N * Psi * B", e.grads)]
    if style == "zero12":
        return [
            add("dp_grad_reduce_scatter", "reduce_scatter", gfull, _PSI, e.grads),
            add("dp_param_all_gather", "all_gather", full, _PSI, e.params),
        ]
    out = [add("dp_param_all_gather_fwd", "all_gather", full, _PSI, e.params)]
    if cost.reshard_after_forward:  # False keeps forward's gathers for backward
        out.append(add("dp_param_all_gather_bwd", "all_gather", full, _PSI, e.params))
    return [*out, add("dp_grad_reduce_scatter", "reduce_scatter", gfull, _PSI, e.grads)]


def tp_items(inp: Inputs) -> list[dict]:
    """Per layer of the busiest stage, per micro-batch, over the tp group: [Megatron] Sec. 3, Fig. 4, 2
    all-reduces forward + 2 backward on b*s*h, 2(t-1)/t each; with sequence parallelism [SP] Sec. 4.2.2, 2
    all-gathers (before the column-parallel linears) + 2 reduce-scatters (after the row-parallel ones) forward
    and the conjugates backward, (t-1)/t each: the same bytes."""
    t = inp.layout.tp
    if t == 1 or inp.act is None:
        return []
    act, b = inp.act.elements * inp.elem.acts, inp.elem.acts
    calls = 4 * inp.busiest_stage_layers * inp.microbatches
    ops = ("all_gather", "reduce_scatter") if inp.sequence_parallel else ("all_reduce",)
    factor = "(t-1)/t" if inp.sequence_parallel else "2(t-1)/t"
    formula = f"4 * ceil(L/p) * m * {factor} * b*s*h * B"
    return [
        item(f"tp_activation_{op}", op, "tp", t, act, calls, formula, phase(f"tp_activation_{op}", inp.cost), b)
        for op in ops
    ]


def pp_items(inp: Inputs) -> list[dict]:
    """Per micro-batch, point to point between consecutive stages (Narayanan et al. 2021, Sec. 3.2): a stage
    sends its output activation (b*s*h) forward and its input gradient backward. Reported for `inp.stage`, by
    default the busiest: an inner stage sends both (p > 2); with p = 2 each stage sends one of them. [SP]: with sequence parallelism
    each tensor-parallel rank sends its sequence shard, b*s/t*h (megatron-core pipeline_parallel/schedules.py)."""
    p, m = inp.layout.pp, inp.microbatches
    if p == 1 or inp.act is None:
        return []
    send = inp.act.elements * inp.elem.acts
    formula = "m * b*s*h * B"
    if inp.sequence_parallel:
        send, formula = send / inp.layout.tp, "m * b*s/t*h * B"
    busiest = "inner" if p > 2 else "first"
    names = STAGES[inp.stage or busiest]
    return [item(n, "send_recv", "pp", p, send, m, formula, phase(n, inp.cost), inp.elem.acts) for n in names]
