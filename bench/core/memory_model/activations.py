"""Activations per rank at backward's peak: [Korthikanti] for GPT-2 under tensor parallelism and Megatron, the
counted harness GPT-2 otherwise, the counted vision models; x the micro-batches a pipeline schedule keeps alive,
and the loss (README.md, "Activations")."""

from __future__ import annotations

import math

from ptbench.core.memory_model.inputs import Inputs


def attention_keeps_scores(attention: str, device: str, dropout: float) -> bool:
    """Whether attention (ptbench.core.layout.ATTENTION) saves [b, a, s, s] tensors for backward. torch's SDPA:
    CUDA's flash / memory-efficient kernels and the CPU's flash kernel keep a log-sum-exp; the CPU flash kernel
    refuses dropout, so there the math form runs, which keeps the softmax, the mask and the dropped scores
    (measured: tests/test_attention_and_cuda_memory.py). Transformer Engine never keeps them; unfused always."""
    if attention == "sdpa":
        return device != "cuda" and dropout > 0
    return attention == "unfused"


def loss_bytes(tokens: int, vocab: int, in_place: bool, act_b: int, tp: int = 1) -> tuple[float, float, str]:
    """(bytes at the loss's peak, of them saved for backward, formula) of a cross-entropy over tokens x vocab logits,
    on one rank (tp > 1: the logits split by vocabulary, V/t). in_place (the harness GPT-2's chunked loss on a CPU,
    workloads/gpt2.py; Megatron's vocab-parallel one): the fp32 softmax saved (4 B), scaled in place into the
    gradient, cast to the 2 B logits' dtype under bf16 / fp16. Else F.cross_entropy(logits.float()) (GPT-2 on
    CUDA): its fp32 log-softmax saved; backward adds nll_loss's zero-filled gradient and log_softmax's gradient, 4 B
    each at once (the cast copy is freed by then). torch's loss_parallel (not in place, tp > 1) computes both
    backwards in one (torch/distributed/tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`): the
    zero-filled gradient, exp(log-softmax), their sum and its product with the incoming gradient, 3 x 4 B at once
    beside the saved log-softmax (measured: `python -m ptbench.scale adapter=tensor_parallel`)."""
    n = tokens * vocab / tp
    if not in_place and tp > 1:
        return 16.0 * n, 4.0 * n, "16 s b V / t: loss_parallel's fp32 log-softmax, zeros, exp, their sum, product"
    if not in_place:
        return 12.0 * n, 4.0 * n, "12 s b V: F.cross_entropy's fp32 log-softmax, nll's gradient, its gradient"
    peak = (4.0 + (2 if act_b == 2 else 0)) * n
    return peak, 4.0 * n, f"4 s b V{' / t' if tp > 1 else ''} fp32 softmax saved by the loss (gradient in place)"


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


def alive(inp: Inputs, stage_name: str, notes: list) -> tuple[int, str]:
    """(micro-batches whose activations a stage keeps at its peak, why): 1 without a pipeline; GPipe all m, at
    one partition too (every forward before any backward, and the loss on the gathered mini-batch); 1F1B the
    first stage min(p, m), the last 1."""
    pp, m, schedule = inp.layout.pp, inp.layout.microbatches, inp.cost.schedule
    if schedule == "gpipe" and m > 1:
        return m, f"m={m} micro-batches (GPipe schedule)"
    if pp == 1:
        return 1, "1 micro-batch"
    if stage_name == "last":
        return 1, "1 micro-batch (1F1B, last stage)"
    if schedule == "interleaved_1f1b":
        notes.append("interleaved 1F1B modelled as 1F1B (it keeps up to (p-1)/(p v) more micro-batches)")
    return min(pp, m), f"min(p, m)={min(pp, m)} micro-batches (1F1B, first stage)"


def activations(inp: Inputs, stage_name: str, notes: list) -> tuple[float, str, float]:
    """(bytes at backward's peak, formula, of them what autograd saved) on stage `stage_name`."""
    a, m = inp.acts, inp.model
    if not a.micro_batch:
        return 0.0, "not estimated (micro_batch=0)", 0.0
    if m.kind == "vision":
        return _vision(inp, stage_name, notes)
    recompute, schedule = inp.cost.recompute, inp.cost.schedule
    # the counted block is one tensor-parallel rank's at the TP degree it was counted for (no sequence parallelism)
    counted = a.layer_saved_elements and a.layer_saved_elements.get("tp", 1) == inp.layout.tp
    counted = counted and not (inp.layout.tp > 1 and inp.cost.sequence_parallel)
    if counted and (recompute == "never" or schedule == "gpipe"):
        return _counted_gpt2(inp, stage_name, notes)
    return _korthikanti(inp, stage_name, notes)


def _vision(inp: Inputs, stage_name: str, notes: list) -> tuple[float, str, float]:
    """Counted per sample (`activation_elements`), per stage where the adapter's split gives the stages."""
    a, pp, b, act_b = inp.acts, inp.layout.pp, inp.acts.micro_batch, inp.act_bytes
    if a.activation_elements_per_sample is None:
        notes.append("vision activations not estimated: give activation_elements_per_sample")
        return 0.0, "not estimated", 0.0
    if a.stage_activation_elements:  # a pipeline's stages (GPipe's one partition included)
        return _vision_stages(inp)
    per_mb = a.activation_elements_per_sample * act_b * b / pp  # a stage holds ~1/p of the layers
    f = f"{a.activation_elements_per_sample:,.0f} elem/sample x {act_b} B x b={b}" + (" / p" if pp > 1 else "")
    n, how = alive(inp, stage_name, notes)
    if pp > 1:
        notes.append("vision pipeline activations assume each stage holds 1/p of the model's activations")
    return per_mb * n, f"{f} x {how}", per_mb * n


def _vision_stages(inp: Inputs) -> tuple[float, str, float]:
    """Each stage counted on its own: stage i keeps m micro-batches (GPipe schedule) or min(p - i, m) (1F1B);
    torchgpipe's checkpointing m stage inputs + one micro-batch's stage at once. The most any stage saves."""
    elems, pp, m = inp.acts.stage_activation_elements, inp.layout.pp, inp.layout.microbatches
    b, act_b, schedule, recompute = inp.acts.micro_batch, inp.act_bytes, inp.cost.schedule, inp.cost.recompute
    if len(elems) != pp:
        raise ValueError(f"stage_activation_elements has {len(elems)} entries for pp={pp}")
    alive_i = [m if schedule == "gpipe" else min(pp - i, m) for i in range(pp)]
    per_stage = [e * act_b * b * n for e, n in zip(elems, alive_i)]
    checkpointed = schedule == "gpipe" and recompute != "never" and m > 1
    ins = inp.acts.stage_input_elements if checkpointed else None
    if ins:
        per_stage = [(m * i + e - i) * act_b * b for e, i in zip(elems, ins)]
    top = max(range(pp), key=lambda i: per_stage[i])
    total = per_stage[top]
    alive_top = f"{alive_i[top]} micro-batch(es) alive ({schedule})"
    if ins:
        alive_top = f"(1 micro-batch + {m - 1} x {ins[top]:,.0f} stage input) ({recompute})"
    how = (
        f"stage {top}: {elems[top]:,.0f} elem/sample (counted per stage) x {act_b} B "
        f"x b={b} x {alive_top}; the most of any stage"
    )
    return total, how, total


def _counted_gpt2(inp: Inputs, stage_name: str, notes: list) -> tuple[float, str, float]:
    """The harness GPT-2, counted: per layer, the embedding (first stage) and the final LayerNorm + head input
    (last stage), each x bytes per element x b, x micro-batches alive; + the softmax the loss saves."""
    e, mo, lay = inp.acts.layer_saved_elements, inp.model, inp.layout
    b, act_b, m, pp = inp.acts.micro_batch, inp.act_bytes, lay.microbatches, lay.pp
    recompute, schedule = inp.cost.recompute, inp.cost.schedule
    per_stage_layers = math.ceil(mo.layers / pp)
    n, how = alive(inp, stage_name, notes)
    first = stage_name in ("all", "first", "any")
    last = stage_name in ("all", "last", "any")
    # counted in bytes (CUDA autocast, `gpt2_saved_bytes_cuda_autocast`) or in fp32 elements x act_b
    per_byte = 1 if e.get("unit") == "bytes" else act_b
    per_mb = (per_stage_layers * e["layer"] + first * e["embed"] + last * e["head"]) * per_byte * b
    # the weights' half copies under CUDA autocast: once per forward, whatever the batch
    fixed = sum(
        k * e.get(f"{part}_fixed", 0.0) for k, part in ((per_stage_layers, "layer"), (first, "embed"), (last, "head"))
    )
    tokens, tp = mo.seq_len * b, lay.tp
    peak_loss, loss, loss_f = loss_bytes(tokens, mo.vocab, inp.loss_in_place, act_b, tp) if last else (0.0, 0.0, "")
    last_alive = 1 if (pp > 1 and schedule != "gpipe") else n
    saved = n * per_mb + fixed + last_alive * loss
    if recompute != "never" and m > 1:  # torchgpipe checkpointing (README.md)
        inp_elems = (8 * mo.seq_len if first else act_b * mo.seq_len * mo.hidden) * b  # int64 token ids first
        # token ids cannot carry torchgpipe's micro-batch order into backward: the next partition's float input
        # orders all but two recomputations; a single partition has nothing to order them, so all m run at once
        r, whole = ((2 if pp > 1 else m) if first else 1), (recompute == "except_last")
        # forward's end (the last micro-batch whole under except_last, the loss) or the recomputation
        saved = m * inp_elems + max(whole * (per_mb - inp_elems) + last_alive * loss, r * (per_mb - inp_elems))
        how = f"recompute={recompute}: m={m} stage inputs + {r} micro-batch(es) at once"
    total = saved + last_alive * (peak_loss - loss)  # the loss's backward: more than it saved
    formula = (
        f"{how} x (ceil(L/p)={per_stage_layers} x {e['layer']:,.0f} per layer"
        + (f" of one of t={tp} tensor-parallel ranks" if tp > 1 else "")
        + (f" + {e['embed']:,.0f} embedding" if first else "")
        + (f" + {e['head']:,.0f} head" if last else "")
        + (") B/sample (counted under CUDA autocast" if per_byte == 1 else ") elem/sample (counted")
        + (f", harness GPT-2) x {act_b} B" if per_byte != 1 else ", harness GPT-2)")
        + f" x b={b}"
        + (f" + {fixed:,.0f} B of autocast's half weight copies" if fixed else "")
        + (f" + {loss_f}" if last else "")
    )
    return total, formula, saved


def _korthikanti(inp: Inputs, stage_name: str, notes: list) -> tuple[float, str, float]:
    """[Korthikanti] per layer x the stage's layers x micro-batches alive, + the loss split by vocabulary over TP."""
    mo, a, lay = inp.model, inp.acts, inp.layout
    b, act_b, m, pp, tp = a.micro_batch, inp.act_bytes, lay.microbatches, lay.pp, lay.tp
    recompute, sp = inp.cost.recompute, inp.cost.sequence_parallel
    per_stage_layers = math.ceil(mo.layers / pp)
    layer = _gpt2_layer_activation_bytes(
        mo.seq_len, b, mo.hidden, mo.heads, tp, sp, a.attention_scores, a.attention_dropout
    )
    layer *= act_b / 2
    peak_loss, loss, loss_f = loss_bytes(mo.seq_len * b, mo.vocab, inp.loss_in_place, act_b, tp)
    logits, logits_saved = (peak_loss, loss) if stage_name in ("all", "last", "any") else (0.0, 0.0)
    n, how = alive(inp, stage_name, notes)
    if recompute in ("always", "except_last") and m > 1:
        full = 1 if recompute == "always" else 2
        inputs = m * mo.seq_len * b * mo.hidden * act_b
        total = inputs + full * per_stage_layers * layer + logits
        formula = (
            f"recompute={recompute}: m stage inputs (s b h) + {full} micro-batch(es) of "
            f"ceil(L/p)={per_stage_layers} layers [Korthikanti]" + (f" + {loss_f}" if logits else "")
        )
        return total, formula, total - (logits - logits_saved)
    last_alive = 1 if (pp > 1 and inp.cost.schedule != "gpipe") else n
    total = n * per_stage_layers * layer + (last_alive * logits if logits else 0.0)
    sc = "" if a.attention_scores else " (no 5as/h: fused attention)"
    tpf = "" if tp == 1 else (" /t (sequence parallel)" if sp else " with 10 + 24/t + 5as/(ht)")
    formula = f"{how} x ceil(L/p)={per_stage_layers} layers x s b h (34 + 5as/h){sc}{tpf} x {act_b}/2 B" + (
        f" + {loss_f}" if logits else ""
    )
    return total, formula, total - last_alive * (logits - logits_saved)
