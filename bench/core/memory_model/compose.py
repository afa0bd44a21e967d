"""`predict`: the busiest rank's bytes, composed from the model states (states.py), the activations
(activations.py) and the optimizer step's temporaries (step.py): total = states + max(transient + activations,
step), per stage, the busiest stage taken."""

from __future__ import annotations

from ptbench.core.memory_model.activations import activations
from ptbench.core.memory_model.inputs import PRECISIONS, Inputs
from ptbench.core.memory_model.stash import stash_of, stash_per_stage
from ptbench.core.memory_model.states import optimizer_state_bytes, stage_shards, states
from ptbench.core.memory_model.step import step_transient


def predict(sharding: str = "none", **fields) -> dict:
    """Bytes per rank (the busiest one) training a model whose states are split by `sharding`
    (ptbench.core.layout.SHARDING, what an adapter's `cost_inputs` states), from the inputs' fields by name
    (`Inputs.of`: params=, world_size=, dp=, tp=, pp=, precision=, micro_batch= ...; README.md lists them):
    `compose(Inputs.of(sharding, **fields))`. The runner builds the grouped `Inputs` itself (`predict_run`)."""
    return compose(Inputs.of(sharding, **fields))


def compose(inp: Inputs) -> dict:
    """The prediction for the grouped inputs: {adapter (the label), sharding, world_size, dp, tp, pp, precision,
    optimizer_name, optimizer_bytes_per_elem, kind, busiest, params_per_rank (elements of the model-parallel
    shard), the bytes of each of PARTS, step_transient, step_optimizer, saved_activations, model_states, total,
    formula (per part what was used), notes (what is uncertain), stash, stash_per_stage}; every byte field is a
    float. `model_states` = params + grads + optimizer + master + stash (an asynchronous pipeline's stashed weight
    versions, per stage in `stash_per_stage`; 0 and [] without one); `transient`: what forward / backward hold beside the activations;
    `step_transient`: what the optimizer step alone holds after backward freed the activations and those buffers;
    `total` = model_states + max(transient + activations, step_transient); `busiest` names the stage taken."""
    _check(inp)
    notes: list[str] = []
    shared: dict[str, str] = {}
    results = []
    stash, stash_rule = stash_per_stage(inp, notes)
    for stage_name, P in stage_shards(inp, shared, notes):
        formula = dict(shared)
        out, part = states(inp, P, formula, notes)
        if stash:
            out["stash"], formula["stash"] = stash_of(stage_name, stash), stash_rule
        out["step_transient"], out["step_optimizer"], formula["step_transient"] = step_transient(inp, P, part, notes)
        out["activations"], formula["activations"], out["saved_activations"] = activations(inp, stage_name, notes)
        out["model_states"] = out["params"] + out["grads"] + out["optimizer"] + out["master"] + out.get("stash", 0.0)
        # the step runs after backward has freed the activations (and the gathered / full gradients): the peak is
        # the larger of backward's and the step's, on top of the model states
        out["total"] = out["model_states"] + max(out["transient"] + out["activations"], out["step_transient"])
        results.append((stage_name, P, out, formula))
    saved_max = max(r[2]["saved_activations"] for r in results)  # the memory ledger compares the most any rank saves
    stage_name, P, out, formula = max(results, key=lambda r: r[2]["total"])
    t, lay = inp.training, inp.layout
    return dict(
        adapter=inp.label or inp.sharding,
        sharding=inp.sharding,
        world_size=lay.world_size,
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        precision=t.precision,
        optimizer_name=t.optimizer,
        optimizer_bytes_per_elem=optimizer_state_bytes(t.optimizer, t.momentum),
        kind=inp.model.kind,
        busiest=stage_name,
        params_per_rank=P,
        **{**out, "saved_activations": saved_max, "stash": out.get("stash", 0.0)},
        stash_per_stage=stash,
        formula=formula,
        notes=sorted(set(notes)),
    )


def _check(inp: Inputs) -> None:
    if inp.training.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {inp.training.precision!r}")
    m = inp.model
    if m.kind not in ("language", "vision"):
        raise ValueError(f"kind must be language or vision, got {m.kind!r}")
    optimizer_state_bytes(inp.training.optimizer, inp.training.momentum)  # an unknown optimizer: one line
    if m.kind == "language" and inp.acts.micro_batch and not (m.layers and m.hidden and m.heads and m.seq_len):
        raise ValueError(
            "language activations need layers, hidden, heads and seq_len (or micro_batch=0 for states only)"
        )


def fits(predicted_total: float, device_bytes: float | None, headroom: float = 0.9) -> bool:
    """True when `predicted_total` bytes fit in `headroom` x `device_bytes` (None: unknown, fits)."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if device_bytes is None:
        return True
    return predicted_total <= headroom * device_bytes
