"""The optimizer step's temporaries on top of the model states (torch 2.14 / DeepSpeed 0.19.8 as installed): the
optimizer's own (`optimizer_temporaries`) and DeepSpeed 1-3's fp32 gradient partition, the norm's fp64 copies and
gloo's all-gather buffer (README.md, "step")."""

from __future__ import annotations

import math

from ptbench.core.memory_model.inputs import PER_TENSOR, ZERO3_SUB_GROUP_SIZE, Inputs
from ptbench.core.memory_model.states import _fsdp_local, numel

STEP_IMPLS = ("single_tensor", "foreach", "fused", "host")
TORCH_OPTIMIZERS = ("adam", "adamw", "sgd")  # torch.optim classes (bench/core/optim.py); lamb / lars are timm's


def torch_step_impl(device: str) -> tuple[str, str]:
    """(implementation, why) torch's Adam / AdamW / SGD pick when neither foreach nor fused is passed (the
    harness passes neither: bench/core/optim.py): torch/optim/adam.py:937-968 (sgd.py:283) ask
    optimizer.py:170-195 `_default_to_fused_or_foreach`, whose foreach needs every parameter of type Tensor,
    Parameter or DTensor (optimizer.py:45; DTensor added by torch/distributed/tensor/__init__.py:78-79, so FSDP2
    and tensor parallel alike) on a foreach device: utils/_foreach_utils.py:8-10 lists cuda, not cpu. fused
    is never the default (adam.py:944-945)."""
    if device == "cuda":
        return "foreach", "torch foreach on CUDA (optimizer.py:187-194: CUDA tensors)"
    return (
        "single_tensor",
        "torch single-tensor for-loop on CPU (foreach devices: cuda, not cpu, _foreach_utils.py:8-10)",
    )


def harness_step_groups(shapes, weight_decay: float) -> list[tuple[list, float]]:
    """The harness's optimizer parameter groups (bench/core/optim.py `param_groups`): the shapes of the tensors
    of >= 2 dimensions with `weight_decay`, then the rest with 0, in `parameters()` order (the order a torch
    optimizer steps them)."""
    decay = [tuple(s) for s in shapes if len(s) >= 2]
    rest = [tuple(s) for s in shapes if len(s) < 2]
    return [(g, wd) for g, wd in ((decay, weight_decay), (rest, 0.0)) if g]


def optimizer_temporaries(groups, optimizer: str, impl: str, momentum: float = 0.9) -> tuple[float, str]:
    """(bytes, why): the most the optimizer's own temporaries hold at once while it steps `groups` ([(elements of
    each fp32 tensor it steps, in order), weight decay] per parameter group; groups are stepped one after
    another and a group's temporaries are freed when its step returns). torch 2.14, 4-byte (fp32) tensors:

    adam / adamw, single_tensor (adam.py:347-550): per tensor i, `denom = (exp_avg_sq.sqrt() / bc2_sqrt)` (:544)
        holds the sqrt and the quotient (8 n_i) while the previous tensor's denom is still bound to `denom`
        (4 n_{i-1}); adam (L2, not decoupled) with weight decay adds `grad = grad.add(param)` (:428, 4 n_i;
        the previous one is dropped at :397): max_i 4 n_{i-1} + (8 + 4 [adam, wd]) n_i.
    adam / adamw, foreach (:553-800): `_foreach_sqrt` (:790) of the whole group (4 x group); adam's weight-decay
        list (:697) is deleted (:726) before it: 4 x the group's elements either way.
    sgd: with weight decay `grad.add(param)` (sgd.py:355: 4 n_i, single_tensor) / `_foreach_add` (:429: 4 x the
        group, foreach); momentum updates its buffer in place.
    fused (torch._fused_adamw_, TE / apex FusedAdam) and host (DeepSpeed's CPU Adam on offloaded state): none on
    the device. lamb / lars (timm): not modelled (0)."""
    name = optimizer.strip().lower()
    if impl not in STEP_IMPLS:
        raise ValueError(f"optimizer implementation must be one of {', '.join(STEP_IMPLS)}, got {impl!r}")
    if impl in ("fused", "host"):
        return 0.0, f"0 ({impl}: no temporaries on the device)"
    if name not in TORCH_OPTIMIZERS:
        return 0.0, f"0 ({name}: timm's optimizer, its temporaries not modelled)"
    top, why = 0.0, "0"
    for elems, wd in groups:
        if not elems:
            continue
        if name in ("adam", "adamw"):
            coupled = 4 if (name == "adam" and wd) else 0
            if impl == "foreach":
                b, how = 4.0 * sum(elems), "4 x the group (_foreach_sqrt, adam.py:790)"
            else:
                b = max(4.0 * p + (8 + coupled) * n for p, n in zip([0, *elems[:-1]], elems))
                how = f"max over tensors of 4 n_prev + {8 + coupled} n (sqrt and quotient, adam.py:544" + (
                    "; L2 grad.add, :428)" if coupled else ")"
                )
        else:  # sgd
            if not wd:
                continue
            b = 4.0 * (sum(elems) if impl == "foreach" else max(elems))
            how = "4 x the group (_foreach_add, sgd.py:429)" if impl == "foreach" else "4 n, the largest (sgd.py:355)"
        if b > top:
            top, why = b, f"{how}; {len(elems)} tensor(s), {sum(elems):,} elements"
    return top, why


def _sub_groups(local: float, wd: float) -> list:
    """DeepSpeed stage 3 steps a group's flat fp32 partition in sub-groups of at most sub_group_size elements."""
    out = []
    while local > 0:
        out.append(([min(local, ZERO3_SUB_GROUP_SIZE)], wd))
        local -= ZERO3_SUB_GROUP_SIZE
    return out


def rank_step_groups(name: str, groups, n: int, rank: int, flat: bool = False) -> list[tuple[list, float]]:
    """`groups` ([(shapes, weight decay)], `harness_step_groups`) as rank `rank` of `n` steps them, each as
    [(elements of each tensor, in order), wd]: DeepSpeed 1-2 one flat fp32 partition of ceil(group / N)
    elements per group (stage_1_and_2.py:3113-3126, single_partition_of_fp32_groups[i]); 3 the per-tensor
    ceil(numel / N) pieces as one flat sub-group of at most sub_group_size (stage3.py:2686-2693); FSDP2 each
    tensor's dim-0 chunk (torch.chunk, the DTensor's local shard); `flat`: one flat tensor of the whole group
    (DeepSpeed's BF16 optimizer at stage 0); else whole tensors."""
    out: list = []
    for shapes, wd in groups:
        elems = [numel(s) for s in shapes]
        if name in ("zero1", "zero2"):
            out.append(([math.ceil(sum(elems) / n)], wd))
        elif name == "zero3":
            out += _sub_groups(sum(math.ceil(k / n) for k in elems), wd)
        elif name == "fsdp":
            local = [_fsdp_local(s, n, rank) for s in shapes]
            out.append(([k for k in local if k], wd))
        elif flat:
            out.append(([sum(elems)], wd))
        else:
            out.append((elems, wd))
    return out


def _grad_piece(name: str, groups, n: int, rank: int) -> int:
    """DeepSpeed: the largest gradient piece rank `rank` of `n` holds (elements): stages 1-2 the largest part of
    a tensor inside the rank's 1/N slice of its group's flat buffer; 3 the largest ceil(numel / N)."""
    top = 0
    for shapes, _ in groups:
        elems = [numel(s) for s in shapes]
        if name == "zero3":
            top = max([top, *(math.ceil(k / n) for k in elems)])
        elif name in ("zero1", "zero2"):
            size = math.ceil(sum(elems) / n)
            lo, hi, start = rank * size, (rank + 1) * size, 0
            for k in elems:
                top = max(top, min(hi, start + k) - max(lo, start))
                start += k
    return top


def step_impl(inp: Inputs) -> tuple[str, str]:
    """(the optimizer's implementation, why): given, torch's default for the device, or the host under offload."""
    given = inp.training.optimizer_impl
    if given is None:
        impl, why = torch_step_impl(inp.training.device)
    elif given in STEP_IMPLS:
        impl, why = given, f"{given} (given)"
    else:
        raise ValueError(f"optimizer_impl must be one of {', '.join(STEP_IMPLS)} or None, got {given!r}")
    if inp.deepspeed and inp.cost.offload_optimizer:
        impl, why = "host", "host (offload_optimizer: DeepSpeed's CPU Adam / torch on the host partition)"
    return impl, why


def step_transient(inp: Inputs, P: float, part: float, notes: list) -> tuple[float, float, str]:
    """(step_transient, the optimizer's temporaries in it, formula) of a rank holding P parameters (part: its
    DeepSpeed partition); the busiest rank (or `inp.rank`) when the shapes give each rank's tensors."""
    impl, impl_why = step_impl(inp)  # checked first, even when offload leaves nothing on the device
    if inp.deepspeed and inp.cost.offload_optimizer:
        return 0.0, 0.0, "0 (offload_optimizer: the fp32 gradient partition is in host memory, stepped there)"
    groups, name = inp.training.step_groups, inp.sharding
    if bool(groups) and (name in PER_TENSOR or not inp.model_parallel):
        per_rank, rule = _groups_by_shapes(inp)
    else:  # no shapes, or a model-parallel shard whose tensors the shapes do not give: one group (a bound)
        if impl == "single_tensor" and not inp.deepspeed:
            return _single_tensor_bound(inp, P, impl_why, notes)
        per_rank, rule = _one_group(inp, P, part), "one group of the rank's elements (an upper bound)"
    peak, opt, how = _largest_term(inp, per_rank, impl)
    if not inp.deepspeed:
        return peak, opt, (f"{impl_why}: {how} [{rule}]" if peak else f"0 ({impl_why}: no temporaries)")
    src = (
        "stage_1_and_2.py:2684 fp64 norms, :3113-3118 flatten + .to(fp32), :3126 .grad, freed :3141-3142; "
        if name != "zero3"
        else f"stage3.py:2457 fp64 norms, :2686-2693 flatten + .to(fp32) per sub-group of <= {ZERO3_SUB_GROUP_SIZE:,}, "
        "freed :2735; "
    )
    return peak, opt, f"DeepSpeed step, the largest of its terms: {how} [{rule}; {src}client optimizer: {impl_why}]"


def _groups_by_shapes(inp: Inputs) -> tuple[list, str]:
    """[(the rank's groups as its optimizer steps them, its largest gradient piece: DeepSpeed's norm)] per rank."""
    name, N, groups, rank = inp.sharding, inp.layout.dp, inp.training.step_groups, inp.rank
    flat = name == "zero0" and inp.half
    per_rank = []
    if name == "distributed_optimizer" and inp.training.device == "cuda":  # Megatron: each rank steps 1/N of each
        per_rank.append(([([math.ceil(sum(numel(x) for x in g) / N)], w) for g, w in groups], 0))
    else:
        sharded = name in PER_TENSOR
        for r in range(N) if (rank is None and sharded) else [rank or 0]:
            per_rank.append((rank_step_groups(name, groups, N, r, flat=flat), _grad_piece(name, groups, N, r)))
    rule = "per group, the busiest rank" + (
        " (flat fp32 group, DeepSpeed's BF16 optimizer: not validated)" if flat else ""
    )
    return per_rank, rule


def _one_group(inp: Inputs, P: float, part: float) -> list:
    """The rank's elements as one group: its DeepSpeed partition (a stage-3 sub-group at most), P/N, or P."""
    name, N = inp.sharding, inp.layout.dp
    if inp.deepspeed:
        whole = part if name != "zero3" else min(part, ZERO3_SUB_GROUP_SIZE)
    elif name == "fsdp" or (name == "distributed_optimizer" and inp.training.device == "cuda"):
        whole = P / N
    else:
        whole = P
    return [([([whole], float(inp.training.weight_decay))], whole)]


def _single_tensor_bound(inp: Inputs, P: float, impl_why: str, notes: list) -> tuple[float, float, str]:
    """A model-parallel shard stepped single-tensor: 8 L1 + 4 L2 (+ 4 L1, L2 adam) from the two largest whole
    tensors, at most (12 + 4) P; without shapes not estimated."""
    groups, opt_name, wd = inp.training.step_groups, inp.training.optimizer.strip().lower(), inp.training.weight_decay
    if not groups:
        notes.append("the optimizer step's temporaries (single-tensor, CPU) need the parameter shapes: not estimated")
        return 0.0, 0.0, f"0 ({impl_why}; not estimated without the parameter shapes)"
    big = sorted((numel(x) for g, _ in groups for x in g), reverse=True) + [0, 0]
    coupled = 4 if (opt_name == "adam" and float(wd)) else 0
    opt = min((8 + coupled) * big[0] + 4 * big[1], (12 + coupled) * P)
    if opt_name not in ("adam", "adamw"):
        opt = 4 * min(big[0], P) if (float(wd) and opt_name == "sgd") else 0
    how = (
        f"{impl_why}: the optimizer's temporaries, bounded by the two largest whole tensors "
        f"(8 L1 + 4 L2{' + 4 L1 (adam, L2 decay)' if coupled else ''}, at most {12 + coupled} P): "
        "the rank steps shards / a stage of them"
    )
    return opt, opt, how


def _largest_term(inp: Inputs, per_rank: list, impl: str) -> tuple[float, float, str]:
    """(peak, the optimizer's part, formula): the largest of each rank's terms, the busiest rank's."""
    best = (-1.0, 0.0, "")
    for groups, piece in per_rank:
        top = max(_terms(inp, groups, piece, impl), key=lambda t: t[0])
        if top[0] > best[0]:
            best = top
    return best


def _terms(inp: Inputs, groups: list, piece: int, impl: str) -> list:
    """What the step holds at each moment, (bytes, the optimizer's part, why); DeepSpeed first the gradient norm's
    fp64 copy of each gradient piece (get_norm_dtype), then per group its fp32 gradient partition + the
    optimizer's temporaries, the bf16 copy beside its conversion, and gloo's all-gather buffer (CPU, stages 1-2)."""
    ds, t = inp.deepspeed, inp.training
    gb = 2 if inp.half else 4  # DeepSpeed's model (bit16) dtype
    terms = [
        (8.0 * piece if ds else 0.0, 0.0, f"8 x {piece:,} the gradient norm's fp64 copy of the largest gradient piece")
    ]
    for elems, w in groups:
        opt, how = optimizer_temporaries([(elems, w)], t.optimizer, impl, t.momentum)
        g = sum(elems)
        if not ds:
            terms.append((opt, opt, f"the optimizer's temporaries, {how}"))
            continue
        terms.append((4.0 * g + opt, opt, f"4 x {g:,} fp32 gradient partition + the optimizer's temporaries, {how}"))
        if inp.half:  # the flat bf16 copy beside its fp32 conversion (under fp32 the copy is the fp32 gradient)
            terms.append((6.0 * g, 0.0, f"6 x {g:,}: the flat bf16 copy and its fp32 conversion"))
        if inp.sharding in ("zero1", "zero2") and t.device == "cpu":  # gloo all-gathers through a flat buffer
            terms.append(
                (gb * inp.layout.dp * g, 0.0, f"{gb} x N x {g:,}: gloo's all-gather of the updated group (CPU only)")
            )
    return terms
