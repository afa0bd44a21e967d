"""PyTorch DistributedDataParallel: the plain-PyTorch baseline every other adapter is compared to.

The diff from a single-process loop: wrap the model in DDP, skip the gradient all-reduce with
`no_sync()` on all but the last micro-batch of an accumulated step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ptbench.adapters.base import Adapter, Batch
from ptbench.core.optim import build_optimizer, optimizer_step
from ptbench.core.precision import autocast, grad_scaler
from ptbench.core.timing import PhaseTimer


class DDPAdapter(Adapter):
    name = "ddp"
    compile_how = "module.compile() of the model inside DDP (graph split at DDP buckets by DDPOptimizer)"

    @classmethod
    def checkpoint_refusal(cls, cfg) -> None:
        return None  # the base's DCP get_state_dict/set_state_dict on the DDP wrapper (replicated tensors once)

    @classmethod
    def compile_refusal(cls, cfg) -> None:
        # the module is compiled in place, then wrapped; TorchDynamo's DDPOptimizer splits the graph at
        # DDP's bucket boundaries, so gradient all-reduces still overlap backward
        return None

    def setup(self) -> None:
        cfg = self.cfg.adapter
        model = self.workload.build_model().to(self.device)
        if cfg.sync_batchnorm and self.ctx.is_cuda:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.compile_module(model)
        self.model = DDP(
            model,
            device_ids=[self.device.index] if self.ctx.is_cuda else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            find_unused_parameters=cfg.find_unused_parameters,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        )
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optimizer)
        self.scaler = grad_scaler(self.cfg.trainer.precision, self.device)

    def modules(self):
        return [self.model.module]

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        precision = self.cfg.trainer.precision
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            # all-reduce gradients only with the last micro-batch of the step
            sync = contextlib.nullcontext() if i == n - 1 else self.model.no_sync()
            with sync:
                with timer.phase("forward"), autocast(precision, self.device):
                    loss = self.workload.loss(self.model(x), y) / n
                with timer.phase("backward"):
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        with timer.phase("optimizer"):
            optimizer_step(self.optimizer, self.model.parameters(), self.cfg.trainer.grad_clip, self.scaler)
            # keep gradient buffers: they are DDP bucket views, held for the whole run anyway
            self.optimizer.zero_grad(set_to_none=False)
        return total

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        with autocast(self.cfg.trainer.precision, self.device):
            out = self.model.module(inputs)  # no DDP forward hooks needed without backward
        return self.workload.eval_sums(out, targets, weight)

    def describe(self) -> dict:
        c = self.cfg.adapter
        return {
            "bucket_cap_mb": c.bucket_cap_mb,
            "find_unused_parameters": c.find_unused_parameters,
            "sync_batchnorm": bool(c.sync_batchnorm and self.ctx.is_cuda),
        }


ADAPTER = DDPAdapter
