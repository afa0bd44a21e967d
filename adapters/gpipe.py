"""GPipe through torchgpipe: one process drives every partition of the model, as in the paper.

The diff from a single-process loop: cut the model's sequential form into partitions, one per device,
and wrap it, `model = GPipe(seq, balance, devices=..., chunks=..., checkpoint=...)`. Its forward
splits each batch into `chunks` micro-batches and pipelines them through the partitions; the
ordinary `loss.backward()` and `optimizer.step()` follow. On GPU the partitions sit on cuda:0..k-1
of the node; on CPU every partition is `cpu`, which runs the same pipeline logic (one worker thread).

Paper's batch policy (`adapter.batch_policy=per_microbatch`): trainer.batch_size is the micro-batch
size and chunks = 4 x partitions, so the mini-batch grows with the partition count. Balance: an
explicit `adapter.balance` or torchgpipe's `balance_by_time` profiling. BatchNorm: deferred (running
statistics once per mini-batch, as a full-batch BatchNorm would keep them). GPT-2's tied embedding /
head weight: the head gets its own copy whose gradient is summed with the embedding's every step
(see adapters/_pipeline.py), because torchgpipe refuses one Parameter in two partitions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from ptbench.adapters import _pipeline as P
from ptbench.adapters.base import Adapter, Batch, load_rank0_state, save_rank0_state, tensor_bytes
from ptbench.core.config import BenchConfig
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.memory import SavedTensorLedger
from ptbench.core.optim import build_optimizer, optimizer_step
from ptbench.core.precision import AutocastModule, grad_scaler
from ptbench.core.timing import PhaseTimer
from ptbench.workloads import build_workload

CHECKPOINT_MODES = ("always", "except_last", "never")


class GPipeAdapter(Adapter):
    name = "gpipe"
    framework = "torchgpipe"
    framework_module = "torchgpipe"
    extra = "gpipe"
    checkpoint_format = "rank 0 torch.save of model and optimizer state_dict"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward": "the pipelined forward of the mini-batch over all partitions, fill and drain bubbles included",
        "backward": "the pipelined backward with recomputation (checkpoint), bubbles included",
        "optimizer": "sum the tied gradients, clip over the global norm, step every partition",
    }

    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        # one process driving `devices` partitions; a mini-batch of 4 x the micro-batch
        return ["launcher.nprocs=1", f"adapter.pipeline_parallel={devices}", "adapter.microbatches=4"]

    # --- before launch ---------------------------------------------------------------------------
    @classmethod
    def partitions(cls, cfg: BenchConfig) -> int:
        return cfg.adapter.pipeline_parallel

    @classmethod
    def processes(cls, cfg: BenchConfig) -> int:
        return 1  # one process drives all partitions; launcher.nprocs does not apply

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str] | str:
        if gpus_per_node and gpus > gpus_per_node:
            return "one process drives every partition (one node)"
        return ["launcher.nprocs=1", f"adapter.pipeline_parallel={gpus}"]

    @classmethod
    def layout(cls, cfg: BenchConfig, world_size: int) -> Layout:
        """One process (one replica) driving k partitions, one device each; paper: micro-batches = 4 x GPUs."""
        k = cls.partitions(cfg)
        return Layout(
            world_size=world_size, dp=1, pp=k, devices_per_process=k, microbatches=cfg.adapter.microbatches or 4 * k
        )

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig) -> CostInputs:
        # every micro-batch's forward before any backward; adapter.checkpoint recomputes stage activations
        a = cfg.adapter  # balance None (balance_by_time) is modelled as an even split
        return CostInputs(
            schedule="gpipe", recompute=a.checkpoint, stage_balance=tuple(a.balance) if a.balance else None
        )

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> None:
        # one process holds every partition: torch.save of the layers' state_dict under the names of the
        # unsplit sequential model (balance_by_time may split a resumed run differently; the tied head copy
        # and deferred BatchNorm buffers included) and the optimizer's (parameters in layer order)
        return None

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        a = cfg.adapter
        k = cls.partitions(cfg)
        if world_size != 1:
            raise ConfigError(
                f"adapter=gpipe drives all {k} partitions from one process but {world_size} processes were "
                f"started; run it with launcher=local (one process), not torchrun/srun with several tasks"
            )
        if a.checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(f"adapter.checkpoint={a.checkpoint}: choose {', '.join(CHECKPOINT_MODES)}")
        if torch.cuda.is_available() and k > torch.cuda.device_count():
            raise ConfigError(
                f"adapter.pipeline_parallel={k} partitions but this node has {torch.cuda.device_count()} "
                f"GPUs; use at most {torch.cuda.device_count()} partitions"
            )
        workload = build_workload(cfg.workload, cfg.data)
        P.check_split(a.balance, P.layer_count(workload), k, cfg.workload.name, f"adapter.pipeline_parallel={k}")
        m = cls.layout(cfg, world_size).microbatches
        P.check_microbatches(cls.local_batch_size(cfg, world_size), m, "the mini-batch")

    # --- on the rank -----------------------------------------------------------------------------
    def setup(self) -> None:
        from torchgpipe import GPipe
        from torchgpipe.balance import balance_by_time

        a = self.cfg.adapter
        k = self.partitions(self.cfg)
        if self.ctx.is_cuda:
            self._devices = [torch.device("cuda", i) for i in range(k)]
        else:
            self._devices = [torch.device("cpu")] * k
        self.chunks = self.layout(self.cfg, 1).microbatches
        self.micro_batch = self.local_batch_size(self.cfg, 1) // self.chunks

        seq = self.workload.sequential(self.workload.build_model())
        # torchgpipe refuses one Parameter in two partitions: the head gets an equal copy (adapters/_pipeline.py)
        self.ties = P.untie(seq, self.workload.tied_parameters(sequential=True))
        self.has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in seq.modules())
        if self.has_batchnorm and a.deferred_batch_norm:
            seq = _defer_batch_norm(seq, self.chunks)

        if a.balance is not None:
            self.balance, self.balance_by = [int(b) for b in a.balance], "config"
        else:
            sample = self._sample(self.micro_batch)
            self.balance = balance_by_time(k, seq, sample, device=self._devices[0])
            self.balance_by = "time"

        self.model = GPipe(
            seq,
            balance=self.balance,
            devices=self._devices,
            chunks=self.chunks,
            checkpoint=a.checkpoint,
            deferred_batch_norm=False,
        )  # converted above (unbiased)
        precision = self.cfg.trainer.precision
        if precision != "fp32":
            # torchgpipe runs partitions in worker threads, where the caller's autocast (thread-local)
            # does not reach: each partition enters it itself (also when checkpointing recomputes it)
            for j, part in enumerate(self.model.partitions):
                self.model.partitions[j] = AutocastModule(part, precision, self._devices[j])
        count_partitions(self.model)  # the memory ledger counts each partition on its worker thread
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optimizer)
        self.scaler = grad_scaler(precision, self.device)
        copies = P.tied_copies(self.ties)
        self.unique_params = [p for p in self.model.parameters() if id(p) not in copies]

    def _sample(self, n: int) -> torch.Tensor:
        """n real inputs of the training set, for balance_by_time's per-layer profile."""
        train, _ = self.workload.datasets(local_rank=self.ctx.local_rank)
        return torch.stack([train[i][0] for i in range(min(n, len(train)))])

    def modules(self):
        return [self.model]

    def devices(self):
        return self._devices

    def _sync(self) -> None:
        # phases must not bill one device's queued kernels to the next phase: wait for every GPU
        if self.ctx.is_cuda and self.cfg.trainer.sync_timing:
            for d in dict.fromkeys(self._devices):
                torch.cuda.synchronize(d)

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        timer.use_devices(self._devices)  # >= 2 GPUs: phase events on every partition's device (next step on)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:  # trainer.grad_accum mini-batches, each pipelined in `chunks` micro-batches
            with timer.phase("forward"):
                out = self.model(x.to(self._devices[0]))
                with _counting(len(self.balance) - 1):  # the loss sits on the last partition's device
                    loss = self.workload.loss(out, y.to(out.device)) / n
                self._sync()
            with timer.phase("backward"):
                (self.scaler.scale(loss) if self.scaler else loss).backward()
                self._sync()
            total += loss.detach().to(self.device)
        with timer.phase("optimizer"):
            for t in self.ties:
                t.sum_local_grads()
            # clip over the unique parameters (the tied gradient counted once), then give the copy its sum
            optimizer_step(
                self.optimizer,
                self.unique_params,
                self.cfg.trainer.grad_clip,
                self.scaler,
                before_step=self._copy_tied_grads,
            )
            self.optimizer.zero_grad(set_to_none=False)  # keep gradient buffers, as DDP does: counted in state bytes
            self._sync()
        return total

    def _copy_tied_grads(self) -> None:
        for t in self.ties:
            t.copy.grad.copy_(t.main.grad)

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        out = self.model(inputs.to(self._devices[0]))  # pipelined too; BatchNorm uses its running stats
        return self.workload.eval_sums(out, targets.to(out.device), weight.to(out.device)).to(self.device)

    def state_bytes(self) -> dict:
        total = tensor_bytes([self.model], self.optimizer)
        total["per_partition"] = [
            {
                "partition": j,
                "device": str(d),
                "layers": n,
                **tensor_bytes([part], _OptimizerView(self.optimizer, part)),
            }
            for j, (part, d, n) in enumerate(zip(self.model.partitions, self._devices, self.balance))
        ]
        return total

    def save_checkpoint(self, path) -> None:
        save_rank0_state(path, _LayerState(self.model), self.optimizer, self.scaler, self.ctx.rank)

    def load_checkpoint(self, path) -> None:
        load_rank0_state(path, _LayerState(self.model), self.optimizer, self.scaler)

    def describe(self) -> dict:
        a = self.cfg.adapter
        return {
            "partitions": len(self.balance),
            "devices": [str(d) for d in self._devices],
            "balance": self.balance,
            "balance_by": self.balance_by,
            "chunks": self.chunks,
            "micro_batch_size": self.micro_batch,
            "checkpoint": a.checkpoint,
            "deferred_batch_norm": bool(self.has_batchnorm and a.deferred_batch_norm),
            "tied_weights": [f"{t.copy_name} = copy of {t.main_name}, gradients summed each step" for t in self.ties],
            "partition_param_bytes": [tensor_bytes([p], None)["params"] for p in self.model.partitions],
        }


class _LayerState:
    """The GPipe module's state keyed by layer name, without the partition index: independent of the balance."""

    def __init__(self, model):
        self.parts = [_unwrapped(p) for p in model.partitions]

    def state_dict(self) -> dict:
        out = {}
        for part in self.parts:
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.state_dict())
        if expected != set(state):
            raise RuntimeError(
                f"checkpoint layers differ from this model's: missing {sorted(expected - set(state))[:5]}, "
                f"unexpected {sorted(set(state) - expected)[:5]}"
            )
        for part in self.parts:
            part.load_state_dict({k: state[k] for k in part.state_dict()})


class _Counted(nn.Module):
    """A partition that, in the memory ledger's counted step, counts for itself what autograd saves in its
    forward, which torchgpipe runs on a worker thread where the step's saved-tensor hooks (per thread) do not
    reach, and in its recomputation in backward; the input it received counts for it when torchgpipe's
    Recompute node keeps it from the main thread (SavedTensorLedger.partition). Outside that step: a call."""

    def __init__(self, module: nn.Module, index: int):
        super().__init__()
        self.module, self.index = module, index

    def forward(self, x):
        with _counting(self.index, x):
            return self.module(x)


def count_partitions(model) -> None:
    """Wrap each partition of a torchgpipe GPipe in _Counted, in place (what `setup` does)."""
    for j, part in enumerate(model.partitions):
        model.partitions[j] = _Counted(part, j)


def _counting(index: int, inputs=()):
    ledger = SavedTensorLedger.active()
    return ledger.partition(index, inputs) if ledger is not None else contextlib.nullcontext()


def _unwrapped(part: nn.Module) -> nn.Module:
    """The partition's layers without _Counted / AutocastModule around them."""
    while isinstance(part, (_Counted, AutocastModule)):
        part = part.module
    return part


class _OptimizerView:
    """The optimizer state of one partition's parameters (for per-partition byte counts)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module):
        self.state = {p: optimizer.state[p] for p in module.parameters() if p in optimizer.state}


def _unbiased_deferred_bn():
    from torchgpipe.batchnorm import DeferredBatchNorm

    class UnbiasedDeferredBatchNorm(DeferredBatchNorm):
        """torchgpipe's DeferredBatchNorm commits the biased variance of the mini-batch; torch's BatchNorm
        keeps the unbiased one (x n/(n-1)), which differs by 1/(n-1): 7 % for a 16-image batch at a 1x1
        feature map. This commit keeps torch's convention, so running statistics equal those a
        full-batch BatchNorm would keep; sums are held in float64 against E[x^2] - E[x]^2 cancellation."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_buffer("sum", self.sum.double())
            self.register_buffer("sum_squares", self.sum_squares.double())

        def _commit(self) -> None:
            self.num_batches_tracked += 1
            m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            n = self.counter
            mean = self.sum / n
            var = (self.sum_squares / n - mean**2) * (n / max(n - 1, 1))
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(var.to(self.running_var.dtype), alpha=m)
            self.sum.zero_()
            self.sum_squares.zero_()
            self.counter = 0
            self.tracked = 0

    return UnbiasedDeferredBatchNorm


def _defer_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """Replace every BatchNorm by UnbiasedDeferredBatchNorm sharing its parameters and buffers (torchgpipe's
    own converter hard-codes its class)."""
    cls = _unbiased_deferred_bn()
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and child.track_running_stats:
            new = cls(child.num_features, child.eps, child.momentum, child.affine, chunks)
            if child.affine:
                new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            new.train(child.training)
            setattr(module, name, new)
        else:
            _defer_batch_norm(child, chunks)
    return module


ADAPTER = GPipeAdapter
