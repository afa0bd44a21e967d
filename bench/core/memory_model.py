"""Predicted memory per rank of each adapter: pure formulas (no torch or framework import at module level).

`predict(sharding, params=..., world_size=..., dp=..., ...)` returns the bytes the busiest rank (the
busiest device, for gpipe, which drives several from one process) should hold: parameters,
gradients, optimizer state, DeepSpeed's fp32 master copy, transient buffers and activations, and
their total. `fits(total, device_bytes)` says whether that total fits a device. `predict_run(cfg,
plan, build_model)` fills every argument from a composed config and its run plan (the one call the
runner makes): the layout and the adapter's cost inputs (ptbench.core.layout) come from the plan, so
no adapter is named here. `device_bytes()` is the memory a rank may use on this machine.

Model states ([ZeRO] Rajbhandari et al., SC 2020, Sec. 3.1 and 5, Fig. 1), Ψ = parameters (elements)
of the rank's model-parallel shard P, N = data-parallel size, K = optimizer state bytes per element,
by the state sharding an adapter states (its `cost_inputs().sharding`):

    sharding (fp32)                    params   grads        optimizer   master   transient                     step (AdamW)
    none (ddp, horovod, tensor_parallel, pipeline, gpipe), zero0, distributed_optimizer on a CPU
                                       4P       4P           K P         -        fusion buffer (horovod)       opt(P)
    distributed_optimizer on CUDA (megatron with adam/adamw)
                                       4P       4P           K P/N       -                                      opt(P/N)
    zero1 (DeepSpeed 0.19)             4P       4P/N (*)     K P/N       4P/N     full gradients in backward    4P/N + opt
    zero2                              4P       4P/N (*)     K P/N       4P/N                                   4P/N + opt
    zero3                              4P/N     4P/N         K P/N       4P/N     the largest gathered module   4P/N + opt
    fsdp (FSDP2)                       4P/N     4P/N         K P/N       -        the largest gathered module   opt(P/N)

    opt: the optimizer's temporaries (see "step" below): CUDA foreach 4 x the largest parameter group; CPU
    single-tensor 8 x the largest tensor (+ 4 x the one before it); fused 0.
    total = params + grads + optimizer + master + max(transient + activations, step)

K: adam / adamw / lamb 8 (two moments), sgd with momentum / lars 4 (one buffer; sgd without momentum 0).
"master": DeepSpeed stages >= 1 keep an fp32 copy of their partition even when the model is fp32
(their optimizer steps that copy and copies it back; bench/memory_study.py). With bf16 / fp16,
DeepSpeed stages 1-3 hold parameters and gradients in 2 bytes and keep master + moments (12 bytes per
element for Adam) per partition: the paper's 2Ψ + 2Ψ + KΨ/N split. Every other adapter runs half
precision as autocast around fp32 weights (DDP, Horovod, tensor parallel, pipelines, Megatron's
bf16 here, FSDP2's MixedPrecisionPolicy), so its states do not change; FSDP then gathers in bf16.
(*) "grads" are what a rank holds at the optimizer step. DeepSpeed 0.19 reduces ZeRO-1's gradients
after backward into the same partition as ZeRO-2, so at rest ZeRO-1 equals ZeRO-2; during backward
ZeRO-1 holds full-size gradients (bP(1 - 1/N) more: `transient`), which is the paper's 4Ψ + 4Ψ +
KΨ/N at the peak. With `shapes` (the model's parameter shapes in `parameters()` order) the
partition follows the framework's rule per tensor instead of Ψ/N: DeepSpeed 1-2 cut one flat buffer
into N equal pieces and keep whole gradients of every tensor touching a rank's piece; DeepSpeed 3
splits each tensor into ceil(numel/N); FSDP2 splits each tensor along dim 0 (torch.chunk).
"step" (`step_transient`, on top of the model states: backward's activations, full gradients (zero1) and
gathered parameters (zero3) are freed by then, so the step's peak is the model states + step, not a sum): the
most the optimizer step holds at once beyond the states, measured on CPU with torch.profiler's memory events
around each adapter's optimizer phase (`python -m ptbench.memory_study --step`: ddp, fsdp, zero1-3 at 2 ranks,
fp32 and bf16, within 50 bytes).
- The optimizer's own temporaries (`step_optimizer`, `optimizer_temporaries`). Every adapter but Megatron's
  GPU distributed optimizer steps a torch Adam / AdamW / SGD (bench/core/optim.py; DeepSpeed takes it as its
  client optimizer, engine.py:2335-2336, and steps the fp32 master partitions with it: no FusedAdam unless
  the config names an optimizer, which only offload does, DeepSpeed's CPU Adam on the host). torch 2.14
  picks the implementation by device (`torch_step_impl`): CUDA foreach, CPU the single-tensor for-loop,
  never fused by default. Single-tensor Adam/AdamW holds per tensor 8 n_i (sqrt and quotient) plus the
  previous tensor's denominator 4 n_{i-1} (+4 n_i for Adam's L2 weight decay): the largest tensor sets it
  (DDP on gpt2_tiny: 8 x the token embedding); foreach holds 4 x the whole parameter group (its
  `_foreach_sqrt`); fused (Megatron with Transformer Engine / Apex on CUDA) none. The harness's two
  parameter groups (>= 2 dimensions with weight decay, then the rest) are stepped one after another.
- DeepSpeed 1-3 (`step_transient` is the largest of): the gradient norm's fp64 copy of each gradient piece
  (8 x the rank's largest piece, stage_1_and_2.py:2684, stage3.py:2457; computed even without clipping);
  per group the fp32 gradient partition made from the gradients (`flat.to(fp32)`, the .grad of the fp32
  master, DS 0.19.8 stage_1_and_2.py:3113-3142, stage3.py:2686-2735: 4 P/N; under fp32 a view when a rank's
  partition lies inside one tensor, not modelled: the busiest rank copies) plus the optimizer's temporaries on it: 12 P/N (CPU) / 8 P/N (CUDA)
  for AdamW; the flat bf16 copy beside its fp32 conversion (6 P/N) for the moment of the conversion (never
  the peak measured: the bf16 copy is freed before the optimizer runs); on CPU stages 1-2 all-gather the
  updated group through gloo's flat buffer (b N x P/N, after the fp32 gradients are freed). Stage 3 steps
  sub-groups of at most sub_group_size = 1e9 elements. With offload_optimizer all of it is on the host (0).
Without parameter shapes the rank's elements are taken as one group (an upper bound); for tensor / pipeline
parallel shards the single-tensor bound is 8 L1 + 4 L2 from the model's two largest tensors.

Model-parallel shard P: tensor parallel divides the sharded weights by t and keeps `replicated`
parameters whole on every TP rank (GPT-2: position embedding, LayerNorms, the row-parallel biases:
s h + 6 h L + 2 h); a pipeline stage holds its layers: for GPT-2 the first stage also holds the token
and position embeddings and the last the final LayerNorm and its own copy of the tied LM head
(adapters/_pipeline.py: V h again); layers are split evenly (ceil(L/p) on the busiest stage).
Vision pipelines: Ψ/p unless `stage_params` gives the real split (VGG's classifier holds most of
its parameters, so the true busiest stage can hold far more than Ψ/p).

Activations, GPT-2 ([Korthikanti] Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, Sec. 4, Eq. 1-4): per transformer layer and micro-batch of b sequences
of s tokens, width h, a heads, with 2-byte activations and 1-byte dropout masks:

    s b h (34 + 5 a s / h)                       no tensor parallelism
    s b h (10 + 24/t + 5 a s / (h t))            tensor parallel t, no sequence parallelism
    s b h (34 + 5 a s / h) / t                   tensor + sequence parallel
    + 12 s b V / t                               the loss at the start of backward: the fp32 log-softmax
                                                 cross_entropy saves, its gradient and the logits' gradient
                                                 (Megatron's loss, in place: 4 s b V / t, + 2 under bf16)

The 5 a s / h term is the attention score, softmax and its dropout mask (5 a s^2 b bytes); fused
attention (torch scaled_dot_product_attention's flash / memory-efficient kernels, which the harness
GPT-2 and Megatron's local spec here use, and Transformer Engine) keeps only a per-row log-sum-exp instead, so
`attention_scores=False` leaves that term out. Which one runs is the adapter's `cost_inputs().attention`
(`attention_keeps_scores`): SDPA keeps the scores only on a CPU with dropout (the math form; it keeps the
mask in the activations' dtype, 6 a s / h where the formula says 5). fp32 activations double everything (the masks are
1 byte in reality, so this slightly over-estimates); bf16 / fp16 use the formula as written.
Layers on the busiest stage and micro-batches alive at its peak: no pipeline, L layers x 1 (gradient
accumulation frees each micro-batch before the next); 1F1B (torch pipelining 1f1b / interleaved,
Megatron) the first stage keeps min(p, m) micro-batches of ceil(L/p) layers (interleaving adds
(p-1)/(p v) more: not modelled); the GPipe schedule keeps all m; torchgpipe with checkpointing keeps
each micro-batch's stage input (s b h) and recomputes one micro-batch's layers at a time
(`recompute=always`: m inputs + 1 micro-batch; `except_last`: m inputs + 2; `never`: m). The harness
GPT-2 and vision pipelines under torchgpipe use the counted stage instead, and what autograd really keeps
(counted per partition, `python -m ptbench.memory_ledger`): `always` and `except_last` both peak at m stage
inputs + 1 micro-batch's stage without its input (the last micro-batch, whole under except_last, is freed
before the first recomputation); on the first stage of GPT-2, whose input is integer token ids that cannot
carry torchgpipe's micro-batch ordering into backward, 2 micro-batches are recomputed at once; the loss's
softmax (GPT-2's last stage, the whole mini-batch) is freed before any recomputation, so there the peak is
the larger of the forward's end (inputs + the loss, + the last micro-batch under except_last) and inputs +
1 recomputed micro-batch.

Activations, the harness GPT-2 (DDP, ZeRO, FSDP, torch pipelines: the model of workloads/gpt2.py without
tensor parallelism): counted instead of [Korthikanti] (`gpt2_saved_elements`): one block's saved tensors
(on the CPU at 4, 8 and 16 tokens, a quadratic in the tokens: exact at seq_len), the embeddings and the
head on the meta device, per sample; plus the 4 s b V fp32 softmax the loss saves (its backward turns
it into the logits' gradient in place), on a CPU; on CUDA the loss is F.cross_entropy(logits.float()), whose
backward holds 12 s b V (`loss_bytes`). Against the counted saved tensors (`SavedTensorLedger`) of real runs
on CPU this is within 1 %; the Korthikanti formula (kept for tensor parallelism and Megatron) within 1 % too
(`python -m ptbench.memory_ledger`).

ZeRO-3 (DeepSpeed 0.19, `zero3_gathered`): tensors of at most stage3_param_persistence_threshold
elements stay whole on every rank; from the second step every non-persistent parameter gathered in
forward stays gathered until its backward while they all fit stage3_max_reuse_distance (default 1e9
elements) or the prefetch bucket: at small scale the whole model is held gathered (transient = b x
non-persistent elements; measured on DeepSpeed 0.19.8), beyond it the largest module plus the prefetch bucket.

Activations, vision: no closed formula covers VGG and ResNet, so the estimate counts what autograd
saves: one forward of the real model on the meta device (`activation_elements`, no memory, no FLOPs)
under `torch.autograd.graph.saved_tensors_hooks`, each saved storage once (a view and its base, or a
tensor two ops save, are one), parameters and buffers excluded, x bytes per element (4 fp32, 2
bf16/fp16) x micro-batch. At 224 px: ResNet-50 21.5 M fp32 elements per sample (82 MiB), VGG-16
18.3 M (70 MiB). (It replaced a count of every leaf module's output: 32.0 M and 28.7 M, which refused
runs that fit.) Pipelines: each stage counted on its own (`stage_activation_elements`, the adapter's
layer split), x micro-batches alive on that stage (1F1B: min(p - i, m) on stage i; GPipe: m). Not counted: cuDNN workspaces and the gradients alive during backward.

Unmodelled (all add to the measured peak): the CUDA caching allocator's fragmentation and
reserved-but-free blocks, the CUDA context (~0.3-0.5 GB per process, outside torch's allocator
statistics), DDP / ZeRO bucket buffers when gradients are not bucket views, NCCL buffers, the data
loader's pinned batches, temporaries of the loss; timm's LAMB / LARS step temporaries.
"""

from __future__ import annotations

import copy
import math

from ptbench.core.layout import SHARDING

REPLICATED = ("none", "distributed_optimizer", "zero0")  # shardings whose parameters and gradients stay whole
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lars": 4, "sgd": 4}
PRECISIONS = ("fp32", "bf16", "fp16")
PARTS = ("params", "grads", "optimizer", "master", "transient", "activations")
ZERO3_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed 0.19's zero_optimization.sub_group_size default (elements)
GIB = 2**30
MIB = 2**20


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


def _dp_shard(sharding: str, shapes, n: int, rank: int | None = None) -> dict:
    """Per-tensor partition of DeepSpeed / FSDP over n ranks: elements of `rank` (None: the busiest rank).
    Returns {part: elements of the flat partition (stages 1-2) or of the local pieces (3, fsdp),
    grad_elems: gradient elements held at the step, param_elems, rank}."""
    numels = [numel(s) for s in shapes]
    psi = sum(numels)
    best = None
    for r in range(n) if rank is None else (rank,):
        if sharding in ("zero1", "zero2"):
            part, overlap = flat_partition(numels, n, r)
            cand = {"part": part, "grad_elems": overlap, "param_elems": psi}
        elif sharding == "zero3":
            local = sum(math.ceil(k / n) for k in numels)
            return {"part": local, "grad_elems": local, "param_elems": local, "rank": 0 if rank is None else rank}
            # every rank holds ceil(numel/N) of each tensor
        elif sharding == "fsdp":
            local = 0
            for s in shapes:
                rows = s[0] if s else 1
                chunk = math.ceil(rows / n)
                mine = max(0, min(chunk, rows - r * chunk))
                local += mine * (numel(s) // rows if rows else 0)
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
      beside their partitions: "all parameters kept gathered at small scale", the issue's 4.3x at 64 GPUs).
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


def attention_keeps_scores(attention: str, device: str, dropout: float) -> bool:
    """Whether attention (ptbench.core.layout.ATTENTION) saves [b, a, s, s] tensors for backward. torch's SDPA:
    CUDA's flash / memory-efficient kernels and the CPU's flash kernel keep a log-sum-exp; the CPU flash kernel
    refuses dropout, so there the math form runs, which keeps the softmax, the mask and the dropped scores
    (measured: tests/test_attention_and_cuda_memory.py). Transformer Engine never keeps them; unfused always."""
    if attention == "sdpa":
        return device != "cuda" and dropout > 0
    return attention == "unfused"


def loss_bytes(tokens: int, vocab: int, in_place: bool, act_b: int) -> tuple[float, float, str]:
    """(bytes at the loss's peak, of them saved for backward, formula) of a cross-entropy over tokens x vocab logits.
    in_place (the harness GPT-2's chunked loss on a CPU, workloads/gpt2.py; Megatron's vocab-parallel one): the fp32
    softmax saved (4 B), scaled in place into the gradient, cast to the 2 B logits' dtype under bf16 / fp16. Else
    F.cross_entropy(logits.float()) (GPT-2 on CUDA, torch's loss_parallel): its fp32 log-softmax saved; backward adds
    nll_loss's zero-filled gradient and log_softmax's gradient, 4 B each at once (the cast copy is freed by then)."""
    n = tokens * vocab
    if not in_place:
        return 12.0 * n, 4.0 * n, "12 s b V: F.cross_entropy's fp32 log-softmax, nll's gradient, its gradient"
    return (4.0 + (2 if act_b == 2 else 0)) * n, 4.0 * n, "4 s b V fp32 softmax saved by the loss (gradient in place)"


def loss_bytes_per_token_vocab(device: str, precision: str = "bf16") -> float:
    """What the harness GPT-2's loss holds at most per token x vocabulary entry on `device` (`loss_bytes`)."""
    return loss_bytes(1, 1, device != "cuda", 2 if precision in ("bf16", "fp16") else 4)[0]


def _gpt2_layer_activation_bytes(
    s: int, b: int, h: int, a: int, tp: int, sequence_parallel: bool, attention_scores: bool, attention_dropout=True
) -> float:
    """[Korthikanti] Eq. 1-3, bytes per transformer layer with 2-byte activations. Without attention dropout
    (p = 0: ATen returns the probabilities themselves, no mask, no copy) the scores keep only the softmax
    output: 2 a s / h instead of 5 a s / h (measured against Megatron's local spec on CPU)."""
    scores = (5 if attention_dropout else 2) * a * s / h if attention_scores else 0.0
    if tp == 1:
        return s * b * h * (34 + scores)
    if sequence_parallel:
        return s * b * h * (34 + scores) / tp
    return s * b * h * (10 + 24 / tp + scores / tp)


def predict(
    sharding: str = "none",
    *,
    params: int,
    world_size: int,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    devices_per_process: int = 1,
    precision: str = "fp32",
    optimizer: str = "adamw",
    momentum: float = 0.9,
    kind: str = "language",
    layers: int = 0,
    hidden: int = 0,
    heads: int = 0,
    seq_len: int = 0,
    vocab: int = 0,
    micro_batch: int = 0,
    microbatches: int = 1,
    schedule: str = "1f1b",
    recompute: str = "never",
    sequence_parallel: bool = False,
    attention_scores: bool = True,
    attention_dropout: bool = True,
    loss_in_place: bool | None = None,
    image_size: int = 0,
    activation_elements_per_sample: float | None = None,
    stage_activation_elements: list[float] | None = None,
    stage_input_elements: list[float] | None = None,
    layer_saved_elements: dict | None = None,
    shapes: list | None = None,
    rank: int | None = None,
    stage_params: list[int] | None = None,
    replicated_params: int | None = None,
    largest_unit_params: int = 0,
    fusion_buffer_bytes: int = 0,
    half_states: bool | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    zero3_settings: dict | None = None,
    device: str = "cuda",
    weight_decay: float = 0.0,
    step_groups: list | None = None,
    optimizer_impl: str | None = None,
    label: str | None = None,
) -> dict:
    """Bytes per rank (the busiest one) training a model of `params` elements whose states are split by
    `sharding` (ptbench.core.layout.SHARDING, what an adapter's `cost_inputs` states).

    sharding: none (every rank holds its shard's full states: DDP, Horovod, tensor parallel, pipelines) |
        distributed_optimizer (Megatron's: the optimizer state over dp, on CUDA only) | zero0..zero3
        (DeepSpeed) | fsdp (FSDP2). world_size: processes; dp x tp x pp must equal world_size x
        devices_per_process (gpipe: one process driving pp devices; the numbers are per device).
    precision: fp32 | bf16 | fp16. optimizer: adam | adamw | sgd | lamb | lars (momentum: sgd's).
        half_states: parameters and gradients in 2 bytes under bf16/fp16 (default: DeepSpeed's stages).
    kind: language (GPT-2: layers, hidden, heads, seq_len, vocab, micro_batch) | vision
        (activation_elements_per_sample, from `activation_elements`; image_size is informational).
    stage_activation_elements: vision pipelines, what each stage saves per sample (fp32 elements, from
        `stage_activation_elements`); else each stage is taken to save 1/p of the model's.
        stage_input_elements: with them, each stage's input per sample (`stage_input_elements`), what
        torchgpipe's checkpointing (schedule gpipe, recompute always | except_last) keeps of a micro-batch.
    layer_saved_elements: language, what the harness GPT-2 saves per sample ({"layer", "embed", "head"}, fp32
        elements, from `gpt2_saved_elements`) used instead of [Korthikanti] where the run trains that model
        without tensor parallelism (the counted implementation, not the paper's).
    micro_batch: samples per micro-batch on one replica; microbatches: per optimizer step (pipelines).
    schedule: the pipeline schedule (1f1b | interleaved_1f1b | gpipe); recompute: activation
        checkpointing of the stages (never | except_last | always, torchgpipe's). attention_scores:
        False for fused attention (no s^2 term); attention_dropout: False when dropout is 0 (2 a s / h).
        loss_in_place: the loss's form (`loss_bytes`); None: the harness GPT-2's, in place on a CPU only.
    shapes: the parameter shapes (per-tensor partitioning for zero1-3 and fsdp, see module doc); rank:
        the rank whose partition is taken (None: the busiest).
    stage_params: parameters of each pipeline stage (else the GPT-2 split, or Ψ/p for vision).
    replicated_params: parameters kept whole on every TP rank (else GPT-2's, see
        `gpt2_replicated_under_tp`, when the dimensions are given; 0 for vision).
    largest_unit_params: the largest group of parameters zero3 / fsdp gather at once.
    fusion_buffer_bytes: a gradient fusion buffer of up to that size (Horovod's threshold).
    offload_optimizer / offload_params (ZeRO-Offload, zero1-3 / zero3): the optimizer state, fp32 master and
        gradient partitions / the parameter partition live in host memory: not on the device (0 bytes here;
        DeepSpeed 0.19 puts the gradient partition on `self.device` = cpu: stage_1_and_2.py:278, :2161-2177
        (stage 1-2 copy each gradient into the fp32 CPU partition, no device grads_in_partition);
        stage3.py:333, :790-792 (grad_partitions_flat_buffer)).
    zero3_settings: DeepSpeed stage 3's own rules ({param_persistence_threshold, max_live_parameters,
        max_reuse_distance, prefetch_bucket_size}, elements; see `zero3_gathered`); None: the plain partition
        with the largest unit gathered.
    device: cuda | cpu (Megatron shards its optimizer only on CUDA; torch's optimizers step foreach on CUDA and a
        single-tensor loop on CPU). label: what the run is called (the adapter's name; only printed).
    weight_decay: the optimizer's (Adam's L2 decay and SGD's make a temporary). step_groups: the optimizer's
        parameter groups as [(the model's parameter shapes in order, weight decay)] (`harness_step_groups`):
        each rank's tensors follow from the sharding; None: one group of the rank's elements.
    optimizer_impl: single_tensor | foreach | fused | host (None: torch's default for `device`).

    Returns {adapter (the label), sharding, world_size, dp, tp, pp, precision, optimizer_name, kind, busiest,
    params_per_rank (elements of the model-parallel shard), and the bytes of each of PARTS (params,
    grads, optimizer, master, transient, activations), step_transient, model_states, total}; every byte field
    is a float (N rarely divides Ψ); `model_states` = params + grads + optimizer + master; `transient`: what
    forward / backward hold beside the activations; `step_transient`: what the optimizer step alone holds
    (the optimizer's temporaries; DeepSpeed 1-3 also the fp32 gradient partition, the norm's fp64 copies), after
    backward freed the activations and those buffers; `step_optimizer`: the optimizer's temporaries in it;
    `total` = model_states + max(transient + activations, step_transient); `busiest` names the stage taken
    (pipelines); `formula` says per part what was used; `notes` what is uncertain."""
    name = sharding.strip().lower()
    if name not in SHARDING:
        raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDING)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if kind not in ("language", "vision"):
        raise ValueError(f"kind must be language or vision, got {kind!r}")
    for key, val, lo in (
        ("params", params, 0),
        ("world_size", world_size, 1),
        ("tp", tp, 1),
        ("pp", pp, 1),
        ("devices_per_process", devices_per_process, 1),
        ("microbatches", microbatches, 1),
        ("micro_batch", micro_batch, 0),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val < lo:
            raise ValueError(f"{key} must be an integer >= {lo}, got {val!r}")
    devices = world_size * devices_per_process
    if devices % (tp * pp):
        raise ValueError(f"{devices} device(s) are not a multiple of tp*pp = {tp * pp}")
    dp = dp or devices // (tp * pp)
    if dp * tp * pp != devices:
        raise ValueError(
            f"dp*tp*pp must equal the devices (world_size x devices_per_process): {dp}*{tp}*{pp} != {devices}"
        )
    if kind == "language" and micro_batch and not (layers and hidden and heads and seq_len):
        raise ValueError(
            "language activations need layers, hidden, heads and seq_len (or micro_batch=0 for states only)"
        )

    if half_states is None:
        half_states = name in ("zero0", "zero1", "zero2", "zero3")  # DeepSpeed's bf16/fp16 modes
    N = dp
    K = optimizer_state_bytes(optimizer, momentum)
    half = precision in ("bf16", "fp16")
    act_b = 2 if half else 4  # bytes per activation element
    in_place = device != "cuda" if loss_in_place is None else loss_in_place
    notes: list[str] = []
    formula: dict[str, str] = {}

    # --- the model-parallel shard of the busiest stage(s) -------------------------------------------------
    stages: list[tuple[str, float]]  # (which stage, parameters it holds)
    if pp > 1:
        if stage_params:
            if len(stage_params) != pp:
                raise ValueError(f"stage_params has {len(stage_params)} entries for pp={pp}")
            top = max(range(pp), key=lambda i: stage_params[i])
            stages = [("first", float(stage_params[0])), ("last", float(stage_params[-1]))]
            if top not in (0, pp - 1):
                stages.append((f"stage {top}", float(stage_params[top])))
            formula["params_per_rank"] = "stage_params (given)"
        elif kind == "language" and layers and hidden and seq_len and vocab:
            first, last = gpt2_stage_params(params, layers=layers, hidden=hidden, seq_len=seq_len, vocab=vocab, pp=pp)
            stages = [("first", float(first)), ("last", float(last))]
            formula["params_per_rank"] = (
                "first: V h + s h + ceil(L/p) block; last: ceil(L/p) block + 2h + V h (head copy)"
            )
        else:
            stages = [("any", params / pp)]
            formula["params_per_rank"] = "Ψ/p"
            notes.append(
                "pipeline stages assumed to hold Ψ/p parameters each (no stage_params): real splits are uneven"
            )
    else:
        stages = [("all", float(params))]
        formula["params_per_rank"] = "Ψ"
    if tp > 1:
        if replicated_params is None:
            replicated_params = (
                gpt2_replicated_under_tp(layers, hidden, seq_len) if (kind == "language" and hidden and layers) else 0
            )
        stages = [(s, (p - replicated_params) / tp + replicated_params) for s, p in stages]
        formula["params_per_rank"] += f" -> (P - R)/t + R, R = {replicated_params:,} replicated"

    # --- activations per stage ----------------------------------------------------------------------
    def activations(stage_name: str) -> tuple[float, str]:
        if not micro_batch:
            return 0.0, "not estimated (micro_batch=0)", 0.0
        b = micro_batch
        if kind == "vision":
            if activation_elements_per_sample is None:
                notes.append("vision activations not estimated: give activation_elements_per_sample")
                return 0.0, "not estimated", 0.0
            if pp > 1 and stage_activation_elements:
                if len(stage_activation_elements) != pp:
                    raise ValueError(
                        f"stage_activation_elements has {len(stage_activation_elements)} entries for pp={pp}"
                    )
                # stage i keeps m micro-batches (GPipe schedule) or min(p - i, m) (1F1B): the most any stage saves
                alive_i = [microbatches if schedule == "gpipe" else min(pp - i, microbatches) for i in range(pp)]
                per_stage = [e * act_b * b * a for e, a in zip(stage_activation_elements, alive_i)]
                checkpointed = schedule == "gpipe" and recompute != "never" and microbatches > 1
                ins = stage_input_elements if checkpointed else None
                if ins:  # torchgpipe checkpointing: m stage inputs + one micro-batch's stage at once (see module doc)
                    per_stage = [(microbatches * i + e - i) * act_b * b for e, i in zip(stage_activation_elements, ins)]
                top = max(range(pp), key=lambda i: per_stage[i])
                total = per_stage[top]
                alive_top = f"{alive_i[top]} micro-batch(es) alive ({schedule})"
                if ins:
                    alive_top = f"(1 micro-batch + {microbatches - 1} x {ins[top]:,.0f} stage input) ({recompute})"
                return (
                    total,
                    (
                        f"stage {top}: {stage_activation_elements[top]:,.0f} elem/sample (counted per stage) x {act_b} B "
                        f"x b={b} x {alive_top}; the most of any stage"
                    ),
                    total,
                )
            per_mb = activation_elements_per_sample * act_b * b / pp  # a stage holds ~1/p of the layers
            f = f"{activation_elements_per_sample:,.0f} elem/sample x {act_b} B x b={b}" + (" / p" if pp > 1 else "")
            alive, how = _alive(stage_name)
            if pp > 1:
                notes.append("vision pipeline activations assume each stage holds 1/p of the model's activations")
            return per_mb * alive, f"{f} x {how}", per_mb * alive
        per_stage_layers = math.ceil(layers / pp)
        if layer_saved_elements and tp == 1 and (recompute == "never" or schedule == "gpipe"):
            # the harness GPT-2, counted: per layer, the embedding (first stage) and the final LayerNorm + head
            # input (last stage), each x bytes per element x b, x micro-batches alive; + the softmax the loss saves
            e = layer_saved_elements
            alive, how = _alive(stage_name)
            first = stage_name in ("all", "first", "any")
            last = stage_name in ("all", "last", "any")
            per_mb = (per_stage_layers * e["layer"] + first * e["embed"] + last * e["head"]) * act_b * b
            peak_loss, loss, loss_f = loss_bytes(seq_len * b, vocab, in_place, act_b) if last else (0.0, 0.0, "")
            last_alive = 1 if (pp > 1 and schedule != "gpipe") else alive
            saved = alive * per_mb + last_alive * loss
            if recompute != "never" and microbatches > 1:  # torchgpipe checkpointing (see module doc)
                inp = (8 * seq_len if first else act_b * seq_len * hidden) * b  # the stage input: int64 token ids
                r, whole = (2 if first else 1), (recompute == "except_last")
                # forward's end (the last micro-batch whole under except_last, the loss) or the recomputation
                saved = microbatches * inp + max(whole * (per_mb - inp) + last_alive * loss, r * (per_mb - inp))
                how = f"recompute={recompute}: m={microbatches} stage inputs + {r} micro-batch(es) at once"
            total = saved + last_alive * (peak_loss - loss)  # the loss's backward: more than it saved
            return (
                total,
                (
                    f"{how} x (ceil(L/p)={per_stage_layers} x {e['layer']:,.0f} per layer"
                    + (f" + {e['embed']:,.0f} embedding" if first else "")
                    + (f" + {e['head']:,.0f} head" if last else "")
                    + f") elem/sample (counted, harness GPT-2) x {act_b} B x b={b}"
                    + (f" + {loss_f}" if last else "")
                ),
                saved,
            )
        layer = _gpt2_layer_activation_bytes(
            seq_len, b, hidden, heads, tp, sequence_parallel, attention_scores, attention_dropout
        )
        layer *= act_b / 2
        # the loss at the start of backward (`loss_bytes`), split by vocabulary over TP
        peak_loss, loss, loss_f = loss_bytes(seq_len * b, vocab, in_place, act_b)
        logits, logits_saved = (peak_loss / tp, loss / tp) if stage_name in ("all", "last", "any") else (0.0, 0.0)
        alive, how = _alive(stage_name)
        if recompute in ("always", "except_last") and microbatches > 1:
            full = 1 if recompute == "always" else 2
            inputs = microbatches * seq_len * b * hidden * act_b
            total = inputs + full * per_stage_layers * layer + logits
            return (
                total,
                (
                    f"recompute={recompute}: m stage inputs (s b h) + {full} micro-batch(es) of "
                    f"ceil(L/p)={per_stage_layers} layers [Korthikanti]" + (f" + {loss_f} / t" if logits else "")
                ),
                total - (logits - logits_saved),
            )
        last_alive = 1 if (pp > 1 and schedule != "gpipe") else alive
        total = alive * per_stage_layers * layer + (last_alive * logits if logits else 0.0)
        sc = "" if attention_scores else " (no 5as/h: fused attention)"
        tpf = "" if tp == 1 else (" /t (sequence parallel)" if sequence_parallel else " with 10 + 24/t + 5as/(ht)")
        return (
            total,
            (
                f"{how} x ceil(L/p)={per_stage_layers} layers x s b h (34 + 5as/h){sc}{tpf} x {act_b}/2 B"
                + (f" + {loss_f} / t" if logits else "")
            ),
            total - last_alive * (logits - logits_saved),
        )

    def _alive(stage_name: str) -> tuple[int, str]:
        if pp == 1:
            return 1, "1 micro-batch"
        if schedule == "gpipe":
            return microbatches, f"m={microbatches} micro-batches (GPipe schedule)"
        if stage_name == "last":
            return 1, "1 micro-batch (1F1B, last stage)"
        if schedule == "interleaved_1f1b":
            notes.append("interleaved 1F1B modelled as 1F1B (it keeps up to (p-1)/(p v) more micro-batches)")
        return min(pp, microbatches), f"min(p, m)={min(pp, microbatches)} micro-batches (1F1B, first stage)"

    # --- the optimizer step: DeepSpeed's fp32 gradient partition and the optimizer's own temporaries ----------
    if optimizer_impl is None:
        impl, impl_why = torch_step_impl(device)
    elif optimizer_impl in STEP_IMPLS:
        impl, impl_why = optimizer_impl, f"{optimizer_impl} (given)"
    else:
        raise ValueError(f"optimizer_impl must be one of {', '.join(STEP_IMPLS)} or None, got {optimizer_impl!r}")
    ds = name in ("zero1", "zero2", "zero3")
    if ds and offload_optimizer:
        impl, impl_why = "host", "host (offload_optimizer: DeepSpeed's CPU Adam / torch on the host partition)"
    model_parallel = tp > 1 or pp > 1 or devices_per_process > 1
    opt_name = optimizer.strip().lower()

    def _step(P: float, part: float) -> tuple[float, float, str]:
        """(step_transient, the optimizer's temporaries in it, formula) of a rank holding P parameters (part: its
        DeepSpeed partition); the busiest rank (or `rank`) when the shapes give each rank's tensors."""
        if ds and offload_optimizer:
            return 0.0, 0.0, "0 (offload_optimizer: the fp32 gradient partition is in host memory, stepped there)"
        wd = float(weight_decay)
        by_shapes = bool(step_groups) and (name in ("zero1", "zero2", "zero3", "fsdp") or not model_parallel)
        per_rank = []  # (the rank's groups as its optimizer steps them, its largest gradient piece: DeepSpeed's norm)
        if by_shapes:
            flat = name == "zero0" and half
            if name == "distributed_optimizer" and device == "cuda":  # Megatron: each rank steps 1/N of every group
                per_rank.append(([([math.ceil(sum(numel(x) for x in g) / N)], w) for g, w in step_groups], 0))
            else:
                sharded = name in ("zero1", "zero2", "zero3", "fsdp")
                for r in range(N) if (rank is None and sharded) else [rank or 0]:
                    per_rank.append(
                        (rank_step_groups(name, step_groups, N, r, flat=flat), _grad_piece(name, step_groups, N, r))
                    )
            rule = "per group, the busiest rank" + (
                " (flat fp32 group, DeepSpeed's BF16 optimizer: not validated)" if flat else ""
            )
        else:  # no shapes, or a model-parallel shard whose tensors the shapes do not give: one group (a bound)
            if ds:
                whole = part if name != "zero3" else min(part, ZERO3_SUB_GROUP_SIZE)
            elif name == "fsdp" or (name == "distributed_optimizer" and device == "cuda"):
                whole = P / N
            else:
                whole = P
            per_rank.append(([([whole], wd)], whole))
            rule = "one group of the rank's elements (an upper bound)"
            if impl == "single_tensor" and not ds:
                if step_groups:  # model parallel: 8 L1 + 4 L2 (+ 4 L1, L2 adam) from the two largest whole tensors
                    big = sorted((numel(x) for g, _ in step_groups for x in g), reverse=True) + [0, 0]
                    coupled = 4 if (opt_name == "adam" and wd) else 0
                    opt = min((8 + coupled) * big[0] + 4 * big[1], (12 + coupled) * P)
                    if opt_name not in ("adam", "adamw"):
                        opt = 4 * min(big[0], P) if (wd and opt_name == "sgd") else 0
                    return (
                        opt,
                        opt,
                        (
                            f"{impl_why}: the optimizer's temporaries, bounded by the two largest whole tensors "
                            f"(8 L1 + 4 L2{' + 4 L1 (adam, L2 decay)' if coupled else ''}, at most {12 + coupled} P): "
                            "the rank steps shards / a stage of them"
                        ),
                    )
                notes.append(
                    "the optimizer step's temporaries (single-tensor, CPU) need the parameter shapes: not estimated"
                )
                return 0.0, 0.0, f"0 ({impl_why}; not estimated without the parameter shapes)"
        gb = 2 if half else 4  # DeepSpeed's model (bit16) dtype
        best = (-1.0, 0.0, "")
        for groups, piece in per_rank:
            # DeepSpeed, before the groups: the gradient norm's fp64 copy of each gradient piece (get_norm_dtype)
            terms = [
                (
                    8.0 * piece if ds else 0.0,
                    0.0,
                    f"8 x {piece:,} the gradient norm's fp64 copy of the largest gradient piece",
                )
            ]
            for elems, w in groups:
                opt, how = optimizer_temporaries([(elems, w)], optimizer, impl, momentum)
                g = sum(elems)
                if not ds:
                    terms.append((opt, opt, f"the optimizer's temporaries, {how}"))
                    continue
                terms.append(
                    (4.0 * g + opt, opt, f"4 x {g:,} fp32 gradient partition + the optimizer's temporaries, {how}")
                )
                if half:  # the flat bf16 copy beside its fp32 conversion (under fp32 the copy is the fp32 gradient)
                    terms.append((6.0 * g, 0.0, f"6 x {g:,}: the flat bf16 copy and its fp32 conversion"))
                if (
                    name in ("zero1", "zero2") and device == "cpu"
                ):  # gloo all-gathers through a flat buffer of the group
                    terms.append(
                        (gb * N * g, 0.0, f"{gb} x N x {g:,}: gloo's all-gather of the updated group (CPU only)")
                    )
            top = max(terms, key=lambda t: t[0])
            if top[0] > best[0]:
                best = top
        peak, opt, how = best
        if not ds:
            return peak, opt, (f"{impl_why}: {how} [{rule}]" if peak else f"0 ({impl_why}: no temporaries)")
        src = (
            "stage_1_and_2.py:2684 fp64 norms, :3113-3118 flatten + .to(fp32), :3126 .grad, freed :3141-3142; "
            if name != "zero3"
            else f"stage3.py:2457 fp64 norms, :2686-2693 flatten + .to(fp32) per sub-group of <= {ZERO3_SUB_GROUP_SIZE:,}, "
            "freed :2735; "
        )
        return peak, opt, f"DeepSpeed step, the largest of its terms: {how} [{rule}; {src}client optimizer: {impl_why}]"

    # --- states per stage, then the busiest stage -------------------------------------------------------
    results = []
    shared_formula = formula
    for stage_name, P in stages:
        formula = dict(shared_formula)
        out = dict.fromkeys(PARTS, 0.0)
        b = 2 if half and half_states else 4
        if name in ("zero1", "zero2", "zero3", "fsdp") and shapes and N > 1:
            sh = _dp_shard(name, shapes, N, rank)
            part, grad_elems, param_elems = sh["part"], sh["grad_elems"], sh["param_elems"]
            rule = "per tensor"
        else:
            part = P / N
            grad_elems = P if name in REPLICATED else P / N
            param_elems = P / N if name in ("zero3", "fsdp") else P
            rule = "Ψ/N"
        if name in REPLICATED:
            out["params"], out["grads"] = b * P, b * P
            if name == "distributed_optimizer" and device == "cuda":
                out["optimizer"] = K * P / N
                formula["optimizer"] = f"{K} P/N (Megatron distributed optimizer)"
            else:
                out["optimizer"] = K * P
                formula["optimizer"] = f"{K} P"
            formula["params"] = f"{b} P"
            formula["grads"] = f"{b} P"
            if name == "zero0" and half:
                out["master"] = 4 * P
                formula["master"] = "4 P"
                notes.append(
                    "zero0 in half precision (DeepSpeed's BF16/FP16 optimizer wrapper) modelled as an "
                    "unsharded fp32 master + moments: not validated"
                )
            if fusion_buffer_bytes:
                out["transient"] = min(float(fusion_buffer_bytes), 4 * P)
                formula["transient"] = "min(fusion threshold, 4P) fusion buffer"
        else:  # zero1-3, fsdp
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
            if name == "zero3" and zero3_settings and shapes and N > 1:
                z = zero3_gathered([numel(x) for x in shapes], N, largest_unit_params, **zero3_settings)
                gb = 2 if half else 4
                out["params"] = b * z["partition"]
                formula["params"] = f"{b} x ({z['persistent']:,} persistent elements whole + the rest / N per tensor)"
                out["transient"] = gb * z["gathered"]
                formula["transient"] = f"{gb} x {z['gathered']:,} gathered: {z['why']}"
            elif name in ("zero3", "fsdp") and largest_unit_params:
                gb = 2 if half else 4
                out["transient"] = gb * largest_unit_params * (N - 1) / N if N > 1 else 0.0
                formula["transient"] = f"{gb} x largest gathered unit ({largest_unit_params:,}) x (N-1)/N"
        if offload_optimizer and name in ("zero1", "zero2", "zero3"):
            if name == "zero1" and N > 1:
                out["transient"] += out["grads"]  # backward still holds every full gradient on the device
            out["optimizer"] = out["master"] = out["grads"] = 0.0
            formula["optimizer"] = formula["master"] = formula["grads"] = "0 (offload_optimizer: in host memory)"
        if offload_params and name == "zero3":
            out["params"] = 0.0
            formula["params"] = "0 (offload_params: in host memory; gathered units in transient)"
        out["step_transient"], out["step_optimizer"], formula["step_transient"] = _step(P, part)
        out["activations"], formula["activations"], out["saved_activations"] = activations(stage_name)
        out["model_states"] = out["params"] + out["grads"] + out["optimizer"] + out["master"]
        # the step runs after backward has freed the activations (and the gathered / full gradients): the peak is
        # the larger of backward's and the step's, on top of the model states
        out["total"] = out["model_states"] + max(out["transient"] + out["activations"], out["step_transient"])
        results.append((stage_name, P, out, formula))
    saved_max = max(r[2]["saved_activations"] for r in results)  # the memory ledger compares the most any rank saves
    stage_name, P, out, formula = max(results, key=lambda r: r[2]["total"])
    out = {**out, "saved_activations": saved_max}
    return dict(
        adapter=label or name,
        sharding=name,
        world_size=world_size,
        dp=N,
        tp=tp,
        pp=pp,
        precision=precision,
        optimizer_name=optimizer,
        optimizer_bytes_per_elem=K,
        kind=kind,
        busiest=stage_name,
        params_per_rank=P,
        **out,
        formula=formula,
        notes=sorted(set(notes)),
    )


def fits(predicted_total: float, device_bytes: float | None, headroom: float = 0.9) -> bool:
    """True when `predicted_total` bytes fit in `headroom` x `device_bytes` (None: unknown, fits)."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if device_bytes is None:
        return True
    return predicted_total <= headroom * device_bytes


# --- the optimizer step's own temporaries (torch 2.14 / DeepSpeed 0.19.8 as installed) --------------------
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
            local = []
            for s in shapes:
                rows = s[0] if s else 1
                chunk = math.ceil(rows / n)
                local.append(max(0, min(chunk, rows - rank * chunk)) * (numel(s) // rows if rows else 0))
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


# --- counting what autograd saves (the memory ledger's "counted" side) -----------------------------------
STEP_RULE = (
    "the optimizer phase (clip + step; DeepSpeed: engine.step) of the last untimed step, bytes allocated beyond "
    "what was alive when it began, the most at once (ptbench.core.memory_model.StepPeak: torch.profiler's memory "
    "events on the rank's device); not measured in a run's first step (the optimizer's state is being made) nor "
    "inside trainer.profile's window"
)
SAVED_RULE = (
    "torch.autograd.graph.saved_tensors_hooks around one training step: every tensor autograd saves for "
    "backward, each storage once (a view and its base, or one tensor saved by several ops, are one storage; "
    "a tensor subclass such as DTensor counts its local tensors), parameters and views of parameters "
    "and the model's buffers excluded; a storage counts from its first save until autograd frees the last saved reference (after "
    "its backward); `peak` is the most bytes alive at once (1F1B pipelines: several micro-batches); gpipe: per "
    "partition (one device each; its forward on torchgpipe's worker thread, its recomputation, the loss on the "
    "last), a storage two partitions save counted for each"
)


def _plain_tensors(t):
    """The plain tensors behind `t` (a wrapper subclass such as DTensor flattens to its inner tensors)."""
    import torch

    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, n) for n in names)  # DTensor also names its device mesh
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain_tensors(i)]


def _is_parameter(t) -> bool:
    import torch

    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


class StepPeak:
    """`with StepPeak(device) as p:` the bytes the block allocated on `device` beyond what was alive when it began,
    the most at once (`p.peak`; entered again, the largest of its entries) and still held at its end (`p.net`);
    None when the block recorded no allocation there. torch.profiler with profile_memory=True records every
    allocation and free of the allocators ("[memory]" events, signed bytes, with their device); their running
    sum in time order is what the block holds at each moment. No allocator statistics are reset, so the run's
    recorded peak memory is untouched (the CUDA branch is written from torch's profiler API and has not run on
    a GPU here). The trainer measures the optimizer phase of the last untimed step with it, the memory ledger's
    step side."""

    def __init__(self, device="cpu"):
        import torch

        self.device = torch.device(device)
        self.peak: int | None = None
        self.net: int | None = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        kind = self.device.type.upper()  # the events' device_type: CPU, CUDA
        index = self.device.index
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
            and e.device_type().name == kind
            and (index is None or kind == "CPU" or e.device_index() == index)
        )
        if not events:
            return False
        peak = net = 0
        for _, nbytes in events:
            net += nbytes
            peak = max(peak, net)
        self.peak = peak if self.peak is None else max(self.peak, peak)
        self.net = net
        return False


class SavedTensorLedger:
    """Context manager counting the bytes autograd saves for backward, by `SAVED_RULE`. After the block:
    `peak` (most bytes alive at once), `total` (bytes of distinct storages saved), `tensors` (saves).
    Hooks are thread-local: the block's own thread is counted. A pipeline that runs its partitions on worker
    threads (torchgpipe) runs each partition's forward inside `partition(j)`, which counts that thread's saves
    for partition j as well: `parts` then holds each partition's own peak (each partition is one device,
    so a storage two partitions save counts for each), and `active()` is how the partition finds the ledger."""

    def __init__(self, modules=()):
        import threading

        # the storages of these modules' buffers (BatchNorm's running statistics) are not counted; parameters
        # are recognised when saved (nn.Parameter and its views: ZeRO-3 / FSDP swap their
        # storages during the step). The storages are kept referenced so that their keys stay theirs.
        self._buffers = [x.untyped_storage() for m in modules for t in m.buffers() for x in _plain_tensors(t)]
        self.held = {st._cdata for st in self._buffers}
        self.alive: dict = {}  # storage key (partition j: (j, key)) -> [nbytes, references]
        self.current = self.peak = self.total = self.tensors = 0
        self.parts: dict[int, list[int]] = {}  # partition -> [bytes alive, peak]
        self._owner: dict[int, int] = {}  # storage key -> the partition it was the input of (see `partition`)
        self._claimed: list = []  # those storages, kept referenced so that their keys stay theirs
        self._local = threading.local()  # .part: the partition this thread counts for (None: none)
        self._lock = threading.RLock()  # worker threads save, and the graph releases, concurrently
        self._hooks = None

    @staticmethod
    def active():
        """The innermost ledger entered (on any thread), None outside one: what a worker thread counts into."""
        return _ACTIVE[-1] if _ACTIVE else None

    def partition(self, index: int, inputs=()):
        """Count this thread's saves inside the block for pipeline partition `index` (and in the ledger's
        totals): saved-tensor hooks on this thread for the block. `inputs`: the partition's inputs; a save
        of their storage outside any partition (torchgpipe's Recompute node keeps a checkpointed partition's
        input from the main thread) counts for this partition."""
        import contextlib

        import torch

        @contextlib.contextmanager
        def block():
            with self._lock:
                self.parts.setdefault(index, [0, 0])
                for t in inputs if isinstance(inputs, (tuple, list)) else (inputs,):
                    if isinstance(t, torch.Tensor):
                        for x in _plain_tensors(t):
                            st = x.untyped_storage()
                            if st._cdata not in self._owner:  # the first partition to receive it
                                self._owner[st._cdata] = index
                                self._claimed.append(st)
            before = getattr(self._local, "part", None)
            self._local.part = index
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                    yield self
            finally:
                self._local.part = before

        return block()

    def _count(self, key, nbytes: int, part) -> tuple:
        """One more reference to storage `key` (for partition `part` when not None); new storages add bytes."""
        entry = self.alive.get(key)
        if entry is None:
            entry = self.alive[key] = [nbytes, 0]
            if part is None:
                self.current += nbytes
                self.total += nbytes
                self.peak = max(self.peak, self.current)
            else:
                p = self.parts.setdefault(part, [0, 0])
                p[0] += nbytes
                p[1] = max(p[1], p[0])
        entry[1] += 1
        return key

    def _pack(self, t):
        if _is_parameter(t):
            return t
        keys = []
        with self._lock:
            part = getattr(self._local, "part", None)
            for x in _plain_tensors(t):
                st = x.untyped_storage()
                key = st._cdata
                if key in self.held:
                    continue
                keys.append(self._count(key, st.nbytes(), None))
                owner = part if part is not None else self._owner.get(key)
                if owner is not None:
                    keys.append(self._count((owner, key), st.nbytes(), owner))
            self.tensors += 1
        return _Held(t, keys, self)

    def _release(self, keys):
        with self._lock:
            for key in keys:
                entry = self.alive.get(key)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    del self.alive[key]
                    if isinstance(key, tuple):
                        self.parts[key[0]][0] -= entry[0]
                    else:
                        self.current -= entry[0]

    def __enter__(self):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)
        return False

    def result(self) -> dict:
        out = {"peak_bytes": int(self.peak), "total_bytes": int(self.total), "tensors": int(self.tensors)}
        if self.parts:
            out["per_partition"] = [int(self.parts.get(j, [0, 0])[1]) for j in range(max(self.parts) + 1)]
        return out


_ACTIVE: list[SavedTensorLedger] = []  # ledgers entered, innermost last (`SavedTensorLedger.active`)


class _Held:
    """What the graph keeps instead of the saved tensor: its release tells the ledger the storage is free."""

    __slots__ = ("t", "keys", "ledger")

    def __init__(self, t, keys, ledger):
        self.t, self.keys, self.ledger = t, keys, ledger

    def __del__(self):
        self.ledger._release(self.keys)


def _unpack(held):
    return held.t if isinstance(held, _Held) else held


def ledger_fields(
    predicted: dict | None, counted: list[dict | None], step_counted: list[int | None] | None = None
) -> dict | None:
    """The summary's `memory_ledger`: the memory model's saved-activation bytes of the busiest rank beside
    the most any rank counted (`SavedTensorLedger`'s peak in the last untimed step), and their ratio. None when
    nothing was counted (no untimed step, resumed runs). A rank that drives several devices (gpipe) counted
    each partition on its own (`per_partition`): its partitions stand in for ranks. `step_counted`: each rank's
    optimizer-phase peak in that step (`StepPeak`; None: not measured) beside the model's `step_transient`."""
    peaks = [p for c in counted for p in ((c.get("per_partition") or [c["peak_bytes"]]) if c else [None])]
    if not peaks or any(p is None for p in peaks):
        return None
    pred = (predicted or {}).get("saved_activations")
    top = max(peaks)
    out = {
        "predicted_saved_bytes": pred,
        "counted_saved_bytes_per_rank": peaks,
        "counted_saved_bytes": top,
        "ratio": pred / top if pred is not None and top else None,
        "rule": SAVED_RULE,
        "model": "bench/core/memory_model.py",
    }
    if step_counted and all(s is not None for s in step_counted):
        step_pred, step_top = (predicted or {}).get("step_transient"), max(step_counted)
        out.update(
            predicted_step_bytes=step_pred,
            counted_step_bytes_per_rank=list(step_counted),
            counted_step_bytes=step_top,
            step_ratio=step_pred / step_top if step_pred is not None and step_top else None,
            step_rule=STEP_RULE,
        )
    return out


# --- from a model and a config (the runner's and `python -m ptbench --plan`'s entry points) --------------
def activation_elements(model, sample_shape, dtype=None) -> float:
    """What autograd really saves for backward for ONE sample of `sample_shape` (without the batch
    dimension), in fp32 elements (bytes / 4): a forward on the meta device (no memory, no FLOPs) under
    `torch.autograd.graph.saved_tensors_hooks`, counting each saved tensor's storage once (a view and its
    base, or one tensor saved by two consumers, are one storage), parameters and buffers excluded. Max-pool
    indices (int64), BatchNorm's statistics and residual adds count as saved; an output nobody saves (a
    leaf module's output that is only an input to an in-place op or a view) does not. `model` must be on the
    meta device (build it under `torch.device("meta")`)."""
    import torch

    # two samples, halved: BatchNorm in training mode refuses one value per channel (a 1x1 map)
    x = torch.empty((2, *sample_shape), device="meta", dtype=dtype or torch.float32)
    with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
        out = model(x)
        saved = ledger.total
        del out
    return saved / 4 / 2


def pipeline_layers(model) -> list:
    """A vision model's layers in the order its pipeline form runs them (the same list as workloads/vision.py
    `vision_sequential`, tests check it): top-level children in order, nn.Sequential children expanded, a
    Flatten before the first Linear."""
    from torch import nn

    layers, flat = [], False
    for child in model.children():
        for m in child if isinstance(child, nn.Sequential) else [child]:
            if isinstance(m, nn.Linear) and not flat:
                layers.append(nn.Flatten(1))
            flat = flat or isinstance(m, (nn.Linear, nn.Flatten))
            layers.append(m)
    return layers


def even_split(layers: int, stages: int) -> list[int]:
    """Layers per stage by count; the first `layers % stages` stages take one more (adapters/_pipeline.py's)."""
    q, r = divmod(layers, stages)
    return [q + (i < r) for i in range(stages)]


def stage_input_elements(model, sample_shape, balance: list[int]) -> list[float]:
    """Per sample, the elements of each pipeline stage's input (layers per stage: `balance`; meta device):
    what torchgpipe's checkpointing keeps of each micro-batch."""
    import torch
    from torch import nn

    layers = pipeline_layers(model)
    x = torch.empty((2, *sample_shape), device="meta")
    out, start = [], 0
    for n in balance:
        out.append(x.numel() / 2)
        with torch.no_grad():
            x = nn.Sequential(*layers[start : start + n])(x)
        start += n
    return out


def stage_activation_elements(model, sample_shape, balance: list[int]) -> list[float]:
    """`activation_elements` of each pipeline stage (layers per stage: `balance`): each stage counted on its
    own, its input a tensor that requires grad as a received activation does (its first op saves it)."""
    import torch
    from torch import nn

    layers = pipeline_layers(model)
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} does not cover the model's {len(layers)} layers")
    x = torch.empty((2, *sample_shape), device="meta")
    out, start = [], 0
    for i, n in enumerate(balance):
        stage = nn.Sequential(*layers[start : start + n])
        start += n
        x = x.detach().requires_grad_(i > 0)
        with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
            y = stage(x)
            out.append(ledger.total / 4 / 2)
        x = y
    return out


def gpt2_saved_elements(model, seq_len: int, scores: bool = True) -> dict | None:
    """What the harness GPT-2 (workloads/gpt2.py: wte, wpe, drop, blocks, ln_f, lm_head) saves per sample,
    counted by `SavedTensorLedger` in fp32 elements (embeddings and head on the meta device, one block on the
    CPU, see below): {layer (one block), embed (the
    embeddings and their dropout), head (final LayerNorm and the tied head's input)}. None for another model.
    scores=False leaves out the s x s terms the CPU keeps with attention dropout (CUDA's kernels fuse it)."""
    import torch

    if not all(hasattr(model, n) for n in ("wte", "wpe", "drop", "blocks", "ln_f", "lm_head")):
        return None
    b = 2
    idx = torch.zeros((b, seq_len), dtype=torch.int64, device="meta")

    def count(fn, *args) -> float:
        with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
            fn(*args)
            return ledger.total / 4 / b

    h = model.wte.embedding_dim
    x = torch.empty((b, seq_len, h), device="meta", requires_grad=True)
    # one block on the CPU at a few token counts: on the meta device scaled_dot_product_attention runs its math
    # form (which keeps the s x s scores); the CPU's flash kernel keeps the output and a log-sum-exp, as
    # CUDA's fused kernels do (with dropout > 0 the CPU keeps s x s terms too). What a block saves is a
    # quadratic in the tokens, so three small token counts give it exactly at seq_len.
    block = copy.deepcopy(model.blocks[0]).to_empty(device="cpu")

    def block_elements(tokens: int) -> float:
        xs = torch.zeros((b, tokens, h), requires_grad=True)
        with torch.enable_grad(), SavedTensorLedger([block]) as ledger:
            block(xs)
            return ledger.total / 4 / b

    t1, t2, t3 = 4, 8, 16
    y1, y2, y3 = (block_elements(t) for t in (t1, t2, t3))
    c2 = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)
    c1 = (y2 - y1) / (t2 - t1) - c2 * (t1 + t2)
    c0 = y1 - c1 * t1 - c2 * t1 * t1
    layer = c0 + c1 * seq_len + (c2 * seq_len * seq_len if scores else 0.0)
    return {
        "embed": count(lambda: model.drop(model.wte(idx) + model.wpe(torch.arange(seq_len, device="meta")))),
        "layer": layer,
        "head": count(lambda: model.lm_head(model.ln_f(x))),
    }


def model_facts(model) -> dict:
    """Ψ, the parameter shapes in `parameters()` order (a tied tensor once) and the largest group of
    parameters one module owns directly (what ZeRO-3 / FSDP gather at once, at least)."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    largest = 0
    for m in model.modules():
        largest = max(largest, sum(p.numel() for p in m.parameters(recurse=False)))
    return {"params": sum(numel(s) for s in shapes), "shapes": shapes, "largest_unit_params": largest}


def predict_run(cfg, plan, build_model, device: str | None = None, shapes: bool = True) -> dict:
    """`predict` for a composed config (`ptbench.core.config.BenchConfig`) and its run plan
    (`ptbench.runner.plan.RunPlan`): the one call the runner and `python -m ptbench --plan` make. The
    layout and the adapter's cost inputs come from the plan (`plan.layout`, `plan.cost`), the model's
    dimensions from the workload config. `build_model`: a no-argument callable returning the workload's
    nn.Module (e.g. `build_workload(cfg.workload, cfg.data).build_model`); it is called under the meta
    device, so nothing is allocated. device: cuda | cpu (default: cuda when torch sees a GPU)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = build_model()
    facts = model_facts(model)
    w, t, layout, cost = cfg.workload, cfg.trainer, plan.layout, plan.cost
    m = layout.microbatches
    params = facts["params"]
    vocab = int(w.vocab_size) if w.kind == "language" else 0
    if cost.padded_vocab and vocab:  # the vocabulary the framework really builds (Megatron pads it)
        params += (cost.padded_vocab - vocab) * int(w.n_embd)
        vocab = cost.padded_vocab
    kw = dict(
        params=params,
        world_size=layout.world_size,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        devices_per_process=layout.devices_per_process,
        precision=t.precision,
        optimizer=cfg.optimizer.name,
        momentum=float(cfg.optimizer.momentum),
        kind=w.kind,
        micro_batch=math.ceil(plan.local_batch / m),
        microbatches=m,
        device=device,
        schedule=cost.schedule,
        recompute=cost.recompute,
        sequence_parallel=cost.sequence_parallel,
        largest_unit_params=facts["largest_unit_params"],
        fusion_buffer_bytes=cost.fusion_buffer_bytes,
        half_states=cost.half_states,
        # ZeRO-Offload (bench/core/layout.py CostInputs; adapters/zero.py cost_inputs)
        offload_optimizer=cost.offload_optimizer,
        offload_params=cost.offload_params,
    )
    if cost.sharding == "zero3":  # DeepSpeed's stage-3 settings as the adapter passes them (the rest: its defaults)
        a = cfg.adapter
        kw["zero3_settings"] = {
            "param_persistence_threshold": int(getattr(a, "param_persistence_threshold", 100_000)),
            "prefetch_bucket_size": int(getattr(a, "allgather_bucket_size", 50_000_000)),
            "max_live_parameters": int(getattr(a, "max_live_parameters", 1_000_000_000)),
            "max_reuse_distance": int(getattr(a, "max_reuse_distance", 1_000_000_000)),
        }
    if shapes and cost.sharding in ("zero1", "zero2", "zero3", "fsdp"):
        kw["shapes"] = facts["shapes"]
    # the optimizer step's temporaries: the harness's two parameter groups (bench/core/optim.py param_groups)
    kw["weight_decay"] = float(cfg.optimizer.weight_decay)
    kw["step_groups"] = harness_step_groups(facts["shapes"], kw["weight_decay"])
    if cost.sharding == "distributed_optimizer" and device == "cuda" and cfg.optimizer.name in ("adam", "adamw"):
        # Megatron's distributed optimizer steps Transformer Engine's or Apex's FusedAdam when either is installed,
        # else torch's AdamW (megatron/core/optimizer/__init__.py:12-33, :358-363)
        import importlib.util

        if any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")):
            kw["optimizer_impl"] = "fused"
    if w.kind == "language":
        # the scores are counted where the adapter's attention keeps them (its cost inputs)
        scores = attention_keeps_scores(cost.attention, device, float(w.dropout))
        kw.update(
            layers=int(w.n_layer),
            hidden=int(w.n_embd),
            heads=int(w.n_head),
            seq_len=int(w.seq_len),
            vocab=vocab,
            attention_scores=scores,
            attention_dropout=float(w.dropout) > 0,
            # Megatron's vocab-parallel loss works in place; torch's loss_parallel (TP) is F.cross_entropy's
            loss_in_place=True if cost.vocab_parallel_loss else (False if layout.tp > 1 else None),
        )
        if not cost.padded_vocab:  # the harness GPT-2 (Megatron builds its own, with its padded vocabulary)
            kw["layer_saved_elements"] = gpt2_saved_elements(model, int(w.seq_len), scores=scores)
    else:
        kw.update(
            image_size=int(w.image_size),
            activation_elements_per_sample=activation_elements(model, (3, int(w.image_size), int(w.image_size))),
        )
        if layout.pp > 1 and cost.schedule != "interleaved_1f1b":  # one stage per rank (or device)
            sample = (3, int(w.image_size), int(w.image_size))
            balance = getattr(cfg.adapter, "balance", None)
            balance = list(balance) if balance else even_split(len(pipeline_layers(model)), layout.pp)
            kw["stage_activation_elements"] = stage_activation_elements(model, sample, balance)
            if cost.schedule == "gpipe" and cost.recompute != "never":  # torchgpipe checkpointing keeps the inputs
                kw["stage_input_elements"] = stage_input_elements(model, sample, balance)
    out = predict(cost.sharding, label=cfg.adapter.name, **kw)
    out["inputs"] = {k: v for k, v in kw.items() if k not in ("shapes", "step_groups")}
    return out


def device_bytes(processes_on_host: int = 1) -> tuple[float | None, str]:
    """(bytes one rank may use, what they are): the first visible GPU's total memory on CUDA; on a
    CPU the host's available memory divided by the ranks that share it. The launcher asks before its ranks
    start: NVML tells without a CUDA context (torch's device properties only where NVML cannot)."""
    import torch

    if torch.cuda.is_available():
        from ptbench.core.records import visible_gpus_nvml

        name, total = (visible_gpus_nvml() or [None])[0] or _torch_device_0(torch)
        return float(total), f"{name} total memory"
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001
        return None, "unknown"
    return float(avail) / max(1, processes_on_host), f"host available memory / {max(1, processes_on_host)} ranks"


def _torch_device_0(torch) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(0)
    return props.name, int(props.total_memory)


def _exceeds(prediction: dict, device: float, what: str, headroom: float) -> str:
    return (
        f"predicted memory per rank {prediction['total'] / GIB:.2f} GiB ({prediction['adapter']}: states "
        f"{prediction['model_states'] / GIB:.2f} + the larger of transient {prediction['transient'] / GIB:.2f} + "
        f"activations {prediction['activations'] / GIB:.2f} and the optimizer step's "
        f"{prediction['step_transient'] / GIB:.2f}) exceeds {headroom:.0%} of the {what} ({device / GIB:.2f} GiB)"
    )


def check_fits(prediction: dict, device: float | None, what: str = "device", headroom: float = 0.9) -> None:
    """Raise ConfigError (the run is refused before launch) when the predicted total does not fit."""
    from ptbench.core.errors import ConfigError

    if fits(prediction["total"], device, headroom):
        return
    raise ConfigError(
        f"{_exceeds(prediction, device, what, headroom)} (trainer.memory_check=refuse); "
        "`python -m ptbench --plan ...` shows the breakdown: shard more (zero stage 3, fsdp, tensor/pipeline "
        "parallel), lower trainer.batch_size, or use bf16"
    )


def memory_warning(prediction: dict, device: float, what: str = "device", headroom: float = 0.9) -> str:
    """trainer.memory_check=warn (the default): the one line printed before launch when the prediction, an
    estimate, does not fit; the run goes on and its record holds the prediction beside the measured peak."""
    return (
        f"warning: {_exceeds(prediction, device, what, headroom)}; running anyway (an estimate: "
        "trainer.memory_check=refuse refuses such runs, `python -m ptbench --plan ...` shows the breakdown)"
    )


def record_fields(prediction: dict) -> dict:
    """The prediction as a record field (JSON-ready, bytes as integers): what the runner stores in the
    summary as `predicted_memory`."""
    p = prediction
    keys = (*PARTS, "step_transient", "step_optimizer", "saved_activations", "model_states", "total")
    out = {k: int(round(p[k])) for k in keys}
    out.update(
        sharding=p["sharding"],
        busiest=p["busiest"],
        params_per_rank=int(round(p["params_per_rank"])),
        dp=p["dp"],
        tp=p["tp"],
        pp=p["pp"],
        notes=p["notes"],
        formula=p["formula"],  # per part what was used (DeepSpeed stage 3: the settings it follows)
        model="bench/core/memory_model.py",
    )
    return out


def plan_memory(cfg, plan, build_model, check: bool | None = None, headroom: float = 0.9) -> dict:
    """The runner's one call before launch: predict (`predict_run`), refuse the run with ConfigError
    when the busiest rank's total does not fit `headroom` x the device (`check_fits`; check=None:
    only when trainer.memory_check=refuse, the estimate being only that), and return `record_fields`
    plus the device memory compared against (`device_bytes`, `device`)."""
    pred = predict_run(cfg, plan, build_model)
    cap, what = device_bytes(getattr(plan, "world_size", 1))
    if check or (check is None and cfg.trainer.memory_check == "refuse"):
        check_fits(pred, cap, what, headroom)
    return {
        **record_fields(pred),
        "device_bytes": None if cap is None else int(cap),
        "device": what,
        "fits": fits(pred["total"], cap, headroom),
    }


def table(prediction: dict) -> str:
    """The prediction as lines for a terminal."""
    p = prediction
    head = (
        f"predicted memory per rank: {p['adapter']}"
        + (f" ({p['sharding']})" if p["sharding"] not in ("none", p["adapter"]) else "")
        + f", {p['world_size']} rank(s) (dp={p['dp']} tp={p['tp']} pp={p['pp']}), {p['precision']}, "
        f"{p['optimizer_name']}; busiest: {p['busiest']}, {p['params_per_rank']:,.0f} parameters"
    )
    lines = [head, f"  {'part':<12} {'MiB':>12}  formula"]
    for k in PARTS:
        lines.append(f"  {k:<12} {p[k] / MIB:12.2f}  {p['formula'].get(k, '-')}")
    lines.append(f"  {'(saved)':<12} {p['saved_activations'] / MIB:12.2f}  what autograd saves, the most of any stage")
    lines.append(f"  {'step':<12} {p['step_transient'] / MIB:12.2f}  {p['formula'].get('step_transient', '-')}")
    lines.append(f"  {'(optimizer)':<12} {p['step_optimizer'] / MIB:12.2f}  the optimizer's own temporaries in step")
    lines.append(f"  {'states':<12} {p['model_states'] / MIB:12.2f}  params + grads + optimizer + master")
    lines.append(f"  {'total':<12} {p['total'] / MIB:12.2f}  states + max(transient + activations, step)")
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)
