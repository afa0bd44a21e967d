"""PyTorch tensor parallelism (`torch.distributed.tensor.parallel`) for the harness's own GPT-2.

The diff from a single-process loop: a 2-D DeviceMesh (dp, tp), then `parallelize_module` with
Megatron's sharding written in torch's styles: per block, attn.c_attn and mlp.c_fc ColwiseParallel
and attn.c_proj and mlp.c_proj RowwiseParallel (one all-reduce after each pair); the token embedding
sharded over the vocabulary (RowwiseParallel) and the tied LM head ColwiseParallel, whose
vocabulary-sharded logits the loss reads under `loss_parallel()` without gathering them. c_attn
can be split by columns because its outputs are ordered per head (workloads/gpt2.py), and the
attention reshapes by head_dim, so each rank simply runs its own heads.

Every rank builds the full model from the seed and keeps its slice, so the run starts from the
same weights as adapter=ddp and a TP-only run matches the single-process GPT-2 (tested).

Data parallelism over the mesh's dp dimension: one coalesced all-reduce of the gradients per step.
(DDP(device_mesh=...)'s TP support cannot handle the tied wte/lm_head weight, nor a vocabulary that
does not split evenly, like GPT-2's 50257 rows over 2 ranks: its parameter broadcast fails.)

Batch: `batch_policy=per_device` counts one TP group as one device's worth of batch: each replica
loads trainer.batch_size, so TP=2 on 2 ranks sees the global batch of a single process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ptbench.adapters import _vocab_parallel as vocab_parallel
from ptbench.adapters.base import Adapter, Batch, local_tensor, tensor_bytes
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.optim import build_optimizer, refuse_layerwise
from ptbench.core.precision import autocast
from ptbench.core.timing import PhaseTimer


def _rows_before(rows: list[int], rank: int) -> int:
    return int(sum(rows[:rank]))


def _per_rank(func):
    """`func` as torch's maybe_run_for_local_tensor makes it: run once per simulated rank under LocalTensorMode (all
    ranks in one process, tests/test_local_tensor.py), unchanged otherwise and on a torch without it."""
    try:
        from torch.distributed._local_tensor import maybe_run_for_local_tensor
    except ImportError:
        return func
    return maybe_run_for_local_tensor(func)


def _is_sharded(t: torch.Tensor) -> bool:
    return any(p.is_shard() for p in getattr(t, "placements", ()))


class TensorParallelAdapter(Adapter):
    name = "tensor_parallel"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward": "forward with the tensor-parallel all-reduces/all-gathers of activations inside",
        "backward": "backward (TP collectives inside), then the data-parallel gradient all-reduce",
    }
    kinds = ("language",)

    @classmethod
    def checkpoint_refusal(cls, cfg) -> None:
        # the base's DCP get_state_dict/set_state_dict: the TP-sharded DTensors (tied wte/lm_head included) are
        # written as shards, the replicated parameters once per data-parallel group
        return None

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str]:
        # tensor parallel inside a node, data parallel across nodes
        return [f"launcher.nprocs={gpus}", f"adapter.tensor_parallel={min(gpus, gpus_per_node or gpus)}"]

    @classmethod
    def layout(cls, cfg, world_size: int) -> Layout:
        tp = cfg.adapter.tensor_parallel
        return Layout(world_size=world_size, dp=world_size // tp if tp >= 1 else 0, tp=tp)

    @classmethod
    def cost_inputs(cls, cfg) -> CostInputs:
        return CostInputs(half_activation_comm=True)  # the TP all-reduces carry bf16 matmul outputs

    @classmethod
    def check(cls, cfg, world_size):
        w, a = cfg.workload, cfg.adapter
        if w.kind != "language" or w.arch != "gpt2":
            raise ConfigError(
                f"adapter=tensor_parallel does not support workload={w.name}: it shards the harness GPT-2 "
                f"(workload.arch=gpt2); use another adapter (ddp, fsdp, zero, ...) for {w.arch}"
            )
        tp = a.tensor_parallel
        if tp < 1 or world_size % tp:
            raise ConfigError(
                f"adapter.tensor_parallel={tp} must be >= 1 and divide the {world_size} ranks "
                f"(launcher.nprocs): ranks = tensor_parallel x data-parallel replicas"
            )
        if w.n_head % tp:
            raise ConfigError(
                f"workload.n_head={w.n_head} is not divisible by adapter.tensor_parallel={tp}: each "
                f"rank computes whole attention heads"
            )
        if cfg.trainer.precision == "fp16":
            raise ConfigError("trainer.precision=fp16 is not supported by adapter=tensor_parallel; use bf16 or fp32")
        if tp > 1:
            refuse_layerwise(
                cfg.optimizer,
                f"adapter=tensor_parallel with tensor_parallel={tp}",
                "gives each rank column/row slices of the weights",
            )

    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        return [f"launcher.nprocs={devices}", f"adapter.tensor_parallel={2 if devices % 2 == 0 else 1}"]

    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.tp = self.cfg.adapter.tensor_parallel
        self.dp = self.ctx.world_size // self.tp
        self.mesh = init_device_mesh(self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        self.tp_group, self.dp_group = self.mesh.get_group("tp"), self.mesh.get_group("dp")

        model = self.workload.build_model().to(self.device)
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows split; output all-reduced
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits split by vocab
        }
        for i in range(len(model.blocks)):
            plan.update(
                {
                    f"blocks.{i}.attn.c_attn": ColwiseParallel(),
                    f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                    f"blocks.{i}.mlp.c_fc": ColwiseParallel(),
                    f"blocks.{i}.mlp.c_proj": RowwiseParallel(),
                }
            )
        parallelize_module(model, self.mesh["tp"], plan)
        model.lm_head.weight = model.wte.weight  # parallelize_module gave lm_head its own copy: tie again
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, self.cfg.optimizer)

        # first vocabulary id of this rank's slice (DTensor splits uneven sizes like torch.chunk)
        rows = torch.tensor([local_tensor(model.wte.weight).shape[0]], device=self.device)
        all_rows = [torch.zeros_like(rows) for _ in range(self.tp)]
        dist.all_gather(all_rows, rows, group=self.tp_group)
        self.vocab_start = _per_rank(_rows_before)([r.item() for r in all_rows], self.mesh.get_local_rank("tp"))

    def modules(self):
        return [self.model]

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def reports_metrics(self) -> bool:
        return self.mesh.get_local_rank("tp") == 0

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        from torch.distributed.tensor.parallel import loss_parallel

        precision = self.cfg.trainer.precision
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            with timer.phase("forward"), autocast(precision, self.device), loss_parallel():
                loss = self.workload.loss(self.model(x), y) / n
            with timer.phase("backward"), loss_parallel():
                loss.backward()
            total += local_tensor(loss.detach())  # replicated over the TP group
        if self.dp > 1:
            with timer.phase("backward"):  # counted like DDP's all-reduce, which runs inside backward
                self._average_gradients()
        with timer.phase("optimizer"):
            if self.cfg.trainer.grad_clip > 0:
                self._clip(self.cfg.trainer.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # keep the buffers, as DDP does
        return total

    def _average_gradients(self) -> None:
        grads = [local_tensor(p.grad) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)  # SUM: gloo has no AVG
        flat /= self.dp
        for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(avg.view_as(g))

    def _clip(self, max_norm: float) -> None:
        """Global L2 norm: slices of sharded gradients summed over the TP group, replicated ones once."""
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        for p in self.params:
            sq = local_tensor(p.grad).float().pow(2).sum()
            if _is_sharded(p.grad):
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(sharded, group=self.tp_group)
        norm = (sharded + replicated).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        torch._foreach_mul_([local_tensor(p.grad) for p in self.params], scale)

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        with autocast(self.cfg.trainer.precision, self.device):
            logits = self.model(inputs)
        return vocab_parallel.eval_sums(local_tensor(logits), self.vocab_start, targets, weight, self.tp_group)

    def state_bytes(self) -> dict[str, int]:
        out = tensor_bytes(self.modules(), self.optimizer)
        out["params_tp_sharded"] = sum(
            local_tensor(p).numel() * p.element_size() for p in self.params if _is_sharded(p)
        )
        return out

    def describe(self) -> dict:
        return {
            "tensor_parallel": self.tp,
            "data_parallel": self.dp,
            "mesh": {"dp": self.dp, "tp": self.tp},
            "sharded": "c_attn, mlp.c_fc: colwise; attn.c_proj, mlp.c_proj: rowwise; wte/lm_head (tied): by vocab",
            "loss": "loss_parallel (vocab-sharded logits, not gathered)",
            "dp_gradient_sync": "one coalesced all-reduce per step" if self.dp > 1 else None,
        }


ADAPTER = TensorParallelAdapter
