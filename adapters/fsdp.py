"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state
sharded over the data-parallel ranks, gathered layer by layer for forward and backward.

The diff from a single-process loop, as in PyTorch's FSDP2 tutorial: call `fully_shard` on each
layer, then on the root, then build the optimizer on the (now DTensor) parameters. Each layer is
one communication unit: its parameters are all-gathered just before it runs and (with
`adapter.reshard_after_forward`) freed again after its forward; its gradients are reduce-scattered
as soon as its backward is done. Parameters that two layers share (GPT-2's tied wte/lm_head) stay
with the root unit, so the tie survives sharding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ptbench.adapters.base import Adapter, Batch, local_tensor
from ptbench.core.layout import CostInputs
from ptbench.core.optim import build_optimizer, optimizer_step, param_groups, refuse_layerwise
from ptbench.core.precision import HALF_DTYPES
from ptbench.core.timing import PhaseTimer


def shard_units(workload, model: nn.Module) -> list[nn.Module]:
    """The layers to shard one by one: the workload's sequential layers that own parameters.

    GPT-2: its blocks (the embedding and head share wte, so they stay with the root). VGG-16: each
    conv and linear layer. ResNet-50: the stem conv and norm, each bottleneck block, the classifier.
    """
    own = {id(m) for m in model.modules()}
    layers = [m for m in workload.sequential(model) if id(m) in own and any(True for _ in m.parameters())]
    owners: dict[int, int] = {}
    for m in layers:
        for p in m.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in layers if all(owners[id(p)] == 1 for p in m.parameters())]


class FSDPAdapter(Adapter):
    name = "fsdp"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward": "forward; each layer's parameters all-gathered first (prefetched, overlapped)",
        "backward": "backward; parameters re-gathered (reshard_after_forward) and gradients reduce-scattered",
        "optimizer": "clip over the global norm of the sharded gradients, step the local shards",
    }
    compile_how = "module.compile() of each shard unit before fully_shard (torchtitan's per-block compile)"
    # fully_shard refuses non-contiguous parameters: channels_last activations only
    channels_last_weights = False
    precision_semantics = (
        "FSDP2 MixedPrecisionPolicy: bf16/fp16 parameters for compute (param_dtype), fp32 "
        "sharded master parameters and fp32 gradient reduction; BatchNorm parameters and math in fp32"
    )

    @classmethod
    def checkpoint_refusal(cls, cfg) -> None:
        # the base's DCP get_state_dict/set_state_dict: each rank writes and reads its own DTensor shards of
        # parameters and optimizer state (a sharded state dict, never gathered)
        return None

    @classmethod
    def compile_refusal(cls, cfg) -> None:
        # as torchtitan, each shard unit (block) is compiled before fully_shard wraps it, so FSDP2's
        # all-gather/reduce-scatter hooks stay outside the compiled graphs
        return None

    @classmethod
    def cost_inputs(cls, cfg) -> CostInputs:
        # MixedPrecisionPolicy: bf16/fp16 parameters gathered, fp32 sharded master and gradient reduction
        return CostInputs(
            sharding="fsdp",
            half_gather=True,
            reshard_after_forward=cfg.adapter.reshard_after_forward,
            root_unit_gathered=True,  # the root unit is wrapped reshard_after_forward=False (as torchtitan)
            whole_norm_params=cfg.trainer.precision in HALF_DTYPES,  # BatchNorm kept out of sharding (setup)
        )

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        refuse_layerwise(cfg.optimizer, "adapter=fsdp", "shards every tensor along dim 0 (DTensor shards)")

    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        cfg = self.cfg
        precision = cfg.trainer.precision
        model = self.workload.build_model().to(self.device)
        mesh = init_device_mesh(self.device.type, (self.ctx.world_size,))
        # compute in half precision, reduce gradients and keep the sharded master parameters in fp32
        self.mp_policy = MixedPrecisionPolicy(
            param_dtype=HALF_DTYPES.get(precision), reduce_dtype=torch.float32 if precision in HALF_DTYPES else None
        )
        reshard = cfg.adapter.reshard_after_forward
        # BatchNorm keeps fp32 parameters and math, as under DDP's autocast: its running statistics are fp32
        # buffers FSDP does not cast, and batch_norm refuses bf16 weights beside them. Its few parameters stay
        # out of sharding (`ignored_params`: whole fp32 tensors on every rank, batch_norm's mixed-type kernel
        # taking the half input) and their gradients are averaged in one all-reduce per step. A fully_shard
        # per norm would cost two collectives each (ResNet-50: 53 norms, 142 all-gathers and 71
        # reduce-scatters a step against 38 and 19), and one over a unit's norms together casts per module
        # only from torch 2.13 on.
        half = HALF_DTYPES.get(precision)
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] if half else []
        self.norm_params = [p for m in norms for p in m.parameters()]
        ignored = set(self.norm_params) or None
        self.units = [u for u in shard_units(self.workload, model) if _has_params(u, ignored)]
        for unit in self.units:
            self.compile_module(unit)
            fully_shard(
                unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=self.mp_policy, ignored_params=ignored
            )
        # the root is all-gathered first in forward and needed again first in backward: keeping it
        # unsharded between the two saves one all-gather, as FSDP2 itself does by default for the root
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=self.mp_policy, ignored_params=ignored)
        self.dp_group = mesh.get_group()
        self.model = model
        norm_ids = {id(p) for p in self.norm_params}
        sharded = [p for p in model.parameters() if id(p) not in norm_ids]
        self.sharded_params = sharded
        # two kinds of tensor, two sets of param groups: foreach kernels take DTensors or plain tensors, not both
        groups = param_groups(sharded, cfg.optimizer.weight_decay) + param_groups(
            self.norm_params, cfg.optimizer.weight_decay
        )
        self.optimizer = build_optimizer(groups, cfg.optimizer)
        self.scaler = None
        if precision == "fp16":
            # fp16 needs loss scaling; the sharded scaler agrees on inf/nan across ranks (GPU only)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type)
        self._probe_grads = True
        self._grad_bytes = 0

    def modules(self):
        return [self.model]

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            # reduce-scatter gradients only in the last micro-batch's backward (like DDP's no_sync)
            self.model.set_requires_gradient_sync(i == n - 1)
            with timer.phase("forward"):
                loss = self.workload.loss(self.model(x), y) / n
            with timer.phase("backward"):
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach().float()
        self._average_norm_grads()
        if self._probe_grads:
            # first step of the run (warm-up): zero_grad below frees the sharded gradients, so read them
            # here, where all are held (unsharded per-layer gradients live only inside FSDP's reduce-scatter)
            self._grad_bytes = _local_bytes(p.grad for p in self.model.parameters())
            self._probe_grads = False
        with timer.phase("optimizer"):
            if not self.norm_params:
                # clip_grad_norm_ on DTensor gradients computes the global norm across the shards
                optimizer_step(self.optimizer, self.model.parameters(), self.cfg.trainer.grad_clip, self.scaler)
            else:
                # unscale (fp16) first, then the norm over sharded and replicated gradients together
                optimizer_step(self.optimizer, (), 0.0, self.scaler, before_step=self._clip_mixed)
            self.optimizer.zero_grad()
        return total

    def _average_norm_grads(self) -> None:
        """The replicated BatchNorm gradients averaged over the ranks, as DDP does: one all-reduce."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.norm_params if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(avg)

    def _clip_mixed(self) -> None:
        """clip_grad_norm_ over all gradients when some are DTensor shards and some whole tensors (it stacks
        both kinds of norm and refuses): the shards' squares summed across the ranks, the replicated ones once."""
        import torch.distributed as dist

        max_norm = self.cfg.trainer.grad_clip
        if max_norm <= 0:
            return
        shards = [local_tensor(p.grad) for p in self.sharded_params if p.grad is not None]
        whole = [p.grad for p in self.norm_params if p.grad is not None]
        squares = sum((g.float().pow(2).sum() for g in shards), torch.zeros((), device=self.device))
        dist.all_reduce(squares, group=self.dp_group)
        squares = squares + sum((g.float().pow(2).sum() for g in whole), torch.zeros((), device=self.device))
        coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(shards + whole, coef)

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        return self.workload.eval_sums(self.model(inputs), targets, weight)

    def state_bytes(self) -> dict[str, int]:
        """Local shards this rank holds: parameters and optimizer state now, gradients at the end of backward."""
        opt = (v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        state = {
            "params": _local_bytes(self.model.parameters()),
            "grads": self._grad_bytes,
            "optimizer": _local_bytes(opt),
        }
        return state

    def describe(self) -> dict:
        return {
            "reshard_after_forward": self.cfg.adapter.reshard_after_forward,
            "shard_units": len(self.units) + 1,  # + the root
            "param_dtype": str(self.mp_policy.param_dtype).replace("torch.", "")
            if self.mp_policy.param_dtype
            else "fp32",
            "reduce_dtype": str(self.mp_policy.reduce_dtype).replace("torch.", "")
            if self.mp_policy.reduce_dtype
            else "fp32",
            # BatchNorm parameter tensors kept whole in fp32 and all-reduced (0: none, or fp32 training)
            "batchnorm_fp32_replicated": len(self.norm_params),
        }


def _has_params(module: nn.Module, ignored) -> bool:
    return any(p not in (ignored or ()) for p in module.parameters())


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_tensor(t)
        total += t.numel() * t.element_size()
    return total


ADAPTER = FSDPAdapter
