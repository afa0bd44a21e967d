"""FSDP2 (sharding fsdp) as torch runs it, beside [ZeRO] 7.2.2's 3 (N-1)/N Psi B: every parameter's dim 0 padded to
a multiple of N (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), the root unit not re-gathered in backward
(wrapped reshard_after_forward=False), and BatchNorm parameters kept out of sharding under bf16/fp16, their
gradients all-reduced once a step. Each measured against torch's fake process group at 8-1024 ranks by
`python -m ptbench.scale`."""

from __future__ import annotations

import math

from ptbench.core.comm_volume.items import item, rebytes, retotal
from ptbench.core.layout import padded_elements


def fsdp_padded(vol: dict, shapes, root_shapes=None) -> list[str]:
    """FSDP2's data-parallel items of `vol` (from `volume`) in place: messages of the dim-0 padded elements of
    `shapes` (every sharded parameter, a tied one once), and, with `root_shapes`, the backward re-gather without
    the root unit (wrapped reshard_after_forward=False: its parameters stay gathered from forward to backward, so
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
        rebytes(it)
        without_root = name == "dp_param_all_gather_bwd" and root_shapes is not None
        it["formula"] = it["formula"].replace("Psi", "(Psi_pad - Psi_root)" if without_root else "Psi_pad")
    retotal(vol)
    return notes


def norm_shapes(model) -> list[tuple]:
    """The shapes of the BatchNorm parameters of `model` (a meta-device build is enough), in module order."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [tuple(p.shape) for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters(False)]


def without(shapes, taken) -> list[tuple]:
    """`shapes` less one occurrence of each of `taken` (a multiset difference; order kept)."""
    left = [tuple(s) for s in shapes]
    for s in taken:
        if tuple(s) in left:
            left.remove(tuple(s))
    return left


def norm_grad_all_reduce(vol: dict, shapes) -> list[str]:
    """FSDP2 with bf16/fp16 as the harness wraps it: the BatchNorm parameters (`shapes`) stay out of sharding,
    whole fp32 tensors on every rank (batch_norm refuses bf16 weights beside its fp32 running statistics), and
    their gradients are averaged in one flattened fp32 all-reduce per step, as DDP does. Appended to `vol` in
    place; returns its note."""
    elems = sum(math.prod(s) for s in shapes)
    if not elems or vol["dp"] == 1:
        return []
    vol["collectives"].append(
        item(
            "dp_norm_grad_all_reduce",
            "all_reduce",
            "dp",
            vol["dp"],
            elems * 4,
            1,
            "2(N-1)/N * Psi_norm * 4",
            "backward",
            4,
        )
    )
    retotal(vol)
    return [
        f"FSDP2 with half precision: {len(shapes)} BatchNorm parameter tensors ({elems:,} elements) are kept "
        "whole in fp32 (ignored_params), left out of the gathers and reduce-scatters, and their gradients "
        "all-reduced once per step"
    ]
