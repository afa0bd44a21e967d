"""The memory model for one run: its inputs from a composed config and its run plan (`predict_run`, the runner's
and `python -m ptbench --plan`'s entry point), the device it is compared against, the refusal or warning before
launch, and the prediction as a record field, a table and the memory ledger's summary."""

from __future__ import annotations

import dataclasses
import math

from ptbench.core.memory_model.activations import attention_keeps_scores
from ptbench.core.memory_model.compose import compose, fits
from ptbench.core.memory_model.counting import (
    activation_elements,
    even_split,
    gpt2_saved_bytes_cuda_autocast,
    gpt2_saved_elements,
    pipeline_layers,
    stage_activation_elements,
    stage_input_elements,
)
from ptbench.core.memory_model.facts import run_facts
from ptbench.core.memory_model.inputs import (
    GIB,
    MIB,
    PARTS,
    PER_TENSOR,
    ZERO3_DEFAULTS,
    ActivationInputs,
    Inputs,
    Training,
)
from ptbench.core.memory_model.step import harness_step_groups

MODEL = "bench/core/memory_model"  # what the records name as the model (its reference: README.md there)


def predict_run(
    cfg, plan, build_model, device: str | None = None, shapes: bool = True, loss_in_place: bool | None = None
) -> dict:
    """`predict` for a composed config (`ptbench.core.config.BenchConfig`) and its run plan
    (`ptbench.runner.plan.RunPlan`): the one call the runner and `python -m ptbench --plan` make. The layout,
    the adapter's cost inputs and the model's facts come from the plan (`plan.layout`, `plan.cost`,
    `plan.facts`, counted here when the plan has none), the training setup from the config. `build_model`: a
    no-argument callable returning the workload's nn.Module (e.g. `build_workload(cfg.workload,
    cfg.data).build_model`); it is called under the meta device, so nothing is allocated, for the counted
    activations. device: cuda | cpu (default: cuda when torch sees a GPU). The prediction's `inputs` lists
    the inputs by name. `loss_in_place`: which GPT-2 loss runs, where the caller knows better than the device
    (a dry run's fake tensors take F.cross_entropy, CUDA's path, on a CPU); None: as the device decides."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = build_model()
    facts = getattr(plan, "facts", None) or run_facts(cfg.workload, plan.cost, model)
    per_tensor = shapes and plan.cost.sharding in PER_TENSOR  # else the plain Ψ/N partition
    inp = Inputs(
        layout=plan.layout,
        cost=plan.cost,
        model=facts if per_tensor else dataclasses.replace(facts, shapes=None),
        training=_training(cfg, plan, device, facts),
        acts=_activation_inputs(cfg, plan, model, facts, device, loss_in_place),
        label=plan.adapter,
    )
    out = compose(inp)
    out["inputs"] = _inputs_record(inp)
    return out


def _training(cfg, plan, device: str, facts) -> Training:
    """The optimizer as the harness builds it: its two parameter groups (bench/core/optim.py param_groups)."""
    o = cfg.optimizer
    wd = float(o.weight_decay)
    impl = None
    if plan.cost.sharding == "distributed_optimizer" and device == "cuda" and o.name in ("adam", "adamw"):
        # Megatron's distributed optimizer steps Transformer Engine's or Apex's FusedAdam when either is installed,
        # else torch's AdamW (megatron/core/optimizer/__init__.py:12-33, :358-363)
        import importlib.util

        if any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")):
            impl = "fused"
    return Training(
        precision=cfg.trainer.precision,
        optimizer=o.name,
        momentum=float(o.momentum),
        weight_decay=wd,
        step_groups=harness_step_groups(facts.shapes, wd),
        optimizer_impl=impl,
        device=device,
    )


def _activation_inputs(cfg, plan, model, facts, device: str, loss_in_place: bool | None = None) -> ActivationInputs:
    """The micro-batch and the counted activations: the harness GPT-2's with the scores where the adapter's
    attention keeps them (Megatron's own model, which pads its vocabulary, on a CPU only: there its local layer
    spec, unfused, saves what the harness block saves, measured by `python -m ptbench.scale`; on CUDA its fused
    kernels take [Korthikanti]); a vision model's, per stage where the adapter's split makes stages."""
    w, cost = cfg.workload, plan.cost
    micro = math.ceil(plan.local_batch / plan.layout.microbatches)
    if facts.kind == "language":
        scores = attention_keeps_scores(cost.attention, device, float(w.dropout))
        return ActivationInputs(
            micro_batch=micro,
            attention_scores=scores,
            attention_dropout=float(w.dropout) > 0,
            # Megatron's vocab-parallel loss works in place; torch's loss_parallel (TP) does not (`loss_bytes`)
            loss_in_place=True if cost.vocab_parallel_loss else (False if plan.layout.tp > 1 else loss_in_place),
            layer_saved_elements=None
            if cost.padded_vocab and device == "cuda"
            else _gpt2_counted(cfg, plan, model, facts, device, scores),
        )
    sample = (3, facts.image_size, facts.image_size)
    stages = ins = None
    # one stage per rank (or device); GPipe's single partition too: its micro-batches and checkpointing apply
    if (plan.layout.pp > 1 or cost.schedule == "gpipe") and cost.schedule != "interleaved_1f1b":
        balance = list(cost.stage_balance) if cost.stage_balance else None
        balance = balance or even_split(len(pipeline_layers(model)), plan.layout.pp)
        stages = stage_activation_elements(model, sample, balance)
        if cost.schedule == "gpipe" and cost.recompute != "never":  # torchgpipe checkpointing keeps the inputs
            ins = stage_input_elements(model, sample, balance)
    return ActivationInputs(
        micro_batch=micro,
        activation_elements_per_sample=activation_elements(model, sample),
        stage_activation_elements=stages,
        stage_input_elements=ins,
    )


def _gpt2_counted(cfg, plan, model, facts, device: str, scores: bool) -> dict:
    """The harness GPT-2's saves per sample: in bytes, counted on fake CUDA tensors, where CUDA autocast runs
    it (an adapter that neither holds nor gathers half-precision parameters); else in fp32 elements. Under
    tensor parallelism, one rank's block (`tp_local_block`)."""
    cost = plan.cost
    precision, tp = cfg.trainer.precision, plan.layout.tp
    if device == "cuda" and precision in ("bf16", "fp16") and not (cost.half_states or cost.half_gather):
        return gpt2_saved_bytes_cuda_autocast(model, facts.seq_len, precision, tp=tp)
    return gpt2_saved_elements(model, facts.seq_len, scores, tp=tp)


def _inputs_record(inp: Inputs) -> dict:
    """The inputs by name (the keyword form's names; shapes and step groups left out)."""
    lay, cost, m, t, a = inp.layout, inp.cost, inp.model, inp.training, inp.acts
    rec = dict(
        params=m.params,
        world_size=lay.world_size,
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        devices_per_process=lay.devices_per_process,
        precision=t.precision,
        optimizer=t.optimizer,
        momentum=t.momentum,
        kind=m.kind,
        micro_batch=a.micro_batch,
        microbatches=lay.microbatches,
        device=t.device,
        **{k: getattr(cost, k) for k in ("schedule", "recompute", "sequence_parallel")},
        largest_unit_params=m.largest_unit_params,
        **{k: getattr(cost, k) for k in ("fusion_buffer_bytes", "half_states", "offload_optimizer", "offload_params")},
    )
    if cost.weight_stash != "none":
        rec.update(weight_stash=cost.weight_stash, flush_every=cost.flush_every, layer_params=cost.layer_params)
    if inp.zero3_settings is not None:
        z = inp.zero3_settings
        rec["zero3_settings"] = {**z, "max_live_parameters": ZERO3_DEFAULTS["max_live_parameters"]}
    rec["weight_decay"] = t.weight_decay
    if t.optimizer_impl is not None:
        rec["optimizer_impl"] = t.optimizer_impl
    if m.kind == "language":
        rec.update({k: getattr(m, k) for k in ("layers", "hidden", "heads", "seq_len", "vocab")})
        rec.update({k: getattr(a, k) for k in ("attention_scores", "attention_dropout", "loss_in_place")})
        if a.layer_saved_elements is not None:
            rec["layer_saved_elements"] = a.layer_saved_elements
        return rec
    rec.update(image_size=m.image_size, activation_elements_per_sample=a.activation_elements_per_sample)
    rec.update({k: v for k in ("stage_activation_elements", "stage_input_elements") if (v := getattr(a, k))})
    return rec


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
    if p.get("stash_per_stage"):  # an asynchronous pipeline's stashed weights, within model_states
        out.update(stash=int(round(p["stash"])), stash_per_stage=[int(round(b)) for b in p["stash_per_stage"]])
    out.update(
        sharding=p["sharding"],
        busiest=p["busiest"],
        params_per_rank=int(round(p["params_per_rank"])),
        dp=p["dp"],
        tp=p["tp"],
        pp=p["pp"],
        notes=p["notes"],
        formula=p["formula"],  # per part what was used (DeepSpeed stage 3: the settings it follows)
        model=MODEL,
    )
    return out


def plan_memory(cfg, plan, build_model, check: bool | None = None, headroom: float = 0.9) -> dict:
    """Predict (`predict_run`), refuse the run with ConfigError when the busiest rank's total does not fit
    `headroom` x the device (`check_fits`; check=None: only when trainer.memory_check=refuse, the estimate being
    only that), and return `record_fields` plus the device memory compared against (`device_bytes`, `device`)."""
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
    if p.get("stash_per_stage"):
        lines.append(f"  {'stash':<12} {p['stash'] / MIB:12.2f}  {p['formula'].get('stash', '-')}")
    plus = " + stash" if p.get("stash_per_stage") else ""
    lines.append(f"  {'states':<12} {p['model_states'] / MIB:12.2f}  params + grads + optimizer + master{plus}")
    lines.append(f"  {'total':<12} {p['total'] / MIB:12.2f}  states + max(transient + activations, step)")
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def ledger_fields(
    predicted: dict | None, counted: list[dict | None], step_counted: list[int | None] | None = None
) -> dict | None:
    """The summary's `memory_ledger`: the memory model's saved-activation bytes of the busiest rank beside
    the most any rank counted (`SavedTensorLedger`'s peak in the last untimed step), and their ratio. None when
    nothing was counted (no untimed step, resumed runs). A rank that drives several devices (gpipe) counted
    each partition on its own (`per_partition`): its partitions stand in for ranks. `step_counted`: each rank's
    optimizer-phase peak in that step (`StepPeak`; None: not measured) beside the model's `step_transient`."""
    from ptbench.core.memory import SAVED_RULE, STEP_RULE

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
        "model": MODEL,
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
