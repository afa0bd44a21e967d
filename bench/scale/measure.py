"""What a dry run measures: the collective ledger (a TorchDispatchMode over the c10d ops) and memory per
category (torch's MemTracker / FSDPMemTracker, each category's own peak beside the total's).

The ledger reads each collective's buffer as torch's own fake-collective tools do
(torch/distributed/_tools/fake_collectives.py `CollectiveOp`): the full, padded buffer S and the group it
runs on. Bus bytes are S x nccl-tests' ring factor (ptbench.core.comm_volume.ring_factor), the unit of
the comm formula, so the two compare without conversion.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ptbench.core.comm_volume import ring_factor

# torch op name (its overload packet) -> the formula's op; recv is counted apart (the formula counts sends)
_OPS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send_recv",
    "isend": "send_recv",
    "recv_": "recv",
    "irecv": "recv",
    "recv_any_source_": "recv",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
}


class CollectiveLedger(TorchDispatchMode):
    """Every collective issued inside the block: {(op, group size): [count, buffer bytes]} per step."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []
        self.unknown: set[str] = set()

    def new_step(self) -> None:
        self.steps.append(defaultdict(lambda: [0, 0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns itself into local ops and collectives, which come back here
        res = func(*args, **(kwargs or {}))
        self._count(func, res, args, kwargs or {})
        return res

    def _count(self, func, res, args, kwargs) -> None:
        if func is torch.ops.c10d.allreduce_coalesced_.default and self.steps:
            # the coalesced all-reduce of a non-NCCL group (torch's fake-collective tools do not list it)
            row = self.steps[-1][("all_reduce", _group(args[1]).size())]
            row[0] += 1
            row[1] += sum(t.numel() * t.element_size() for t in args[0])
            return
        if func not in collective_ops or func in sync_ops or not self.steps:
            return
        name = func.overloadpacket.__name__
        op = _OPS.get(name)
        try:
            size = CollectiveOp.get_process_group(func, args).size()
            nbytes = _comm_bytes(func, res, args, kwargs)
        except TypeError:
            self.unknown.add(name)
            return
        if op is None:
            self.unknown.add(name)
            return
        row = self.steps[-1][(op, size)]
        row[0] += 1
        row[1] += nbytes

    def rows(self, step: int) -> list[dict]:
        """One step's collectives: op, group size, count, buffer bytes and bus bytes (ring factor applied)."""
        out = []
        for (op, n), (count, nbytes) in sorted(self.steps[step].items()):
            factor = ring_factor(op, n) if op in ("all_reduce", "all_gather", "reduce_scatter") else 1.0
            out.append(dict(op=op, group_size=n, count=count, buffer_bytes=nbytes, bytes=nbytes * factor))
        return out


def _group(group):
    """A process group as the dispatcher hands it to a c10d op (a ScriptObject, or the group itself)."""
    import torch.distributed as dist

    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


def tracker_class(fsdp: bool):
    """MemTracker (FSDPMemTracker for a fully_shard model) that also keeps each category's own peak: torch's
    `peak` snapshot is the categories at the moment of the total's peak, where a persistent state (the
    optimizer's) may not be whole yet."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class CategoryPeaks(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.category_peaks: dict[str, int] = defaultdict(int)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            if not callable(getattr(module, "buffers", None)):
                # megatron-core's DistributedDataParallel keeps its gradient buffers in a list attribute named
                # `buffers`, which hides nn.Module.buffers: read the module's own through nn.Module
                module = _ModuleView(module)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state) -> None:
            # after every operator: the total's peak (with its categories) and each category's own, what a dry run
            # reads. torch's own also raises each active module's local peak, a pass over every tracked module per
            # operator (most of the tracker's cost on DeepSpeed's W slices per gradient); nothing here reads those
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)
                for key, val in snap.items():
                    if val > self.category_peaks[key]:
                        self.category_peaks[key] = val

    return CategoryPeaks


class _ModuleView:
    """A module's parameters and buffers as nn.Module lists them, whatever attributes the module shadows."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def parameters(self, *args, **kwargs):
        return torch.nn.Module.parameters(self._module, *args, **kwargs)

    def buffers(self, *args, **kwargs):
        return torch.nn.Module.buffers(self._module, *args, **kwargs)


def category_names(snap: dict) -> dict:
    """A tracker snapshot of one device with its categories by name ("Sharded Param", "Total", ...)."""
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def tracker_snapshot(tracker, step_start: dict | None) -> dict:
    """{peak_total, at_peak, category_peaks, step_start}: the tracker's one device at the total's peak, each
    category's own peak, and the categories when the last optimizer step started (`step_start`, taken by an
    optimizer pre-hook; None where the optimizer is not a torch one)."""
    peak = tracker.get_tracker_snapshot("peak")
    at_peak = category_names(next(iter(peak.values()), {})) if peak else {}
    return dict(
        peak_total=at_peak.get("Total", 0),
        at_peak=at_peak,
        category_peaks=category_names(tracker.category_peaks),
        step_start=step_start,
    )


def step_start_hook(tracker, optimizer, into: dict):
    """Keep the tracker's current categories in `into` each time `optimizer` starts a step; the handle."""

    def hook(*_):
        current = tracker.get_tracker_snapshot("current")
        into.clear()
        into.update(category_names(next(iter(current.values()), {})) if current else {})

    return optimizer.register_step_pre_hook(hook)


def fake_mode():
    """FakeTensorMode that accepts the real tensors a framework makes outside it (its constants)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _comm_bytes(func, res, args, kwargs) -> int:
    """The bytes a collective moves: the buffer tensor's own bytes where torch's fake-collective tools count its
    whole storage (a single-tensor op, `_reduce_scatter_base_`). A view of a larger buffer moves only its own
    elements: DeepSpeed's ZeRO-3 reduce-scatters a lone gradient as a view of its contiguous reduce bucket, and
    counting the bucket read gpt2_medium's reduce-scatter 1.1 % over at W=64."""
    if func is torch.ops.c10d._reduce_scatter_base_.default:
        return args[1].numel() * args[1].element_size()
    if func in CollectiveOp.COMM_TENSOR_SINGLE_UNTYPED_STORAGE:
        return args[0].numel() * args[0].element_size()
    return CollectiveOp.get_comm_tensor_size(func, res, args, kwargs)
