"""The fake world a dry run runs in, and the stand-ins for what torch's fake backend lacks.

A dry run is rank R of W ranks in one process: torch's fake process group (collectives complete at once
and move nothing) and FakeTensorMode (tensors with shapes, dtypes and devices but no storage). The
adapter's own `setup` and `train_step` run unchanged; where the fake world cannot run a step of it, a
stand-in does that step's bookkeeping and nothing else. Each stand-in is named in STANDINS and in the
record (`dry_run.standins`), and only those the run used are listed.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

# name -> what it replaces and why (the record states these for the stand-ins a run used)
STANDINS = {
    "module_to_fake": "nn.Module.to(device) on a module whose tensors are already fake on that device returns "
    "it unchanged: torch 2.14's Module._apply always swaps FakeTensor parameters, and swap_tensors refuses "
    "a tensor with a weakref (every FakeTensor has one)",
    "device_mesh_real": "DeviceMesh / init_device_mesh build their rank map outside FakeTensorMode (the "
    "integers of the mesh, real in a real run; under the mode `.tolist()` is data-dependent), as torchtitan "
    "builds its mesh before entering the mode",
    "dtensor_propagation_mode": "DTensor's sharding propagation runs each op at its global shape in a "
    "FakeTensorMode of its own, as in a real run: it takes the active fake mode when there is one "
    "(torch/distributed/tensor/_sharding_prop.py), and the tracker would then count those global-shape tensors "
    "as this rank's memory (a TP loss's full-vocabulary logits, an optimizer step's full parameters)",
    "ddp_comm_hook": "DDP's buckets are all-reduced by a comm hook that issues the same all_reduce on the bucket's "
    "buffer, divides it by the group's size and returns it in a completed Future: DDP's built-in hook hands back "
    "the Work's value, and the fake backend's Work has none ('expected the hook result is either a Tensor or a "
    "TensorList found None')",
    "ddp_shape_check": "DDP's constructor skips _verify_param_shape_across_processes, a C++ all-gather of every "
    "parameter's shape read from host memory (fake tensors have none): on a fake group there are no other ranks' "
    "shapes to compare, and it runs once at setup, outside the steps measured",
    "ddp_bucket_rebuild": "DDP keeps the buckets it built at construction: its rebuild after the first step "
    "broadcasts rank 0's bucket indices through a host buffer, which a fake tensor does not have. torch 2.14's DDP "
    "puts every parameter in one bucket at construction (find_unused_parameters off) and cuts bucket_cap_mb buckets "
    "only at that rebuild, so the ledger's all-reduce count is 1 where a real step makes about gradient bytes / "
    "bucket_cap_mb; the bytes all-reduced per step are the same",
    "deepspeed_host_checks": "DeepSpeed's checks that read a value on the host take their passing answer: "
    "is_invalid_grad_norm (bool() of the gradient norm: the step is not skipped for an overflow, as in a healthy "
    "run) and ZeRO-3's assert_ints_same_as_other_ranks (its lists of parameter ids broadcast from rank 0 and "
    "compared: a fake broadcast returns this rank's own); the few small collectives of that assert are not issued",
    "megatron_no_gloo": "megatron-core's initialize_model_parallel is called with create_gloo_process_groups=False: "
    "the gloo groups it makes by default beside each NCCL group segfault on the fake backend (exit 139); its "
    "training collectives run on the default group's backend, here the fake one",
    "memtracker_microbatches": "torch's MemTracker refuses a top-level module that runs forward twice before "
    "reset_mod_stats ('does not support memory tracking for multiple iterative calls'), taking it for the next "
    "iteration; a pipeline stage runs once per micro-batch within one step, so its next micro-batch is tracked "
    "as the tracker tracks a submodule used twice in one iteration. The category totals compared are the same",
    "coalesced_allreduce_meta": "c10d's allreduce_coalesced_ (what torch.distributed's coalescing manager issues "
    "on a non-NCCL group: megatron-core's gradient buckets on CPU) gets a Meta kernel that hands the tensors to "
    "the fake backend, as c10d's other collectives have one: FakeTensorMode has no kernel to run it with",
}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The default process group as torch's fake backend, rank `rank` of `world_size`, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: a dry run needs its own")
    # what a rank's launcher exports and bench/core/dist.py sets (DeepSpeed reads them, not the group)
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def patched(used: set[str], adapter: str = ""):
    """The stand-ins module_to_fake, device_mesh_real, dtensor_propagation_mode and DDP's for the block, and those
    of `adapter`'s framework (DeepSpeed's, Megatron's, torch pipelining's); `used` collects those that ran."""
    import torch.distributed.device_mesh as mesh_module
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    to, mesh_init, init_mesh = nn.Module.to, mesh_module.DeviceMesh.__init__, mesh_module.init_device_mesh

    def module_to(self, *args, **kwargs):
        if _fake_on(self, *args, **kwargs):
            used.add("module_to_fake")
            return self
        return to(self, *args, **kwargs)

    def real_mesh_init(self, *args, **kwargs):
        used.add("device_mesh_real")
        with unset_fake_temporarily():
            return mesh_init(self, *args, **kwargs)

    def real_init_mesh(*args, **kwargs):
        used.add("device_mesh_real")
        with unset_fake_temporarily():
            return init_mesh(*args, **kwargs)

    import torch.distributed.tensor._sharding_prop as propagation

    detect = propagation.detect_fake_mode

    def own_mode():
        used.add("dtensor_propagation_mode")
        return None  # the propagator then makes its own FakeTensorMode, as it does outside a fake mode

    nn.Module.to, mesh_module.DeviceMesh.__init__ = module_to, real_mesh_init
    mesh_module.init_device_mesh, propagation.detect_fake_mode = real_init_mesh, own_mode
    framework = {"zero": _deepspeed_standins, "megatron": _megatron_standins, "pipeline": _pipeline_standins}.get(
        adapter
    )
    # a Library registration lives as long as its object: made here, destroyed on the way out
    coalesced = torch.library.Library("c10d", "IMPL")
    coalesced.impl("allreduce_coalesced_", _coalesced_allreduce_meta(used), "Meta")
    try:
        with _ddp_standins(used), framework(used) if framework else contextlib.nullcontext():
            yield
    finally:
        coalesced._destroy()
        nn.Module.to, mesh_module.DeviceMesh.__init__ = to, mesh_init
        mesh_module.init_device_mesh, propagation.detect_fake_mode = init_mesh, detect


@contextlib.contextmanager
def _ddp_standins(used: set[str]):
    """ddp_shape_check and ddp_comm_hook: every DDP built in the block (an adapter's model, a pipeline stage's
    replicas) skips the cross-rank shape check and all-reduces its buckets through `fake_allreduce_hook`."""
    import torch.nn.parallel.distributed as ddp_module

    verify, init = ddp_module._verify_param_shape_across_processes, ddp_module.DistributedDataParallel.__init__

    def no_verify(*_args, **_kwargs):
        used.add("ddp_shape_check")

    def init_with_hook(self, *args, **kwargs):
        init(self, *args, **kwargs)
        used.add("ddp_comm_hook")
        self.register_comm_hook(self.process_group, fake_allreduce_hook)
        self.reducer = _NoRebuild(self.reducer, used)

    ddp_module._verify_param_shape_across_processes = no_verify
    ddp_module.DistributedDataParallel.__init__ = init_with_hook
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = verify
        ddp_module.DistributedDataParallel.__init__ = init


@contextlib.contextmanager
def _deepspeed_standins(used: set[str]):
    """deepspeed_host_checks in each DeepSpeed module that imported the checks by name."""
    import importlib

    from deepspeed.runtime.utils import is_invalid_grad_norm
    from torch._subclasses.fake_tensor import FakeTensor

    def finite_norm(norm):
        if isinstance(norm, FakeTensor):
            used.add("deepspeed_host_checks")
            return False
        return is_invalid_grad_norm(norm)

    def same_ints(_ints):
        used.add("deepspeed_host_checks")

    replaced = []
    for name in ("stage3", "stage_1_and_2", "partition_parameters", "partitioned_param_coordinator"):
        module = importlib.import_module(f"deepspeed.runtime.zero.{name}")
        for attr, standin in (("is_invalid_grad_norm", finite_norm), ("assert_ints_same_as_other_ranks", same_ints)):
            if hasattr(module, attr):
                replaced.append((module, attr, getattr(module, attr)))
                setattr(module, attr, standin)
    try:
        yield
    finally:
        for module, attr, original in replaced:
            setattr(module, attr, original)


def _coalesced_allreduce_meta(used: set[str]):
    """coalesced_allreduce_meta: the Meta kernel of c10d::allreduce_coalesced_, the fake backend's Work boxed."""

    def kernel(tensors, group, *_reduce_op_async_timeout):
        used.add("coalesced_allreduce_meta")
        group = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
        backend = group._get_backend(torch.device("cpu"))
        return backend.allreduce_coalesced(tensors, dist.AllreduceCoalescedOptions()).boxed()

    return kernel


@contextlib.contextmanager
def _megatron_standins(used: set[str]):
    """megatron_no_gloo: initialize_model_parallel without its gloo groups."""
    from megatron.core import parallel_state

    init = parallel_state.initialize_model_parallel

    def without_gloo(*args, **kwargs):
        used.add("megatron_no_gloo")
        return init(*args, **{**kwargs, "create_gloo_process_groups": False})

    parallel_state.initialize_model_parallel = without_gloo
    try:
        yield
    finally:
        parallel_state.initialize_model_parallel = init


@contextlib.contextmanager
def _pipeline_standins(used: set[str]):
    """memtracker_microbatches: a stage module's forward for its next micro-batch, within the step, is tracked as
    MemTracker's own case of a module called again in one iteration (its parents then hold more than "Global")."""
    from torch.distributed._tools.mem_tracker import MemTracker

    pre_forward = MemTracker._pre_fw_hook
    schedule = "pipeline schedule (micro-batch loop)"

    def next_microbatch(self, module, inputs):
        tracker = self._mod_tracker
        again = module in self.memory_tracking and not tracker.is_bw
        # a top-level module: nothing but "Global" and its own name (there while its hooks run) in parents
        if not again or tracker.parents - {tracker.get_known_fqn(module)} != {"Global"}:
            return pre_forward(self, module, inputs)
        used.add("memtracker_microbatches")
        tracker.parents.add(schedule)
        try:
            return pre_forward(self, module, inputs)
        finally:
            tracker.parents.discard(schedule)

    MemTracker._pre_fw_hook = next_microbatch
    try:
        yield
    finally:
        MemTracker._pre_fw_hook = pre_forward


class _NoRebuild:
    """A DDP Reducer whose `_rebuild_buckets` keeps the buckets it has (ddp_bucket_rebuild); the rest is the
    Reducer's own."""

    def __init__(self, reducer, used: set[str]):
        self._reducer, self._used = reducer, used

    def _rebuild_buckets(self) -> bool:
        self._used.add("ddp_bucket_rebuild")
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def fake_allreduce_hook(group, bucket):  # unannotated: DDP checks the annotation as a type, not a string
    """DDP's default all-reduce of one bucket (sum, then divide by the group's size), its result in a completed
    Future: the default hook returns the Work's value, which the fake backend's Work does not have."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(dist.get_world_size(group))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _fake_on(module: nn.Module, *args, **kwargs) -> bool:
    """Whether `module.to(*args)` is a move to where its tensors already are, all of them fake."""
    from torch._subclasses.fake_tensor import FakeTensor

    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if dtype is not None or memory_format is not None:
        return False
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(
        isinstance(t, FakeTensor) and (device is None or t.device == torch.device(device)) for t in tensors
    )
