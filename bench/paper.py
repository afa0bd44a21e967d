"""The paper's protocol as one command: three sweeps, the second chosen from the first.

    python -m ptbench.paper plan --workloads gpt2_small --adapters ddp,zero,megatron,gpipe,pipeline,pipedream \\
        --gpus 1,2,4,8,16,32,64 --gpus-per-node 4 [--out results/paper] [--submit | --dry-run] [--one-at-a-time]
        [-- overrides]
    python -m ptbench.paper stateff results/paper [--submit | --run] [--gpus-per-node 4] [--one-at-a-time]  # phase 2
    python -m ptbench.paper run results/paper   # all three phases here, one after another (CPU scale)
    python -m ptbench.paper wait results/paper  # until every job of the plan (phase 2's arrays too) has left the queue,
                                                # a line when what it waits for changes and every minute

--out defaults to RESULTS/paper ($RESULTS, else results/); --dry-run prints the sbatch lines and writes nothing.

As in "How to Train Your Neural Network" (Lin et al.):
1. epoch time at every GPU count per framework (`epoch.txt`: the preset's settings, 2 epochs so the
   second is a steady one; speedup uses `epoch_time_steady_s`);
2. statistical efficiency: full training for each framework at the GPU count where its epoch time was
   lowest (`stateff.txt`, written from phase 1's records when phase 2 starts: with --submit a small
   job that depends on phase 1 with `--dependency=afterok`), with what its adapter compares it with beside it
   (`Adapter.paper_companions`; PipeDream: 2BW, the flushing 1F1B pipeline and DDP at its rank count and global
   batch, for the staleness claim in analysis/claims.py);
3. memory at every GPU count (`memory.txt`: a few steps, no validation).
Each adapter's batch policy is its own (adapter.batch_policy: per-device for DDP/ZeRO, linear for
Megatron, per micro-batch for GPipe, fixed for the pipeline schedules and PipeDream); layouts per GPU count
come from each adapter (`Adapter.paper_layout`: data parallel, tensor parallel inside a node, one process for
gpipe, pipeline stages, one PipeDream stage per rank from 2 ranks). --one-at-a-time runs every task of the plan
alone (each array held, throttled to one task and released; one singleton job name per plan). A point that runs
out of memory is retried once with half the per-device batch (bench/runner/points.py `oom_retry`, recorded as
`extra.batch_reduced_from`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import subprocess
import sys
import time
import zlib
from pathlib import Path

from ptbench.core.readers import read_record, summaries
from ptbench.runner.points import read_points, write_points
from ptbench.runner.slurm import REPO, submit_arrays, with_repeats

PRESET = {
    "gpt2_small": "paper_language",
    "gpt2_medium": "paper_language",
    "gpt2_tiny": "paper_language_small",
    "vgg16": "paper_vision",
    "resnet50": "paper_vision",
    "vgg16_tiny": "paper_vision",
    "resnet50_tiny": "paper_vision",
}
PHASES = ("epoch", "stateff", "memory")


@functools.cache
def adapter_class(name: str):
    """The adapter class behind `adapter=NAME` (a preset such as zero2 names its adapter in its config)."""
    from ptbench.adapters import get_adapter_class
    from ptbench.runner.compose import compose

    return get_adapter_class(compose([f"adapter={name}"]).adapter.name)


def placement(adapter: str, gpus: int, gpus_per_node: int, layers: int = 12) -> list[str] | str:
    """Overrides that put `adapter` on `gpus` devices, or why it cannot run there: each adapter's own rule
    (`Adapter.paper_layout`)."""
    return adapter_class(adapter).paper_layout(gpus, gpus_per_node, layers)


def layout(adapter: str, gpus: int, gpus_per_node: int, layers: int = 12) -> list[str] | None:
    """Overrides that put `adapter` on `gpus` devices, or None where it cannot run there."""
    found = placement(adapter, gpus, gpus_per_node, layers)
    return None if isinstance(found, str) else found


def plan(workloads: list[str], adapters: list[str], gpus: list[int], gpus_per_node: int, extra: list[str]) -> dict:
    """The points of phases 1 and 3 (phase 2 is chosen later from phase 1's records)."""
    from ptbench.runner.compose import compose

    phases = {"epoch": [], "memory": [], "skipped": []}
    for w in workloads:
        if w not in PRESET:
            raise SystemExit(f"error: --workloads {w}: choose from {', '.join(PRESET)}")
        layers = compose([f"workload={w}"]).workload.n_layer
        for a in adapters:
            for n in gpus:
                lay = placement(a, n, gpus_per_node, layers)
                if isinstance(lay, str):
                    phases["skipped"].append(f"{w} {a} x{n}: {lay}")
                    continue
                base = [f"experiment={PRESET[w]}", f"workload={w}", f"adapter={a}", *lay, *extra]
                phases["epoch"].append([*base, "trainer.epochs=2", f"results.experiment=paper-epoch-{w}"])
                phases["memory"].append(
                    [
                        *base,
                        "trainer.epochs=1",
                        "trainer.max_steps=20",
                        "trainer.eval_every_epoch=false",
                        f"results.experiment=paper-memory-{w}",
                    ]
                )
    return phases


def results_root() -> Path:
    """Where records go: $RESULTS (as slurm/array.sbatch reads it), else the checkout's results/."""
    return Path(os.environ.get("RESULTS") or REPO / "results")


def write_plan(out: Path, phases: dict, args_line: str, stateff_epochs: int = 0, repeats: int = 1) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("epoch", "memory"):
        write_points(out / f"{name}.txt", phases[name], f"python -m ptbench.paper {args_line} (phase {name})")
    (out / "plan.json").write_text(
        json.dumps(
            {"command": args_line, "skipped": phases["skipped"], "stateff_epochs": stateff_epochs, "repeats": repeats},
            indent=2,
        )
        + "\n"
    )


def serial_args(out: Path) -> list[str]:
    """sbatch options that make the plan's tasks run one at a time (--one-at-a-time; timing runs that share a
    node's cores measure each other): every array is held at submission, throttled to one task and released
    (`release_serial`), and one job name per plan with a singleton dependency keeps two arrays from running
    together (Slurm's singleton alone lets an array's tasks run side by side)."""
    return [
        "--hold",
        "--dependency=singleton",
        f"--job-name=bench-paper-{zlib.crc32(str(out.absolute()).encode()):08x}",
    ]


def release_serial(ids: list[str]) -> int:
    """Throttle each held array to one task at a time, then release it; 1 (said in one line) if Slurm refused."""
    for job in ids:
        for cmd in (["scontrol", "update", f"JobId={job}", "ArrayTaskThrottle=1"], ["scontrol", "release", job]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"error: {shlex.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}", file=sys.stderr)
                return 1
    return 0


def add_jobs(out: Path, ids: list[str]) -> None:
    """Job ids of the plan, one a line in OUT/jobs.txt (phase 2's job appends its arrays): what `wait` waits for."""
    with open(out / "jobs.txt", "a") as f:
        f.writelines(f"{i}\n" for i in ids if i and not i.startswith("<"))


def wait(out: Path, timeout: float, poll: float = 2.0) -> int:
    """Until no job of OUT/jobs.txt is queued or running (the file is read again at every poll, so the
    arrays phase 2 submits while it runs are waited for too); 1 on timeout, 2 when OUT holds no submitted plan."""
    if not (out / "jobs.txt").is_file():
        what = "no such folder" if not out.is_dir() else "no jobs.txt in it: nothing was submitted"
        print(f"error: wait {out}: {what}; give the --out folder of `python -m ptbench.paper plan --submit`",
              file=sys.stderr)  # fmt: skip
        return 2
    start = time.time()
    deadline, said, said_at = start + timeout, None, 0.0
    while True:
        ids = (out / "jobs.txt").read_text().split()
        rows = (
            subprocess.run(
                ["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(ids)], capture_output=True, text=True
            ).stdout.splitlines()
            if ids
            else []
        )
        # squeue lists an array's pending tasks one row each (1234_[2-5] or 1234_1): count jobs, not rows
        queued = sorted({r.split()[0].split("_")[0] for r in rows if r.split()})
        for job in [r.split()[0] for r in rows if r.endswith("DependencyNeverSatisfied")]:
            # phase 2 waits for phase 1 with afterok: a failed phase-1 point leaves it pending for ever
            print(f"wait: job {job} can never start (a job it depends on failed): cancelled", file=sys.stderr)
            subprocess.run(["scancel", job])
        if not queued:
            print(f"wait: the plan's {len(ids)} job(s) have left the queue", flush=True)
            return 0
        if time.time() > deadline:
            print(f"wait: still queued after {timeout:.0f} s: {' '.join(queued)}", file=sys.stderr)
            return 1
        # what it waits for, when that changes and at least every 60 s (slow can be told from hung)
        now_rows = sorted(rows)
        if now_rows != said or time.time() - said_at >= 60:
            states = ", ".join(f"{r.split()[0]} ({' '.join(r.split()[1:]) or '?'})" for r in now_rows)
            print(
                f"wait: {len(queued)} of the plan's {len(ids)} job(s) queued or running after "
                f"{time.time() - start:.0f} s (state, reason): {states}",
                flush=True,
            )
            said, said_at = now_rows, time.time()
        time.sleep(poll)


def choose_stateff(out: Path, results: Path) -> list[list[str]]:
    """Phase 2: per (workload, adapter), the phase-1 point with the lowest epoch time among its ok
    records (steady epoch time where there is one), run for the preset's full training."""
    epoch_points = read_points(out / "epoch.txt")
    plan_file = out / "plan.json"
    planned = (read_record(plan_file) or {}) if plan_file.exists() else {}
    stateff_epochs, repeats = planned.get("stateff_epochs", 0), planned.get("repeats", 1)
    best: dict[tuple[str, str], tuple[float, list[str]]] = {}
    for _, s in summaries([results]):  # bounded reads: a shared results root may hold anything
        if s.get("status") != "ok" or not str(s.get("experiment", "")).startswith("paper-epoch-"):
            continue
        t = s.get("epoch_time_steady_s") or s.get("epoch_time_mean_s")
        point = next((p for p in epoch_points if _point_id(p) == s.get("point")), None)
        if t is None or point is None:
            continue
        key = (s["workload"], s["adapter"])
        if key not in best or t < best[key][0]:
            best[key] = (t, point)
    chosen, seen = [], set()
    for (w, a), (_, point) in sorted(best.items()):
        kept = [o for o in point if not o.startswith(("trainer.epochs=", "results.experiment=", "results.repeat="))]
        epochs = [f"trainer.epochs={stateff_epochs}"] if stateff_epochs else []  # else the preset's
        # beside it, what its adapter compares it with at the same global batch (PipeDream: 2BW, 1F1B, DDP)
        for p in [kept, *adapter_class(a).paper_companions(kept)]:
            if _point_id(p) not in seen:
                seen.add(_point_id(p))
                chosen.append([*p, *epochs, f"results.experiment=paper-stateff-{w}"])
    chosen = with_repeats(chosen, repeats, vary_seed=True)  # --repeats: curves with bands (seed + repeat)
    write_points(out / "stateff.txt", chosen, "phase stateff: each adapter at its fastest GPU count of phase epoch")
    return chosen


def _point_id(overrides: list[str]) -> str:
    from ptbench.runner.points import point_id

    return point_id(overrides)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ptbench.paper", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="write the sweep files; --submit: Slurm arrays, phase 2 after phase 1")
    pl.add_argument("--workloads", required=True)
    pl.add_argument("--adapters", required=True)
    pl.add_argument("--gpus", required=True, help="GPU counts, e.g. 1,2,4,8")
    pl.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU ranks, one node)")
    pl.add_argument("--out", type=Path, default=None, help="where the sweep files go (default: RESULTS/paper)")
    pl.add_argument("--submit", action="store_true")
    pl.add_argument("--dry-run", action="store_true", help="print the sbatch lines only; writes nothing")
    pl.add_argument("--sbatch", action="append", default=[], metavar="ARG")
    pl.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the plan's tasks (phase 2's too) one after another, never two at once (CPU nodes: no contention)",
    )
    pl.add_argument(
        "--stateff-epochs",
        type=int,
        default=0,
        help="epochs of phase 2's full training (0: the preset's, e.g. 100 for GPT-2)",
    )
    pl.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each epoch-time and memory point N times, interleaved (one array task each), and phase 2 N "
        "times with trainer.seed + R (bands on the curves)",
    )
    st = sub.add_parser("stateff", help="phase 2: choose from phase 1's records, then run or submit")
    st.add_argument("out", type=Path)
    st.add_argument("--results", type=Path, default=None, help="records of phase 1 (default: $RESULTS or results/)")
    st.add_argument("--submit", action="store_true")
    st.add_argument("--run", action="store_true")
    st.add_argument("--gpus-per-node", type=int, default=0)
    st.add_argument("--one-at-a-time", action="store_true", help="--submit: one task at a time (as plan's)")
    rn = sub.add_parser("run", help="run phases epoch, stateff, memory here, one after another")
    rn.add_argument("out", type=Path)
    rn.add_argument("--results", type=Path, default=None, help="records (default: $RESULTS or results/)")
    wt = sub.add_parser("wait", help="wait until every job of a submitted plan has left the queue")
    wt.add_argument("out", type=Path)
    wt.add_argument("--timeout", type=float, default=3600)
    return p


def _submit_phase(args, name: str, points: list, sbatch: list[str], serial: bool) -> tuple[int, list[str]]:
    """One phase's Slurm arrays (printed only under --dry-run); the job ids, added to the plan's jobs.txt."""
    code, ids = submit_arrays(
        args.out / f"{name}.txt",
        [],
        gpus_per_node=args.gpus_per_node,
        sbatch=sbatch,
        dry_run=args.dry_run,
        points=points if args.dry_run else None,
    )
    code = code or (release_serial(ids) if serial else 0)
    if not args.dry_run:
        add_jobs(args.out, ids)
    return code, ids


def _submit_stateff_after(args, ids: list[str], submit: bool) -> int:
    """Phase 2 as a job that starts when every epoch-time task has ended well (it chooses, then submits);
    printed always, submitted when `submit`."""
    phase2 = [
        "sbatch",
        "--parsable",
        f"--dependency=afterok:{':'.join(ids)}",
        "--job-name=bench-paper-stateff",
        "--ntasks=1",
        f"--output={results_root().absolute() / 'slurm'}/%x-%j.out",
        f"--wrap={sys.executable} -m ptbench.paper stateff {args.out.absolute()} --submit "
        f"--gpus-per-node {args.gpus_per_node}" + (" --one-at-a-time" if args.one_at_a_time else ""),
    ]
    print(shlex.join(phase2), flush=True)
    if not submit:
        return 0
    proc = subprocess.run(phase2, capture_output=True, text=True, cwd=REPO)
    print(proc.stdout.strip() or proc.stderr.strip(), flush=True)
    add_jobs(args.out, [proc.stdout.strip().split(";")[0]] if proc.returncode == 0 else [])
    return proc.returncode


def _plan_cmd(args, argv: list[str], extra: list[str]) -> int:
    phases = plan(
        args.workloads.split(","),
        args.adapters.split(","),
        [int(g) for g in args.gpus.split(",")],
        args.gpus_per_node,
        extra,
    )
    phases["epoch"] = with_repeats(phases["epoch"], args.repeats)
    # the memory phase too: CPU peak RSS varies run to run (GPU allocated bytes repeat, and compare exactly)
    phases["memory"] = with_repeats(phases["memory"], args.repeats)
    if not args.dry_run:
        line = shlex.join(argv + (["--", *extra] if extra else []))
        write_plan(args.out, phases, line, args.stateff_epochs, args.repeats)
    print(
        f"plan: {len(phases['epoch'])} epoch-time points, {len(phases['memory'])} memory points -> {args.out}/; "
        f"{len(phases['skipped'])} skipped (plan.json)" + ("; dry run: nothing written" if args.dry_run else "")
    )
    if args.dry_run:
        print("".join(f"skipped: {why}\n" for why in phases["skipped"]), end="")
    if not (args.submit or args.dry_run):
        return 0
    serial = args.one_at_a_time and not args.dry_run
    sbatch = [*args.sbatch, *(serial_args(args.out) if args.one_at_a_time else [])]
    if not args.dry_run:
        (args.out / "jobs.txt").write_text("")
    code, ids = _submit_phase(args, "epoch", phases["epoch"], sbatch, serial)
    code = _submit_stateff_after(args, ids, submit=not args.dry_run and code == 0) or code
    code2, _ = _submit_phase(args, "memory", phases["memory"], sbatch, serial)
    return code or code2


def _sweep_run(out: Path, phase: str, results: Path) -> int:
    """One phase's sweep file run here, its records under `results` (the root phase 2 chooses from)."""
    cmd = [sys.executable, "-m", "ptbench.sweep", "run", str(out / f"{phase}.txt")]
    return subprocess.run([*cmd, "--", f"results.root={results.absolute()}"]).returncode


def _stateff_cmd(args) -> int:
    chosen = choose_stateff(args.out, args.results)
    print(f"stateff: {len(chosen)} points -> {args.out / 'stateff.txt'}")
    if args.submit:
        sbatch = serial_args(args.out) if args.one_at_a_time else []
        code, ids = submit_arrays(args.out / "stateff.txt", [], gpus_per_node=args.gpus_per_node, sbatch=sbatch)
        add_jobs(args.out, ids)  # before this job ends, so `wait` sees them
        return code or (release_serial(ids) if args.one_at_a_time else 0)
    return _sweep_run(args.out, "stateff", args.results) if args.run else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = _parser().parse_args(argv)
    if getattr(args, "results", None) is None and args.cmd in ("stateff", "run"):
        args.results = results_root()
    if args.cmd == "wait":
        return wait(args.out, args.timeout)
    if args.cmd == "plan":
        if args.out is None:
            args.out = results_root() / "paper"  # never a folder of the checkout outside results/
        return _plan_cmd(args, argv, extra)
    if args.cmd == "stateff":
        return _stateff_cmd(args)
    # run: the whole protocol here, every phase's records under --results (phase 2 chooses from them)
    code = 0
    for phase in PHASES:
        if phase == "stateff":
            choose_stateff(args.out, args.results)
        code |= _sweep_run(args.out, phase, args.results)
    return code


if __name__ == "__main__":
    sys.exit(main())
