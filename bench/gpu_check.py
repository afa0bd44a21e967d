"""`make gpu-check` / `python -m ptbench.gpu_check`: for anyone with a GPU, the one-GPU smoke, then one short
bf16 run of gpt2_small and resnet50 per installed adapter on the visible GPUs, as a table (status,
step time, tokens or images per second, MFU, peak device memory).

Warm-up steps are excluded from the step statistics (trainer.untimed_steps); data is synthetic, so
the table measures the frameworks, not storage.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ptbench.adapters import available, get_adapter_class
from ptbench.run_point import run_bench
from ptbench.runner.compose import visible_gpus
from ptbench.smoke import framework_installed, smoke_point
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
    args = p.parse_args(argv)
    gpus = visible_gpus()
    if not gpus:
        print(
            "error: make gpu-check needs a visible GPU (torch.cuda.is_available() is False); on a CPU "
            "machine use make smoke",
            file=sys.stderr,
        )
        return 2
    code = 0 if args.skip_smoke else smoke_main(["--world-size", "1"])
    header = ["adapter", "workload", "status", "layout / reason", "step", "throughput", "MFU", "peak mem"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-check-") as tmp:
        for adapter in args.adapters.split(","):
            for workload in WORKLOADS:
                rows.append(row(adapter, workload, gpus, Path(tmp), args.timeout))
                print("  ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\ngpu-check on {gpus} GPU(s), bf16, synthetic data, {COMMON[4].split('=')[1]} warm-up steps excluded")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    failed = [r for r in rows if r[2] not in ("ok", "skipped", "n/a")]
    return 1 if failed or code else 0


if __name__ == "__main__":
    sys.exit(main())
