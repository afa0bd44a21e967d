"""Harness overhead: the same model, data and DDP setup, stepped by a bare hand-written loop and by
the harness's trainer (phase timers, NVTX, loss bookkeeping, stop agreement, watchdog), in
interleaved blocks inside one run so both see the same machine state.

    python -m ptbench.overhead                    # gpt2_tiny, synthetic data, 2 ranks
    python -m ptbench.overhead --blocks 8 --steps 10 workload=resnet50_tiny
    python -m ptbench.overhead --models           # harness GPT-2 vs Megatron's GPT (and HF's), then data shares
    python -m ptbench.overhead --data-shares --variants   # data shares only, plus each vision input option

Prints the per-block step times and the ratio harness/bare (goal <= 1.02), plus the time from
launch to the first finished step of a normal `python -m ptbench` run when `--startup` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


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
            x, y = next(bare_data)
            x, y = x.to(device), y.to(device)
            loss = workload.loss(bare_model(x), y)
            loss.backward()
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=False)

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
    from pathlib import Path

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
    from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--startup", action="store_true", help="also measure launch-to-first-step of `python -m ptbench`")
    p.add_argument(
        "--models",
        action="store_true",
        help="instead: the harness GPT-2, Megatron's GPT and Hugging Face's GPT-2 of one size stepped in "
        "interleaved blocks (bench/model_speed.py), then the data-loading share per bundled workload",
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
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=resnet50_tiny")
    args = p.parse_args(argv)
    if args.data_shares:
        print(data_shares(args.nprocs, points={**DATA_SHARE_POINTS, **DATA_SHARE_VARIANTS} if args.variants else None))
        return 0
    if args.models:
        from ptbench.model_speed import main as model_speed

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
    sys.exit(main())
