"""The model's facts, counted once per launch from its meta-device build and carried on the run plan
(`RunPlan.facts`): what the memory model and the comm volume both read."""

from __future__ import annotations

from ptbench.core.memory_model.counting import pipeline_layers
from ptbench.core.memory_model.inputs import ModelFacts
from ptbench.core.memory_model.states import numel


def model_facts(model) -> dict:
    """Ψ, the parameter shapes in `parameters()` order (a tied tensor once) and the largest group of
    parameters one module owns directly (what ZeRO-3 / FSDP gather at once, at least)."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    largest = 0
    for m in model.modules():
        largest = max(largest, sum(p.numel() for p in m.parameters(recurse=False)))
    return {"params": sum(numel(s) for s in shapes), "shapes": shapes, "largest_unit_params": largest}


def vision_units(model) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(units, norms) of a vision model: per layer of its sequential form (`pipeline_layers`) that owns
    parameters, the indices of its tensors in `parameters()` order; and the indices of BatchNorm's parameters."""
    from torch import nn

    index = {id(p): i for i, p in enumerate(model.parameters())}
    units = tuple(tuple(index[id(p)] for p in m.parameters()) for m in pipeline_layers(model))
    norms = tuple(
        index[id(p)] for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()
    )
    return tuple(u for u in units if u), norms


def run_facts(workload, cost, model) -> ModelFacts:
    """The facts of `model` (the workload's nn.Module, on the meta device) as the run's framework builds it:
    the workload config's dimensions, and the vocabulary the adapter's cost inputs state (Megatron pads it:
    Ψ then holds the padded rows of the embedding too)."""
    f = model_facts(model)
    params = f["params"]
    if workload.kind != "language":
        units, norms = vision_units(model)
        return ModelFacts(
            params=params,
            kind=workload.kind,
            image_size=int(workload.image_size),
            shapes=f["shapes"],
            largest_unit_params=f["largest_unit_params"],
            units=units,
            norms=norms,
        )
    vocab = int(workload.vocab_size)
    if cost.padded_vocab and vocab:  # the vocabulary the framework really builds
        params += (cost.padded_vocab - vocab) * int(workload.n_embd)
        vocab = cost.padded_vocab
    return ModelFacts(
        params=params,
        kind="language",
        layers=int(workload.n_layer),
        hidden=int(workload.n_embd),
        heads=int(workload.n_head),
        seq_len=int(workload.seq_len),
        vocab=vocab,
        shapes=f["shapes"],
        largest_unit_params=f["largest_unit_params"],
    )
