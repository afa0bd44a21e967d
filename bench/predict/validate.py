"""`python -m ptbench.predict validate`: the check this project can run honestly on one machine, as root.

It starts the two-node Slurm in network namespaces (slurm/local_cluster.sh start --nodes 2), shapes the link
between the nodes with tc tbf on both root-side veths (tbv1, tbv2: each node's incoming traffic) at each rate,
and runs one rank per node, each bound to its own core (taskset -c $SLURM_NODEID):
- calibration: ptbench.comm and DDP at the two calibration rates; every other adapter once at the fastest
  rate, profiled (trainer.profile: its non-overlapped fraction of communication, from the traces); one rank at
  the pipeline's two micro-batch sizes (no link; in the fastest rate's folder), which tells how a micro-batch's
  time moves with its size;
- held out: every adapter at the held-out rate, and the pipeline at a second micro-batch count, measured only
  there. ptbench.comm also runs there, into comm-check/, which the model never reads: it checks the fitted
  alpha-beta at a rate the fit never saw (messages of 1 MiB or more).
Records go to ROOT/link-<R>mbit/; then every held-out point is predicted from the calibration points alone and
the table is printed, its last line `median |err| X %, max Y %, tau Z`. `--from ROOT` only evaluates a folder
an earlier validate wrote. The cluster and the shaping are removed at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.resources
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ptbench.predict.model import fit_comm
from ptbench.predict.points import PredictError, load_comm, load_points
from ptbench.predict.table import held_out, report, write_predictions

MULTI = Path(os.environ.get("SLURM_LOCAL_MULTI", "/var/run/trainbench-slurm-multi"))
VETHS = ("tbv1", "tbv2")
COMMON = (
    "workload=gpt2_tiny",
    "workload.seq_len=32",
    "workload.vocab_size=4096",
    "data=synthetic",
    "data.train_samples=96",
    "data.val_samples=16",
    "trainer.epochs=3",
    "trainer.batch_size=8",
    "trainer.untimed_steps=1",
    "trainer.progress=false",
    "results.experiment=validate",
)
# name -> overrides; the pipeline's second micro-batch count is held out (measured only at the held-out rate)
ADAPTERS = {
    "ddp": ("adapter=ddp",),
    "zero1": ("adapter=zero", "adapter.stage=1"),
    "zero2": ("adapter=zero", "adapter.stage=2"),
    "zero3": ("adapter=zero", "adapter.stage=3"),
    "fsdp": ("adapter=fsdp",),
    "pipeline_m2": ("adapter=pipeline", "adapter.microbatches=2"),
    "megatron_tp2": ("adapter=megatron", "adapter.tensor_parallel=2"),
}
HELD_OUT_ONLY = {"pipeline_m4": ("adapter=pipeline", "adapter.microbatches=4")}
# one rank, no link: a micro-batch's time at the pipeline's two micro-batch sizes (global 8 over m = 2 and 4), which
# the model reads to move the pipeline's compute between micro-batch counts (model.slot_ratio)
ONE_RANK = {f"ddp_1rank_b{b}": ("adapter=ddp", f"trainer.batch_size={b}") for b in (4, 2)}
DEFAULT = "ddp,zero2,fsdp,pipeline_m2,megatron_tp2"
COMM_OPS = "all_reduce,all_gather,reduce_scatter,send_recv"
# global steps 8-9: in the second of 3 epochs of 6 steps (dp=2; megatron at a global batch of 16) and in the first of
# 12 (the pipeline at a global batch of 8), so that two epochs stay clean of the profiler's slowdown
PROFILE = "trainer.profile=8:2"
CHECK = "comm-check"  # the held-out rate's ptbench.comm, beside (not in) the comm/ folder the model reads
BURST = 65536  # tbf's bucket in bytes (`shape`)


def _sh(cmd: list[str], env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        lines = (proc.stderr or proc.stdout or "no output").strip().splitlines()
        ours = [ln for ln in lines if not ln.startswith("srun:")] or lines
        what = next((w for w in cmd if "ptbench" in w or w.endswith(".sh")), cmd[0])
        raise PredictError(f"{what} exited {proc.returncode}: {ours[-1].strip()}")
    return proc


def cluster_script() -> str:
    return str(importlib.resources.files("ptbench.slurm") / "local_cluster.sh")


def preflight() -> None:
    if os.geteuid() != 0:
        raise PredictError("validate needs root (network namespaces, tc, slurmd): run it as root")
    missing = [t for t in ("tc", "srun", "slurmctld", "slurmd", "taskset") if not shutil.which(t)]
    if missing:
        raise PredictError(f"validate needs {', '.join(missing)}: install slurm-wlm and iproute2")
    if (MULTI / "nodes").exists():
        raise PredictError(
            f"a two-node local cluster is up ({MULTI}): stop it with bash slurm/local_cluster.sh stop --nodes 2"
        )


def shape(rate: float, burst: int = BURST) -> None:
    """tbf on each root-side veth: the rate into each node, with the same burst (bucket) at every rate: one that
    grew with the rate (10 ms' worth) let a 1 MiB message through unshaped at 1000 Mbit/s. The bucket is a
    trade-off of the emulated link, which a real link does not have:
    - it lends a message that follows a compute gap its burst at line rate, where ptbench.comm's back-to-back
      messages find it empty, so steps with collectives between compute (megatron's all-reduces between layers)
      run faster than the alpha-beta says;
    - a smaller one bends the collectives' time off 1/rate (a late timer loses tokens), which the fit needs.
    64 KiB is the default: the steps, which are what a user predicts, come closest (128, 64 and 32 KiB measured,
    dated: bench/MEASUREMENTS.md, "Predict: validate"). The queue (latency) holds a second at the rate, so TCP meets
    delay, not drops."""
    for dev in VETHS:
        _sh(
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate:g}mbit",
                "burst",
                str(burst),
                "latency",
                "1000ms",
            ]
        )


def unshape() -> None:
    for dev in VETHS:
        _sh(["tc", "qdisc", "del", "dev", dev, "root"], check=False)


def srun(args: list[str], env: dict, timeout: int, nodes: int = 2) -> None:
    inner = " ".join(args)
    cmd = ["srun", f"-N{nodes}", "--ntasks-per-node=1", "bash", "-c", f"exec taskset -c $SLURM_NODEID {inner}"]
    _sh(cmd, env, timeout)


@dataclass
class Runs:
    """The runs of one validate: each shapes the link to its rate first, and its record goes to link-<R>mbit/."""

    root: Path
    env: dict
    log: Callable[[str], None]
    burst: int = BURST

    def comm(self, rate: float, folder: str) -> None:
        shape(rate, self.burst)
        t0 = time.time()
        out = self.root / f"link-{rate:g}mbit" / folder
        # 30 calls per size: at 10, a 1-2 MiB all-gather under tbf moved 9-14 % from run to run
        srun([sys.executable, "-m", "ptbench.comm", "--ops", COMM_OPS, "--min-bytes", "16K", "--max-bytes", "4M",
              "--iters", "30", "--warmup", "3", "--out", str(out)], self.env, 600)  # fmt: skip
        self.log(f"  comm at {rate:g} Mbit/s ({folder}/): {time.time() - t0:.0f} s")

    def train(self, rate: float, name: str, profile: bool = False) -> None:
        shape(rate, self.burst)
        mine = {**ADAPTERS, **HELD_OUT_ONLY, **ONE_RANK}[name]
        common = [c for c in COMMON if c.split("=")[0] not in {o.split("=")[0] for o in mine}]
        over = [*mine, *common, f"results.root={self.root / f'link-{rate:g}mbit'}", *([PROFILE] if profile else [])]
        t0 = time.time()
        srun([sys.executable, "-m", "ptbench", "launcher=slurm", *over], self.env, 600, 1 if name in ONE_RANK else 2)
        self.log(f"  {name} at {rate:g} Mbit/s{' (profiled)' if profile else ''}: {time.time() - t0:.0f} s")


def measure(
    root: Path, rates: list[float], held: float, names: list[str], log, repeats: int = 1, burst: int = BURST
) -> None:
    """Each adapter's runs back to back (its calibration and held-out rates), so that a slow spell of a shared
    machine falls on both rather than on one side."""
    preflight()
    env = {
        **os.environ,
        "SLURM_CONF": str(MULTI / "etc/slurm.conf"),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    env.pop("SLURM_JOB_ID", None)
    runs = Runs(root, env, log, burst)
    _sh(["bash", cluster_script(), "start", "--nodes", "2"], timeout=300)
    try:
        cal = sorted(r for r in rates if r != held)
        for i in range(repeats):  # ptbench.comm repeated too: 1 MiB under tbf moves ~10 % from run to run
            again = f"repeat-{i + 1}/" if i else ""
            for rate in cal:
                runs.comm(rate, f"{again}comm")
            runs.comm(held, f"{again}{CHECK}")  # never read by the model: its alpha-beta at a rate it never saw
        for name in names:
            for _ in range(repeats):  # repeats interleaved: calibration, held out, calibration, held out, ...
                for rate in cal if name == "ddp" else cal[-1:]:  # DDP: every calibration rate; the others profiled
                    runs.train(rate, name, profile=name != "ddp")
                runs.train(held, name)
                if name == "pipeline_m2":
                    runs.train(held, "pipeline_m4")
                    for one in ONE_RANK:  # beside the pipeline's runs: the same spell of the machine
                        runs.train(cal[-1], one)
    finally:
        unshape()
        _sh(["bash", cluster_script(), "stop", "--nodes", "2"], timeout=120, check=False)


def comm_check(root: Path, held: float, fits: dict) -> list[str]:
    """The fitted alpha-beta against ptbench.comm at the held-out rate, messages of 1 MiB or more: against the
    mean of the check's repeats, with their run-to-run noise (half range) beside it."""
    from statistics import fmean

    from ptbench.predict.points import load_comm as load

    times: dict[tuple[int, str, int], list[float]] = {}
    for rep in load(root, CHECK):
        for r in rep.rows:
            if r["bytes"] >= 1 << 20:
                times.setdefault((rep.world_size, r["op"], int(r["bytes"])), []).append(float(r["time_s"]))
    lines = []
    for n in sorted({k[0] for k in times}):
        for op in COMM_OPS.split(","):
            fit, sizes = fits.get((op, n)), sorted(s for m, o, s in times if (m, o) == (n, op))
            if fit is None or not sizes:
                continue
            errs = []
            for size in sizes:
                ts = times[(n, op, size)]
                noise = f" (noise {50 * (max(ts) - min(ts)) / fmean(ts):.1f} %)" if len(ts) > 1 else ""
                errs.append(f"{size >> 20} MiB {(fit.time(size, held) / fmean(ts) - 1) * 100:+.1f} %{noise}")
            lines.append(f"  alpha-beta at {held:g} Mbit/s (held out), {op}: {', '.join(errs)}")
    return lines


def evaluate(root: Path, held: float) -> list[str]:
    points = load_points(root)
    cal = [p for p in points if p.link is not None and p.link != held]
    targets = [p for p in points if p.link == held]
    reports = [r for r in load_comm(root) if r.link != held]
    if not cal or not targets or not reports:
        raise PredictError(
            f"{root}: needs calibration points and comm reports at other rates and points at {held:g} Mbit/s "
            f"(found {len(cal)}, {len(reports)}, {len(targets)}): run python -m ptbench.predict validate"
        )
    preds, skipped = held_out(cal, targets, reports, str(root))
    if not preds:
        raise PredictError(f"no held-out point could be predicted: {skipped[0][1]}")
    write_predictions(root, "validate", preds, measured=True)
    lines = report(preds, skipped)
    tail = 2 if len(lines) > 1 and lines[-2].startswith("contention:") else 1  # its line stays above the summary
    return [*lines[:-tail], *comm_check(root, held, fit_comm(reports)), *lines[-tail:]]


def _log(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptbench.predict validate", description=__doc__)
    ap.add_argument("--rates", default="100,300,1000", help="link rates in Mbit/s (default 100,300,1000)")
    ap.add_argument("--held-out", type=float, default=300.0, help="the rate held out (default 300)")
    ap.add_argument("--adapters", default=DEFAULT, help=f"of {', '.join(ADAPTERS)} (default {DEFAULT})")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="ptbench.comm and each adapter's runs this many times, interleaved (default 1)",
    )
    ap.add_argument("--burst", type=int, default=BURST, help=f"tbf's bucket in bytes (default {BURST}; see shape)")
    ap.add_argument("--root", help="where the records go (default results/predict-validate-<time>)")
    ap.add_argument("--from", dest="from_root", help="only evaluate the records an earlier validate wrote here")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.from_root:
        root = Path(args.from_root)
    else:
        try:
            rates = [float(r) for r in args.rates.split(",")]
        except ValueError:
            raise PredictError(f"--rates {args.rates!r}: give numbers in Mbit/s, e.g. 100,300,1000") from None
        names = [n.strip() for n in args.adapters.split(",")]
        if bad := [n for n in names if n not in ADAPTERS]:
            raise PredictError(f"--adapters: unknown {', '.join(bad)}; known: {', '.join(ADAPTERS)}")
        if args.held_out not in rates or len(rates) < 3 or "ddp" not in names:
            raise PredictError("validate needs three or more --rates including --held-out, and ddp among --adapters")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = Path(args.root or f"results/predict-validate-{stamp}").resolve()
        print(f"# validate: records under {root}", flush=True)
        measure(root, rates, args.held_out, names, _log, max(args.repeats, 1), args.burst)
    lines = evaluate(root, args.held_out)
    print(f"# held out: {args.held_out:g} Mbit/s; calibrated on the other rates (comm + ddp) and each adapter once")
    print("\n".join(lines[:-1]))
    print(f"# run time {time.time() - t0:.0f} s ({datetime.date.today().isoformat()})")
    print(lines[-1])
    return 0
