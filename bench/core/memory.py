"""Peak memory per rank, reset at each epoch.

CUDA: max allocated / reserved from the caching allocator. CPU twin: the process high-water mark
VmHWM from /proc/self/status, reset by writing 5 to /proc/self/clear_refs after malloc_trim(0)
(without the trim, freed memory stays resident and the reset is a no-op). tracemalloc does not see
tensors and polling misses peaks, so neither is used.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the whole run


def rss() -> int | None:
    """This process's resident bytes now (VmRSS)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def used_outside_allocator(free: int, total: int, reserved: int) -> int:
    """Device bytes in use (total - free) that the caching allocator does not hold (reserved)."""
    return max(0, int(total) - int(free) - int(reserved))


def peak(device: torch.device) -> dict[str, int | None]:
    """Bytes: `peak_allocated`/`peak_reserved` (CUDA) and always the process's `peak_rss` (VmHWM: host
    memory, on CUDA runs too). CUDA also gives `outside_allocator`: device memory in use that the allocator's
    peaks never see (torch.cuda.mem_get_info's total - free minus memory_reserved, read now): the CUDA
    context, NCCL communicator buffers (megatron and horovod create more communicators), library
    workspaces, and any other process on the GPU. Add it to peak_reserved to compare adapters' device use."""
    hwm = _status_kib("VmHWM")
    out = {"peak_allocated": None, "peak_reserved": None, "peak_rss": hwm * 1024 if hwm is not None else None}
    if device.type == "cuda":
        out.update(
            peak_allocated=int(torch.cuda.max_memory_allocated(device)),
            peak_reserved=int(torch.cuda.max_memory_reserved(device)),
            outside_allocator=used_outside_allocator(
                *torch.cuda.mem_get_info(device), torch.cuda.memory_reserved(device)
            ),
        )
    return out


def _unique(devices) -> list[torch.device]:
    out: list[torch.device] = []
    for d in devices:
        d = torch.device(d)
        d = torch.device("cpu") if d.type == "cpu" else d  # every cpu device is the one process memory
        if d not in out:
            out.append(d)
    return out


def reset_peaks(devices) -> None:
    for d in _unique(devices):
        reset_peak(d)


def peak_over(devices) -> dict:
    """`peak` of one process that computes on several devices (GPipe). CUDA: each value is the largest
    device's (the per-GPU number other adapters report) and `per_device` lists them all; CPU devices
    share the process memory, so they give one reading."""
    devs = _unique(devices)
    if len(devs) == 1:
        return peak(devs[0])
    per = [peak(d) for d in devs]
    out = {k: max((p[k] for p in per if p[k] is not None), default=None) for k in per[0]}
    out["per_device"] = [{"device": str(d), **p} for d, p in zip(devs, per)]
    return out
