"""Communication bytes per optimizer step per rank: pure functions, no torch at import.

`volume(sharding, params=..., world_size=..., ...)` returns the bytes one rank moves per optimizer
step in each collective, and their total; `volume_run(cfg, plan, build_model)` fills it from a run
plan's layout and its adapter's cost inputs (no adapter is named here). Seconds at a bus bandwidth
measured by `python -m ptbench.comm` are the report's business (analysis/tables.py `comm_time`: the one
rule, bytes / busbw at the nearest measured size).

Units. "Bytes" here are the per-rank bus volume of nccl-tests (doc/PERFORMANCE.md,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): for a collective on a buffer
of S bytes over n ranks a rank moves S * factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather and reduce-scatter (S = the full, unsharded array), 1 for broadcast and send/recv. The
same factor turns nccl-tests' algbw into busbw, so time = bytes / busbw holds for every op and
needs no per-op case. Values are floats: (n-1)/n is seldom an integer fraction.

Symbols: Psi = parameters (elements), N = data-parallel group size, B = bytes per element,
t = tensor-parallel size, p = pipeline stages, b = micro-batch size (sequences), s = sequence
length, h = hidden size, L = transformer layers, m = micro-batches per optimizer step.

Sources:
- [ZeRO] Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020, Section 7 "Communication analysis of ZeRO-DP" (7.1 data parallel:
  all-reduce = reduce-scatter + all-gather, 2 Psi per rank; 7.2.1 P_os+g: reduce-scatter of
  gradients Psi + all-gather of parameters Psi = 2 Psi; 7.2.2 P_os+g+p: parameter all-gather in
  forward Psi, again in backward Psi, gradient reduce-scatter Psi = 3 Psi). The paper rounds
  (N-1)/N to 1; here the exact ring factor is kept, so the numbers equal nccl-tests' bus volume.
- [Megatron] Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
  Model Parallelism", 2019, Section 3 / Figure 4: per transformer layer 2 all-reduces in forward
  (after the attention and the MLP row-parallel linears, operator g) and 2 in backward (operator
  f), each on the b x s x h activation. Narayanan et al., "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", SC 2021, Section 3.2 for the pipeline p2p message
  (b x s x h per micro-batch between consecutive stages, forward activation and backward gradient)
  and the t x p x d decomposition.
- [SP] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
  Section 4.2.2 / Figure 5: with sequence parallelism each layer's all-reduce g becomes a reduce-scatter
  (after the row-parallel linear) and its f an all-gather (before the column-parallel linear), and the
  reverse in backward: per layer 2 all-gathers + 2 reduce-scatters forward and 2 + 2 backward on b x s x h,
  the same bytes as the 4 all-reduces (an all-reduce is a reduce-scatter plus an all-gather). Stage-to-stage
  sends carry the sequence shard, b x s/t x h (megatron-core pipeline_parallel/schedules.py:1965).
- [nccl-tests] doc/PERFORMANCE.md for the ring factors above.
- [FSDP2] torch/distributed/fsdp/_fully_shard/_fsdp_param.py: every parameter's dim 0 padded to a multiple of the
  world size before it is sharded, gathered and reduce-scattered (`padded_elements`); the root unit, wrapped
  reshard_after_forward=False, is not re-gathered in backward. Both measured against torch's fake process group at
  8-1024 ranks by `python -m ptbench.scale` (bench/scale/), which passes the root's shapes: the formula equals
  the ledger there.

Not modelled (the numbers are lower bounds of the traffic): embedding / vocab-parallel
cross-entropy all-reduces in `volume` (`volume_run` adds torch TP's, `corrected` Megatron's), activation recomputation (which repeats the forward TP all-reduces in
backward: 6 instead of 4 per layer), interleaved pipeline schedules (v x the p2p traffic), DDP's
and ZeRO's bucketing (which changes message sizes, not volume), loss-scale / metric all-reduces.
"""

from __future__ import annotations

import math

from ptbench.core.layout import SHARDING

# state sharding (an adapter's cost inputs) -> how gradients are synchronised across data-parallel ranks.
# Megatron's distributed optimizer is counted as an all-reduce (on CUDA it reduce-scatters the gradients and
# all-gathers the parameters: the same bytes).
_DP_SYNC = {
    "none": "all_reduce",
    "distributed_optimizer": "all_reduce",
    "zero0": "all_reduce",
    "zero1": "zero12",
    "zero2": "zero12",
    "zero3": "zero3",
    "fsdp": "zero3",
}


# ring factors of nccl-tests doc/PERFORMANCE.md (per-rank bus volume = S * factor)
def ring_factor(op: str, n: int) -> float:
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; known: all_reduce, all_gather, reduce_scatter, broadcast, send_recv")


def _item(
    name: str,
    op: str,
    group: str,
    group_size: int,
    message_bytes: float,
    calls: float,
    bytes_: float,
    formula: str,
    phase: str,
    bytes_per_elem: int,
) -> dict:
    return dict(
        name=name,
        op=op,
        group=group,
        group_size=group_size,
        message_bytes=message_bytes,
        calls=calls,
        bytes=bytes_,
        formula=formula,
        phase=phase,
        bytes_per_elem=bytes_per_elem,
    )


# The timed phase (bench/core/timing.py PHASES) each collective runs in, as the adapters' `phase_semantics`
# state: where its exposed remainder shows in the breakdown. An adapter moves the gradient all-reduce
# (`grad_sync_phase`: Horovod synchronizes in step()) or puts the whole step in one phase (`step_phase`:
# a pipeline schedule) through its cost inputs.
def _phase(name: str, grad_sync_phase: str, step_phase: str | None) -> str:
    if step_phase:
        return step_phase
    if name == "dp_grad_all_reduce":
        return grad_sync_phase
    if name == "dp_param_all_gather":
        return "optimizer"  # ZeRO-1/2 gather the updated parameters in engine.step
    if name == "dp_param_all_gather_fwd":
        return "forward"
    if name in ("tp_activation_all_reduce", "tp_activation_all_gather", "tp_activation_reduce_scatter"):
        return "forward,backward"
    if name == "pp_activation_send":
        return "forward"
    return "backward"  # gradient reduce-scatter, backward re-gather, pipeline gradient send


def volume(
    sharding: str = "none",
    *,
    params: int,
    world_size: int,
    bytes_per_elem: int = 4,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    layers: int = 0,
    hidden: int = 0,
    seq_len: int = 0,
    micro_batch: int = 0,
    microbatches: int = 1,
    reshard_after_forward: bool = True,
    grad_bytes_per_elem: int | None = None,
    activation_bytes_per_elem: int | None = None,
    grad_sync_phase: str = "backward",
    step_phase: str | None = None,
    sequence_parallel: bool = False,
    label: str | None = None,
) -> dict:
    """Per-rank communication bytes of one optimizer step.

    sharding: how model states are split over the data-parallel ranks (ptbench.core.layout.SHARDING, an
             adapter's `cost_inputs().sharding`): none | distributed_optimizer | zero0 (gradient
             all-reduce) | zero1, zero2 (reduce-scatter + parameter all-gather) | zero3, fsdp (gathers
             in forward and backward + reduce-scatter).
    params: Psi, all parameters of the model (elements). Model-parallel ranks hold Psi / (t p)
            (replicated norms and biases are counted as sharded: a slight under-estimate).
    world_size: devices in the job = dp * tp * pp (for gpipe, the devices the one process drives).
    dp: data-parallel size; default world_size / (tp * pp).
    layers, hidden, seq_len, micro_batch: needed when tp > 1 or pp > 1 (the b x s x h activation).
    microbatches: micro-batches per optimizer step (pipeline micro-batches or gradient accumulation
                  steps); scales the activation traffic, not the once-per-step gradient traffic.
    reshard_after_forward: zero3 / fsdp; False keeps the gathered parameters from forward to
                  backward, so the backward all-gather disappears.
    bytes_per_elem: parameters as gathered; grad_bytes_per_elem: gradients as reduced (FSDP2 with
                  bf16 gathers 2-byte parameters but reduce-scatters fp32 gradients);
                  activation_bytes_per_elem: the b x s x h activation (bf16 under autocast). Both
                  default to bytes_per_elem.
    grad_sync_phase, step_phase: the timed phases the collectives run in (see `_phase`).
    sequence_parallel: tp > 1 with the sequence split over the tensor-parallel ranks ([SP]): each layer's
                  activation all-reduces become all-gathers + reduce-scatters, stage sends b x s/t x h.
    label: what the run is called (the adapter's name; only recorded).

    Returns {adapter (the label), sharding, world_size, dp, tp, pp, bytes_per_elem, params_per_rank,
    collectives: [{name, op, group, group_size, message_bytes, calls, bytes, formula, phase,
    bytes_per_elem}] (phase: the timed phase(s) the collective runs in, comma-separated),
    bytes: {name: bytes}, total: bytes}. `bytes` are per rank per step in nccl-tests' bus volume.
    """
    name = sharding.strip().lower()
    if name not in SHARDING:
        raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDING)}")
    for key, val, lo in (
        ("params", params, 0),
        ("world_size", world_size, 1),
        ("bytes_per_elem", bytes_per_elem, 1),
        ("tp", tp, 1),
        ("pp", pp, 1),
        ("microbatches", microbatches, 1),
        ("layers", layers, 0),
        ("hidden", hidden, 0),
        ("seq_len", seq_len, 0),
        ("micro_batch", micro_batch, 0),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val < lo:
            raise ValueError(f"{key} must be an integer >= {lo}, got {val!r}")
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp*pp = {tp * pp}")
    if dp is None:
        dp = world_size // (tp * pp)
    if dp < 1 or dp * tp * pp != world_size:
        raise ValueError(f"dp*tp*pp must equal world_size: {dp}*{tp}*{pp} != {world_size}")
    if (tp > 1 or pp > 1) and not (hidden and seq_len and micro_batch):
        raise ValueError("tp > 1 or pp > 1 needs hidden, seq_len and micro_batch (the b x s x h activation)")
    if tp > 1 and not layers:
        raise ValueError("tp > 1 needs layers (4 all-reduces per transformer layer)")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks)")

    B = bytes_per_elem
    Bg = bytes_per_elem if grad_bytes_per_elem is None else grad_bytes_per_elem
    Ba = bytes_per_elem if activation_bytes_per_elem is None else activation_bytes_per_elem
    for key, val in (("grad_bytes_per_elem", Bg), ("activation_bytes_per_elem", Ba)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {val!r}")
    psi_rank = params / (tp * pp)  # parameters this rank holds (and syncs with its DP peers)
    full = psi_rank * B  # bytes of those parameters, unsharded, as gathered
    gfull = psi_rank * Bg  # bytes of their gradients, as reduced
    items: list[dict] = []

    def add(item_name, op, group, n, message, calls, bytes_, formula, b):
        items.append(
            _item(
                item_name,
                op,
                group,
                n,
                message,
                calls,
                bytes_,
                formula,
                _phase(item_name, grad_sync_phase, step_phase),
                b,
            )
        )

    # --- data parallel: once per optimizer step, over the dp group -----------------------------
    style = _DP_SYNC[name]
    N = dp
    if N > 1:
        ar, g = ring_factor("all_reduce", N), ring_factor("all_gather", N)
        if style == "all_reduce":
            # [ZeRO] 7.1 / [nccl-tests]: ring all-reduce of the gradients, 2(N-1)/N * Psi * B per rank
            add("dp_grad_all_reduce", "all_reduce", "dp", N, gfull, 1, ar * gfull, "2(N-1)/N * Psi * B", Bg)
        elif style == "zero12":
            # [ZeRO] 7.2.1 (P_os, P_os+g): reduce-scatter of gradients, then all-gather of the
            # updated parameters, (N-1)/N * Psi * B each: the same total as DDP's all-reduce
            add("dp_grad_reduce_scatter", "reduce_scatter", "dp", N, gfull, 1, g * gfull, "(N-1)/N * Psi * B", Bg)
            add("dp_param_all_gather", "all_gather", "dp", N, full, 1, g * full, "(N-1)/N * Psi * B", B)
        else:
            # [ZeRO] 7.2.2 (P_os+g+p) and FSDP: all-gather the parameters in forward and again in
            # backward, reduce-scatter the gradients: 3 (N-1)/N * Psi * B, 1.5x DDP
            add("dp_param_all_gather_fwd", "all_gather", "dp", N, full, 1, g * full, "(N-1)/N * Psi * B", B)
            if reshard_after_forward:
                add("dp_param_all_gather_bwd", "all_gather", "dp", N, full, 1, g * full, "(N-1)/N * Psi * B", B)
            add("dp_grad_reduce_scatter", "reduce_scatter", "dp", N, gfull, 1, g * gfull, "(N-1)/N * Psi * B", Bg)

    # --- tensor parallel: per layer, per micro-batch, over the tp group --------------------------
    act = micro_batch * seq_len * hidden * Ba  # one b x s x h activation, bytes
    if tp > 1:
        layers_rank = math.ceil(layers / pp)  # layers on the busiest pipeline stage
        calls = 4 * layers_rank * microbatches
        if sequence_parallel:
            # [SP] Sec. 4.2.2: per layer 2 all-gathers (before the column-parallel linears) + 2 reduce-scatters
            # (after the row-parallel linears) forward, the conjugates backward: 4 + 4 on the full b*s*h,
            # each (t-1)/t * b*s*h*B per rank
            for op in ("all_gather", "reduce_scatter"):
                add(
                    f"tp_activation_{op}",
                    op,
                    "tp",
                    tp,
                    act,
                    calls,
                    calls * ring_factor(op, tp) * act,
                    "4 * ceil(L/p) * m * (t-1)/t * b*s*h * B",
                    Ba,
                )
        else:
            # [Megatron] Sec. 3, Fig. 4: 2 all-reduces forward + 2 backward per layer on b*s*h,
            # each 2(t-1)/t * b*s*h*B per rank ([nccl-tests] ring all-reduce factor)
            add(
                "tp_activation_all_reduce",
                "all_reduce",
                "tp",
                tp,
                act,
                calls,
                calls * ring_factor("all_reduce", tp) * act,
                "4 * ceil(L/p) * m * 2(t-1)/t * b*s*h * B",
                Ba,
            )

    # --- pipeline: per micro-batch, point to point between consecutive stages -------------------
    if pp > 1:
        # [Megatron] (Narayanan et al. 2021, Sec. 3.2): per micro-batch a stage sends its output
        # activation (b*s*h) forward and the input gradient (b*s*h) backward. Reported for the
        # busiest stage: an inner stage sends both (p > 2); with p = 2 each stage sends one of them.
        # [SP]: with sequence parallelism each tensor-parallel rank sends its sequence shard, b*s/t*h.
        send = act / tp if sequence_parallel else act
        f = "m * b*s/t*h * B" if sequence_parallel else "m * b*s*h * B"
        add("pp_activation_send", "send_recv", "pp", pp, send, microbatches, microbatches * send, f, Ba)
        if pp > 2:
            add("pp_gradient_send", "send_recv", "pp", pp, send, microbatches, microbatches * send, f, Ba)

    per = {it["name"]: it["bytes"] for it in items}
    return dict(
        adapter=label or name,
        sharding=name,
        world_size=world_size,
        dp=dp,
        tp=tp,
        pp=pp,
        bytes_per_elem=B,
        params_per_rank=psi_rank,
        collectives=items,
        bytes=per,
        total=sum(per.values()),
    )


# --- from a composed config and its run plan (the runner's entry point) --------------------------------
HALF = ("bf16", "fp16")


def volume_run(cfg, plan, build_model, root_shapes=None) -> dict:
    """`volume` for a composed config (`BenchConfig`) and its run plan (`RunPlan`), with the same
    parameter count, layout and micro-batch as the memory prediction: the model's facts the plan carries
    (`plan.facts`, counted once per launch, a padded vocabulary included; counted here from `build_model`
    when the plan has none). The layout and the element sizes come from the plan's layout and the
    adapter's cost inputs: `half_states` (DeepSpeed's bf16/fp16 modes: 2-byte parameters and gradients),
    `half_gather` (FSDP2 gathers 2-byte parameters and reduce-scatters fp32 gradients),
    `half_activation_comm` (tensor-parallel activations are outputs of bf16 matmuls); everything else
    runs autocast around fp32 weights, so gradients stay 4 bytes, and a pipeline's stage outputs (the
    residual stream, fp32 under autocast) stay 4 bytes. FSDP2 (sharding fsdp, the plan's parameter shapes
    known): each parameter's dim 0 padded to a multiple of N, and `root_shapes` (the root unit's parameter
    shapes, kept gathered from forward to backward; None: not known here) left out of the backward re-gather
    (`fsdp_padded`)."""
    layout, cost = plan.layout, plan.cost
    facts = getattr(plan, "facts", None)
    if facts is None:
        import torch

        from ptbench.core.memory_model import run_facts

        with torch.device("meta"):
            facts = run_facts(cfg.workload, cost, build_model())
    half = cfg.trainer.precision in HALF
    accum = int(cfg.trainer.grad_accum)
    kw = dict(
        params=int(facts.params),
        world_size=layout.devices,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        bytes_per_elem=2 if half and (cost.half_states or cost.half_gather) else 4,
        grad_bytes_per_elem=2 if half and cost.half_states else 4,
        activation_bytes_per_elem=2 if half and cost.half_activation_comm else 4,
        reshard_after_forward=cost.reshard_after_forward,
        grad_sync_phase=cost.grad_sync_phase,
        step_phase=cost.step_phase,
        sequence_parallel=bool(cost.sequence_parallel and layout.tp > 1),
        label=cfg.adapter.name,
    )
    vision = cfg.workload.kind != "language"
    if layout.tp > 1 or layout.pp > 1:
        if vision:  # no b x s x h for a CNN: placeholders, and the activation items are dropped below
            kw.update(layers=1, hidden=1, seq_len=1, micro_batch=1)
        else:
            kw.update(
                layers=facts.layers,
                hidden=facts.hidden,
                seq_len=facts.seq_len,
                micro_batch=math.ceil(plan.local_batch / layout.microbatches),  # as the memory model's
                microbatches=layout.microbatches * accum,
            )
    notes = []
    if accum > 1 and cost.sharding in ("zero0", "zero1", "zero2", "zero3", "fsdp"):
        notes.append(
            f"trainer.grad_accum={accum}: parameter gathers (and DeepSpeed's gradient reductions) repeat "
            "per micro-batch; counted once here"
        )
    if layout.devices_per_process > 1 and layout.pp > 1:
        notes.append("stages in one process: stage-to-stage traffic is device-to-device copies, not a collective")
    vol = volume(cost.sharding, **kw)
    if layout.tp > 1 and not vision and not cost.vocab_parallel_loss and not cost.sequence_parallel:
        notes += _vocab_parallel_items(vol, cfg.workload)
    if cost.sharding == "fsdp" and facts.shapes and layout.tp == layout.pp == 1:
        notes += fsdp_padded(vol, facts.shapes, root_shapes)
    if vision and layout.pp > 1:
        vol["collectives"] = [it for it in vol["collectives"] if it["group"] != "pp"]
        vol["bytes"] = {it["name"]: it["bytes"] for it in vol["collectives"]}
        vol["total"] = sum(vol["bytes"].values())
        notes.append(
            "vision pipeline: stage-to-stage activations are not modelled (no b x s x h); data-parallel traffic only"
        )
    vol["notes"] = notes
    return vol


def _vocab_parallel_items(vol: dict, workload) -> list[str]:
    """torch tensor parallelism on the harness GPT-2 (a vocabulary-sharded embedding, the tied head
    column-parallel, loss_parallel): the embedding all-reduces its output, the head's input gradient is
    all-reduced, and the loss all-reduces 3 fp32 b x s tensors per micro-batch, as Megatron's vocab-parallel
    layers without sequence parallelism (`_megatron_vocab_parallel`). Appended to `vol` in place."""
    item = next((it for it in vol["collectives"] if it["name"] == "tp_activation_all_reduce"), None)
    if item is None:
        return []
    notes: list[str] = []
    vol["collectives"] += _megatron_vocab_parallel(item, vol, workload, False, notes)
    vol["bytes"] = {it["name"]: it["bytes"] for it in vol["collectives"]}
    vol["total"] = sum(vol["bytes"].values())
    return [n.replace("Megatron TP", "tensor parallel (vocabulary-sharded embedding and loss)") for n in notes]


def padded_elements(shapes, n: int) -> int:
    """Elements of `shapes` with each tensor's dim 0 padded to a multiple of n: what FSDP2 all-gathers and
    reduce-scatters (torch/distributed/fsdp/_fully_shard/_fsdp_param.py pads dim 0 to the world size so that
    every rank's chunk has one size; a 0-d tensor counts as one row)."""
    total = 0
    for s in shapes:
        rows = s[0] if len(s) else 1
        rest = math.prod(s[1:]) if len(s) > 1 else 1
        total += math.ceil(rows / n) * n * rest
    return total


def fsdp_padded(vol: dict, shapes, root_shapes=None) -> list[str]:
    """FSDP2's data-parallel items of `vol` (from `volume`) in place: messages of the dim-0 padded elements of
    `shapes` (every parameter, a tied one once), and, with `root_shapes`, the backward re-gather without the
    root unit (wrapped reshard_after_forward=False: its parameters stay gathered from forward to backward, so
    backward gathers only the other units). Returns one note per change."""
    items = {it["name"]: it for it in vol["collectives"]}
    if not any(k.startswith("dp_") for k in items):
        return []
    n = vol["dp"]
    padded = padded_elements(shapes, n)
    notes = []
    plain = sum(math.prod(s) if len(s) else 1 for s in shapes)
    if padded != plain:
        notes.append(
            f"FSDP2 pads dim 0 of every parameter to a multiple of N={n}: {padded:,} elements gathered and "
            f"reduce-scattered instead of {plain:,} (+{100 * (padded / plain - 1):.2f} %)"
        )
    elems = {"dp_param_all_gather_fwd": padded, "dp_grad_reduce_scatter": padded, "dp_param_all_gather_bwd": padded}
    if root_shapes is not None:
        root = padded_elements(root_shapes, n)
        elems["dp_param_all_gather_bwd"] = padded - root
        notes.append(
            f"FSDP2: the root unit ({root:,} padded elements) is wrapped reshard_after_forward=False: not "
            "re-gathered in backward"
        )
    for name, count in elems.items():
        it = items.get(name)
        if it is None:
            continue
        it["message_bytes"] = count * it["bytes_per_elem"]
        it["bytes"] = it["calls"] * it["message_bytes"] * ring_factor(it["op"], it["group_size"])
        without_root = name == "dp_param_all_gather_bwd" and root_shapes is not None
        it["formula"] = it["formula"].replace("Psi", "(Psi_pad - Psi_root)" if without_root else "Psi_pad")
    vol["bytes"] = {it["name"]: it["bytes"] for it in vol["collectives"]}
    vol["total"] = sum(vol["bytes"].values())
    return notes


def record_fields(vol: dict, backend: str | None = None) -> dict:
    """`volume(...)` as the record's `comm_volume` field (JSON-ready): bytes per optimizer step per
    rank in total, by op, and per collective with its formula, group, message size and phase."""
    by_op: dict = {}
    for it in vol["collectives"]:
        by_op[it["op"]] = by_op.get(it["op"], 0.0) + it["bytes"]
    phases = []
    for it in vol["collectives"]:
        phases += [p for p in it["phase"].split(",") if p not in phases]
    return dict(
        model="bench/core/comm_volume.py",
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
        by_op=by_op,
        phases=phases,
        collectives=[dict(it) for it in vol["collectives"]],
        notes=list(vol.get("notes", [])),
    )


# --- what the frameworks really move (measured: python -m ptbench.ledger) ------------------------------
# megatron-core 0.16.1 source, paths under megatron/core/ (the installed version; what the SP lines cite)
_MCORE_SP = "megatron-core, adapter.sequence_parallel=true"


def _busiest_stage(first: list[dict], last: list[dict], pp: int) -> list[dict]:
    """The collectives the first and the last pipeline stage make beyond their layers': with p = 1 one rank makes
    both lists; with p > 1, per collective kind the list of the stage that moves more of it (the ledger reports
    each kind's busiest rank; the stages' layers move the same, ceil(L/p) each)."""
    if pp == 1:
        return [*first, *last]
    out = []
    for op in dict.fromkeys(it["op"] for it in [*first, *last]):
        a, b = ([it for it in stage if it["op"] == op] for stage in (first, last))
        out += a if sum(it["bytes"] for it in a) > sum(it["bytes"] for it in b) else b
    return out


def _megatron_vocab_parallel(tp_item: dict, fields: dict, workload, sp: bool, diffs: list[str]) -> list[dict]:
    """Megatron-core's tensor-parallel traffic beyond the papers' per-layer collectives (`tp_item`: the formula's
    tp_activation_all_reduce, or its tp_activation_all_gather with sequence parallelism): the vocab-parallel
    embedding (first stage), output layer and cross-entropy (last stage), and with sequence parallelism the
    backward re-gather of the column-parallel linears' input and the all-reduce of the gradients of the
    parameters marked `sequence_parallel`. Appends one line per difference to `diffs`."""
    n, act, b = tp_item["group_size"], tp_item["message_bytes"], tp_item["bytes_per_elem"]
    h, pp = workload.n_embd, max(1, fields.get("pp", 1))
    layers_rank = math.ceil(workload.n_layer / pp)
    m = tp_item["calls"] / (4 * layers_rank)
    bs = act / (h * b)  # b x s
    ar, g = ring_factor("all_reduce", n), ring_factor("all_gather", n)

    def item(name, op, message, calls, factor, formula, phase, elem):
        return _item(name, op, "tp", n, message, calls, calls * factor * message, formula, phase, elem)

    act_ar = "m * 2(t-1)/t * b*s*h * B"
    ce = item(
        "tp_cross_entropy_all_reduce", "all_reduce", bs * 4, 3 * m, ar, "3 * m * 2(t-1)/t * b*s * 4", "forward", 4
    )
    where = (
        "the first stage holds the embedding, the last the output layer and the loss (each kind's busiest stage "
        f"counted, p = {pp})"
        if pp > 1
        else "one rank holds the embedding, the output layer and the loss (p = 1)"
    )
    if not sp:
        first = [item("tp_embedding_all_reduce", "all_reduce", act, m, ar, act_ar, "forward", b)]
        last = [item("tp_output_layer_all_reduce", "all_reduce", act, m, ar, act_ar, "backward", b), ce]
        diffs.append(
            "Megatron TP: the vocab-parallel embedding all-reduces its output (forward) and the column-parallel "
            "output layer all-reduces its input gradient (backward), a b*s*h all-reduce each per micro-batch; "
            "the vocab-parallel cross-entropy (parallel_output) all-reduces 3 fp32 b*s tensors (max logit, target "
            f"logit, sum of exp) per micro-batch; {where}"
        )
        return _busiest_stage(first, last, pp)

    layer_elems = layers_rank * 6 * h  # each stage's layers: 2 LayerNorms (weight, bias) and 2 biases of h

    def sp_grads(elems: int, final_norm: bool) -> dict:  # the stage's one flattened fp32 all-reduce
        formula = f"2(t-1)/t * (6h * ceil(L/p){' + 2h' if final_norm else ''}) * 4"
        return item("tp_sequence_parallel_grad_all_reduce", "all_reduce", elems * 4, 1, ar, formula, "backward", 4)

    first = [
        item("tp_embedding_all_reduce", "all_reduce", act, m, ar, act_ar, "forward", b),
        item("tp_embedding_grad_all_gather", "all_gather", act, m, g, "m * (t-1)/t * b*s*h * B", "backward", b),
    ]
    last = [
        item(
            "tp_output_layer_all_gather",
            "all_gather",
            act,
            2 * m,
            g,
            "2 * m * (t-1)/t * b*s*h * B",
            "forward,backward",
            b,
        ),
        item("tp_output_layer_reduce_scatter", "reduce_scatter", act, m, g, "m * (t-1)/t * b*s*h * B", "backward", b),
        ce,
    ]
    # the final LayerNorm's 2h sit on the last stage (with p = 1, in the one rank's all-reduce)
    if pp > 1:
        first.append(sp_grads(layer_elems, final_norm=False))
        last.append(sp_grads(layer_elems + 2 * h, final_norm=True))
    else:
        first.append(sp_grads(layer_elems + 2 * h, final_norm=True))
    regather = item(
        "tp_backward_input_all_gather",
        "all_gather",
        act,
        2 * layers_rank * m,
        g,
        "2 * ceil(L/p) * m * (t-1)/t * b*s*h * B",
        "backward",
        b,
    )
    diffs += [
        f"{_MCORE_SP}: the column-parallel linears (QKV, fc1) all-gather their sequence-shard input again in "
        "backward for the weight gradient instead of keeping the gathered input (tensor_parallel/layers.py:522): "
        "2 more b*s*h all-gathers per layer and micro-batch, 6 instead of the paper's 4",
        f"{_MCORE_SP}: the vocab-parallel embedding still all-reduces its output (learned positions turn "
        "reduce_scatter_embeddings off, models/common/embeddings/language_model_embedding.py:48) and scatters it "
        "to the sequence shards (no bytes forward, an all-gather of its gradient backward, "
        "tensor_parallel/mappings.py:293); the column-parallel output layer all-gathers the final norm's output "
        "forward and again backward and reduce-scatters its input gradient (tensor_parallel/layers.py:483, 522, "
        "555); per micro-batch the embedding's 1 b*s*h all-reduce and 1 all-gather, the output layer's 2 "
        f"all-gathers and 1 reduce-scatter, and the vocab-parallel cross-entropy's 3 fp32 b*s all-reduces; {where}",
        f"{_MCORE_SP}: finalize_model_grads all-reduces over the TP group, once per step in one flattened fp32 "
        "tensor, the gradients of the parameters marked sequence_parallel: the LayerNorms (2 per layer, the "
        "final one on the last stage) and the row-parallel linears' biases, added after the reduce-scatter "
        "(tensor_parallel/layers.py:1228; distributed/finalize_model_grads.py:354, 376): 6h per layer "
        f"({layer_elems} elements per stage) + 2h",
    ]
    return [regather, *_busiest_stage(first, last, pp)]


def corrected(fields: dict, cost, workload, root_params: int | None = None) -> dict:
    """`record_fields(...)` with the papers' formulas corrected where the framework moves other bytes, each
    difference stated with the framework setting that causes it (`differences`, one line each). `cost`: the
    adapter's CostInputs (which corrections apply); `workload`: the workload config; `root_params`: the
    parameters of the root unit (not resharded after forward). Measured against the
    traces by `python -m ptbench.ledger` (2 ranks, CPU, DeepSpeed 0.19.8, megatron-core)."""
    items = [dict(c) for c in fields.get("collectives", [])]
    diffs: list[str] = []
    if cost.grad_bucket_all_reduce:
        for it in items:
            if it["name"] == "dp_grad_reduce_scatter":
                n = it["group_size"]
                it.update(
                    op="all_reduce",
                    name="dp_grad_all_reduce",
                    bytes=it["message_bytes"] * ring_factor("all_reduce", n),
                    formula="2(N-1)/N * Psi * B",
                )
                diffs.append(
                    f"DeepSpeed ({cost.sharding}): zero_optimization.use_multi_rank_bucket_allreduce (default true) "
                    "all-reduces the gradient buckets instead of reduce-scattering them: 2(N-1)/N instead of "
                    "(N-1)/N x Psi x B, 1.5x the paper's total"
                )
    # stage3_max_reuse_distance counts the elements fetched whole (a parameter's full ds_numel), so it is
    # compared with the model-parallel shard's parameters, not with them times the data-parallel ranks
    if fields.get("params_per_rank", 0) < cost.live_params_limit:
        if any(it["name"] == "dp_param_all_gather_bwd" for it in items):
            items = [it for it in items if it["name"] != "dp_param_all_gather_bwd"]
            diffs.append(
                "DeepSpeed ZeRO-3: the model's parameters fit stage3_max_reuse_distance (default 1e9 elements), so "
                "a parameter gathered in forward is not released before its use in backward "
                "(runtime/zero/partitioned_param_coordinator.py __params_to_release): no backward re-gather (the "
                "formula's 3 (N-1)/N x Psi x B is 1.5x too high)"
            )
    if cost.vocab_parallel_loss:
        sp = bool(cost.sequence_parallel)
        layer_item = "tp_activation_all_gather" if sp else "tp_activation_all_reduce"  # the papers' per-layer one
        tp_item = next((it for it in items if it["name"] == layer_item), None)
        if tp_item is not None:
            items += _megatron_vocab_parallel(tp_item, fields, workload, sp, diffs)
    if cost.root_unit_gathered and root_params and cost.reshard_after_forward:
        for it in items:
            if it["name"] == "dp_param_all_gather_bwd":
                n, b = it["group_size"], it["bytes_per_elem"]
                share = root_params / (fields["params_per_rank"] or 1)
                it["message_bytes"] -= root_params * b
                it["bytes"] = it["message_bytes"] * ring_factor("all_gather", n)
                it["formula"] = "(N-1)/N * (Psi - Psi_root) * B"
                diffs.append(
                    f"FSDP2: the root unit (embedding, final norm, head: {root_params} parameters, {100 * share:.1f} % "
                    "of Psi) is wrapped with reshard_after_forward=False (as torchtitan), so backward re-gathers "
                    "only the blocks"
                )
    pp = fields.get("pp", 1)
    if pp > 1 and cost.tied_embedding_stages and workload.kind == "language":
        t = fields.get("tp", 1)
        vocab = cost.padded_vocab or workload.vocab_size
        elems = vocab * workload.n_embd / t
        b = 4  # fp32 gradients (autocast keeps fp32 weights)
        items.append(
            _item(
                "pp_tied_embedding_grad_all_reduce",
                "all_reduce",
                "embedding",
                2,
                elems * b,
                1,
                elems * b * ring_factor("all_reduce", 2),
                "2(2-1)/2 * V*h/t * 4",
                "backward",
                b,
            )
        )
        diffs.append(
            "tied embedding across pipeline stages: the first stage's token embedding and the last stage's output "
            "layer are one weight; after backward their gradients are all-reduced between the two stages "
            "(megatron-core's embedding group with share_embeddings_and_output_weights; adapters/_pipeline.py TiedPair)"
        )
    by_op: dict = {}
    for it in items:
        by_op[it["op"]] = by_op.get(it["op"], 0.0) + it["bytes"]
    return {
        **fields,
        "collectives": items,
        "by_op": by_op,
        "total_bytes": float(sum(by_op.values())),
        "differences": diffs,
        "uncorrected_total_bytes": fields.get("total_bytes"),
    }
