"""`make gpu-check` / `python -m ptbench.gpu_check`: for anyone with a GPU, the one-GPU smoke, then one short
bf16 run of gpt2_small and resnet50 per installed adapter on the visible GPUs, as a table (status,
step time, tokens or images per second, MFU, peak device memory).

Warm-up steps are excluded from the step statistics (trainer.untimed_steps); data is synthetic, so
the table measures the frameworks, not storage.

CUDA is required (one line naming a driver/CUDA mismatch otherwise: torch.version.cuda against the
driver's CUDA from nvidia-smi); `--assert-cuda` only checks that (the GPU CI's first step). Under CI=true a
skipped adapter is a failure (a missing framework, a layout that cannot run, a Gloo-only Horovod build on
GPUs). Sized for the GPU CI: the whole check stops starting runs after --budget seconds (default 540, under
10 minutes on one GPU); a run not started for the budget is a failure. With 2 GPUs every adapter runs its
largest layout on both (pipeline stages, tensor parallelism across the devices: the cross-device paths).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptbench.adapters import available, get_adapter_class
from ptbench.run_point import run_bench
from ptbench.runner.compose import visible_gpus
from ptbench.smoke import framework_installed, in_ci, smoke_point
from ptbench.smoke import main as smoke_main

WORKLOADS = {"gpt2_small": "language", "resnet50": "vision"}
COMMON = [
    "data=synthetic",
    "trainer.precision=bf16",
    "trainer.epochs=1",
    "trainer.max_steps=12",
    "trainer.untimed_steps=4",
    "trainer.eval_every_epoch=false",
    "trainer.batch_size=8",
    "data.train_samples=2048",
    "trainer.progress=false",
]


def nvidia_smi_versions(run=None) -> tuple[str | None, str | None]:
    """(driver version, newest CUDA the driver supports) from nvidia-smi's header; (None, None) without it.
    `run() -> stdout` is injectable (tests feed recorded output)."""
    if run is None:
        if not shutil.which("nvidia-smi"):
            return None, None

        def run():
            return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout

    try:
        out = run()
    except (OSError, subprocess.SubprocessError):
        return None, None
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def cuda_error_line(
    available: bool, torch_version: str, torch_cuda: str | None, driver: str | None, driver_cuda: str | None
) -> str | None:
    """None when torch sees a GPU, else the one line saying why not and the fix."""
    if available:
        return None
    head = f"error: CUDA required but torch.cuda.is_available() is False (torch {torch_version}"
    if torch_cuda is None:
        return f"{head}, a CPU-only build: torch.version.cuda is None); install a CUDA build of torch"
    if driver is None:
        return f"{head} built for CUDA {torch_cuda}): nvidia-smi finds no NVIDIA driver; run on a GPU node"
    if driver_cuda and _version(driver_cuda) < _version(torch_cuda):
        return (
            f"{head}): driver/CUDA mismatch: torch.version.cuda={torch_cuda} but driver {driver} supports CUDA "
            f"<= {driver_cuda}; install a torch build for CUDA <= {driver_cuda} or a driver for CUDA {torch_cuda}"
        )
    return (
        f"{head}, torch.version.cuda={torch_cuda}, driver {driver} supports CUDA {driver_cuda}): no device visible "
        "to torch; check CUDA_VISIBLE_DEVICES and the runner's GPU binding (docker --gpus)"
    )


def cuda_error() -> str | None:
    """`cuda_error_line` for this machine (nvidia-smi asked only when torch sees no GPU)."""
    import torch

    if torch.cuda.is_available():
        return None
    return cuda_error_line(False, torch.__version__, torch.version.cuda, *nvidia_smi_versions())


def cuda_ok_line() -> str:
    import torch

    driver, driver_cuda = nvidia_smi_versions()
    return (
        f"cuda: torch {torch.__version__} built for CUDA {torch.version.cuda}, driver {driver} (CUDA {driver_cuda}), "
        f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"
    )


def ci_skip_fails(r: list[str]) -> list[str]:
    """Under CI=true a skipped row is a failure."""
    if r[2] == "skipped" and in_ci():
        return [r[0], r[1], "FAILED", f"{r[3]} (CI=true: a skip is a failure)", *r[4:]]
    return r


def row(adapter: str, workload: str, gpus: int, root: Path, timeout: float) -> list[str]:
    cls = get_adapter_class(adapter)
    if WORKLOADS[workload] not in cls.kinds:
        return [adapter, workload, "n/a", f"adapter supports {', '.join(cls.kinds)}", "", "", "", ""]
    if not framework_installed(cls):
        return [adapter, workload, "skipped", f"{cls.framework} not installed", "", "", "", ""]
    overrides, why = smoke_point(adapter, gpus, root)
    if overrides is None:
        return [adapter, workload, "skipped", why[:60], "", "", "", ""]
    layout = [o for o in overrides if o.startswith(("launcher.", "adapter."))]
    run = run_bench(
        [f"adapter={adapter}", f"workload={workload}", *COMMON, *layout],
        root=root,
        experiment="gpu-check",
        timeout=timeout,
        run_name=(adapter, workload, gpus),
    )
    s = run.summary
    if not run.ok:
        return [adapter, workload, run.status, run.error_line[:60], "", "", "", ""]
    rate = s.get("tokens_per_s") if WORKLOADS[workload] == "language" else s.get("samples_per_s")
    unit = "tok/s" if WORKLOADS[workload] == "language" else "img/s"
    mfu = s.get("mfu")
    peak = (s.get("peak_memory_max") or 0) / 2**30
    return [
        adapter,
        workload,
        "ok",
        " ".join(layout),
        f"{s['step_time_mean_s'] * 1e3:.1f} ms",
        f"{rate:,.0f} {unit}",
        "-" if mfu is None else f"{100 * mfu:.1f}%",
        f"{peak:.1f} GiB",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default=",".join(available()))
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--skip-smoke", action="store_true")
    p.add_argument("--budget", type=float, default=540, help="seconds after which no further run starts")
    p.add_argument("--assert-cuda", action="store_true", help="only check that torch sees a GPU, in one line")
    args = p.parse_args(argv)
    error = cuda_error()
    if error:
        print(f"{error} (on a CPU machine use make smoke)", file=sys.stderr)
        return 2
    print(cuda_ok_line(), flush=True)
    if args.assert_cuda:
        return 0
    gpus = visible_gpus()
    deadline = time.monotonic() + args.budget
    code = 0 if args.skip_smoke else smoke_main(["--world-size", "1", "--timeout", str(min(args.timeout, 300))])
    header = ["adapter", "workload", "status", "layout / reason", "step", "throughput", "MFU", "peak mem"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-check-") as tmp:
        for adapter in args.adapters.split(","):
            for workload in WORKLOADS:
                left = deadline - time.monotonic()
                if left < 30:
                    r = [adapter, workload, "FAILED", f"not started: --budget={args.budget:.0f}s spent", *[""] * 4]
                else:
                    r = ci_skip_fails(row(adapter, workload, gpus, Path(tmp), min(args.timeout, left)))
                rows.append(r)
                print("  ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\ngpu-check on {gpus} GPU(s), bf16, synthetic data, {COMMON[4].split('=')[1]} warm-up steps excluded")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    failed = [r for r in rows if r[2] not in ("ok", "skipped", "n/a")]
    return 1 if failed or code else 0


if __name__ == "__main__":
    sys.exit(main())
