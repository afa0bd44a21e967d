"""Model states per rank ([ZeRO] Sec. 3.1 and 5): the model-parallel shard each stage holds, and its parameters,
gradients, optimizer state, fp32 master and the transient buffers beside them, by the sharding the adapter
states (README.md, "Model states" and "Model-parallel shard")."""

from __future__ import annotations

import math

from ptbench.core.memory_model.inputs import OPTIMIZER_STATE_BYTES, PARTS, PER_TENSOR, REPLICATED, Inputs


def optimizer_state_bytes(optimizer: str, momentum: float = 0.9) -> int:
    """Bytes of optimizer state per parameter element (fp32 state): Adam/AdamW/LAMB two moments (8),
    SGD with momentum and LARS one buffer (4), SGD without momentum none."""
    name = optimizer.strip().lower()
    if name not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}")
    if name == "sgd" and not momentum:
        return 0
    return OPTIMIZER_STATE_BYTES[name]


def numel(shape) -> int:
    return math.prod(shape) if shape else 1


def flat_partition(numels: list[int], n: int, rank: int) -> tuple[int, int]:
    """DeepSpeed ZeRO-1/2: (elements of rank's 1/n slice of the flat buffer, elements of the gradients it
    keeps: every tensor overlapping that slice, whole)."""
    part = math.ceil(sum(numels) / n)
    lo, hi = rank * part, (rank + 1) * part
    start, overlap = 0, 0
    for k in numels:
        if start < hi and start + k > lo:
            overlap += k
        start += k
    return part, overlap


def gpt2_replicated_under_tp(layers: int, hidden: int, seq_len: int) -> int:
    """Parameters a GPT-2 keeps whole on every tensor-parallel rank (adapters/tensor_parallel.py's plan):
    the position embedding (s h), per layer two LayerNorms (4 h) and the row-parallel c_proj biases
    (2 h), the final LayerNorm (2 h)."""
    return seq_len * hidden + 6 * hidden * layers + 2 * hidden


def gpt2_stage_params(params: int, *, layers: int, hidden: int, seq_len: int, vocab: int, pp: int) -> tuple[int, int]:
    """(first stage, last stage) parameters of a GPT-2 split over `pp` stages, layers evenly
    (ceil(L/p) on each end stage). `params` counts the tied embedding once; with pp > 1 the last stage
    holds its own copy of the head (V h)."""
    embed = vocab * hidden + seq_len * hidden
    head = 2 * hidden  # final LayerNorm
    block = (params - embed - head) / layers if layers else 0
    per = math.ceil(layers / pp) if layers else 0
    if pp == 1:
        return params, params
    first = embed + per * block
    last = per * block + head + vocab * hidden
    return int(round(first)), int(round(last))


def _fsdp_local(s, n: int, r: int) -> int:
    """FSDP2: the elements of tensor `s` rank r of n holds (its dim-0 chunk, torch.chunk)."""
    rows = s[0] if s else 1
    chunk = math.ceil(rows / n)
    mine = max(0, min(chunk, rows - r * chunk))
    return mine * (numel(s) // rows if rows else 0)


def _dp_shard(sharding: str, shapes, n: int, rank: int | None = None, whole=frozenset()) -> dict:
    """Per-tensor partition of DeepSpeed / FSDP over n ranks: elements of `rank` (None: the busiest rank).
    Returns {part: elements of the flat partition (stages 1-2) or of the local pieces (3, fsdp),
    grad_elems: gradient elements held at the step, param_elems, rank}. `whole`: indices of the tensors FSDP
    keeps whole on every rank (its ignored parameters)."""
    numels = [numel(s) for s in shapes]
    psi = sum(numels)
    best = None
    for r in range(n) if rank is None else (rank,):
        if sharding in ("zero1", "zero2"):
            part, overlap = flat_partition(numels, n, r)
            cand = {"part": part, "grad_elems": overlap, "param_elems": psi}
        elif sharding == "zero3":  # every rank holds ceil(numel/N) of each tensor
            local = sum(math.ceil(k / n) for k in numels)
            return {"part": local, "grad_elems": local, "param_elems": local, "rank": 0 if rank is None else rank}
        elif sharding == "fsdp":
            local = sum(numel(s) if i in whole else _fsdp_local(s, n, r) for i, s in enumerate(shapes))
            cand = {"part": local, "grad_elems": local, "param_elems": local}
        else:
            raise ValueError(sharding)
        cand["rank"] = r
        key = cand["param_elems"] + cand["grad_elems"] + cand["part"]
        if best is None or key > best[0]:
            best = (key, cand)
    return best[1]


def zero3_gathered(
    numels: list[int],
    n: int,
    largest_unit: int = 0,
    *,
    param_persistence_threshold: int = 100_000,
    max_live_parameters: int = 1_000_000_000,
    max_reuse_distance: int = 1_000_000_000,
    prefetch_bucket_size: int = 50_000_000,
) -> dict:
    """DeepSpeed 0.19 stage 3's parameters on one rank, in elements (its config names):
    - stage3_param_persistence_threshold: a tensor of at most that many elements is never partitioned (whole
      on every rank, `persistent`); the rest are split ceil(numel/n) per tensor (`partition` counts both);
    - from the second step (once the module trace is recorded) a parameter gathered in forward is not
      released when it is used again within stage3_max_reuse_distance elements of fetches, and the end of
      forward prefetches the backward's first stage3_prefetch_bucket_size elements: when the non-persistent
      parameters fit either, every one stays gathered from forward to backward (`gathered` = all of them
      beside their partitions: all parameters kept gathered at small scale, 4.3x the partition at 64 GPUs).
      Measured on DeepSpeed 0.19.8 (CPU, 2 ranks, gpt2_tiny: every parameter AVAILABLE after forward from
      step 1, with either setting large; stage3_max_live_parameters = 1e5 did not cap it);
    - otherwise (not validated) the largest module plus the prefetch bucket: min(largest + prefetch, all).
    `max_live_parameters` is accepted for the record but does not enter the count (see above)."""
    persistent = sum(k for k in numels if k <= param_persistence_threshold)
    sharded = [k for k in numels if k > param_persistence_threshold]
    rest = sum(sharded)
    partition = persistent + sum(math.ceil(k / n) for k in sharded)
    if rest <= max_reuse_distance or rest <= prefetch_bucket_size:
        gathered = rest
        why = (
            f"all {rest:,} non-persistent elements stay gathered from forward to backward (<= stage3_max_reuse_distance"
            f" {max_reuse_distance:,} or stage3_prefetch_bucket_size {prefetch_bucket_size:,})"
        )
    else:
        gathered = min(rest, largest_unit + prefetch_bucket_size)
        why = f"largest unit {largest_unit:,} + stage3_prefetch_bucket_size {prefetch_bucket_size:,} (not validated)"
    return {"persistent": persistent, "partition": partition, "gathered": gathered, "why": why}


def stage_shards(inp: Inputs, formula: dict, notes: list) -> list[tuple[str, float]]:
    """(which stage, the parameters it holds) of the stages that may be the busiest: every rank's shard without a
    pipeline, the end stages (and the largest, given `stage_params`) with one; tensor parallelism then divides the
    sharded weights by t and keeps the replicated ones whole."""
    m, pp, tp = inp.model, inp.layout.pp, inp.layout.tp
    if pp > 1:
        if m.stage_params:
            if len(m.stage_params) != pp:
                raise ValueError(f"stage_params has {len(m.stage_params)} entries for pp={pp}")
            top = max(range(pp), key=lambda i: m.stage_params[i])
            stages = [("first", float(m.stage_params[0])), ("last", float(m.stage_params[-1]))]
            if top not in (0, pp - 1):
                stages.append((f"stage {top}", float(m.stage_params[top])))
            formula["params_per_rank"] = "stage_params (given)"
        elif m.kind == "language" and m.layers and m.hidden and m.seq_len and m.vocab:
            dims = dict(layers=m.layers, hidden=m.hidden, seq_len=m.seq_len, vocab=m.vocab)
            first, last = gpt2_stage_params(m.params, **dims, pp=pp)
            stages = [("first", float(first)), ("last", float(last))]
            formula["params_per_rank"] = (
                "first: V h + s h + ceil(L/p) block; last: ceil(L/p) block + 2h + V h (head copy)"
            )
        else:
            stages = [("any", m.params / pp)]
            formula["params_per_rank"] = "Ψ/p"
            notes.append(
                "pipeline stages assumed to hold Ψ/p parameters each (no stage_params): real splits are uneven"
            )
    else:
        stages = [("all", float(m.params))]
        formula["params_per_rank"] = "Ψ"
    if tp > 1:
        replicated = m.replicated_params
        if replicated is None:
            gpt2 = m.kind == "language" and m.hidden and m.layers
            replicated = gpt2_replicated_under_tp(m.layers, m.hidden, m.seq_len) if gpt2 else 0
        stages = [(s, (p - replicated) / tp + replicated) for s, p in stages]
        formula["params_per_rank"] += f" -> (P - R)/t + R, R = {replicated:,} replicated"
    return stages


def states(inp: Inputs, P: float, formula: dict, notes: list) -> tuple[dict, float]:
    """(bytes of each of PARTS but activations, the rank's DeepSpeed partition in elements) of a rank holding
    a shard of P parameters."""
    name, N = inp.sharding, inp.layout.dp
    K = optimizer_state_bytes(inp.training.optimizer, inp.training.momentum)
    shapes = inp.model.shapes
    out = dict.fromkeys(PARTS, 0.0)
    whole = whole_tensors(inp)
    if name in PER_TENSOR and shapes and N > 1:
        sh = _dp_shard(name, shapes, N, inp.rank, whole)
        part, grad_elems, param_elems = sh["part"], sh["grad_elems"], sh["param_elems"]
        rule = "per tensor" + (f", {len(whole)} BatchNorm tensors whole" if whole else "")
    else:
        part = P / N
        grad_elems = P if name in REPLICATED else P / N
        param_elems = P / N if name in ("zero3", "fsdp") else P
        rule = "Ψ/N"
    if name in REPLICATED:
        _replicated(inp, out, P, K, formula, notes)
    else:
        _sharded(inp, out, (P, part, grad_elems, param_elems), K, rule, formula, whole)
    _offload(inp, out, formula)
    return out, part


def _replicated(inp: Inputs, out: dict, P: float, K: int, formula: dict, notes: list) -> None:
    """Whole parameters and gradients (DDP, Horovod, model parallel, ZeRO-0; Megatron's optimizer over dp)."""
    name, N, b = inp.sharding, inp.layout.dp, inp.state_bytes
    out["params"], out["grads"] = b * P, b * P
    if name == "distributed_optimizer" and inp.training.device == "cuda":
        out["optimizer"] = K * P / N
        formula["optimizer"] = f"{K} P/N (Megatron distributed optimizer)"
    else:
        out["optimizer"] = K * P
        formula["optimizer"] = f"{K} P"
    formula["params"] = f"{b} P"
    formula["grads"] = f"{b} P"
    if name == "zero0" and inp.half:
        out["master"] = 4 * P
        formula["master"] = "4 P"
        notes.append(
            "zero0 in half precision (DeepSpeed's BF16/FP16 optimizer wrapper) modelled as an "
            "unsharded fp32 master + moments: not validated"
        )
    if inp.cost.fusion_buffer_bytes:
        out["transient"] = min(float(inp.cost.fusion_buffer_bytes), 4 * P)
        formula["transient"] = "min(fusion threshold, 4P) fusion buffer"


def _sharded(inp: Inputs, out: dict, elems: tuple, K: int, rule: str, formula: dict, whole=frozenset()) -> None:
    """ZeRO 1-3 and FSDP: the partition, the fp32 master (DeepSpeed), and what backward gathers or holds whole."""
    name, N, b, m = inp.sharding, inp.layout.dp, inp.state_bytes, inp.model
    P, part, grad_elems, param_elems = elems
    out["params"] = b * param_elems
    out["grads"] = b * grad_elems
    out["optimizer"] = K * part
    formula["params"] = f"{b} P" + ("" if name in ("zero1", "zero2") else f"/N ({rule})")
    formula["grads"] = f"{b} P/N ({rule})"
    formula["optimizer"] = f"{K} P/N ({rule})"
    if name != "fsdp":
        out["master"] = 4 * part
        formula["master"] = f"4 P/N ({rule})"
    if name == "zero1" and N > 1:
        out["transient"] = b * P - out["grads"]
        formula["transient"] = "full gradients during backward: b P - grads at the step"
    gb = 2 if inp.half else 4
    settings = inp.zero3_settings
    if name == "zero3" and settings and m.shapes and N > 1:
        z = zero3_gathered([numel(x) for x in m.shapes], N, m.largest_unit_params, **settings)
        out["params"] = b * z["partition"]
        formula["params"] = f"{b} x ({z['persistent']:,} persistent elements whole + the rest / N per tensor)"
        out["transient"] = gb * z["gathered"]
        formula["transient"] = f"{gb} x {z['gathered']:,} gathered: {z['why']}"
    elif name == "fsdp" and N > 1 and m.units and m.shapes:
        out["transient"], formula["transient"] = fsdp_backward_buffers(inp, whole)
    elif name in ("zero3", "fsdp") and m.largest_unit_params:
        out["transient"] = gb * m.largest_unit_params * (N - 1) / N if N > 1 else 0.0
        formula["transient"] = f"{gb} x largest gathered unit ({m.largest_unit_params:,}) x (N-1)/N"
        if name == "fsdp" and N > 1 and m.kind == "vision":
            # FSDP2 computes a unit's gradients unsharded, in the parameters' dtype, before its reduce-scatter
            # (fully_shard's post-backward foreach_reduce): beside the gathered unit at its backward, at the peak
            # where that unit's backward comes first (VGG-16's 103M-element fc6; python -m ptbench.scale). GPT-2's
            # largest unit is the root (embedding, tied head), whose gradient comes after the loss's temporaries,
            # the peak, are freed: not added there
            out["transient"] += gb * m.largest_unit_params
            formula["transient"] += f" + {gb} x its unsharded gradient in backward"


def whole_tensors(inp: Inputs) -> frozenset:
    """Indices (in the model's shapes) of the tensors an FSDP adapter keeps whole on every rank and all-reduces:
    BatchNorm's parameters where its cost inputs say so (fsdp under bf16 / fp16: batch_norm takes fp32 weights
    beside its fp32 running statistics)."""
    # read with a default: a cost input the adapters' layout module states (ptbench.core.layout.CostInputs)
    if inp.sharding != "fsdp" or not inp.cost.whole_norm_params:
        return frozenset()
    return frozenset(inp.model.norms)


def _fsdp_units(inp: Inputs, whole) -> tuple[list[int], list[int]]:
    """(padded, plain) elements of each FSDP2 unit in forward order, its whole tensors left out, empty units
    dropped: FSDP2 pads dim 0 of every tensor to a multiple of N for its all-gathers and reduce-scatters."""
    from ptbench.core.layout import padded_elements

    shapes, n = inp.model.shapes, inp.layout.dp
    padded, plain = [], []
    for unit in inp.model.units:
        own = [shapes[i] for i in unit if i not in whole]
        if own:
            padded.append(padded_elements(own, n))
            plain.append(sum(numel(s) for s in own))
    return padded, plain


def fsdp_backward_buffers(inp: Inputs, whole=frozenset()) -> tuple[float, str]:
    """(bytes, formula): what FSDP2 holds beside the activations in the backward of its busiest unit k (units in
    forward order, backward runs them in reverse): unit k gathered and unit k-1 prefetched (all-gather outputs of
    the padded shapes, in the gather dtype), unit k's unsharded gradients (gather dtype, unpadded) and the fp32
    reduce-scatter input of unit k+1, the unit before it in backward (FSDP2 keeps one reduce-scatter in flight).
    Measured against FSDPMemTracker by `python -m ptbench.scale` (ResNet-50, VGG-16 at 8-1024 ranks)."""
    padded, plain = _fsdp_units(inp, whole)
    if not padded:
        return 0.0, "0 (no FSDP2 unit holds sharded parameters)"
    gb = 2 if inp.half else 4
    # (the unit prefetched while unit k runs backward, the unit whose reduce-scatter is in flight)
    around = [(padded[k - 1] if k else 0, padded[k + 1] if k + 1 < len(padded) else 0) for k in range(len(padded))]
    held = [gb * (padded[k] + ahead + plain[k]) + 4.0 * behind for k, (ahead, behind) in enumerate(around)]
    top = max(range(len(held)), key=held.__getitem__)
    ahead, behind = around[top]
    return held[top], (
        f"FSDP2 in the backward of unit {top} of {len(padded)}: {gb} x ({padded[top]:,} gathered + {ahead:,} "
        f"prefetched, dim 0 padded to a multiple of N, + its {plain[top]:,}-element unsharded gradient) + 4 x "
        f"{behind:,} the previous unit's reduce-scatter input"
    )


def _offload(inp: Inputs, out: dict, formula: dict) -> None:
    """ZeRO-Offload: the optimizer state, master and gradient partitions (and stage 3's parameters) in host memory."""
    name, N = inp.sharding, inp.layout.dp
    if inp.cost.offload_optimizer and name in ("zero1", "zero2", "zero3"):
        if name == "zero1" and N > 1:
            out["transient"] += out["grads"]  # backward still holds every full gradient on the device
        out["optimizer"] = out["master"] = out["grads"] = 0.0
        formula["optimizer"] = formula["master"] = formula["grads"] = "0 (offload_optimizer: in host memory)"
    if inp.cost.offload_params and name == "zero3":
        out["params"] = 0.0
        formula["params"] = "0 (offload_params: in host memory; gathered units in transient)"
