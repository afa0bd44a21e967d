"""`make smoke` / `python -m ptbench.smoke [--world-size N] [ADAPTER ...]`: every installed adapter for a
few steps on the devices there are, one line each.

N defaults to the visible GPUs (a one-GPU CI runner: 1), or 2 on a CPU-only machine. Each adapter
runs at the largest world size <= N that its layout allows (`Adapter.smoke_overrides`; at N=1:
ddp, zero, fsdp, megatron TP=1, tensor_parallel 1, gpipe with one partition, horovod 1); an adapter
that cannot run at any size <= N is *skipped with its reason*, as is one whose framework is not
installed — except under CI=true, where a missing framework, and any skip, is a failure (CI installs them
all and sizes the runner for every adapter; a Gloo-only Horovod build on a GPU machine is such a skip).
`--require-cuda` (the GPU CI) fails in one line unless torch sees a GPU: no silent CPU fallback; nor
without it on a host where nvidia-smi lists GPUs that torch cannot see (the line names why).
Exit 1 only on a real failure. Each run has a timeout (--timeout) that ends its launcher and ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ptbench.adapters import available, get_adapter_class
from ptbench.adapters.base import framework_importable
from ptbench.core.errors import ConfigError
from ptbench.run_point import run_bench
from ptbench.runner.compose import compose, typed, visible_gpus
from ptbench.runner.plan import make_plan


def framework_installed(cls) -> bool:
    return framework_importable(cls.framework_module)


def in_ci() -> bool:
    """CI set to 1/true/yes/on (any case): the rule tests/conftest.py's require_or_skip follows."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def smoke_point(name: str, world_size: int, root: Path) -> tuple[list[str] | None, str]:
    """The overrides of the largest valid smoke run of `name` on <= world_size devices, or (None, why)."""
    cls = get_adapter_class(name)
    why = ""
    for devices in range(world_size, 0, -1):
        overrides = ["experiment=smoke", f"adapter={name}", *cls.smoke_overrides(devices)]
        try:
            make_plan(typed(compose([*overrides, f"results.root={root}"])), "local")
            return overrides, ""
        except ConfigError as e:
            why = why or str(e)
    return None, f"cannot run on <= {world_size} device(s): {why}"


def run_one(name: str, world_size: int, root: Path, timeout: float) -> tuple[str, str]:
    cls = get_adapter_class(name)
    if not framework_installed(cls):
        reason = f"{cls.framework} not installed"
        return ("FAILED", f"{reason} (CI=true: CI must install every framework)") if in_ci() else ("skipped", reason)
    overrides, why = smoke_point(name, world_size, root)
    if overrides is None:
        return ("FAILED", f"{why} (CI=true: a skip is a failure)") if in_ci() else ("skipped", why)
    run = run_bench(
        overrides, root=root, experiment=f"smoke-{name}", timeout=timeout, run_name=(name, "smoke", world_size)
    )
    if not run.ok:
        return "FAILED", f"{run.status}: {run.error_line} ({run.wall_s:.0f}s)"
    s = run.summary
    return "ok", (
        f"{s['workload']} x{s['devices']} device(s)  step {s['step_time_mean_s']:.4f}s  "
        f"loss {s['train_loss']:.3f}  ({run.wall_s:.0f}s)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("adapters", nargs="*", help=f"adapters to run (default: all of {', '.join(available())})")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="devices to use at most (default: the visible GPUs, or 2 on a CPU-only machine)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per adapter before its run is ended")
    p.add_argument(
        "--require-cuda", action="store_true", help="fail in one line unless torch sees a GPU (the GPU CI's flag)"
    )
    args = p.parse_args(argv)
    from ptbench.core.environments import cuda_error, unseen_gpus_line

    error = cuda_error() if args.require_cuda else None
    unseen = None if error else unseen_gpus_line()  # a GPU host must not pass its smoke on CPU ranks
    if error or unseen:
        print(error or f"error: {unseen}", file=sys.stderr)
        return 2
    world = args.world_size or visible_gpus() or 2
    names = args.adapters or available()
    unknown = [n for n in names if n not in available()]
    if unknown or world < 1:
        print(
            f"error: unknown adapter(s) {', '.join(unknown)}: choose from {', '.join(available())}"
            if unknown
            else f"error: --world-size={world} must be >= 1",
            file=sys.stderr,
        )
        return 2
    counts = {"ok": 0, "skipped": 0, "FAILED": 0}
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        for name in names:
            status, detail = run_one(name, world, Path(tmp), args.timeout)
            counts[status] += 1
            print(f"smoke {name:<16} {status:<8} {detail}", flush=True)
    print(
        f"smoke (world size <= {world}): {counts['ok']} passed, {counts['skipped']} skipped, {counts['FAILED']} failed"
    )
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
