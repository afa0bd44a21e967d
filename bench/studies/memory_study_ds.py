"""`python -m ptbench.studies.memory_study --deepspeed-estimators`: the memory model beside DeepSpeed's own estimators.

--deepspeed-estimators sets the memory model against DeepSpeed's own estimators, called as they are
(deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs, stage3.
estimate_zero3_model_states_mem_needs, the model's total and largest-layer parameters from stage3.
model_to_params): per workload x stage (2, 3; with the offload variants) x GPU count, model-state bytes per
GPU by `predict` (bf16, Adam: DeepSpeed's estimators assume 2-byte parameters and gradients with an fp32
master and two fp32 moments, 12 bytes; at the step: + the fp32 gradient partition, part of predict's step_transient)
and by DeepSpeed, their ratio, and the difference split into stated reasons, each naming the DeepSpeed rule (`DS_REASONS`); what the reasons do not explain is printed. DeepSpeed
has no stage-1 estimator. --measure adds the state bytes the runner reads from the engine's tensors on
this machine (bf16 runs of zero2 / zero3 at each GPU count) beside both predictions.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from ptbench.core.memory_model import predict
from ptbench.studies.memory_points import (
    MIB,
    announce,
    expected_state,
    measured_states,
    ok_record,
    param_numels,
    ruled,
    run_point,
    start,
    workload_model,
)

# --- DeepSpeed's own estimators vs the memory model ----------------------------------------------------
# (label, stage, offload_optimizer, offload_params): the settings DeepSpeed's estimators take
DS_ROWS = (
    ("zero2", 2, False, False),
    ("zero2 off-opt", 2, True, False),
    ("zero3", 3, False, False),
    ("zero3 off-opt", 3, True, False),
    ("zero3 off-opt+par", 3, True, True),
)
# why DeepSpeed 0.19's estimate differs from `predict` (bf16, Adam); DS = .venv/.../deepspeed/runtime/zero/
DS_REASONS = {
    "A": (
        "+4Ψ/N, now in ours (part of predict's step_transient; column ours@step = model_states + 4Ψ/N): the fp32 "
        "gradient partition that step() makes from the bf16 one, alive through the Adam step (DS "
        "stage_1_and_2.py:3113-3126, freed :3141; stage3.py:2686-2693, freed :2735; with offload_optimizer the "
        "persistent host buffer): DeepSpeed's 18 B/param = 2 grads_16bit + 4 grads_32bit + 4 params_32bit + 8 "
        "moments (comment at stage_1_and_2.py:4029-4031). model_states (column ours) are the states held when "
        "the step begins (what the runner measures); predict's total = model_states + max(transient + "
        "activations, step_transient), whose step_transient also holds the optimizer's temporaries and the fp64 "
        "gradient norms, which DeepSpeed's estimators do not count"
    ),
    "B": (
        "+4 B x largest layer: `largest_layer_memory = 4 * largest_layer_params` (stage3.py:4027), the module "
        "with the most parameters of its own by model_to_params (GPT-2: the tied token embedding / LM head), "
        "DeepSpeed's allowance for one gathered layer. Ours keeps gathered parameters out of the model states, "
        "in `transient` (column ours+gath: model_states + 2 B x largest unit x (N-1)/N; with DeepSpeed 0.19's reuse rules "
        "every non-persistent parameter stays gathered at small scale, see memory_model.zero3_gathered)"
    ),
    "C": (
        "-2Ψ/N: stage 3's 18 B/param (stage3.py:4046) hold one 2-byte partition fewer than stage3.py allocates "
        "at the step: bf16 parameter partition 2 + bf16 gradient partition 2 (grad_partitions_flat_buffer, "
        "stage3.py:790-792) + fp32 master 4 + moments 8 + the step's fp32 gradient 4 = 20 (ours@step: 16 + the "
        "step's copy, A)"
    ),
}
DS_NOTES = (
    "DeepSpeed's estimators assume bf16/fp16 parameters and gradients (2 + 2 B) and an fp32 master + Adam "
    "moments (4 + 8 B), and count neither activations nor communication buckets; ours: predict(sharding, "
    "precision='bf16', optimizer='adam'), Ψ/N sharding, model_states = params + grads + optimizer + master. "
    "DeepSpeed has no stage-1 estimator (ours: stage 1 = stage 2 at the step, + full gradients in backward).",
    "Where ours was wrong: with offload_optimizer DeepSpeed 0.19 keeps the gradient partition in host memory "
    "(`self.device` = cpu, stage_1_and_2.py:278 and :2161-2177, stage3.py:333 and :790-792); predict had kept "
    "2Ψ/N of gradients on the device and now counts 0 there, as DeepSpeed's estimators do (off-opt rows).",
    "Stage 2 keeps only its gradient partition (partition_gradients: gradients outside it are cleared after "
    "each bucket's reduction, stage_1_and_2.py:2262-2271), as ours does; by the per-tensor rule a tensor "
    "straddling a partition edge keeps its whole gradient, which neither Ψ/N estimate sees (--measure).",
)


def _ds():
    """DeepSpeed's estimator functions, imported the adapter's way (CPU: DS_ACCELERATOR=cpu)."""
    from ptbench.adapters.zero import _import_deepspeed

    _import_deepspeed()
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return stage_1_and_2, stage3


def ds_model_params(overrides: list[str]) -> tuple[int, int]:
    """(total parameters, largest layer's parameters) of the workload's model by DeepSpeed's own counter
    (stage3.model_to_params: tied tensors once; a layer is a module's parameters without its children's)."""
    _, stage3 = _ds()
    # built for real: model_to_params tells tied tensors apart by data_ptr(), which is 0 for every meta tensor
    return stage3.model_to_params(workload_model(overrides, "cpu"))


def ds_nodes(n: int, gpus_per_node: int) -> tuple[int, int]:
    """(num_gpus_per_node, num_nodes) of n GPUs: one node up to gpus_per_node, else full nodes."""
    if n <= gpus_per_node:
        return n, 1
    if n % gpus_per_node:
        raise ValueError(
            f"--gpus {n} is not a multiple of --gpus-per-node {gpus_per_node}: give whole nodes, e.g. --gpus "
            f"{math.ceil(n / gpus_per_node) * gpus_per_node}"
        )
    return gpus_per_node, n // gpus_per_node


def ds_estimate(stage: int, psi: int, largest: int, n: int, offload_opt: bool, offload_params: bool, gpn: int = 8):
    """DeepSpeed's GPU bytes per GPU for the model states (its own function, called as it is)."""
    s12, s3 = _ds()
    per_node, nodes = ds_nodes(n, gpn)
    if stage == 2:
        _cpu, gpu = s12.estimate_zero2_model_states_mem_needs(
            total_params=psi,
            num_gpus_per_node=per_node,
            num_nodes=nodes,
            cpu_offload=offload_opt,
            additional_buffer_factor=1.5,
        )
    else:
        _cpu, gpu, _largest = s3.estimate_zero3_model_states_mem_needs(
            total_params=psi,
            largest_layer_params=largest,
            num_gpus_per_node=per_node,
            num_nodes=nodes,
            cpu_offload=offload_opt,
            cpu_offload_params=offload_params,
            zero_init=True,
            additional_buffer_factor=1.5,
        )
    return gpu


def ours_ds_settings(stage: int, psi: int, largest: int, n: int, offload_opt: bool, offload_params: bool) -> dict:
    """predict() with DeepSpeed's estimator assumptions: bf16 states, Adam, Ψ/N, the same offload."""
    return predict(
        f"zero{stage}",
        params=psi,
        world_size=n,
        precision="bf16",
        optimizer="adam",
        largest_unit_params=largest if stage == 3 else 0,
        offload_optimizer=offload_opt,
        offload_params=offload_params,
    )


def ds_reasons(stage: int, psi: int, largest: int, n: int, offload_opt: bool) -> list[tuple[str, float]]:
    """The stated differences DeepSpeed minus ours at the step (model_states + the step's fp32 gradient partition),
    (reason key of DS_REASONS, bytes). A (the step's fp32 gradient partition) is in ours: part of predict's
    step_transient."""
    out = []
    if stage == 3:
        out.append(("B", 4.0 * largest))
        if not offload_opt:
            out.append(("C", -2 * psi / n))
    return out


def ds_rows(workload: str, psi: int, largest: int, gpus: list[int], gpn: int = 8) -> list[dict]:
    """One row per stage / offload variant x GPU count: ours, DeepSpeed's, the reasons and what is left."""
    rows = []
    for label, stage, off_opt, off_par in DS_ROWS:
        for n in gpus:
            o = ours_ds_settings(stage, psi, largest, n, off_opt, off_par)
            ds = ds_estimate(stage, psi, largest, n, off_opt, off_par, gpn)
            reasons = ds_reasons(stage, psi, largest, n, off_opt)
            # A: the step's fp32 gradient partition, the size of the fp32 master partition (4Ψ/N; 0 offloaded);
            # DeepSpeed's estimators count neither the optimizer's temporaries nor the fp64 norms in step_transient
            at_step = o["model_states"] + o["master"]
            rows.append(
                {
                    "workload": workload,
                    "variant": label,
                    "n": n,
                    "ours": o["model_states"],
                    "ours_step": at_step,
                    "ours_gathered": o["model_states"] + o["transient"] if stage == 3 else None,
                    "ds": ds,
                    "ratio": ds / at_step if at_step else None,
                    "reasons": reasons,
                    "unexplained": ds - at_step - sum(b for _, b in reasons),
                }
            )
    return rows


def ds_table(rows: list[dict], params: dict) -> str:
    head = (
        "model-state bytes per GPU (MiB): ours (bench/core/memory_model/ predict, bf16 + Adam) vs DeepSpeed "
        "0.19's estimators\n"
        f"{'workload':<12} {'variant':<17} {'N':>4} {'ours':>10} {'ours@step':>10} {'ours+gath':>10} "
        f"{'DeepSpeed':>10} {'DS/@step':>8} | {'reasons (MiB, DS - ours@step)':<34} {'unexplained B':>13}"
    )
    lines = ruled(head)
    for w, (psi, largest) in params.items():
        lines.append(f"{w}: Ψ = {psi:,} parameters, largest layer {largest:,} (model_to_params)")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    for r in rows:
        why = " ".join(f"{k}{b / MIB:+.1f}" for k, b in r["reasons"]) or "-"
        left = r["unexplained"]
        flag = "" if abs(left) <= 1 else "  UNEXPLAINED"
        ratio = "       -" if r["ratio"] is None else f"{r['ratio']:8.3f}"
        gath = "-" if r["ours_gathered"] is None else f"{r['ours_gathered'] / MIB:.1f}"
        lines.append(
            f"{r['workload']:<12} {r['variant']:<17} {r['n']:>4} {r['ours'] / MIB:10.1f} "
            f"{r['ours_step'] / MIB:10.1f} {gath:>10} "
            f"{r['ds'] / MIB:10.1f} {ratio} | {why:<34} {left:13.0f}{flag}"
        )
    lines.append("")
    if ratios:
        lines.append(f"DS/ours@step over these rows: {min(ratios):.3f} - {max(ratios):.3f} (ours@step 0: '-')")
    lines.append(
        "ours: predict's model_states (held when the step begins); ours@step: + the step's fp32 gradient partition "
        "(reason A, part of predict's step_transient); "
        "unexplained: DeepSpeed - ours@step - the reasons, in bytes (its int() rounding: <= 1); ours+gath: ours + "
        "predict's transient gathered unit (stage 3)"
    )
    lines += [f"  {k}: {v}" for k, v in DS_REASONS.items()]
    lines += [f"  - {v}" for v in DS_NOTES]
    return "\n".join(lines)


def ds_measured_table(workloads, gpus, run_overrides: dict, results: dict, params: dict, gpn: int) -> str:
    """Ours (Ψ/N and per tensor), DeepSpeed's estimate and the runner's measured state bytes (busiest rank)
    of bf16 zero2 / zero3 runs on this machine."""
    head = (
        "measured on this machine (bf16 runs; state bytes read from the engine at the step's start, busiest "
        "rank; MiB)\n"
        f"{'workload':<12} {'variant':<6} {'N':>3} {'ours Ψ/N':>9} {'ours tensor':>11} {'DeepSpeed':>10} "
        f"{'measured':>9} | {'meas/tensor':>11} {'DS/meas':>8} {'DS-meas':>8}"
    )
    lines = ruled(head)
    for w in workloads:
        psi, largest = params[w]
        shapes = param_numels(run_overrides[w])
        lines.append(
            f"{w} as run: Ψ = {psi:,} parameters, largest layer {largest:,} ({' '.join(run_overrides[w][1:])})"
        )
        for stage in (2, 3):
            v = f"zero{stage}"
            for n in gpus:
                s = ok_record(results.get((w, v, n)), f"{w:<12} {v:<6} {n:>3}", lines, cut=100)
                if s is None:
                    continue
                meas = measured_states(s)
                if meas is None:
                    lines.append(f"{w:<12} {v:<6} {n:>3}  the record has no state bytes")
                    continue
                ours = ours_ds_settings(stage, psi, largest, n, False, False)["model_states"]
                tensor = max(sum(expected_state(v, shapes, n, r, precision="bf16").values()) for r in range(n))
                ds = ds_estimate(stage, psi, largest, n, False, False, gpn)
                m = meas["total"]
                lines.append(
                    f"{w:<12} {v:<6} {n:>3} {ours / MIB:9.2f} {tensor / MIB:11.2f} {ds / MIB:10.2f} {m / MIB:9.2f} | "
                    f"{m / tensor:11.3f} {ds / m:8.3f} {(ds - m) / MIB:8.2f}"
                )
    lines.append(
        "ours tensor: the per-tensor partition rule (the zero3 run sets stage3_param_persistence_threshold=0: "
        "every tensor sharded). DeepSpeed's estimate is for the run's precision (bf16): no scaling. Expected: "
        "measured = ours tensor, and DeepSpeed - measured = the step's fp32 gradient (A, in ours' step_transient: not "
        "yet made when the states are read) + B + C at stage 3, minus what the per-tensor rule adds to Ψ/N "
        "(stage 2: a tensor straddling the partition edge keeps its whole gradient)"
    )
    return "\n".join(lines)


def deepspeed_main(args) -> int:
    from ptbench.core.errors import ConfigError

    try:
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1 (DeepSpeed's num_gpus_per_node)")
        for n in args.gpus:
            if n < 1:
                raise ValueError(f"--gpus {n}: GPU counts must be >= 1")
            ds_nodes(n, args.gpus_per_node)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    user = [
        o for o in args.overrides if o.split("=")[0].split(".")[0] in ("workload", "data") and "." in o.split("=")[0]
    ]
    params = {}
    for w in args.workloads:
        try:
            params[w] = ds_model_params([f"workload={w}", *user])
        except ConfigError as e:
            print(f"error: --workloads {w}: {e}", file=sys.stderr)
            return 2
    rows = [r for w, (psi, largest) in params.items() for r in ds_rows(w, psi, largest, args.gpus, args.gpus_per_node)]
    print(ds_table(rows, params))
    if not args.measure:
        return 0
    root = Path(args.results).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_overrides, mparams, results = {}, {}, {}
    what = f"{' '.join(args.workloads)} x zero2 zero3 at {' '.join(map(str, args.gpus))} ranks, bf16"
    tally = start(len(args.workloads) * 2 * len(args.gpus), what, root / "memory_study")
    for w in args.workloads:
        base = ["trainer.batch_size=4", "data.train_samples=512"]
        base += ["workload.seq_len=32"] if w.startswith("gpt2") else []
        run_overrides[w] = [f"workload={w}", *base, "trainer.precision=bf16", *args.overrides]
        mparams[w] = ds_model_params(
            [o for o in run_overrides[w] if o.split("=")[0].split(".")[0] in ("workload", "data")]
        )
        for v in ("zero2", "zero3"):
            for n in args.gpus:
                results[(w, v, n)] = s = run_point(
                    v,
                    n,
                    run_overrides[w],
                    root,
                    f"{stamp}-ds-{w}",
                    args.steps,
                    min(args.warmup, args.steps - 1),
                    args.timeout,
                )
                announce(tally, f"{w} {v} x {n} rank(s)", s.get("status"), s["wall_s"])
    print()
    print(ds_measured_table(args.workloads, args.gpus, run_overrides, results, mparams, args.gpus_per_node))
    return 0
