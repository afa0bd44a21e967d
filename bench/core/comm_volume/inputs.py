"""What the comm formulas read: the run's layout and the adapter's cost inputs (ptbench.core.layout, as the run
plan carries them, validated there once), the parameter count, the b x s x h activation and the bytes per element
each kind of message travels in. `Inputs.of` builds them from `volume`'s keyword form."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ptbench.core.layout import SHARDING, CostInputs, Layout

HALF = ("bf16", "fp16")


@dataclass(frozen=True)
class Activation:
    """The b x s x h activation tensor- and pipeline-parallel ranks exchange ([Megatron]): L transformer layers,
    hidden size h, sequence length s, micro-batch size b (sequences)."""

    layers: int = 0
    hidden: int = 0
    seq_len: int = 0
    micro_batch: int = 0

    @property
    def elements(self) -> int:
        return self.micro_batch * self.seq_len * self.hidden


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element as each kind of message travels: parameters as gathered, gradients as reduced, the
    b x s x h activation (FSDP2 with bf16 gathers 2-byte parameters but reduce-scatters fp32 gradients)."""

    params: int = 4
    grads: int = 4
    acts: int = 4

    @classmethod
    def of(cls, precision: str, cost: CostInputs) -> ElementBytes:
        """As the adapter's cost inputs say: `half_states` (DeepSpeed's bf16/fp16 modes: 2-byte parameters and
        gradients), `half_gather` (2-byte parameters gathered), `half_activation_comm` (tensor-parallel
        activations are outputs of bf16 matmuls); everything else runs autocast around fp32 weights, so gradients
        and a pipeline's stage outputs (the fp32 residual stream) stay 4 bytes."""
        half = precision in HALF
        return cls(
            params=2 if half and (cost.half_states or cost.half_gather) else 4,
            grads=2 if half and cost.half_states else 4,
            acts=2 if half and cost.half_activation_comm else 4,
        )


@dataclass(frozen=True)
class Inputs:
    """Everything `compose` reads. `params`: Ψ, all parameters of the model (elements); `act`: the activation
    (None: not a transformer, so no tensor- or pipeline-parallel activation traffic is modelled); `grad_accum`:
    gradient accumulation steps (they repeat the activation traffic, not the once-per-step gradient traffic);
    `label`: what the run is called (recorded only); `stage`: the pipeline stage whose sends are counted, "first"
    (activations only), "inner" (activations and gradients) or "last" (input gradients only); None: the busiest,
    what a step waits for (a dry run at rank R compares R's own stage); `stage_params`: the parameter elements
    that stage holds, a tied copy included (None: Ψ/p, as if the layers split evenly by size)."""

    layout: Layout
    cost: CostInputs
    params: int
    act: Activation | None = field(default_factory=Activation)
    elem: ElementBytes = field(default_factory=ElementBytes)
    grad_accum: int = 1
    label: str | None = None
    stage: str | None = None
    stage_params: int | None = None

    @classmethod
    def of(cls, sharding: str = "none", **given) -> Inputs:
        """From `volume`'s keyword form: params, world_size (devices), dp (default world_size / (tp pp)), tp, pp,
        microbatches (per optimizer step), layers, hidden, seq_len, micro_batch, bytes_per_elem,
        grad_bytes_per_elem and activation_bytes_per_elem (default bytes_per_elem), reshard_after_forward,
        grad_sync_phase, step_phase, sequence_parallel, label, stage, stage_params."""
        name = sharding.strip().lower()
        if name not in SHARDING:
            raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDING)}")
        layout = _layout(given)
        act = Activation(**{k: _count(k, given.pop(k, 0), 0) for k in Activation.__dataclass_fields__})
        b = _count("bytes_per_elem", given.pop("bytes_per_elem", 4), 1)
        g, a = (given.pop(k, None) for k in ("grad_bytes_per_elem", "activation_bytes_per_elem"))
        elem = ElementBytes(
            params=b,
            grads=_count("grad_bytes_per_elem", b if g is None else g, 1),
            acts=_count("activation_bytes_per_elem", b if a is None else a, 1),
        )
        sp = given.pop("sequence_parallel", False)
        if sp and layout.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks)")
        cost = CostInputs(
            sharding=name,
            sequence_parallel=sp,
            **{k: given.pop(k) for k in ("reshard_after_forward", "grad_sync_phase", "step_phase") if k in given},
        )
        params, label = _count("params", given.pop("params", None), 0), given.pop("label", None)
        stage, held = given.pop("stage", None), given.pop("stage_params", None)
        held = None if held is None else _count("stage_params", held, 0)
        if given:
            raise TypeError(f"volume() got unexpected keyword argument(s) {', '.join(sorted(given))}")
        return cls(layout, cost, params, act, elem, label=label, stage=stage, stage_params=held)

    # --- what the formulas read, derived once ---
    @property
    def params_per_rank(self) -> float:
        """Ψ / (t p), or the stage's own parameters / t when given: the parameters a model-parallel rank holds and
        syncs with its data-parallel peers (replicated norms and biases counted as sharded: a slight
        under-estimate)."""
        if self.stage_params is not None and self.layout.pp > 1:
            return self.stage_params / self.layout.tp
        return self.params / (self.layout.tp * self.layout.pp)

    @property
    def microbatches(self) -> int:
        """m: micro-batches per optimizer step (a pipeline's, times gradient accumulation)."""
        return self.layout.microbatches * self.grad_accum

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.cost.sequence_parallel and self.layout.tp > 1)

    @property
    def busiest_stage_layers(self) -> int:
        return math.ceil(self.act.layers / self.layout.pp) if self.act else 0


def _count(key: str, val, lo: int) -> int:
    if not isinstance(val, int) or isinstance(val, bool) or val < lo:
        raise ValueError(f"{key} must be an integer >= {lo}, got {val!r}")
    return val


def _layout(given: dict) -> Layout:
    """The keyword form's layout; Layout checks its own integers (dp: world_size / (tp x pp) when not given)."""
    if "world_size" not in given:
        raise TypeError("volume() missing required keyword argument: 'world_size'")
    world, tp, pp = given.pop("world_size"), given.pop("tp", 1), given.pop("pp", 1)
    dp = given.pop("dp", None)
    if dp is None:
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (world, tp, pp))
        dp = world // (tp * pp) if ints else 1  # else Layout names the bad one
    return Layout(world_size=world, dp=dp, tp=tp, pp=pp, microbatches=given.pop("microbatches", 1))
