"""Harness overhead: the same model, data and DDP setup, stepped by a bare hand-written loop and by
the harness's trainer (phase timers, NVTX, loss bookkeeping, stop agreement, watchdog), in
interleaved blocks inside one run so both see the same machine state.

    python -m ptbench.studies.overhead                    # gpt2_tiny, synthetic data, 2 ranks
    python -m ptbench.studies.overhead --blocks 8 --steps 10 workload=resnet50_tiny
    python -m ptbench.studies.overhead --models           # harness GPT-2 vs Megatron's GPT (and HF's), then data shares
    python -m ptbench.studies.overhead --data-shares --variants   # data shares only, plus each vision input option
    python -m ptbench.studies.overhead --whole-run --pairs 6      # whole `python -m ptbench` runs vs a bare DDP program

Prints the per-block step times and the ratio harness/bare (goal <= 1.02), plus the time from
launch to the first finished step of a normal `python -m ptbench` run when `--startup` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def bare_step(workload, model, opt, x, y, device) -> None:
    """One step of a hand-written loop, as a user writes it without a harness: both bare loops take it."""
    x, y = x.to(device), y.to(device)
    workload.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _compose(overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    from ptbench.runner.compose import compose, typed

    return OmegaConf.to_container(typed(compose(overrides)), resolve=True)


def _rank(rank: int, cfg_dict: dict, world: int, port: int, blocks: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ptbench.adapters.ddp import DDPAdapter
    from ptbench.core.dist import DistContext, init_process_group, set_cpu_threads
    from ptbench.core.optim import build_optimizer
    from ptbench.runner.compose import typed
    from ptbench.runner.plan import make_plan
    from ptbench.runner.trainer import Trainer
    from ptbench.workloads import build_workload

    cfg = typed(cfg_dict)
    cfg.trainer.progress = False
    set_cpu_threads(1)
    ctx = DistContext(
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        master_port=port,
        backend="nccl" if torch.cuda.is_available() else "gloo",
    )
    init_process_group(ctx, 300)
    device = ctx.device
    workload = build_workload(cfg.workload, cfg.data)
    train_set, _ = workload.datasets(local_rank=rank)
    batch = cfg.trainer.batch_size

    def endless_loader():
        sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.trainer.seed, drop_last=True)
        loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True)
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    # the bare loop: what a user writes by hand
    torch.manual_seed(cfg.trainer.seed)
    bare_model = DDP(workload.build_model().to(device))
    bare_opt = build_optimizer(bare_model.parameters(), cfg.optimizer)
    bare_data = endless_loader()

    def bare_steps(n: int) -> None:
        for _ in range(n):
            bare_step(workload, bare_model, bare_opt, *next(bare_data), device)

    # the harness: the real adapter and the trainer's hot loop
    torch.manual_seed(cfg.trainer.seed)
    adapter = DDPAdapter(cfg, workload, ctx)
    adapter.setup()
    trainer = Trainer(cfg, make_plan(cfg, "local", world, check=False), ctx, adapter, workload, record=None)
    harness_data = endless_loader()

    def timed(fn) -> float:
        dist.barrier()
        if ctx.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if ctx.is_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    timed(lambda: bare_steps(steps))  # warm-up, excluded
    timed(lambda: trainer.train_steps(harness_data, steps))
    rows = []
    for b in range(blocks):  # alternate the order so neither always runs first
        pair = [("bare", lambda: bare_steps(steps)), ("harness", lambda: trainer.train_steps(harness_data, steps))]
        if b % 2:
            pair.reverse()
        rows.append({name: timed(fn) for name, fn in pair})
    if rank == 0:
        data_share = [s["data"] / s["step"] for s in trainer.timer.steps]
        with open(out, "w") as f:
            import json

            json.dump({"rows": rows, "data_share": statistics.mean(data_share)}, f)
    dist.destroy_process_group()


def measure_startup(overrides: list[str]) -> float:
    """Seconds from `python -m ptbench` starting to its first finished step (from the run's record)."""

    from ptbench.run_point import run_bench

    with tempfile.TemporaryDirectory() as tmp:
        run = run_bench(["experiment=smoke", *overrides], root=Path(tmp), experiment="startup", timeout=600)
        if not run.ok:
            raise SystemExit(f"error: the startup run failed: {run.error_line}")
        return run.summary["startup_s"]


# the bundled CPU workloads, each on its default data (ImageFolder JPEGs where BENCH_DATA_ROOT has them)
DATA_SHARE_POINTS = {
    "gpt2_tiny (synthetic)": ["workload=gpt2_tiny", "data=synthetic"],
    "gpt2_tiny (wikitext2)": ["workload=gpt2_tiny", "data=wikitext2"],
    "resnet50_tiny (cifar10 JPEG)": ["workload=resnet50_tiny", "data=cifar10"],
    "vgg16_tiny (cifar10 JPEG)": ["workload=vgg16_tiny", "data=cifar10"],
}
# --data-shares --variants: the vision input pipeline's options one by one (data.decoder, data.cache_decoded;
# conf/data/cifar10.yaml turns the RAM cache on, so the row above is the cached one)
DATA_SHARE_VARIANTS = {
    "resnet50_tiny (JPEG, PIL)": [
        "workload=resnet50_tiny",
        "data=cifar10",
        "data.decoder=pil",
        "data.cache_decoded=false",
    ],
    "resnet50_tiny (JPEG, torchvision)": [
        "workload=resnet50_tiny",
        "data=cifar10",
        "data.decoder=torchvision",
        "data.cache_decoded=false",
    ],
    "resnet50_tiny (JPEG, RAM cache)": ["workload=resnet50_tiny", "data=cifar10", "data.cache_decoded=true"],
}


def data_shares(nprocs: int, steps: int = 12, warmup: int = 2, points: dict | None = None) -> str:
    """Share of the step spent loading data (after warm-up), per bundled workload, from real runs."""

    from ptbench.run_point import run_bench

    lines = [
        f"data loading share of the step, {nprocs} rank(s), {steps} steps ({warmup} warm-up excluded)",
        f"{'workload':<34} {'data share':>10} {'workers':>8} {'step s':>8}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in (points or DATA_SHARE_POINTS).items():
            run = run_bench(
                [
                    *overrides,
                    f"launcher.nprocs={nprocs}",
                    "trainer.epochs=1",
                    f"trainer.max_steps={steps}",
                    f"trainer.untimed_steps={warmup}",
                    "trainer.eval_every_epoch=false",
                    "trainer.progress=false",
                ],
                root=Path(tmp),
                experiment="data-share",
                timeout=900,
            )
            if not run.ok:
                lines.append(f"{name:<34} {run.status}: {run.error_line[:70]}")
                continue
            s = run.summary
            ev = json.loads((run.run_dir / "events.jsonl").read_text().splitlines()[0])
            lines.append(
                f"{name:<34} {100 * ev['data_share']:9.1f}% {s['data_workers']:>8} {s['step_time_mean_s']:8.4f}"
            )
    return "\n".join(lines)


# --- --whole-run: a real `python -m ptbench` run against a bare hand-written DDP program ---------------------
# The interleaved blocks above cannot see what a real run has beside its loop (the launcher and its contention
# sampler, each rank's helper threads, the record). Here both sides are whole programs, each in its own
# processes: the harness run with its record in a temporary folder; the bare loop as N ranks of
# torch.multiprocessing (gloo on CPU) with the same model, loss, optimizer, DDP bucket size, batch, data and
# CPU threads. Compared: the mean timed step time after the untimed steps, each step's time being its slowest
# rank's: the record's step_time_mean_s vs the bare loop's own host-clock timing (data fetch to optimizer
# step, synchronized on CUDA), per rank, slowest per step, as the trainer does. The ratio's 95 % interval:
# Welch's t on the logs of the runs' step times (the two sides' variances may differ).

# what the whole run is: gpt2_tiny on synthetic data, no evaluation (the bare loop has none); the steps,
# untimed steps, ranks and batch come from the command line
RUN_OVERRIDES = [
    "workload=gpt2_tiny",
    "data=synthetic",
    "trainer.epochs=1",
    "trainer.eval_every_epoch=false",
    "trainer.progress=false",
]


def run_overrides(steps: int, untimed: int, nprocs: int, batch: int, extra: list[str]) -> list[str]:
    """The overrides of both sides: enough synthetic samples that `steps` fit in one epoch."""
    samples = (steps + 2) * nprocs * batch
    return [
        *RUN_OVERRIDES,
        f"data.train_samples={samples}",
        f"launcher.nprocs={nprocs}",
        f"trainer.batch_size={batch}",
        f"trainer.max_steps={steps}",
        f"trainer.untimed_steps={untimed}",
        *extra,
    ]


def harness_step_time(overrides: list[str], entry: list[str], timeout: float = 900) -> tuple[float, dict]:
    """One whole `python <entry> <overrides>` run (entry: `-m ptbench`); its record's step_time_mean_s and
    the record's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, *entry, *overrides, f"results.root={tmp}", "results.experiment=overhead-whole"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        found = sorted(Path(tmp).glob("overhead-whole/*/summary.json"))
        summary = json.loads(found[0].read_text()) if found else {}
        if proc.returncode or summary.get("status") != "ok":
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"error: the harness run failed (exit {proc.returncode}): {tail[0]}")
        return summary["step_time_mean_s"], summary


def bare_step_time(overrides: list[str], timeout: float = 900) -> dict:
    """One bare loop in its own processes (`python -m ptbench.studies.overhead --bare`): its mean timed step
    (`step_time_mean_s`, slowest rank per step) and rank 0's own (`rank0_step_time_mean_s`)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "ptbench.studies.overhead", "--bare", out.name, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"error: the bare loop failed (exit {proc.returncode}): {tail[0]}")
        return json.loads(Path(out.name).read_text())


def log_ratio_interval(harness: list[float], bare: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """exp(mean log harness - mean log bare) and its `level` interval by Welch's t on the logs; the interval is
    (nan, nan) with fewer than 2 runs a side."""
    from scipy import stats

    lh, lb = [math.log(v) for v in harness], [math.log(v) for v in bare]
    diff = statistics.mean(lh) - statistics.mean(lb)
    if min(len(lh), len(lb)) < 2:
        return math.exp(diff), math.nan, math.nan
    vh, vb = statistics.variance(lh) / len(lh), statistics.variance(lb) / len(lb)
    se = math.sqrt(vh + vb)
    if se == 0:
        return math.exp(diff), math.exp(diff), math.exp(diff)
    df = (vh + vb) ** 2 / (vh**2 / (len(lh) - 1) + vb**2 / (len(lb) - 1))
    t = stats.t.ppf(0.5 + level / 2, df)
    return math.exp(diff), math.exp(diff - t * se), math.exp(diff + t * se)


def whole_run(
    pairs: int, steps: int, untimed: int, nprocs: int, batch: int, extra: list[str], entry: list[str] | None = None
) -> dict:
    """`pairs` pairs of (harness run, bare run), alternating which goes first, each printed as it ends; then the
    ratio line. Returns the step times and the ratio with its interval."""
    overrides = run_overrides(steps, untimed, nprocs, batch, extra)
    entry = entry or ["-m", "ptbench"]
    print(
        f"whole run: `python {' '.join(entry)}` vs a bare DDP loop, each in its own processes; gpt2_tiny, synthetic "
        f"data, {nprocs} rank(s), batch {batch}/rank, {steps} steps ({untimed} untimed), no evaluation"
        f"{''.join(f', {o}' for o in extra)}; {pairs} pair(s), alternating order",
        flush=True,
    )
    print("compared: mean timed step time (slowest rank per step): the record's step_time_mean_s vs the bare loop's")
    harness, bare = [], []
    for i in range(pairs):
        order = ["harness", "bare"] if i % 2 == 0 else ["bare", "harness"]
        got = {}
        for side in order:
            print(f"pair {i + 1}/{pairs}: {side} run ...", flush=True)
            t0 = time.perf_counter()
            note = ""
            if side == "harness":
                got[side] = harness_step_time(overrides, entry)[0]
            else:
                row = bare_step_time(overrides)
                got[side] = row["step_time_mean_s"]
                note = f", rank 0 alone {row['rank0_step_time_mean_s']:.4f}"
            took = time.perf_counter() - t0
            print(f"pair {i + 1}/{pairs}: {side} {got[side]:.4f} s/step{note} ({took:.0f}s)", flush=True)
        harness.append(got["harness"])
        bare.append(got["bare"])
        print(
            f"pair {i + 1}/{pairs} ({' first, '.join(order)} second): harness {got['harness']:.4f}  bare "
            f"{got['bare']:.4f}  ratio {got['harness'] / got['bare']:.4f}",
            flush=True,
        )
    ratio, lo, hi = log_ratio_interval(harness, bare)
    interval = "95 % interval needs >= 2 pairs" if math.isnan(lo) else f"95 % interval [{lo:.3f}, {hi:.3f}]"
    spread = (
        f"pair ratios {min(h / b for h, b in zip(harness, bare)):.3f}-{max(h / b for h, b in zip(harness, bare)):.3f}"
    )
    print(
        f"whole-run ratio harness/bare = {ratio:.4f}, {interval} (Welch on logs); {spread}; goal <= 1.02, upper <= 1.05"
    )
    return {"harness": harness, "bare": bare, "ratio": ratio, "low": lo, "high": hi}


# --- the bare loop: what a user writes by hand ------------------------------------------------------------
def _bare_rank(rank: int, cfg_dict: dict, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ptbench.core.dist import cpu_threads
    from ptbench.core.optim import build_optimizer
    from ptbench.runner.compose import typed
    from ptbench.workloads import build_workload

    cfg = typed(cfg_dict)
    torch.set_num_threads(cpu_threads(cfg.launcher.threads_per_rank))  # the harness's threads per rank
    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t = cfg.trainer
    torch.manual_seed(t.seed)
    workload = build_workload(cfg.workload, cfg.data)
    train_set, _ = workload.datasets(local_rank=rank)
    model = DDP(
        workload.build_model().to(device),
        device_ids=[rank] if cuda else None,
        bucket_cap_mb=cfg.adapter.bucket_cap_mb,
        gradient_as_bucket_view=cfg.adapter.gradient_as_bucket_view,
    )
    opt = build_optimizer(model.parameters(), cfg.optimizer)
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=t.seed, drop_last=True)
    loader = iter(DataLoader(train_set, batch_size=t.batch_size, sampler=sampler, drop_last=True))
    times = []
    for _ in range(t.max_steps):
        t0 = time.perf_counter()
        bare_step(workload, model, opt, *next(loader), device)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    every = [None] * world
    dist.all_gather_object(every, times[t.untimed_steps :])
    if rank == 0:  # also rank 0's own mean: a loop that times one rank only reads low by the ranks' spread
        slowest = [max(step) for step in zip(*every)]
        row = {"step_time_mean_s": statistics.mean(slowest), "rank0_step_time_mean_s": statistics.mean(every[0])}
        Path(out).write_text(json.dumps({**row, "steps": len(slowest)}))
    dist.destroy_process_group()


def bare_main(out: str, overrides: list[str]) -> int:
    """The bare loop's own program: compose the same config as the harness, start its ranks, wait."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from ptbench.core.dist import free_port
    from ptbench.runner.compose import compose, typed

    cfg = OmegaConf.to_container(typed(compose(overrides)), resolve=True)
    method = "spawn" if torch.cuda.is_available() else "fork"  # as the harness's launcher.start_method=auto
    nprocs = cfg["launcher"]["nprocs"]
    mp.start_processes(_bare_rank, args=(cfg, nprocs, free_port(), out), nprocs=nprocs, start_method=method)
    return 0


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="steps per block (10); --whole-run: steps per run (45)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--startup", action="store_true", help="also measure launch-to-first-step of `python -m ptbench`")
    p.add_argument(
        "--models",
        action="store_true",
        help="instead: the harness GPT-2, Megatron's GPT and Hugging Face's GPT-2 of one size stepped in "
        "interleaved blocks (bench/studies/model_speed.py), then the data-loading share per bundled workload",
    )
    p.add_argument(
        "--data-shares",
        action="store_true",
        help="instead: only the data-loading share per bundled workload (the second part of --models)",
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="with --data-shares: resnet50_tiny's input pipeline per option (PIL, torchvision, RAM cache)",
    )
    p.add_argument(
        "--whole-run",
        action="store_true",
        help="instead: whole `python -m ptbench` runs against a bare DDP loop in its own processes, in --pairs "
        "pairs of alternating order (whole_run below)",
    )
    p.add_argument("--pairs", type=int, default=6, help="with --whole-run: pairs of runs")
    p.add_argument("--untimed", type=int, default=5, help="with --whole-run: untimed warm-up steps per run")
    p.add_argument("--batch", type=int, default=8, help="with --whole-run: batch per rank")
    p.add_argument(
        "--harness-entry",
        default="-m ptbench",
        help="with --whole-run: what python runs as the harness (a script that switches something off, to "
        "measure its cost); default `-m ptbench`",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=resnet50_tiny")
    args = p.parse_args(argv)
    if args.whole_run:
        whole_run(
            args.pairs, args.steps or 45, args.untimed, args.nprocs, args.batch, args.overrides,
            args.harness_entry.split(),
        )  # fmt: skip
        return 0
    args.steps = args.steps or 10
    if args.data_shares:
        print(data_shares(args.nprocs, points={**DATA_SHARE_POINTS, **DATA_SHARE_VARIANTS} if args.variants else None))
        return 0
    if args.models:
        from ptbench.studies.model_speed import main as model_speed

        code = model_speed(["--blocks", str(max(args.blocks, 5))])
        print()
        print(data_shares(args.nprocs))
        return code
    cfg = _compose(args.overrides)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.start_processes(
            _rank,
            args=(cfg, args.nprocs, free_port(), args.blocks, args.steps, out.name),
            nprocs=args.nprocs,
            start_method="spawn",
        )
        import json

        result = json.load(open(out.name))
    rows = result["rows"]
    print(
        f"{cfg['workload']['name']} on {args.nprocs} rank(s), batch {cfg['trainer']['batch_size']}/rank, "
        f"{args.blocks} blocks x {args.steps} steps (1 warm-up block each excluded)"
    )
    print("block  bare s/step  harness s/step  ratio")
    for i, r in enumerate(rows):
        print(f"{i:5d}  {r['bare']:11.4f}  {r['harness']:14.4f}  {r['harness'] / r['bare']:.4f}")
    bare = statistics.median(r["bare"] for r in rows)
    harness = statistics.median(r["harness"] for r in rows)
    print(
        f"median step time: bare {bare:.4f}s, harness {harness:.4f}s, ratio harness/bare = {harness / bare:.4f} (goal <= 1.02)"
    )
    print(f"data loading share of harness step time: {100 * result['data_share']:.1f}%")
    if args.startup:
        print(f"startup, launch to first finished step: {measure_startup(args.overrides):.1f}s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:  # the bare side of --whole-run, in its own processes
        sys.exit(bare_main(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
