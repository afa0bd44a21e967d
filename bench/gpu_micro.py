"""The GPU check's micro-checks, each in a process of its own: `python -m ptbench.gpu_micro CHECK [--cpu]`
prints one JSON line.

- `cdmc`: does CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron with TP > 1) take effect in a process that started
  with it? Two streams: A (long) then B (short) on stream 1, C (long) on stream 2. With several hardware
  queues C runs beside A (total ~ A); with one, C queues behind B (total ~ 2 A). `ratio` = total / A.
  The GPU check runs it three ways: not set, set before start, set in-process after CUDA started.
  `--late` sets it in-process after `torch.cuda.is_available()`, as a rank would that sets it itself.
- `loss`: the peak of GPT-2's loss path, `F.cross_entropy(logits.float(), y)` on bf16 logits with its
  backward, in bytes per N x V (N tokens, V vocabulary), beside what the memory model charges.
- `lm_head`: the vocabulary projection's forward and both backward GEMMs at V = 50257 (GPT-2's) and 50304
  (the next multiple of 64).
- `resnet`: a ResNet-50 training step in NCHW, channels_last (weights and input), NCHW weights with
  channels_last input, and channels_last with cudnn.benchmark.
- `steppeak`: the cost of the memory ledger's profiler (bench/core/memory.py `StepPeak`, torch.profiler with
  profile_memory): a training step's times (median, fastest) before any profiler ran in the process, inside one
  StepPeak, and after it exited (the trainer's timed steps follow the untimed step it measures: a profiler that
  leaves CUPTI or its callbacks attached shows as `after_ratio` above 1). The step is launch-bound (many small
  kernels), where a cost per kernel launch shows most.

`--cpu` runs the same code at tiny sizes on the CPU (the test suite's twin): CPU timings say nothing about
a GPU; the checks' code paths are what it tests. On a GPU, timing is by CUDA events after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SIZES = {  # (GPU, CPU twin)
    "loss": ((8192, 50257), (256, 1024)),
    "lm_head": ((8192, 768), (128, 32)),
    "resnet": ((64, 224), (2, 32)),
    "steppeak": ((1024, 16, 1024, 40), (64, 8, 32, 60)),  # width, depth, batch, steps per phase
}


def _device(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_ms(fn, dev: torch.device, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds per call after `warmup` calls: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def cdmc(late: bool, cpu: bool) -> dict:
    started_with = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    out = {"check": "cdmc", "started_with": started_with, "late": late}
    if cpu or not torch.cuda.is_available():
        return {**out, "ratio": None, "note": "no CUDA streams on a CPU: nothing to measure"}
    torch.cuda.is_available()
    if late:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    torch.cuda.set_device(0)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(20_000_000)
    torch.cuda.synchronize()
    cycles = int(20_000_000 * 0.05 / max(time.perf_counter() - t0, 1e-4))  # ~50 ms of spinning

    def alone():
        torch.cuda._sleep(cycles)

    def two_streams():
        with torch.cuda.stream(s1):
            torch.cuda._sleep(cycles)
            torch.cuda._sleep(cycles // 20)
        with torch.cuda.stream(s2):
            torch.cuda._sleep(cycles)

    a = statistics.median(timed_ms(alone, torch.device("cuda", 0), 1, 1) for _ in range(3))
    total = statistics.median(_wall_ms(two_streams) for _ in range(5))
    return {
        **out,
        "A_ms": round(a, 2),
        "total_ms": round(total, 2),
        "ratio": round(total / a, 2),
        "one_queue": total / a > 1.6,
    }


def _wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def loss_peak(cpu: bool) -> dict:
    """Peak bytes of the loss path beyond its inputs, per N x V: allocator statistics on a GPU, torch.profiler's
    memory events on the CPU (memory.StepPeak)."""
    from ptbench.core.memory import StepPeak

    dev = _device(cpu)
    n, v = SIZES["loss"][cpu]
    logits = torch.randn(n, v, device=dev, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device=dev)

    def step():
        F.cross_entropy(logits.float(), target).backward()

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with StepPeak(dev) as p:
            step()
        peak = p.peak or 0
    return {"check": "loss", "N": n, "V": v, "peak_bytes": peak, "per_NV": round(peak / (n * v), 2)}


def lm_head(cpu: bool) -> dict:
    dev = _device(cpu)
    n, d = SIZES["lm_head"][cpu]
    dtype = torch.float32 if cpu else torch.bfloat16
    x = torch.randn(n, d, device=dev, dtype=dtype)
    out = {"check": "lm_head", "N": n, "d": d}
    for v in (50257, 50304):
        w = torch.randn(v, d, device=dev, dtype=dtype)
        g = torch.randn(n, v, device=dev, dtype=dtype)
        out[f"ms_V{v}"] = round(timed_ms(lambda w=w, g=g: (x @ w.t(), g @ w, g.t() @ x), dev, 3 if cpu else 20), 3)
    out["ratio"] = round(out["ms_V50257"] / out["ms_V50304"], 3)
    return out


def resnet(cpu: bool) -> dict:
    import torchvision

    dev = _device(cpu)
    batch, size = SIZES["resnet"][cpu]
    x0 = torch.randn(batch, 3, size, size, device=dev)
    y0 = torch.randint(0, 1000, (batch,), device=dev)
    out = {"check": "resnet", "batch": batch, "image": size}
    cases = (
        ("nchw", False, False, False),
        ("channels_last", True, True, False),
        ("nchw_weights_cl_input", False, True, False),
        ("channels_last_cudnn_benchmark", True, True, True),
    )
    for label, weights_cl, input_cl, benchmark in cases:
        torch.backends.cudnn.benchmark = benchmark
        model = torchvision.models.resnet50().to(dev)
        if weights_cl:
            model = model.to(memory_format=torch.channels_last)
        x = x0.contiguous(memory_format=torch.channels_last) if input_cl else x0

        def step(model=model, x=x):
            with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
                loss = F.cross_entropy(model(x).float(), y0)
            loss.backward()

        out[f"ms_{label}"] = round(timed_ms(step, dev, 1 if cpu else 10, 1 if cpu else 3), 2)
    torch.backends.cudnn.benchmark = False
    return out


def step_times_ms(fn, dev: torch.device, n: int) -> list[float]:
    """Each of `n` calls' milliseconds: CUDA events between the calls on a GPU (read after the last; a launch-bound
    step's host delays show as device idle between them), perf_counter around each on the CPU."""
    _sync(dev)
    if dev.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        marks[0].record()
        for m in marks[1:]:
            fn()
            m.record()
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def step_peak_cost(cpu: bool) -> dict:
    """Step times (forward, backward, AdamW; median and fastest) before StepPeak's profiler ever ran in this process,
    inside one StepPeak, and after it exited; the ratios are against `before`."""
    from ptbench.core.memory import StepPeak

    dev = _device(cpu)
    if dev.type == "cpu":  # one thread: a busy machine's cores make threads wait on each other, swamping the ratio
        torch.set_num_threads(1)
    width, depth, batch, n = SIZES["steppeak"][cpu]
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)]
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=dev)

    def step():
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_times_ms(step, dev, 3)  # the optimizer's state and the kernels' first launches
    before = step_times_ms(step, dev, n)
    with StepPeak(dev) as p:
        inside = step_times_ms(step, dev, n)
    after = step_times_ms(step, dev, n)
    out = {"check": "steppeak", "steps": n, "profiled_peak_bytes": p.peak}
    # the median, and the fastest step: on a shared machine other work lengthens some steps, never shortens one
    for stat, name in ((statistics.median, "ms"), (min, "min_ms")):
        out.update(
            {f"{name}_{k}": round(stat(v), 3) for k, v in (("before", before), ("inside", inside), ("after", after))}
        )
        suffix = "" if name == "ms" else "_min"
        out[f"inside_ratio{suffix}"] = round(stat(inside) / stat(before), 3)
        out[f"after_ratio{suffix}"] = round(stat(after) / stat(before), 3)
    return out


CHECKS = {"cdmc": cdmc, "loss": loss_peak, "lm_head": lm_head, "resnet": resnet, "steppeak": step_peak_cost}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.gpu_micro", description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (the test suite's twin)")
    p.add_argument("--late", action="store_true", help="cdmc: set CUDA_DEVICE_MAX_CONNECTIONS=1 after CUDA started")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    result = cdmc(args.late, args.cpu) if args.check == "cdmc" else CHECKS[args.check](args.cpu)
    print(json.dumps({"device": "cpu" if args.cpu else torch.cuda.get_device_name(0), **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
