"""Tensor-parallel traffic beyond the papers' per-layer collectives, as megatron-core 0.16.1 moves it (paths under
megatron/core/, the installed version) and torch TP on the harness GPT-2 with its vocabulary-sharded embedding:
the vocab-parallel embedding, output layer and cross-entropy, and with sequence parallelism the backward
re-gather of the column-parallel linears' input and the all-reduce of the sequence-parallel parameters'
gradients. Measured against the traces by `python -m ptbench.studies.ledger`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptbench.core.comm_volume.items import item

MCORE_SP = "megatron-core, adapter.sequence_parallel=true"
_ACT_AR = "m * 2(t-1)/t * b*s*h * B"


@dataclass(frozen=True)
class _Tp:
    """The tensor-parallel group's numbers, read off the formula's per-layer item."""

    n: int  # t
    act: float  # one b*s*h message, bytes
    b: int  # bytes per activation element
    h: int
    pp: int
    layers_rank: int  # ceil(L/p)
    m: float  # micro-batches per step

    @classmethod
    def of(cls, tp_item: dict, fields: dict, workload) -> _Tp:
        h, pp = workload.n_embd, max(1, fields.get("pp", 1))
        layers_rank = math.ceil(workload.n_layer / pp)
        m = tp_item["calls"] / (4 * layers_rank)
        n, act, b = tp_item["group_size"], tp_item["message_bytes"], tp_item["bytes_per_elem"]
        return cls(n, act, b, h, pp, layers_rank, m)

    def act_item(self, name: str, op: str, calls: float, formula: str, phase: str) -> dict:
        return item(name, op, "tp", self.n, self.act, calls, formula, phase, self.b)

    def cross_entropy(self) -> dict:
        """The vocab-parallel cross-entropy (parallel_output): 3 fp32 b*s all-reduces (max logit, target logit,
        sum of exp) per micro-batch."""
        bs = self.act / (self.h * self.b)
        formula = "3 * m * 2(t-1)/t * b*s * 4"
        return item(
            "tp_cross_entropy_all_reduce", "all_reduce", "tp", self.n, bs * 4, 3 * self.m, formula, "forward", 4
        )

    def where(self) -> str:
        if self.pp > 1:
            return (
                "the first stage holds the embedding, the last the output layer and the loss (each kind's busiest "
                f"stage counted, p = {self.pp})"
            )
        return "one rank holds the embedding, the output layer and the loss (p = 1)"


def busiest_stage(first: list[dict], last: list[dict], pp: int) -> list[dict]:
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


def vocab_parallel(tp_item: dict, fields: dict, workload, sp: bool, diffs: list[str]) -> list[dict]:
    """The items beyond `tp_item` (the formula's tp_activation_all_reduce, or its tp_activation_all_gather with
    sequence parallelism); appends one line per difference to `diffs`."""
    t = _Tp.of(tp_item, fields, workload)
    return _sequence_parallel(t, diffs) if sp else _plain(t, diffs)


def _plain(t: _Tp, diffs: list[str]) -> list[dict]:
    first = [t.act_item("tp_embedding_all_reduce", "all_reduce", t.m, _ACT_AR, "forward")]
    last = [t.act_item("tp_output_layer_all_reduce", "all_reduce", t.m, _ACT_AR, "backward"), t.cross_entropy()]
    diffs.append(
        "Megatron TP: the vocab-parallel embedding all-reduces its output (forward) and the column-parallel "
        "output layer all-reduces its input gradient (backward), a b*s*h all-reduce each per micro-batch; "
        "the vocab-parallel cross-entropy (parallel_output) all-reduces 3 fp32 b*s tensors (max logit, target "
        f"logit, sum of exp) per micro-batch; {t.where()}"
    )
    return busiest_stage(first, last, t.pp)


def _sp_grads(t: _Tp, elems: int, final_norm: bool) -> dict:
    """A stage's one flattened fp32 all-reduce of its sequence-parallel parameters' gradients."""
    formula = f"2(t-1)/t * (6h * ceil(L/p){' + 2h' if final_norm else ''}) * 4"
    return item("tp_sequence_parallel_grad_all_reduce", "all_reduce", "tp", t.n, elems * 4, 1, formula, "backward", 4)


def _sequence_parallel(t: _Tp, diffs: list[str]) -> list[dict]:
    one = "m * (t-1)/t * b*s*h * B"
    first = [
        t.act_item("tp_embedding_all_reduce", "all_reduce", t.m, _ACT_AR, "forward"),
        t.act_item("tp_embedding_grad_all_gather", "all_gather", t.m, one, "backward"),
    ]
    last = [
        t.act_item("tp_output_layer_all_gather", "all_gather", 2 * t.m, f"2 * {one}", "forward,backward"),
        t.act_item("tp_output_layer_reduce_scatter", "reduce_scatter", t.m, one, "backward"),
        t.cross_entropy(),
    ]
    layer_elems = t.layers_rank * 6 * t.h  # each stage's layers: 2 LayerNorms (weight, bias) and 2 biases of h
    # the final LayerNorm's 2h sit on the last stage (with p = 1, in the one rank's all-reduce)
    if t.pp > 1:
        first.append(_sp_grads(t, layer_elems, final_norm=False))
        last.append(_sp_grads(t, layer_elems + 2 * t.h, final_norm=True))
    else:
        first.append(_sp_grads(t, layer_elems + 2 * t.h, final_norm=True))
    calls = 2 * t.layers_rank * t.m
    regather = t.act_item("tp_backward_input_all_gather", "all_gather", calls, f"2 * ceil(L/p) * {one}", "backward")
    diffs += _sp_differences(t, layer_elems)
    return [regather, *busiest_stage(first, last, t.pp)]


def _sp_differences(t: _Tp, layer_elems: int) -> list[str]:
    return [
        f"{MCORE_SP}: the column-parallel linears (QKV, fc1) all-gather their sequence-shard input again in "
        "backward for the weight gradient instead of keeping the gathered input (tensor_parallel/layers.py:522): "
        "2 more b*s*h all-gathers per layer and micro-batch, 6 instead of the paper's 4",
        f"{MCORE_SP}: the vocab-parallel embedding still all-reduces its output (learned positions turn "
        "reduce_scatter_embeddings off, models/common/embeddings/language_model_embedding.py:48) and scatters it "
        "to the sequence shards (no bytes forward, an all-gather of its gradient backward, "
        "tensor_parallel/mappings.py:293); the column-parallel output layer all-gathers the final norm's output "
        "forward and again backward and reduce-scatters its input gradient (tensor_parallel/layers.py:483, 522, "
        "555); per micro-batch the embedding's 1 b*s*h all-reduce and 1 all-gather, the output layer's 2 "
        f"all-gathers and 1 reduce-scatter, and the vocab-parallel cross-entropy's 3 fp32 b*s all-reduces; "
        f"{t.where()}",
        f"{MCORE_SP}: finalize_model_grads all-reduces over the TP group, once per step in one flattened fp32 "
        "tensor, the gradients of the parameters marked sequence_parallel: the LayerNorms (2 per layer, the "
        "final one on the last stage) and the row-parallel linears' biases, added after the reduce-scatter "
        "(tensor_parallel/layers.py:1228; distributed/finalize_model_grads.py:354, 376): 6h per layer "
        f"({layer_elems} elements per stage) + 2h",
    ]
