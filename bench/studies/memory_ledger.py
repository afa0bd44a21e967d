"""The memory ledger: predicted vs counted saved-activation bytes per adapter x workload.

    python -m ptbench.studies.memory_ledger                          # every adapter x tiny workload, 2 ranks
    python -m ptbench.studies.memory_ledger --adapters ddp zero3 --workloads gpt2_tiny
    python -m ptbench.studies.memory_ledger --tolerance 0.10         # exit 1 when a point is further off

Runs `python -m ptbench` once per point (2 ranks on this machine, a few steps, fp32): the runner counts
what autograd saves in the last untimed step on every rank (the second here) (bench/core/memory.py,
`SavedTensorLedger`: saved-tensor hooks, each storage once, parameters and buffers excluded, the most
bytes alive at once) and records it beside the memory model's prediction for the busiest rank in the
summary's `memory_ledger`. The table prints both and their ratio. gpipe (torchgpipe, one process driving 2
partitions, 4 micro-batches, its default checkpointing except_last) is counted per partition, as each is
one device on a cluster: the partition modules count their forward (on torchgpipe's worker threads, which
the step's thread-local hooks do not reach) and their recomputation in backward for themselves
(`SavedTensorLedger.partition`, adapters/gpipe.py), the loss for the last; the table lists the partitions
where it lists ranks. It runs with the even split by layer count (`adapter.balance`), the one the plan
predicts for (torchgpipe's balance_by_time splits by time measured in the run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptbench.core.records import command_root
from ptbench.run_point import run_bench
from ptbench.studies.tally import Tally
from ptbench.studies.variants import overrides

# rows of ptbench.studies.variants at 2 ranks; gpipe: one process driving the 2 partitions
ADAPTERS = {
    name: overrides(name, 2)
    for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "tensor_parallel", "megatron", "pipeline", "gpipe")
}
ADAPTERS["gpipe"].append("launcher.nprocs=1")
LANGUAGE_ONLY = ("tensor_parallel", "megatron")
WORKLOADS = ("gpt2_tiny", "resnet50_tiny", "vgg16_tiny")
# small enough for 2 ranks on 2 cores; vocabulary 1024 so that the transformer layers, not the head, dominate
COMMON = [
    "experiment=smoke",
    "trainer.max_steps=3",
    "trainer.untimed_steps=2",
    "trainer.batch_size=8",
]
EXTRA = {"gpt2_tiny": ["workload.vocab_size=1024"]}
# gpipe: the even split by layer count (the memory model's); torchgpipe's default balance_by_time splits by time
# measured in the run, which the plan cannot know
GPIPE_BALANCE = {"gpt2_tiny": "[2,2]", "resnet50_tiny": "[12,11]", "vgg16_tiny": "[20,20]"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--tolerance", type=float, default=0.10, help="largest |predicted/counted - 1| accepted")
    p.add_argument(
        "--root", type=Path, default=None, help="where the records go (default: results/memory-ledger-<time>/)"
    )
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    root = args.root or command_root("memory-ledger")
    points = [(w, a) for w in args.workloads for a in args.adapters if a not in LANGUAGE_ONLY or w.startswith("gpt2")]
    print(f"memory_ledger: {len(points)} runs, a row as each ends; records under {root}/", flush=True)
    tally = Tally(len(points))
    rows, bad = [], 0
    print(
        f"{'adapter':<16} {'workload':<14} {'predicted KiB':>14} {'counted KiB per rank (gpipe: partition)':>38} {'ratio':>7}"
    )
    for w, a in points:  # a row as each run ends, with how far the command is
        balance = [f"adapter.balance={GPIPE_BALANCE[w]}"] if a == "gpipe" else []
        run = run_bench(
            [*COMMON, f"workload={w}", *EXTRA.get(w, []), *ADAPTERS[a], *balance]
            + ([] if any(o.startswith("launcher.nprocs=") for o in ADAPTERS[a]) else ["launcher.nprocs=2"]),
            root=root,
            experiment="memory_ledger",
            timeout=args.timeout,
            run_name=(a, w, 2),
        )
        led = run.summary.get("memory_ledger") if run.status == "ok" else None
        if led and led.get("error"):  # stated, not a failure
            print(f"{a:<16} {w:<14} {'-':>14} {'-':>38} {'-':>7}  {led['error']}{tally.tick()}", flush=True)
            continue
        if not led or led.get("ratio") is None:
            errors = [ln for ln in run.stderr.splitlines() if "error" in ln.lower()]
            why = run.summary.get("error") or (errors[-1] if errors else run.status)
            print(f"{a:<16} {w:<14} {'-':>14} {'-':>38} {'-':>7}  not counted: {why[:120]}{tally.tick()}", flush=True)
            bad += 1
            continue
        ratio = led["ratio"]
        per_rank = " / ".join(f"{b / 1024:,.0f}" for b in led["counted_saved_bytes_per_rank"])
        flag = "" if abs(ratio - 1) <= args.tolerance else f"  off by more than {args.tolerance:.0%}"
        bad += bool(flag)
        print(
            f"{a:<16} {w:<14} {led['predicted_saved_bytes'] / 1024:>14,.0f} {per_rank:>38} {ratio:>7.3f}{flag}"
            f"{tally.tick()}"
        )
        rows.append((a, w, ratio))
        sys.stdout.flush()
    print(f"memory_ledger: {len(points)} runs in {tally.spent()}; records: {root}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
