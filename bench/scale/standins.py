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
def patched(used: set[str]):
    """The stand-ins module_to_fake, device_mesh_real and dtensor_propagation_mode for the block; `used` collects those that ran."""
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
    try:
        yield
    finally:
        nn.Module.to, mesh_module.DeviceMesh.__init__ = to, mesh_init
        mesh_module.init_device_mesh, propagation.detect_fake_mode = init_mesh, detect


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
