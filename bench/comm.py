"""Measured network: nccl-tests-style bandwidth of the collectives that training adapters use.

    python -m ptbench.comm [--world-size N] [--backend auto|gloo|nccl] [--min-bytes 1K]
                         [--max-bytes 256M] [--iters K] [--warmup W] [--ops all_reduce,...]
                         [--json PATH] [--out DIR]

Without torchrun/srun around it, this spawns N ranks itself (torch.multiprocessing with the local
launcher's start method, ptbench.runner.checks.start_method: fork on a CPU, spawn with CUDA; a free
port on 127.0.0.1). Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or srun (SLURM_PROCID/SLURM_NTASKS)
the process is one rank of the job and measures with the others. Rank and address come from the
harness's cluster environments (bench/core/environments.py), the backend choice and the process
group from bench/core/dist.py, the JSON writing from bench/core/records.py, as for a training run.

What is measured, per op and size (fp32, out-of-place where torch allows it):
- all_reduce (sum), all_gather, reduce_scatter (sum), broadcast (root 0), send_recv (each rank
  sends to rank+1 and receives from rank-1, as nccl-tests' sendrecv_perf does).
- `--warmup` untimed calls, then `--iters` timed calls back to back. On CUDA the time is taken with
  CUDA events around the loop (torch.cuda.Event.elapsed_time); on CPU with time.perf_counter after
  a barrier (gloo calls with async_op=False return when the op is complete on this rank). Time per
  op = the per-rank mean over the timed calls, then the MAX over ranks (nccl-tests reports the
  average over ranks by default, `-a 1`; its `-a 3` is the max that is used here).
- Before timing, one call with known data is checked (the `#wrong` column, like nccl-tests).

Bandwidths are those of nccl-tests, doc/PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) and src/*.cu `*GetBw`:
  algbw = S / t   (GB/s, 1 GB = 1e9 bytes)
  busbw = algbw * factor, factor = 2(n-1)/n all_reduce, (n-1)/n all_gather and reduce_scatter,
          1 broadcast, 1 send_recv
where S is, as in nccl-tests: the buffer size for all_reduce and broadcast; the TOTAL gathered /
scattered array (per-rank count * n * sizeof) for all_gather and reduce_scatter; the per-rank
message for send_recv. The `size` column is that S and `count` is the per-rank element count
passed to the collective (nccl-tests' `paramcount`).

Reduce-scatter: the backend's native reduce_scatter when it has one; otherwise (or with
`--reduce-scatter-impl ring`) a ring reduce-scatter built from send/recv, which moves the same
(n-1)/n * S bytes per rank as a native ring; the result's `impl` field says which ran. If neither
can run the op is reported as n/a with the reason, never replaced by another collective.

Python API: `run_rank(ctx, cfg)` is the per-rank function (a `DistContext`; it returns the report on
rank 0), `measure(cfg)` runs inside an already initialized process group, `launch(cfg, world_size)`
spawns ranks and returns the report. `--out DIR` writes DIR/<backend>-<N>.json and the table as DIR/<backend>-<N>.txt: what
`python -m ptbench.sweep run` does once per world size of a sweep, into <results>/<experiment>/comm/,
where `python -m ptbench.analysis report` finds it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ptbench.core.comm_volume import ring_factor
from ptbench.core.dist import DistContext, default_backend, free_port, init_process_group, set_cpu_threads
from ptbench.core.records import read_json, write_json

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")

# nccl-tests' bus-bandwidth correction factors (doc/PERFORMANCE.md, "Summary"): the same ring factors
# the communication-volume formulas use (bench/core/comm_volume/)
busbw_factor = ring_factor


DEFAULT_MAX_BYTES_CUDA = 256 << 20
# On CPU (gloo over loopback, one thread per rank) 2 ranks x 5 ops x 1K..16M with the default
# 5 + 20 iterations take well under 60 s on 2 cores (see --help); 256M would take many minutes.
DEFAULT_MAX_BYTES_CPU = 16 << 20
ELEM_BYTES = 4  # fp32
TYPE_NAME = "float"  # nccl-tests' name for fp32


@dataclass
class CommConfig:
    backend: str = "auto"  # auto | gloo | nccl
    min_bytes: int = 1 << 10
    max_bytes: int | None = None  # None: DEFAULT_MAX_BYTES_CUDA on CUDA, DEFAULT_MAX_BYTES_CPU on CPU
    factor: int = 2  # sizes grow by this factor (nccl-tests -f)
    iters: int = 20  # timed calls per size (nccl-tests -n default)
    warmup: int = 5  # untimed calls per size (nccl-tests -w default)
    ops: tuple[str, ...] = OPS
    check: bool = True  # validate one call per size with known data
    reduce_scatter_impl: str = "auto"  # auto | native | ring
    json_path: str | None = None  # rank 0 writes the report here
    quiet: bool = False  # rank 0 prints the table unless quiet
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: int = 600
    extra: dict = field(default_factory=dict)  # copied into the report (e.g. a sweep's run id)


# ----------------------------------------------------------------------------------------------
# sizes and launch environment


def parse_size(text: str | int) -> int:
    """'1K' -> 1024, '256M', '1G', '4096' (K/M/G are powers of 1024, as in nccl-tests -b/-e)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1K, 64M, 1G, 4096)")
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * unit)


def human_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor must be >= 2, got {factor}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def default_max_bytes(backend: str) -> int:
    return DEFAULT_MAX_BYTES_CUDA if backend == "nccl" else DEFAULT_MAX_BYTES_CPU


def external_launch(backend: str, env=os.environ) -> DistContext | None:
    """This rank's place when torchrun or srun started this process (the harness's own cluster
    environments, bench/core/environments.py); None when we must spawn."""
    from ptbench.core.environments import SlurmEnvironment, TorchrunEnvironment

    if TorchrunEnvironment.detect(env, "local"):
        return TorchrunEnvironment.context(env, backend)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # any srun task: `srun python -m ptbench.comm`
        return SlurmEnvironment.context(env, backend)
    return None


# ----------------------------------------------------------------------------------------------
# the ops


def _pattern(count: int, offset: int, device) -> torch.Tensor:
    """Small integers in fp32 (sums stay exact): element i holds (i % 13) + offset."""
    return (torch.arange(count, device=device, dtype=torch.int32) % 13).to(torch.float32) + offset


class _Op:
    """Buffers and one call of a collective for one size; `expected()` is this rank's correct output."""

    def __init__(self, op: str, nbytes: int, rank: int, n: int, device, rs_impl: str):
        self.op, self.rank, self.n, self.device = op, rank, n, device
        self.impl = op
        count = nbytes // ELEM_BYTES
        if op in ("all_gather", "reduce_scatter"):
            self.count = count // n  # per-rank count, as nccl-tests' paramcount
            self.size = self.count * n * ELEM_BYTES  # S: the total array
        else:
            self.count = count
            self.size = count * ELEM_BYTES
        c = self.count
        if op == "all_reduce":
            self.buf = torch.empty(c, device=device)
        elif op == "all_gather":
            self.inp = torch.empty(c, device=device)
            self.out = torch.empty(c * n, device=device)
            self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            self.impl = self._ag.__name__
        elif op == "reduce_scatter":
            self.inp = torch.empty(c * n, device=device)
            self.out = torch.empty(c, device=device)
            if rs_impl == "ring":
                self._scratch = torch.empty(c * n, device=device)
                self._recv = torch.empty(c, device=device)
                self.impl = "ring_send_recv"
            else:
                self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                self.impl = self._rs.__name__
        elif op == "broadcast":
            self.buf = torch.empty(c, device=device)
        elif op == "send_recv":
            self.inp = torch.empty(c, device=device)
            self.out = torch.empty(c, device=device)
            self.impl = "batch_isend_irecv"
        else:
            raise ValueError(f"unknown op {op!r}")
        self.fill()

    def fill(self) -> None:
        """Known inputs: rank r holds pattern + r."""
        c, r, n = self.count, self.rank, self.n
        if self.op in ("all_reduce", "broadcast"):
            self.buf.copy_(_pattern(c, r, self.device))
        elif self.op == "reduce_scatter":
            self.inp.copy_(_pattern(c * n, r, self.device))
            self.out.zero_()
        else:
            self.inp.copy_(_pattern(c, r, self.device))
            self.out.zero_()

    def result(self) -> torch.Tensor:
        return self.buf if self.op in ("all_reduce", "broadcast") else self.out

    def expected(self) -> torch.Tensor:
        c, r, n, d = self.count, self.rank, self.n, self.device
        tri = n * (n - 1) // 2  # sum of the rank offsets
        if self.op == "all_reduce":
            return _pattern(c, 0, d) * n + tri
        if self.op == "all_gather":
            return torch.cat([_pattern(c, j, d) for j in range(n)])
        if self.op == "reduce_scatter":
            return _pattern(c * n, 0, d)[r * c : (r + 1) * c] * n + tri
        if self.op == "broadcast":
            return _pattern(c, 0, d)
        return _pattern(c, (r - 1) % n, d)  # send_recv: from rank-1

    def __call__(self) -> None:
        op, n, r = self.op, self.n, self.rank
        if op == "all_reduce":
            dist.all_reduce(self.buf)
        elif op == "all_gather":
            self._ag(self.out, self.inp)
        elif op == "reduce_scatter":
            if self.impl == "ring_send_recv":
                self._ring_reduce_scatter()
            else:
                self._rs(self.out, self.inp)
        elif op == "broadcast":
            dist.broadcast(self.buf, src=0)
        else:
            reqs = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, self.inp, (r + 1) % n),
                    dist.P2POp(dist.irecv, self.out, (r - 1) % n),
                ]
            )
            for q in reqs:
                q.wait()

    def _ring_reduce_scatter(self) -> None:
        """Ring reduce-scatter from send/recv: n-1 steps, each rank sends one chunk of S/n and adds
        the chunk it receives; per rank (n-1)/n * S bytes go out, as in a native ring. At step s rank
        r sends its partial chunk (r-s-1) mod n to r+1 and adds the incoming chunk (r-s-2) mod n, so
        after n-1 steps it holds the full sum of chunk r."""
        n, r, c = self.n, self.rank, self.count
        acc = self._scratch
        acc.copy_(self.inp)
        for s in range(n - 1):
            send_i, recv_i = (r - s - 1) % n, (r - s - 2) % n
            reqs = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, acc[send_i * c : (send_i + 1) * c], (r + 1) % n),
                    dist.P2POp(dist.irecv, self._recv, (r - 1) % n),
                ]
            )
            for q in reqs:
                q.wait()
            acc[recv_i * c : (recv_i + 1) * c].add_(self._recv)
        self.out.copy_(acc[r * c : (r + 1) * c])


def _probe_reduce_scatter(device, n: int) -> tuple[str | None, str]:
    """Does the backend have a native reduce-scatter? Returns (error or None, function name).

    Unsupported collectives raise on every rank before any traffic, so all ranks agree."""
    fn = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
    if fn is None:
        return "torch.distributed has no reduce_scatter_tensor", "none"
    try:
        fn(torch.empty(1, device=device), torch.zeros(n, device=device))
        return None, fn.__name__
    except (RuntimeError, NotImplementedError, ValueError) as e:  # backend lacks it
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", fn.__name__


# ----------------------------------------------------------------------------------------------
# measuring


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(call, iters: int, device) -> float:
    """Seconds per call on this rank: CUDA events on GPU, perf_counter after a barrier on CPU."""
    _sync(device)
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def _max_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _reduce_scatter_choice(cfg: CommConfig, device: torch.device, n: int, backend: str) -> tuple[str, str, dict]:
    """Which reduce-scatter runs, why, and the ops that cannot run here ({op: reason})."""
    rs_impl, rs_note, na = "native", "", {}
    if "reduce_scatter" in cfg.ops:
        if cfg.reduce_scatter_impl not in ("auto", "native", "ring"):
            raise ValueError(f"reduce_scatter_impl must be auto, native or ring, got {cfg.reduce_scatter_impl!r}")
        err, name = (None, "") if cfg.reduce_scatter_impl == "ring" else _probe_reduce_scatter(device, n)
        if cfg.reduce_scatter_impl == "ring":
            rs_impl, rs_note = "ring", "ring of send/recv (requested)"
        elif err is None:
            rs_impl = "native"
        elif cfg.reduce_scatter_impl == "native":
            na["reduce_scatter"] = f"backend {backend} lacks {name}: {err}"
        else:
            rs_impl, rs_note = "ring", f"ring of send/recv: backend {backend} lacks {name} ({err})"
        if rs_impl == "ring" and n == 1 and "reduce_scatter" not in na:
            rs_impl = "native"  # a 1-rank ring has no peer; native one-rank reduce-scatter is a copy
    if "send_recv" in cfg.ops and n == 1:
        na["send_recv"] = "needs at least 2 ranks (each rank sends to rank+1)"
    return rs_impl, rs_note, na


def _not_measured(op: str, nbytes: int, count, impl, why: str) -> dict:
    """A result row for a size that was not timed, with the reason."""
    return dict(
        op=op,
        bytes=nbytes,
        count=count,
        type=TYPE_NAME,
        time_s=None,
        algbw_GBps=None,
        busbw_GBps=None,
        wrong=None,
        impl=impl,
        na=why,
    )


def _measure_size(cfg: CommConfig, op: str, nbytes: int, rank: int, n: int, device, rs_impl: str) -> dict:
    """One collective at one size: the data check, warm-up, timed calls; the row (time: max over ranks)."""
    o = _Op(op, nbytes, rank, n, device, rs_impl)
    if o.count == 0:
        return _not_measured(op, nbytes, 0, o.impl, f"{nbytes} B is less than one fp32 element per rank")
    wrong = 0
    if cfg.check:  # one call with known data, like nccl-tests' data check
        o()
        _sync(device)
        wrong = int((o.result() != o.expected()).sum().item())
    for _ in range(cfg.warmup):
        o()
    # Timed calls on zeroed buffers: repeated in-place sums of the pattern would grow without
    # bound (and could reach inf for many ranks and iterations); zeros keep every call alike.
    if op in ("all_reduce", "broadcast"):
        o.buf.zero_()
    else:
        o.inp.zero_()
    per_call = _time_calls(o, cfg.iters, device)
    (t_max,) = _max_over_ranks([per_call], device)
    t_mean_sum, wrong_sum = _sum_over_ranks([per_call, float(wrong)], device)
    algbw = o.size / t_max / 1e9
    return dict(
        op=op,
        bytes=o.size,
        count=o.count,
        type=TYPE_NAME,
        time_s=t_max,
        algbw_GBps=algbw,
        busbw_GBps=algbw * busbw_factor(op, n),
        wrong=int(wrong_sum) if cfg.check else None,
        impl=o.impl,
        time_s_rank_mean=t_mean_sum / n,
    )


def _report(cfg: CommConfig, backend: str, n: int, hosts: list, device, max_bytes: int, rs: tuple, results) -> dict:
    """The report: how it was measured (nccl-tests' definitions), where, and the rows."""
    rs_impl, rs_note, na = rs
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()
    return dict(
        tool="ptbench.comm",
        backend=backend,
        world_size=n,
        hosts=sorted(set(hosts)),
        ranks_per_host={h: hosts.count(h) for h in sorted(set(hosts))},
        device=device.type,
        device_name=device_name,
        torch_version=torch.__version__,
        dtype="float32",
        min_bytes=cfg.min_bytes,
        max_bytes=max_bytes,
        factor=cfg.factor,
        iters=cfg.iters,
        warmup=cfg.warmup,
        timer="cuda_event" if device.type == "cuda" else "perf_counter+barrier",
        time_reduction="max over ranks of the per-rank mean",
        busbw_definition="nccl-tests doc/PERFORMANCE.md: algbw=S/t; busbw=algbw*{all_reduce: 2(n-1)/n, "
        "all_gather/reduce_scatter: (n-1)/n, broadcast/send_recv: 1}",
        reduce_scatter_impl=None if "reduce_scatter" not in cfg.ops else ("n/a" if "reduce_scatter" in na else rs_impl),
        reduce_scatter_note=rs_note or na.get("reduce_scatter", ""),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **({"extra": cfg.extra} if cfg.extra else {}),
        results=results,
    )


def measure(cfg: CommConfig, device: torch.device | None = None) -> dict:
    """Measure in the current (initialized) default process group; every rank returns the report."""
    if not dist.is_initialized():
        raise RuntimeError("measure() needs an initialized process group; use run_rank() or launch()")
    n, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    max_bytes = cfg.max_bytes if cfg.max_bytes is not None else default_max_bytes(backend)
    size_list = sizes(cfg.min_bytes, max_bytes, cfg.factor)
    for op in cfg.ops:
        busbw_factor(op, n)  # validates names
    if cfg.iters < 1 or cfg.warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {cfg.iters}, {cfg.warmup}")
    rs_impl, rs_note, na = _reduce_scatter_choice(cfg, device, n, backend)
    hosts: list = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    results = []
    for op in cfg.ops:
        for nbytes in size_list:
            if op in na:
                results.append(_not_measured(op, nbytes, None, None, na[op]))
            else:
                results.append(_measure_size(cfg, op, nbytes, rank, n, device, rs_impl))
    return _report(cfg, backend, n, hosts, device, max_bytes, (rs_impl, rs_note, na), results)


# ----------------------------------------------------------------------------------------------
# output


def _fmt_time(us: float) -> str:
    # nccl-tests' time format: %7.0f from 10 ms, %7.1f from 100 us, %7.2f below
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_table(report: dict) -> str:
    n = report["world_size"]
    lines = [
        f"# ptbench.comm: nranks {n} backend {report['backend']} device {report['device']} "
        f"({report['device_name']}) torch {report['torch_version']}",
        f"# minBytes {report['min_bytes']} maxBytes {report['max_bytes']} step: {report['factor']}(factor) "
        f"warmup iters: {report['warmup']} iters: {report['iters']} type: float (fp32)",
        f"# hosts: {', '.join(f'{h} x{c}' for h, c in report['ranks_per_host'].items())}",
        f"# time: {report['timer']}, {report['time_reduction']}; "
        "algbw = S/t, busbw per nccl-tests doc/PERFORMANCE.md (GB = 1e9 B)",
    ]
    if report.get("reduce_scatter_note"):
        lines.append(f"# reduce_scatter: {report['reduce_scatter_note']}")
    lines.append("#")
    head = f"# {'size':>10}  {'count':>12}  {'type':>6}  {'op':>14}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}"
    unit = f"# {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'':>14}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}"
    lines += [head, unit]
    wrong_total, busbw = 0, []
    for r in report["results"]:
        if r.get("na"):
            lines.append(f"  {r['bytes']:>10}  {'-':>12}  {r['type']:>6}  {r['op']:>14}      n/a  ({r['na']})")
            continue
        wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
        wrong_total += r["wrong"] or 0
        busbw.append(r["busbw_GBps"])
        lines.append(
            f"  {r['bytes']:>10}  {r['count']:>12}  {r['type']:>6}  {r['op']:>14}  {_fmt_time(r['time_s'] * 1e6)}"
            f"  {r['algbw_GBps']:6.2f}  {r['busbw_GBps']:6.2f}  {wrong:>6}"
        )
    lines.append(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    if busbw:
        lines.append(f"# Avg bus bandwidth    : {sum(busbw) / len(busbw):.4g} GB/s (all ops and sizes)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# ranks and launch


def run_rank(ctx: DistContext, cfg: CommConfig) -> dict | None:
    """One rank: start the process group (the harness's own, bench/core/dist.py), measure, rank 0 prints
    and writes; returns the report on rank 0."""
    if ctx.backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; use --backend gloo on CPU")
        device = ctx.device
    else:
        device = torch.device("cpu")
        set_cpu_threads(1)  # one thread per rank: ranks share the cores
    init_process_group(ctx, cfg.timeout_s)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation notes of c10d wrappers
            report = measure(cfg, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if ctx.rank != 0:
        return None
    if not cfg.quiet:
        print(format_table(report), flush=True)
    if cfg.json_path:
        write_json(Path(cfg.json_path), report)
    return report


def _spawned_rank(local_rank: int, world_size: int, cfg: CommConfig) -> None:
    run_rank(
        DistContext(
            rank=local_rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=world_size,
            master_addr=cfg.master_addr,
            master_port=cfg.master_port,
            backend=cfg.backend,
        ),
        cfg,
    )


def launch(cfg: CommConfig, world_size: int) -> dict:
    """Start `world_size` ranks on this machine as the local launcher does (its start method; a free port on
    127.0.0.1) and return rank 0's report."""
    import torch.multiprocessing as mp

    from ptbench.runner.checks import start_method

    backend = default_backend(cfg.backend)
    cuda = torch.cuda.is_available()
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise RuntimeError(
            f"--world-size {world_size} > {torch.cuda.device_count()} CUDA devices: NCCL needs one GPU per rank"
        )
    tmp = None
    if cfg.json_path is None:
        fd, tmp = tempfile.mkstemp(prefix="bench_comm_", suffix=".json")
        os.close(fd)
    run_cfg = replace(
        cfg, backend=backend, master_addr="127.0.0.1", master_port=free_port(), json_path=cfg.json_path or tmp
    )
    try:
        sys.stdout.flush()  # a forked rank would print this process's unflushed output again
        mp.start_processes(
            _spawned_rank,
            args=(world_size, run_cfg),
            nprocs=world_size,
            start_method=start_method("auto", cuda),
            join=True,
        )
        return read_json(run_cfg.json_path)
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ptbench.comm",
        description="nccl-tests-style bandwidth of all_reduce, all_gather, reduce_scatter, broadcast and "
        "send_recv (fp32). Spawns --world-size ranks unless started by torchrun or srun.",
        epilog="busbw follows nccl-tests doc/PERFORMANCE.md: algbw = S/t, busbw = algbw x 2(n-1)/n "
        "(all_reduce), (n-1)/n (all_gather, reduce_scatter), 1 (broadcast, send_recv). "
        "Time per op = max over ranks of the per-rank mean of --iters calls after --warmup calls.",
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun/srun; default 2)")
    p.add_argument(
        "--backend", default="auto", choices=("auto", "gloo", "nccl"), help="auto: nccl on CUDA, gloo on CPU"
    )
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10, help="smallest size (default 1K)")
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        help=f"largest size (default {human_size(DEFAULT_MAX_BYTES_CUDA)} on CUDA; "
        f"{human_size(DEFAULT_MAX_BYTES_CPU)} on CPU/gloo, so that 2 ranks finish in < 60 s "
        "on 2 cores with the default iterations; pass --max-bytes 256M for the full range)",
    )
    p.add_argument("--factor", type=int, default=2, help="size step factor, 2 or 4 (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up calls per size (default 5)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument(
        "--reduce-scatter-impl",
        default="auto",
        choices=("auto", "native", "ring"),
        help="auto: the backend's reduce_scatter, else a send/recv ring; native: n/a if missing",
    )
    p.add_argument("--no-check", action="store_true", help="skip the data check of one call per size")
    p.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here (rank 0)")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write DIR/<backend>-<N>.json and the table as DIR/<backend>-<N>.txt (what a sweep stores "
        "in <results>/<experiment>/comm/ for the report)",
    )
    p.add_argument("--timeout", type=int, default=600, help="process-group timeout in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        _parser().error(f"--ops: unknown {bad}; choose from {','.join(OPS)}")
    cfg = CommConfig(
        backend=args.backend,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        iters=args.iters,
        warmup=args.warmup,
        ops=ops,
        check=not args.no_check,
        reduce_scatter_impl=args.reduce_scatter_impl,
        json_path=args.json_path,
        timeout_s=args.timeout,
    )
    # validate sizes up front, before any rank starts
    try:
        sizes(
            cfg.min_bytes,
            cfg.max_bytes or max(cfg.min_bytes, default_max_bytes(default_backend(cfg.backend))),
            cfg.factor,
        )
    except ValueError as e:
        _parser().error(str(e))
    ext = external_launch(cfg.backend)
    if args.out:
        if args.json_path:
            _parser().error("give --json or --out, not both")
        stem = os.path.join(args.out, f"{default_backend(cfg.backend)}-{ext.world_size if ext else args.world_size}")
        cfg = replace(cfg, json_path=stem + ".json")
    if ext is not None:
        report = run_rank(ext, replace(cfg, backend=ext.backend))
    else:
        if args.world_size < 1:
            _parser().error("--world-size must be >= 1")
        report = launch(cfg, args.world_size)
    if report is None:  # not rank 0
        return 0
    if args.out:
        with open(os.path.splitext(cfg.json_path)[0] + ".txt", "w") as f:
            f.write(format_table(report) + "\n")
    wrong = sum(r["wrong"] or 0 for r in report["results"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
