"""Model-state memory per rank: DDP, ZeRO-1/2/3 (DeepSpeed) and FSDP2 at several rank counts.

    python -m ptbench.studies.memory_study                       # gpt2_tiny at 1, 2, 4 ranks
    python -m ptbench.studies.memory_study --ranks 2 4 workload=resnet50_tiny
    python -m ptbench.studies.memory_study --timing              # step-time ratios vs DDP at 2 ranks
    python -m ptbench.studies.memory_study --variants ddp zero3 tensor_parallel pipeline --ranks 2 4
    python -m ptbench.studies.memory_study --records results/memory_study   # the tables again from records, no run
    python -m ptbench.studies.memory_study --deepspeed-estimators --workloads gpt2_small gpt2_medium --gpus 1 2 8 64
    python -m ptbench.studies.memory_study --deepspeed-estimators --workloads gpt2_tiny --gpus 2 --measure
    python -m ptbench.studies.memory_study --step                # the optimizer step's peak: measured vs predicted

The default is 15 runs (5 variants at 1, 2 and 4 ranks; how long they took: bench/MEASUREMENTS.md). Every mode that runs prints a line per finished run, with the time left at the mean
pace so far, on stderr (the tables go to stdout).

Runs `python -m ptbench` once per (variant, ranks) point, as a user would, then prints the bytes of
parameters, gradients and optimizer state each rank reported (read from the framework's tensors, see
adapters/zero.py and adapters/fsdp.py) beside two predictions for fp32 Adam (Ψ parameters, N ranks), both
from bench/core/memory_model/ (the one memory model), for the sharding each adapter's cost inputs state:

- paper: the ZeRO paper's model-state formula (the model's Ψ/N rule). DDP 16Ψ; ZeRO-1 4Ψ+4Ψ+8Ψ/N; ZeRO-2 4Ψ+12Ψ/N;
  ZeRO-3 16Ψ/N; FSDP (fully sharded, like ZeRO-3) 16Ψ/N. "+master" adds the fp32 copy of its
  partition (4Ψ/N) that DeepSpeed keeps for stages >= 1 even when the model is fp32: its optimizer
  steps that copy and copies the result back into the model's parameters.
- expected: what the algorithm holds for this model's tensor shapes (`expected_state`, the model's
  per-tensor rule for that rank): DeepSpeed
  stages 1-2 cut one flat buffer of all parameters into N equal partitions but keep gradients for
  whole tensors, so a tensor that straddles a partition edge keeps its full gradient on every rank it
  touches (GPT-2's token embedding is ~94 % of gpt2_tiny: at 2 ranks both ranks keep its gradient);
  stage 3 and FSDP split every tensor, so they follow the formula.

A second table sets bench/core/memory_model/'s prediction (what `python -m ptbench --plan` prints
and the runner checks before launch) against the record, per variant and rank count, with the
error of the model-state bytes of the busiest rank: "formula" uses Ψ/N, "model" the per-tensor
partition rule. The model-parallel variants (tensor_parallel, megatron: TP = N; pipeline: N stages;
gpipe: one process, N partitions) are predicted by the same module. ΔRSS (CPU: peak RSS minus RSS
before the first step, the busiest rank) is set beside the predicted activations + transient for
orientation only: it also holds allocator slack and the lazily allocated gradients / moments.

--deepspeed-estimators sets the memory model against DeepSpeed's own estimators (bench/studies/memory_study_ds.py).

--step measures the optimizer step's peak: per variant (--variants, default ddp fsdp zero1 zero2 zero3) and
precision (--precisions, default fp32 bf16) a real `python -m ptbench` run at --ranks (default 2) ranks on the
CPU (gpt2_tiny, gloo, two untimed steps; `measure_step`). Every run's trainer measures the adapter's
"optimizer" phase (clip + step; DeepSpeed's engine.step) in its last untimed step once the optimizer's state
exists (ptbench.core.memory.StepPeak: on the CPU torch.profiler's memory events, the most bytes held at
once beyond the phase's start) and records it in the memory ledger beside the run's predicted step_transient
(the optimizer's temporaries; DeepSpeed's fp32 gradient partition, fp64 norms and gloo all-gather): the table
reads those records. Overrides are passed to every run (e.g. optimizer=sgd).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ptbench.core.memory_model import numel
from ptbench.core.records import command_root
from ptbench.studies.memory_points import (
    ALL_VARIANTS,
    DATA_PARALLEL,
    MIB,
    announce,
    expected_state,
    measured_states,
    ok_record,
    paper_formula,
    param_numels,
    rss_delta_max,
    ruled,
    run_point,
    start,
    variant_overrides,
)
from ptbench.studies.memory_study_ds import deepspeed_main


def load_records(folder: Path) -> dict:
    """{(variant, ranks): summary} from records of earlier study runs (run ids STAMP-VARIANT-wN), the
    newest ok record of each point winning over failed ones."""
    import json
    import re

    found: dict = {}
    for d in sorted(Path(folder).glob("*-w*")):
        m = re.match(r"^\d{8}-\d{6}-(?P<variant>.+)-w(?P<ranks>\d+)$", d.name)
        if not m or m["variant"] not in ALL_VARIANTS or not (d / "summary.json").exists():
            continue
        summary = json.loads((d / "summary.json").read_text())
        summary["rss_delta_max"] = rss_delta_max(d)
        summary["run_dir"] = str(d)
        key = (m["variant"], int(m["ranks"]))
        if summary.get("status") == "ok" or found.get(key, {}).get("status") != "ok":
            found[key] = summary
    return found


def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:8.2f}"


def memory_table(results: dict, shapes, ranks_list, variants) -> str:
    psi = sum(numel(s) for s in shapes)
    head = (
        f"model-state bytes per rank (MiB; the rank holding the most), fp32 Adam, Ψ = {psi:,} parameters\n"
        f"{'variant':<7} {'N':>2} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} | {'paper':>8} "
        f"{'+master':>8} {'expected':>8} {'meas/exp':>8} | {'grads pk':>8} {'peak RSS':>9}"
    )
    lines = ruled(head)
    for n in ranks_list:
        for v in variants:
            s = results.get((v, n))
            if s is None:
                continue
            if v not in DATA_PARALLEL:
                continue  # the ZeRO formulas cover data-parallel variants only: see predicted_table
            f = paper_formula(v, psi, n)
            if s.get("status") != "ok":
                lines.append(f"{v:<7} {n:>2}  {s.get('status')}: {s.get('error')}")
                continue
            per_rank = s["state_bytes_per_rank"]
            totals = [r["params"] + r["grads"] + r["optimizer"] for r in per_rank]
            top = max(range(len(per_rank)), key=lambda i: totals[i])
            r = per_rank[top]
            exp = expected_state(v, shapes, n, top)
            exp_total = sum(exp.values())
            pk = max((x.get("grads_peak_backward") or 0) for x in per_rank) or None
            lines.append(
                f"{v:<7} {n:>2} {_mib(r['params'])} {_mib(r['grads'])} {_mib(r['optimizer'])} {_mib(totals[top])} | "
                f"{_mib(f['total'])} {_mib(f['total'] + f['master'])} {_mib(exp_total)} {totals[top] / exp_total:8.3f} | "
                f"{_mib(pk)} {_mib(s.get('peak_memory_max')):>9}"
            )
    lines.append(
        "paper: ZeRO formula (fp32 Adam); +master: with DeepSpeed's fp32 partition copy (stages 1-3); "
        "expected: per-tensor partition rule (see module doc); grads pk: most gradient bytes held during "
        "backward (DeepSpeed, in-flight full-size gradients included); peak RSS: process high-water mark."
    )
    return "\n".join(lines)


def predictions(variant: str, n: int, overrides: list[str]) -> tuple[dict, dict]:
    """(formula, per-tensor model) predictions of bench/core/memory_model/ for one point, from the
    same composed config and run plan `python -m ptbench --plan` uses."""
    from ptbench.core.memory_model import predict_run
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = typed(compose([*variant_overrides(variant, n), *overrides, f"launcher.nprocs={n}"]))
    plan = make_plan(cfg, "local", check=False)
    build = build_workload(cfg.workload, cfg.data).build_model
    return (
        predict_run(cfg, plan, build, device="cpu", shapes=False),
        predict_run(cfg, plan, build, device="cpu", shapes=True),
    )


def _err(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas * 100 if meas else None


def _pct(v) -> str:
    return "       -" if v is None else f"{v:+7.1f}%"


def predicted_table(results: dict, overrides: list[str], ranks_list, variants) -> str:
    """Predicted (bench/core/memory_model/) vs measured (record) model-state bytes of the busiest rank,
    the error per point, and the largest error per variant."""
    head = (
        "predicted vs measured model states per rank (MiB; busiest rank / device), bench/core/memory_model/\n"
        f"{'variant':<15} {'N':>2} {'measured':>9} | {'formula':>9} {'err':>8} | {'model':>9} {'err':>8} | "
        f"{'meas grads':>10} {'pred grads':>10} | {'pred act':>9} {'pred Δ':>9} {'ΔRSS meas':>10} {'err':>8}"
    )
    lines = ruled(head)
    worst: dict = {}
    for v in variants:
        for n in ranks_list:
            s = ok_record(results.get((v, n)), f"{v:<15} {n:>2}", lines, cut=110)
            if s is None:
                continue
            meas = measured_states(s)
            try:
                f, m = predictions(v, n, overrides)
            except Exception as e:  # noqa: BLE001 - a layout the model refuses: say so, go on
                lines.append(f"{v:<15} {n:>2}  no prediction: {type(e).__name__}: {e}")
                continue
            if meas is None:
                lines.append(f"{v:<15} {n:>2}  the record has no state bytes")
                continue
            ef, em = _err(f["model_states"], meas["total"]), _err(m["model_states"], meas["total"])
            w = worst.setdefault(v, [0.0, 0.0, []])
            w[0], w[1] = max(w[0], abs(ef or 0)), max(w[1], abs(em or 0))
            w[2].append(n)
            added = m["total"] - m["params"]  # what training adds to the process after the model is built
            rss = s.get("rss_delta_max")
            lines.append(
                f"{v:<15} {n:>2} {meas['total'] / MIB:9.2f} | {f['model_states'] / MIB:9.2f} {_pct(ef)} | "
                f"{m['model_states'] / MIB:9.2f} {_pct(em)} | {meas['grads'] / MIB:10.2f} {m['grads'] / MIB:10.2f} | "
                f"{m['activations'] / MIB:9.2f} {added / MIB:9.2f} {_mib(rss):>10} "
                f"{_pct(_err(added, rss) if rss else None)}"
            )
    lines.append("")
    lines.append("largest |error| of the model states per variant (over the rank counts that ran):")
    for v, (ef, em, ns) in worst.items():
        lines.append(f"  {v:<15} formula {ef:5.1f}%   model {em:5.1f}%   (N = {', '.join(map(str, ns))})")
    lines.append(
        "formula: Ψ/N sharding; model: the per-tensor partition rule (zero1-3, fsdp; the same as formula "
        "for the rest); err = (predicted - measured) / measured. pred act: activation estimate (GPT-2: "
        "Korthikanti et al. 2022 per layer + fp32 logits); pred Δ: predicted total minus parameters (gradients, "
        "optimizer state, master, and the larger of transient buffers + activations and the optimizer step's "
        "fp32 gradient partition: what training adds once the model "
        "exists); ΔRSS meas: CPU peak RSS minus RSS before the first step, busiest rank (it also holds "
        "allocator slack, the loss's and optimizer's temporaries and autograd buffers the model leaves out; "
        "on a GPU compare with peak_allocated instead)."
    )
    return "\n".join(lines)


def timing_table(results: dict, n: int, variants) -> str:
    base = results.get(("ddp", n), {}).get("step_time_mean_s")
    head = (
        f"CPU step time at {n} ranks, mean over the timed steps after warm-up (one thread per rank)\n"
        f"{'variant':<7} {'step s':>8} {'vs ddp':>7} {'samples/s':>10} {'steps':>6}"
    )
    lines = ruled(head)
    for v in variants:
        s = ok_record(results.get((v, n)), f"{v:<7}", lines)
        if s is None:
            continue
        t = s["step_time_mean_s"]
        ratio = f"{t / base:7.2f}" if base else "      -"
        lines.append(f"{v:<7} {t:8.4f} {ratio} {s['samples_per_s']:10.1f} {s['steps']:>6}")
    return "\n".join(lines)


# --- --step: the optimizer step's peak, measured with torch.profiler's memory events -------------------------
STEP_VARIANTS = ("ddp", "fsdp", "zero1", "zero2", "zero3")
STEP_OVERRIDES = ["workload=gpt2_tiny", "workload.seq_len=32", "trainer.batch_size=4", "data.train_samples=512"]


def measure_step(variant: str, precision: str, ranks: int = 2, extra: list[str] | None = None, root=None) -> dict:
    """A real run of `variant` (`run_point`: harness adapter, CPU, gloo, `ranks` ranks, two untimed steps): the
    record's memory ledger holds each rank's optimizer-phase peak in the second step, when the optimizer's state
    exists (the trainer's `StepPeak`), beside the memory model's step_transient for the run. Returns {variant,
    precision, ranks, measured: [{peak} per rank], predicted: the record's predicted_memory}."""
    root = Path(root or command_root("memory-step"))
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-step-{precision}"
    over = [*STEP_OVERRIDES, f"trainer.precision={precision}", "results.mllog=false", *(extra or [])]
    s = run_point(variant, ranks, over, root, stamp, steps=2, warmup=2, timeout=600)
    led = s.get("memory_ledger") or {}
    if s.get("status") != "ok" or led.get("counted_step_bytes_per_rank") is None:
        why = s.get("error") or "no step peak in the record"
        raise RuntimeError(f"{variant} {precision}: {why} (records under {root})")
    return {
        "variant": variant,
        "precision": precision,
        "ranks": ranks,
        "measured": [{"peak": b} for b in led["counted_step_bytes_per_rank"]],
        "predicted": s["predicted_memory"],
    }


def step_table(rows: list[dict]) -> str:
    head = (
        "optimizer step peak per rank, CPU: each run's record (memory_ledger.counted_step_bytes_per_rank, the "
        "trainer's StepPeak: torch.profiler memory events around the adapter's optimizer phase, bytes beyond what "
        "the phase began with) vs bench/core/memory_model/'s step_transient\n"
        f"{'variant':<7} {'prec':<5} {'N':>2} {'measured B (busiest)':>21} {'predicted B':>12} {'pred/meas':>9} "
        f"{'of which optimizer':>18}  formula"
    )
    lines = ruled(head)
    for r in rows:
        meas = max(m["peak"] for m in r["measured"])
        p = r["predicted"]
        ratio = f"{p['step_transient'] / meas:9.3f}" if meas else "        -"
        lines.append(
            f"{r['variant']:<7} {r['precision']:<5} {r['ranks']:>2} {meas:>21,} {p['step_transient']:>12,.0f} {ratio} "
            f"{p['step_optimizer']:>18,.0f}  {p['formula']['step_transient'][:160]}"
        )
    lines.append(
        "measured: the most bytes the optimizer phase (clip + step; DeepSpeed: engine.step) held at once beyond its "
        "start, the busiest of the ranks; per rank: "
        + "; ".join(f"{r['variant']}/{r['precision']} {[m['peak'] for m in r['measured']]}" for r in rows)
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ptbench.studies.memory_study", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="bench overrides for every point, e.g. workload=resnet50_tiny")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--variants", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "fsdp"], choices=ALL_VARIANTS)
    p.add_argument(
        "--records", help="print the tables from the records in this folder (earlier study runs), running nothing"
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per point (memory mode)")
    p.add_argument(
        "--timing",
        action="store_true",
        help="time ddp, zero0-3 and fsdp instead: --timed-steps after --warmup, at the first of --ranks",
    )
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--results", default="results", help="records go to RESULTS/memory_study/")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    p.add_argument(
        "--deepspeed-estimators",
        action="store_true",
        help="set predict (bf16, Adam) against DeepSpeed's estimate_zero2/zero3_model_states_mem_needs, with reasons",
    )
    p.add_argument("--workloads", nargs="+", default=["gpt2_small", "gpt2_medium"], help="(--deepspeed-estimators)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 8, 64], help="GPU counts (--deepspeed-estimators)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="DeepSpeed's num_gpus_per_node above one node")
    p.add_argument(
        "--step",
        action="store_true",
        help="measure the optimizer step's peak (torch.profiler) of real runs at --ranks (default 2) vs predict",
    )
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="(--step)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="(--deepspeed-estimators) also run bf16 zero2/zero3 at each --gpus here and print the measured states",
    )
    return p


def _step_main(args, p: argparse.ArgumentParser) -> int:
    """--step: the optimizer step's measured peak of real runs against the model."""
    if args.deepspeed_estimators or args.timing or args.records:
        print("error: --step runs on its own: drop --deepspeed-estimators / --timing / --records", file=sys.stderr)
        return 2
    variants = list(STEP_VARIANTS) if args.variants == p.get_default("variants") else args.variants
    bad = [v for v in variants if v not in STEP_VARIANTS]
    if bad:
        print(f"error: --step measures {', '.join(STEP_VARIANTS)}; drop --variants {' '.join(bad)}", file=sys.stderr)
        return 2
    n = args.ranks[0] if args.ranks != p.get_default("ranks") else 2
    rows, failed = [], 0
    step_root = command_root("memory-step")  # one folder for the command's runs
    tally = start(
        len(variants) * len(args.precisions), f"{' '.join(variants)} x {' '.join(args.precisions)}", step_root
    )
    for v in variants:
        for prec in args.precisions:
            t0 = time.perf_counter()
            try:
                rows.append(measure_step(v, prec, n, args.overrides, root=step_root))
                status = "measured"
            except RuntimeError as e:  # a run that failed or recorded no step peak: one line, go on
                print(f"error: {e}", file=sys.stderr)
                failed, status = failed + 1, "failed"
            announce(tally, f"{v} {prec} x {n} rank(s)", status, time.perf_counter() - t0)
    if rows:
        print(step_table(rows))
    return 1 if failed else 0


def _timing_main(args, p: argparse.ArgumentParser, overrides: list[str], root: Path, stamp: str) -> int:
    """--timing: ddp, zero0-3 and fsdp timed at one rank count."""
    results = {}
    variants = (
        ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp"]
        if args.variants == p.get_default("variants")
        else args.variants
    )
    n = args.ranks[0] if args.ranks != p.get_default("ranks") else 2
    tally = start(len(variants), f"{' '.join(variants)} at {n} ranks, timed", root / "memory_study")
    for v in variants:
        results[(v, n)] = run_point(
            v, n, overrides, root, stamp, args.warmup + args.timed_steps, args.warmup, args.timeout
        )
        announce(tally, f"{v} x {n} rank(s)", results[(v, n)].get("status"), results[(v, n)]["wall_s"])
    print(timing_table(results, n, variants))
    return 0


def _memory_main(args, overrides: list[str], root: Path, stamp: str) -> int:
    """The memory tables: from new runs at --ranks, or from --records."""
    results = {}
    if args.records:
        results = load_records(Path(args.records))
        if not results:  # a folder this command did not write: say so, not empty tables
            print(
                f"error: --records {args.records}: no memory_study records there (run folders "
                "STAMP-VARIANT-wN with a summary.json); run `python -m ptbench.studies.memory_study` first and pass "
                "its folder, e.g. --records results/memory_study",
                file=sys.stderr,
            )
            return 2
    shapes = param_numels(overrides)
    if not args.records:
        what = f"{' '.join(args.variants)} at {' '.join(map(str, args.ranks))} ranks"
        tally = start(len(args.ranks) * len(args.variants), what, root / "memory_study")
        for n in args.ranks:
            for v in args.variants:
                results[(v, n)] = run_point(
                    v, n, overrides, root, stamp, args.steps, min(args.warmup, args.steps - 1), args.timeout
                )
                announce(tally, f"{v} x {n} rank(s)", results[(v, n)].get("status"), results[(v, n)]["wall_s"])
        print(f"memory_study: {tally.total} runs in {tally.spent()}", file=sys.stderr)
    print(memory_table(results, shapes, args.ranks, args.variants))
    print()
    print(predicted_table(results, overrides, args.ranks, args.variants))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.step:
        return _step_main(args, p)
    if args.deepspeed_estimators:
        if args.timing or args.records:
            print(
                "error: --deepspeed-estimators runs on its own: drop --timing / --records (run them separately)",
                file=sys.stderr,
            )
            return 2
        return deepspeed_main(args)

    overrides = ["workload=gpt2_tiny", "workload.seq_len=32", "trainer.batch_size=4", "data.train_samples=512"]
    overrides += args.overrides  # later overrides win
    root = Path(args.results).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.timing:
        return _timing_main(args, p, overrides, root, stamp)
    return _memory_main(args, overrides, root, stamp)


if __name__ == "__main__":
    sys.exit(main())
