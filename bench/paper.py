"""The paper's protocol as one command: three sweeps, the second chosen from the first.

    python -m bench.paper plan --workloads gpt2_small --adapters ddp,zero,megatron,gpipe,pipeline \\
        --gpus 1,2,4,8,16,32,64 --gpus-per-node 4 --out paper/ [--submit | --dry-run] [-- overrides]
    python -m bench.paper stateff paper/ [--submit | --run] [--gpus-per-node 4]   # phase 2, from phase 1's records
    python -m bench.paper run paper/        # all three phases here, one after another (CPU scale)

As in "How to Train Your Neural Network" (Lin et al.):
1. epoch time at every GPU count per framework (`epoch.txt`: the preset's settings, 2 epochs so the
   second is a steady one; speedup uses `epoch_time_steady_s`);
2. statistical efficiency: full training for each framework at the GPU count where its epoch time was
   lowest (`stateff.txt`, written from phase 1's records when phase 2 starts: with --submit a small
   job that depends on phase 1 with `--dependency=afterok`);
3. memory at every GPU count (`memory.txt`: a few steps, no validation).
Each adapter's batch policy is its own (adapter.batch_policy: per-device for DDP/ZeRO, linear for
Megatron, per micro-batch for GPipe, fixed for the pipeline schedules); layouts per GPU count come
from `layout()`. A point that runs out of memory is retried once with half the per-device batch
(bench/sweep.py `oom_retry`, recorded as `extra.batch_reduced_from`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench.sweep import REPO, read_points, submit_arrays, write_points

PRESET = {"gpt2_small": "paper_language", "gpt2_medium": "paper_language", "gpt2_tiny": "paper_language_small",
          "vgg16": "paper_vision", "resnet50": "paper_vision", "vgg16_tiny": "paper_vision",
          "resnet50_tiny": "paper_vision"}
PHASES = ("epoch", "stateff", "memory")


def layout(adapter: str, gpus: int, gpus_per_node: int, layers: int = 12) -> list[str] | None:
    """Overrides that put `adapter` on `gpus` devices, or None where it cannot run there."""
    if adapter in ("ddp", "zero", "zero1", "zero2", "zero3", "fsdp", "horovod"):
        return [f"launcher.nprocs={gpus}"]
    if adapter in ("megatron", "tensor_parallel"):  # tensor parallel inside a node, data parallel across
        tp = min(gpus, gpus_per_node or gpus)
        return [f"launcher.nprocs={gpus}", f"adapter.tensor_parallel={tp}"]
    if adapter == "gpipe":  # one process drives every partition: one node at most
        return None if gpus_per_node and gpus > gpus_per_node else ["launcher.nprocs=1", f"adapter.pipeline_parallel={gpus}"]
    if adapter == "pipeline":  # stages up to the layer count, data parallel beyond
        pp = max(d for d in range(1, min(gpus, layers) + 1) if gpus % d == 0)
        return [f"launcher.nprocs={gpus}", f"adapter.pipeline_parallel={pp}"]
    return [f"launcher.nprocs={gpus}"]


def plan(workloads: list[str], adapters: list[str], gpus: list[int], gpus_per_node: int, extra: list[str]) -> dict:
    """The points of phases 1 and 3 (phase 2 is chosen later from phase 1's records)."""
    from bench.runner.compose import compose

    phases = {"epoch": [], "memory": [], "skipped": []}
    for w in workloads:
        if w not in PRESET:
            raise SystemExit(f"error: --workloads {w}: choose from {', '.join(PRESET)}")
        layers = compose([f"workload={w}"]).workload.n_layer
        for a in adapters:
            for n in gpus:
                lay = layout(a, n, gpus_per_node, layers)
                if lay is None:
                    phases["skipped"].append(f"{w} {a} x{n}: one process drives every partition (one node)")
                    continue
                base = [f"experiment={PRESET[w]}", f"workload={w}", f"adapter={a}", *lay, *extra]
                phases["epoch"].append([*base, "trainer.epochs=2", f"results.experiment=paper-epoch-{w}"])
                phases["memory"].append([*base, "trainer.epochs=1", "trainer.max_steps=20",
                                         "trainer.eval_every_epoch=false", f"results.experiment=paper-memory-{w}"])
    return phases


def write_plan(out: Path, phases: dict, args_line: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("epoch", "memory"):
        write_points(out / f"{name}.txt", phases[name], f"python -m bench.paper {args_line} (phase {name})")
    (out / "plan.json").write_text(json.dumps({"command": args_line, "skipped": phases["skipped"]}, indent=2) + "\n")


def choose_stateff(out: Path, results: Path) -> list[list[str]]:
    """Phase 2: per (workload, adapter), the phase-1 point with the lowest epoch time among its ok
    records (steady epoch time where there is one), run for the preset's full training."""
    epoch_points = read_points(out / "epoch.txt")
    best: dict[tuple[str, str], tuple[float, list[str]]] = {}
    for summary_path in results.rglob("summary.json"):
        s = json.loads(summary_path.read_text())
        if s.get("status") != "ok" or not str(s.get("experiment", "")).startswith("paper-epoch-"):
            continue
        t = s.get("epoch_time_steady_s") or s.get("epoch_time_mean_s")
        point = next((p for p in epoch_points if _point_id(p) == s.get("point")), None)
        if t is None or point is None:
            continue
        key = (s["workload"], s["adapter"])
        if key not in best or t < best[key][0]:
            best[key] = (t, point)
    chosen = []
    for (w, _), (_, point) in sorted(best.items()):
        kept = [o for o in point if not o.startswith(("trainer.epochs=", "results.experiment="))]
        chosen.append([*kept, f"results.experiment=paper-stateff-{w}"])  # the preset's epochs
    write_points(out / "stateff.txt", chosen, "phase stateff: each adapter at its fastest GPU count of phase epoch")
    return chosen


def _point_id(overrides: list[str]) -> str:
    from bench.sweep import point_id

    return point_id(overrides)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.paper", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="write the sweep files; --submit: Slurm arrays, phase 2 after phase 1")
    pl.add_argument("--workloads", required=True)
    pl.add_argument("--adapters", required=True)
    pl.add_argument("--gpus", required=True, help="GPU counts, e.g. 1,2,4,8")
    pl.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU ranks, one node)")
    pl.add_argument("--out", type=Path, default=Path("paper"))
    pl.add_argument("--submit", action="store_true")
    pl.add_argument("--dry-run", action="store_true", help="print the sbatch lines only")
    pl.add_argument("--sbatch", action="append", default=[], metavar="ARG")
    st = sub.add_parser("stateff", help="phase 2: choose from phase 1's records, then run or submit")
    st.add_argument("out", type=Path)
    st.add_argument("--results", type=Path, default=REPO / "results")
    st.add_argument("--submit", action="store_true")
    st.add_argument("--run", action="store_true")
    st.add_argument("--gpus-per-node", type=int, default=0)
    rn = sub.add_parser("run", help="run phases epoch, stateff, memory here, one after another")
    rn.add_argument("out", type=Path)
    rn.add_argument("--results", type=Path, default=REPO / "results")
    args = p.parse_args(argv)

    if args.cmd == "plan":
        phases = plan(args.workloads.split(","), args.adapters.split(","), [int(g) for g in args.gpus.split(",")],
                      args.gpus_per_node, extra)
        write_plan(args.out, phases, shlex.join(argv + (["--", *extra] if extra else [])))
        print(f"plan: {len(phases['epoch'])} epoch-time points, {len(phases['memory'])} memory points -> {args.out}/; "
              f"{len(phases['skipped'])} skipped (plan.json)")
        if not (args.submit or args.dry_run):
            return 0
        code, ids = submit_arrays(args.out / "epoch.txt", [], gpus_per_node=args.gpus_per_node, sbatch=args.sbatch,
                                  dry_run=args.dry_run)
        dep = f"--dependency=afterok:{':'.join(ids)}"
        phase2 = ["sbatch", "--parsable", dep, "--job-name=bench-paper-stateff", "--ntasks=1",
                  f"--output={REPO / 'results' / 'slurm'}/%x-%j.out",
                  f"--wrap={sys.executable} -m bench.paper stateff {args.out.absolute()} --submit "
                  f"--gpus-per-node {args.gpus_per_node}"]
        print(shlex.join(phase2), flush=True)
        if not args.dry_run and code == 0:
            proc = subprocess.run(phase2, capture_output=True, text=True, cwd=REPO)
            print(proc.stdout.strip() or proc.stderr.strip(), flush=True)
            code = proc.returncode
        code2, _ = submit_arrays(args.out / "memory.txt", [], gpus_per_node=args.gpus_per_node, sbatch=args.sbatch,
                                 dry_run=args.dry_run)
        return code or code2
    if args.cmd == "stateff":
        chosen = choose_stateff(args.out, args.results)
        print(f"stateff: {len(chosen)} points -> {args.out / 'stateff.txt'}")
        if args.submit:
            return submit_arrays(args.out / "stateff.txt", [], gpus_per_node=args.gpus_per_node)[0]
        if args.run:
            return subprocess.run([sys.executable, "-m", "bench.sweep", "run", str(args.out / "stateff.txt")]).returncode
        return 0
    # run: the whole protocol here
    code = 0
    for phase in PHASES:
        if phase == "stateff":
            choose_stateff(args.out, args.results)
        code |= subprocess.run([sys.executable, "-m", "bench.sweep", "run", str(args.out / f"{phase}.txt")]).returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
