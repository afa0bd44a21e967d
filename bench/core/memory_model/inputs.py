"""The memory model's inputs in five groups: the run's layout and the adapter's cost inputs (ptbench.core.layout,
as the run plan carries them), the model's facts, the training setup and what the activations are made of.
`Inputs.of` builds them from `predict`'s keyword form; the derived numbers every part reads are properties."""

from __future__ import annotations

from dataclasses import dataclass, field

from ptbench.core.layout import SHARDING, CostInputs, Layout

REPLICATED = ("none", "distributed_optimizer", "zero0")  # shardings whose parameters and gradients stay whole
DEEPSPEED = ("zero1", "zero2", "zero3")  # DeepSpeed's partitioned stages (an fp32 master partition, its step)
PER_TENSOR = ("zero1", "zero2", "zero3", "fsdp")  # shardings whose partition follows the parameter shapes
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lars": 4, "sgd": 4}
PRECISIONS = ("fp32", "bf16", "fp16")
PARTS = ("params", "grads", "optimizer", "master", "transient", "activations")
ZERO3_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed 0.19's zero_optimization.sub_group_size default (elements)
ZERO3_DEFAULTS = {  # DeepSpeed 0.19's stage-3 defaults (elements), for what a caller leaves out
    "param_persistence_threshold": 100_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "prefetch_bucket_size": 50_000_000,
}
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class ModelFacts:
    """What the model is: counted once per launch from its meta-device build (`run_facts`) and carried on the run
    plan, so the memory model and the comm volume read the same numbers. `params`: Ψ as the framework builds it
    (Megatron's padded vocabulary included); `shapes`: the parameter shapes in `parameters()` order (a tied
    tensor once); `largest_unit_params`: the most parameters one module owns directly (what ZeRO-3 / FSDP gather
    at once, at least); the dimensions (0: not a language model / not given). `stage_params`: each pipeline
    stage's parameters (None: the GPT-2 split, or Ψ/p); `replicated_params`: kept whole on every TP rank (None:
    GPT-2's, `gpt2_replicated_under_tp`). Vision: `units`, per layer of its sequential form that owns parameters
    (what FSDP2 wraps one by one), the indices of its tensors in `shapes`; `norms`, the indices of BatchNorm's
    parameters (kept whole where the cost inputs say `whole_norm_params`)."""

    params: int
    kind: str = "language"  # language | vision
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    seq_len: int = 0
    vocab: int = 0
    image_size: int = 0  # vision; informational
    shapes: list | None = None
    largest_unit_params: int = 0
    stage_params: list[int] | None = None
    replicated_params: int | None = None
    units: tuple[tuple[int, ...], ...] | None = None
    norms: tuple[int, ...] = ()


@dataclass(frozen=True)
class Training:
    """precision: fp32 | bf16 | fp16. optimizer: adam | adamw | sgd | lamb | lars (momentum: sgd's);
    weight_decay: the optimizer's (Adam's L2 decay and SGD's make a temporary). step_groups: the optimizer's
    parameter groups as [(parameter shapes in order, weight decay)] (`harness_step_groups`; None: one group of
    the rank's elements). optimizer_impl: single_tensor | foreach | fused | host (None: torch's default for
    `device`). device: cuda | cpu."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.9
    weight_decay: float = 0.0
    step_groups: list | None = None
    optimizer_impl: str | None = None
    device: str = "cuda"


@dataclass(frozen=True)
class ActivationInputs:
    """micro_batch: samples per micro-batch on one replica (0: activations not estimated). attention_scores:
    False for fused attention (no s^2 term); attention_dropout: False when dropout is 0. loss_in_place: the
    loss's form (`loss_bytes`; None: the harness GPT-2's, in place on a CPU only). The counted forms, per
    sample in fp32 elements: `activation_elements_per_sample` (vision, `activation_elements`),
    `stage_activation_elements` / `stage_input_elements` (vision pipelines, per stage), `layer_saved_elements`
    (the harness GPT-2, `gpt2_saved_elements`, used instead of [Korthikanti] without tensor parallelism)."""

    micro_batch: int = 0
    attention_scores: bool = True
    attention_dropout: bool = True
    loss_in_place: bool | None = None
    activation_elements_per_sample: float | None = None
    stage_activation_elements: list | None = None
    stage_input_elements: list | None = None
    layer_saved_elements: dict | None = None


@dataclass(frozen=True)
class Inputs:
    """Everything `compose` reads: the layout (dp x tp x pp = devices), the adapter's cost inputs (its sharding,
    schedule, recompute, offload, stage-3 settings ...), the model, the training setup and the activations'
    inputs; `rank`: the rank whose partition is taken (None: the busiest); `label`: what the run is called."""

    layout: Layout
    cost: CostInputs
    model: ModelFacts
    training: Training = field(default_factory=Training)
    acts: ActivationInputs = field(default_factory=ActivationInputs)
    rank: int | None = None
    label: str | None = None

    @classmethod
    def of(cls, sharding: str = "none", **given) -> Inputs:
        """From `predict`'s keyword form: each group's fields by name, and the layout's (world_size, dp, tp, pp,
        devices_per_process, microbatches), the cost inputs' (schedule, recompute, sequence_parallel,
        half_states, fusion_buffer_bytes, offload_optimizer, offload_params, weight_stash, flush_every,
        layer_params, stage_balance) and zero3_settings (DeepSpeed's stage-3 rules, see `zero3_gathered`; None: the plain
        partition)."""
        name = sharding.strip().lower()
        if name not in SHARDING:
            raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDING)}")
        layout = _layout(given)  # checked first, as predict always did
        cost = _cost(name, given)
        groups = {g: _take(given, g) for g in (ModelFacts, Training, ActivationInputs)}
        rank, label = given.pop("rank", None), given.pop("label", None)
        if given:
            raise TypeError(f"predict() got unexpected keyword argument(s) {', '.join(sorted(given))}")
        return cls(layout, cost, groups[ModelFacts], groups[Training], groups[ActivationInputs], rank, label)

    # --- what every part reads, derived once from the groups ---
    @property
    def sharding(self) -> str:
        return self.cost.sharding

    @property
    def half(self) -> bool:
        return self.training.precision in ("bf16", "fp16")

    @property
    def act_bytes(self) -> int:
        return 2 if self.half else 4  # bytes per activation element

    @property
    def state_bytes(self) -> int:
        return 2 if self.half and self.cost.half_states else 4  # bytes per parameter / gradient element

    @property
    def deepspeed(self) -> bool:
        return self.sharding in DEEPSPEED

    @property
    def model_parallel(self) -> bool:
        lay = self.layout
        return lay.tp > 1 or lay.pp > 1 or lay.devices_per_process > 1

    @property
    def loss_in_place(self) -> bool:
        given = self.acts.loss_in_place
        return self.training.device != "cuda" if given is None else given

    @property
    def zero3_settings(self) -> dict | None:
        """DeepSpeed stage 3's rules as the adapter states them (None: not stated)."""
        c = self.cost
        if c.param_persistence_threshold is None:
            return None
        return {
            "param_persistence_threshold": c.param_persistence_threshold,
            "prefetch_bucket_size": c.prefetch_bucket_size,
            "max_reuse_distance": c.live_params_limit,
        }


def _take(given: dict, group) -> object:
    names = [f for f in group.__dataclass_fields__ if f in given]
    return group(**{f: given.pop(f) for f in names})


def _layout(given: dict) -> Layout:
    """The keyword form's layout, checked as predict always did (dp: devices / (tp x pp) when not given)."""
    if "world_size" not in given:
        raise TypeError("predict() missing required keyword argument: 'world_size'")
    world_size, tp, pp = given.pop("world_size"), given.pop("tp", 1), given.pop("pp", 1)
    per, m = given.pop("devices_per_process", 1), given.pop("microbatches", 1)
    for key, val, lo in (
        ("params", given.get("params"), 0),
        ("world_size", world_size, 1),
        ("tp", tp, 1),
        ("pp", pp, 1),
        ("devices_per_process", per, 1),
        ("microbatches", m, 1),
        ("micro_batch", given.get("micro_batch", 0), 0),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val < lo:
            raise ValueError(f"{key} must be an integer >= {lo}, got {val!r}")
    devices = world_size * per
    if devices % (tp * pp):
        raise ValueError(f"{devices} device(s) are not a multiple of tp*pp = {tp * pp}")
    dp = given.pop("dp", None) or devices // (tp * pp)
    if dp * tp * pp != devices:
        raise ValueError(
            f"dp*tp*pp must equal the devices (world_size x devices_per_process): {dp}*{tp}*{pp} != {devices}"
        )
    return Layout(world_size=world_size, dp=dp, tp=tp, pp=pp, devices_per_process=per, microbatches=m)


def _cost(name: str, given: dict) -> CostInputs:
    """The keyword form's cost inputs (half_states by default: DeepSpeed's bf16/fp16 modes)."""
    half = given.pop("half_states", None)
    z3 = given.pop("zero3_settings", None)
    z3 = None if z3 is None else {**ZERO3_DEFAULTS, **z3}
    return CostInputs(
        sharding=name,
        half_states=name in ("zero0", *DEEPSPEED) if half is None else half,
        schedule=given.pop("schedule", "1f1b"),
        recompute=given.pop("recompute", "never"),
        sequence_parallel=given.pop("sequence_parallel", False),
        fusion_buffer_bytes=given.pop("fusion_buffer_bytes", 0),
        offload_optimizer=given.pop("offload_optimizer", False),
        offload_params=given.pop("offload_params", False),
        param_persistence_threshold=z3 and z3["param_persistence_threshold"],
        prefetch_bucket_size=z3 and z3["prefetch_bucket_size"],
        live_params_limit=z3["max_reuse_distance"] if z3 else 0,
        weight_stash=given.pop("weight_stash", "none"),
        flush_every=given.pop("flush_every", 0),
        layer_params=_tuple(given.pop("layer_params", None)),
        stage_balance=_tuple(given.pop("stage_balance", None)),
    )


def _tuple(values) -> tuple | None:
    return tuple(values) if values else None
