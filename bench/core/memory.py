"""Peak memory per rank, reset at each epoch and after the warm-up steps (`end_warmup`); and the memory ledger's
instruments: the optimizer phase's peak (`StepPeak`) and what autograd saves for backward (`SavedTensorLedger`),
which the trainer runs in the last untimed step and the memory model's counting functions run on the meta device.

CUDA: max allocated / reserved from the caching allocator. CPU twin: the process high-water mark
VmHWM from /proc/self/status, reset by writing 5 to /proc/self/clear_refs after malloc_trim(0)
(without the trim, freed memory stays resident and the reset is a no-op). tracemalloc does not see
tensors and polling misses peaks, so neither is used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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


def reset_method(device_type: str) -> str:
    """How a device's peak is reset: "allocator" (CUDA: torch.cuda.reset_peak_memory_stats) or "vmhwm" (any
    other device computes in host memory: the process high-water mark, reset through /proc/self/clear_refs)."""
    return "allocator" if device_type == "cuda" else "vmhwm"


def reset_peak(device: torch.device) -> bool:
    """Reset `device`'s peak; False when it could not be (no /proc/self/clear_refs, or not permitted: the
    CPU peak then keeps covering everything since the last reset that took, or the process start)."""
    if reset_method(device.type) == "allocator":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


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


def reset_peaks(devices) -> bool:
    """Reset the peaks of every device this process drives; True when every reset took."""
    return all([reset_peak(d) for d in _unique(devices)])


def end_warmup(devices) -> dict:
    """The peaks of the warm-up steps (cuDNN autotuning, compilation, the memory ledger's step), read and then
    reset, so that the epoch's peak read at its end covers only the steady steps after them. `reset`: whether
    every reset took (CPU: False where /proc/self/clear_refs is missing or refused; the epoch's peak then
    still holds the warm-up)."""
    reading = peak_over(devices)
    reading.pop("outside_allocator", None)  # read at the epoch end, not a peak: only the epoch's reading has it
    return {**reading, "reset": reset_peaks(devices)}


def with_warmup(mem: dict, warm: dict) -> dict:
    """An epoch reading `mem` taken after `end_warmup` reset the peaks at the epoch's last step: every step was
    warm-up, so its peaks are the larger of the two readings (peak_rss_delta moves with peak_rss)."""
    out = dict(mem)
    for k in ("peak_allocated", "peak_reserved", "peak_rss"):
        if out.get(k) is not None and warm.get(k) is not None:
            out[k] = max(out[k], warm[k])
    if out.get("peak_rss_delta") is not None:
        out["peak_rss_delta"] += out["peak_rss"] - mem["peak_rss"]
    return out


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


# --- the memory ledger's instruments: the optimizer phase's peak and what autograd saves --------------------
STEP_RULE = (
    "the optimizer phase (clip + step; DeepSpeed: engine.step) of the last untimed step, bytes allocated beyond "
    "what was alive when it began, the most at once (ptbench.core.memory.StepPeak: torch.profiler's memory "
    "events on the rank's device); not measured in a run's first step (the optimizer's state is being made) nor "
    "inside trainer.profile's window"
)
SAVED_RULE = (
    "torch.autograd.graph.saved_tensors_hooks around one training step: every tensor autograd saves for "
    "backward, each storage once (a view and its base, or one tensor saved by several ops, are one storage; "
    "a tensor subclass such as DTensor counts its local tensors), parameters and views of parameters "
    "and the model's buffers excluded; a storage counts from its first save until autograd frees the last saved reference (after "
    "its backward); `peak` is the most bytes alive at once (1F1B pipelines: several micro-batches); gpipe: per "
    "partition (one device each; its forward on torchgpipe's worker thread, its recomputation, the loss on the "
    "last), a storage two partitions save counted for each"
)


def _plain_tensors(t):
    """The plain tensors behind `t` (a wrapper subclass such as DTensor flattens to its inner tensors)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, n) for n in names)  # DTensor also names its device mesh
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain_tensors(i)]


def _is_parameter(t) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


class StepPeak:
    """`with StepPeak(device) as p:` the bytes the block allocated on `device` beyond what was alive when it began,
    the most at once (`p.peak`; entered again, the largest of its entries) and still held at its end (`p.net`);
    None when the block recorded no allocation there. torch.profiler with profile_memory=True records every
    allocation and free of the allocators ("[memory]" events, signed bytes, with their device); their running
    sum in time order is what the block holds at each moment. No allocator statistics are reset, so the run's
    recorded peak memory is untouched (the CUDA branch is written from torch's profiler API and has not run on
    a GPU here). The trainer measures the optimizer phase of the last untimed step with it, the memory ledger's
    step side."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak: int | None = None
        self.net: int | None = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        quiet_cpu_profiler()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        kind = self.device.type.upper()  # the events' device_type: CPU, CUDA
        index = self.device.index
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
            and e.device_type().name == kind
            and (index is None or kind == "CPU" or e.device_index() == index)
        )
        if not events:
            return False
        peak = net = 0
        for _, nbytes in events:
            net += nbytes
            peak = max(peak, net)
        self.peak = peak if self.peak is None else max(self.peak, peak)
        self.net = net
        return False


class SavedTensorLedger:
    """Context manager counting the bytes autograd saves for backward, by `SAVED_RULE`. After the block:
    `peak` (most bytes alive at once), `total` (bytes of distinct storages saved), `tensors` (saves).
    Hooks are thread-local: the block's own thread is counted. A pipeline that runs its partitions on worker
    threads (torchgpipe) runs each partition's forward inside `partition(j)`, which counts that thread's saves
    for partition j as well: `parts` then holds each partition's own peak (each partition is one device,
    so a storage two partitions save counts for each), and `active()` is how the partition finds the ledger."""

    def __init__(self, modules=()):
        import threading

        # the storages of these modules' buffers (BatchNorm's running statistics) are not counted; parameters
        # are recognised when saved (nn.Parameter and its views: ZeRO-3 / FSDP swap their
        # storages during the step). The storages are kept referenced so that their keys stay theirs.
        self._buffers = [x.untyped_storage() for m in modules for t in m.buffers() for x in _plain_tensors(t)]
        self.held = {st._cdata for st in self._buffers}
        self.alive: dict = {}  # storage key (partition j: (j, key)) -> [nbytes, references]
        self.current = self.peak = self.total = self.tensors = 0
        self.parts: dict[int, list[int]] = {}  # partition -> [bytes alive, peak]
        self._owner: dict[int, int] = {}  # storage key -> the partition it was the input of (see `partition`)
        self._claimed: list = []  # those storages, kept referenced so that their keys stay theirs
        self._local = threading.local()  # .part: the partition this thread counts for (None: none)
        self._lock = threading.RLock()  # worker threads save, and the graph releases, concurrently
        self._hooks = None

    @staticmethod
    def active():
        """The innermost ledger entered (on any thread), None outside one: what a worker thread counts into."""
        return _ACTIVE[-1] if _ACTIVE else None

    def partition(self, index: int, inputs=()):
        """Count this thread's saves inside the block for pipeline partition `index` (and in the ledger's
        totals): saved-tensor hooks on this thread for the block. `inputs`: the partition's inputs; a save
        of their storage outside any partition (torchgpipe's Recompute node keeps a checkpointed partition's
        input from the main thread) counts for this partition."""
        import contextlib

        @contextlib.contextmanager
        def block():
            with self._lock:
                self.parts.setdefault(index, [0, 0])
                for t in inputs if isinstance(inputs, (tuple, list)) else (inputs,):
                    if isinstance(t, torch.Tensor):
                        for x in _plain_tensors(t):
                            st = x.untyped_storage()
                            if st._cdata not in self._owner:  # the first partition to receive it
                                self._owner[st._cdata] = index
                                self._claimed.append(st)
            before = getattr(self._local, "part", None)
            self._local.part = index
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                    yield self
            finally:
                self._local.part = before

        return block()

    def _count(self, key, nbytes: int, part) -> tuple:
        """One more reference to storage `key` (for partition `part` when not None); new storages add bytes."""
        entry = self.alive.get(key)
        if entry is None:
            entry = self.alive[key] = [nbytes, 0]
            if part is None:
                self.current += nbytes
                self.total += nbytes
                self.peak = max(self.peak, self.current)
            else:
                p = self.parts.setdefault(part, [0, 0])
                p[0] += nbytes
                p[1] = max(p[1], p[0])
        entry[1] += 1
        return key

    def _pack(self, t):
        if _is_parameter(t):
            return t
        keys = []
        with self._lock:
            part = getattr(self._local, "part", None)
            for x in _plain_tensors(t):
                st = x.untyped_storage()
                key = st._cdata
                if key in self.held:
                    continue
                keys.append(self._count(key, st.nbytes(), None))
                owner = part if part is not None else self._owner.get(key)
                if owner is not None:
                    keys.append(self._count((owner, key), st.nbytes(), owner))
            self.tensors += 1
        return _Held(t, keys, self)

    def _release(self, keys):
        with self._lock:
            for key in keys:
                entry = self.alive.get(key)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    del self.alive[key]
                    if isinstance(key, tuple):
                        self.parts[key[0]][0] -= entry[0]
                    else:
                        self.current -= entry[0]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)
        return False

    def result(self) -> dict:
        out = {"peak_bytes": int(self.peak), "total_bytes": int(self.total), "tensors": int(self.tensors)}
        if self.parts:
            out["per_partition"] = [int(self.parts.get(j, [0, 0])[1]) for j in range(max(self.parts) + 1)]
        return out


_ACTIVE: list[SavedTensorLedger] = []  # ledgers entered, innermost last (`SavedTensorLedger.active`)


class _Held:
    """What the graph keeps instead of the saved tensor: its release tells the ledger the storage is free."""

    __slots__ = ("t", "keys", "ledger")

    def __init__(self, t, keys, ledger):
        self.t, self.keys, self.ledger = t, keys, ledger

    def __del__(self):
        self.ledger._release(self.keys)


def _unpack(held):
    return held.t if isinstance(held, _Held) else held


def quiet_cpu_profiler() -> None:
    """Without a GPU, torch.profiler's Kineto prints its stage markers and "ERROR: ... gpuGetDeviceCount failed
    with code 35" to stderr at every start: noise in a run that asked for no GPU, taken for a failure. Kineto reads
    KINETO_LOG_LEVEL when a profiler starts; 6 is above its last level (USDT = 5). A user's own setting wins, and
    on a GPU its errors stay visible."""
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
