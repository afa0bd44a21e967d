"""torch.distributed.pipelining: one rank per pipeline stage, across processes and nodes.

The diff from a single-process loop: every rank builds the same model, keeps only its stage's layers
of `workload.sequential(model)`, wraps them in `PipelineStage(module, stage_index, num_stages,
device)` and lets a schedule run forward, loss and backward of all micro-batches in one call,
`schedule.step(x, target=y, losses=losses)`; then the ordinary `optimizer.step()`.

Schedules (`adapter.schedule`): `gpipe` (all forwards, then all backwards), `1f1b` (one forward one
backward in steady state, = PipeDream-Flush: activations of at most #stages micro-batches alive) and
`interleaved_1f1b` (several stages per rank, stage s on rank s % pipeline ranks). Stages: an even
split by layer count or `adapter.balance` (layers per stage). Ranks = pipeline ranks x data-parallel
replicas: rank r is stage rank r % pp of replica r // pp; replicas read different data and average
gradients with DDP over the replica group (the DDP support built into PipelineStage).

Stage shapes are given to each PipelineStage (`input_args` / `output_args`, from one micro-batch's forward
on fake tensors: `stage_shapes`), so the schedule does not infer them at the first step; torch's inference
and these are equal (tests/test_scale_pipeline.py), and they let the stages run on a fake process group.

GPT-2's tied embedding / head weight: when the embedding and the head land on different stages, the
head stage holds its own copy, initialised equal, and after every step the two gradients are summed
(an all-reduce between the first and the last stage rank of each replica), so both copies take the
same update as the tied weight would. See adapters/_pipeline.py.

Checkpoints: DCP (get_state_dict/set_state_dict) of a ModuleDict of this rank's stage modules keyed
`stage<s>`, with the optimizer state flattened to one key per parameter (`flatten_optimizer_state_dict`,
as torchtitan does for pipelines): every stage's keys are its own, so the ranks of one pipeline write
disjoint keys (unflattened, their different `param_groups` would share one key and DCP would keep
one rank's) and the replicas of a stage write the same keys, which DCP writes once. The tied head
copy is a parameter like any other.

BatchNorm (ResNet): each micro-batch is normalised with its own statistics and the running
statistics are updated once per micro-batch, as under gradient accumulation (no deferred BatchNorm).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ptbench.adapters import _pipeline as P
from ptbench.adapters.base import Adapter, Batch
from ptbench.core.config import BenchConfig
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.optim import build_optimizer
from ptbench.core.precision import AutocastModule
from ptbench.core.timing import PhaseTimer
from ptbench.workloads import build_workload

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class PipelineAdapter(Adapter):
    name = "pipeline"
    checkpoint_format = "torch.distributed.checkpoint of the stages (get_state_dict, flattened optimizer state)"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward_backward": "the schedule's whole step: every micro-batch's forward and backward, stage-to-stage "
        "sends/receives, pipeline bubbles and the data-parallel gradient reduction",
        "optimizer": "clip over the global norm (all stages), step this stage",
    }

    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        # smoke's batch of 4 splits into 4 micro-batches, not the default 4 x stages
        return [f"launcher.nprocs={devices}", "adapter.microbatches=4"]

    # --- before launch ---------------------------------------------------------------------------
    @classmethod
    def pipeline_size(cls, cfg: BenchConfig, world_size: int) -> int:
        return cfg.adapter.pipeline_parallel or world_size

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str]:
        # stages up to the layer count, data parallel beyond
        pp = max(d for d in range(1, min(gpus, layers) + 1) if gpus % d == 0)
        return [f"launcher.nprocs={gpus}", f"adapter.pipeline_parallel={pp}"]

    @classmethod
    def layout(cls, cfg: BenchConfig, world_size: int) -> Layout:
        pp = cls.pipeline_size(cfg, world_size)
        return Layout(
            world_size=world_size,
            dp=max(1, world_size // max(1, pp)),
            pp=pp,
            microbatches=cfg.adapter.microbatches or 4 * pp,
        )

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig) -> CostInputs:
        # the schedule runs the whole step (sends, bubbles, the dp gradient reduction) in one timed phase
        # a language model's tied embedding spans the first and last stage (adapters/_pipeline.py TiedPair)
        a = cfg.adapter
        return CostInputs(
            schedule=a.schedule,
            step_phase="forward_backward",
            tied_embedding_stages=True,
            stage_balance=tuple(a.balance) if a.balance else None,
        )

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> None:
        return None  # DCP of this rank's stages (module docstring)

    @classmethod
    def num_stages(cls, cfg: BenchConfig, world_size: int) -> int:
        if cfg.adapter.balance is not None:
            return len(cfg.adapter.balance)
        pp = cls.pipeline_size(cfg, world_size)
        return 2 * pp if cfg.adapter.schedule == "interleaved_1f1b" else pp

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        a = cfg.adapter
        if cfg.trainer.precision == "fp16":  # refused on a CPU stand-in too (the twin test calls this)
            raise ConfigError(
                "trainer.precision=fp16: adapter=pipeline has no gradient scaler (an overflow would have to skip "
                "the step on every stage at once); use trainer.precision=bf16, or adapter=gpipe, which scales"
            )
        if a.schedule not in SCHEDULES:
            raise ConfigError(f"adapter.schedule={a.schedule}: choose {', '.join(SCHEDULES)}")
        pp = cls.pipeline_size(cfg, world_size)
        if pp < 1 or world_size % pp:
            raise ConfigError(
                f"{world_size} ranks cannot form pipelines of adapter.pipeline_parallel={pp} ranks; "
                f"make the rank count (launcher.nprocs) a multiple of it"
            )
        stages = cls.num_stages(cfg, world_size)
        if a.balance is not None:
            where = f"adapter.balance ({stages} entries)"
        else:
            where = f"adapter.pipeline_parallel={a.pipeline_parallel}"
            where += "" if a.pipeline_parallel else f" (all {world_size} ranks)"
            where += " with 2 stages per rank (interleaved_1f1b)" if a.schedule == "interleaved_1f1b" else ""
        if a.schedule == "interleaved_1f1b":
            if stages % pp:
                raise ConfigError(
                    f"adapter.schedule=interleaved_1f1b places stage s on rank s % {pp}: {where} gives "
                    f"{stages} stages, not a multiple of {pp} pipeline ranks; use a multiple, e.g. {2 * pp}"
                )
        elif stages != pp:
            raise ConfigError(
                f"adapter.schedule={a.schedule} runs one stage per rank but adapter.balance has {stages} "
                f"entries for {pp} pipeline ranks; give {pp} entries or use adapter.schedule=interleaved_1f1b"
            )
        workload = build_workload(cfg.workload, cfg.data)
        P.check_split(a.balance, P.layer_count(workload), stages, cfg.workload.name, where)
        m = cls.layout(cfg, world_size).microbatches
        P.check_microbatches(cls.local_batch_size(cfg, world_size), m, "the batch of one pipeline replica")
        if a.schedule == "1f1b" and m < stages:
            raise ConfigError(
                f"adapter.schedule=1f1b needs at least as many micro-batches as stages: "
                f"adapter.microbatches={m} < {stages} stages; raise adapter.microbatches"
            )
        if a.schedule == "interleaved_1f1b":
            rounds = max(1, m // pp)
            if m % rounds:
                raise ConfigError(
                    f"adapter.schedule=interleaved_1f1b needs the micro-batch count to be a multiple of "
                    f"{rounds} rounds: adapter.microbatches={m}; use a multiple of {pp} pipeline ranks"
                )

    # --- on each rank ----------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.ctx.rank // self.pp

    @property
    def reports_metrics(self) -> bool:
        return self.is_last  # the loss and the outputs exist on the last stage only

    def setup(self) -> None:
        import torch.distributed.pipelining as pipelining
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel as DDP

        cfg, a, world = self.cfg, self.cfg.adapter, self.ctx.world_size
        self.pp = self.pipeline_size(cfg, world)
        dp = self.layout(cfg, world).dp
        self.pp_rank = self.ctx.rank % self.pp
        mesh = init_device_mesh(self.device.type, (dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp")

        # every rank builds the whole model from the same seed, so its stages start exactly as the
        # unpipelined model does; the layers of other stages are dropped right after
        seq = self.workload.sequential(self.workload.build_model())
        n_stages = self.num_stages(cfg, world)
        self.balance = P.check_split(a.balance, len(seq), n_stages, cfg.workload.name, "adapter.balance")
        self.stage_ids = [s for s in range(n_stages) if s % self.pp == self.pp_rank]
        self.is_first, self.is_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids

        self.ties = self._untie(seq, n_stages)
        layers = list(seq.named_children())
        slices = P.stage_slices(self.balance)
        self.stage_modules = [nn.Sequential(OrderedDict(layers[slices[s]])).to(self.device) for s in self.stage_ids]
        del seq, layers
        gc.collect()

        self.m = self.layout(cfg, world).microbatches
        self.local_batch = self.local_batch_size(cfg, world)
        shapes = self.stage_shapes(self.local_batch // self.m)
        stages = []
        for s, module in zip(self.stage_ids, self.stage_modules):
            wrapped = self._wrap(module)
            if dp > 1:  # PipelineStage drives DDP itself: no_sync on all but the last micro-batch
                wrapped = DDP(
                    wrapped, process_group=self.dp_group, device_ids=[self.device.index] if self.ctx.is_cuda else None
                )
            inputs, outputs = shapes[s] if shapes is not None else (None, None)
            stages.append(
                pipelining.PipelineStage(
                    wrapped, s, n_stages, self.device, input_args=inputs, output_args=outputs, group=self.pp_group
                )
            )

        scale = 1.0 / (self.m * cfg.trainer.grad_accum)

        def loss_fn(out, y):
            # each micro-batch loss pre-divided, so gradients accumulate to the mean over the whole step,
            # also across several schedule.step calls (the schedule's own scaling would rescale those)
            return self.workload.loss(out, y) * scale

        schedule_cls = getattr(pipelining, SCHEDULES[a.schedule])
        if a.schedule == "interleaved_1f1b":
            self.schedule = schedule_cls(stages, self.m, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule_cls(stages[0], self.m, loss_fn=loss_fn, scale_grads=False)
        self.optimizer = build_optimizer([p for mod in self.stage_modules for p in mod.parameters()], cfg.optimizer)
        copies = P.tied_copies(self.ties)
        self.unique_params = [p for mod in self.stage_modules for p in mod.parameters() if id(p) not in copies]

    def _wrap(self, module: nn.Module) -> nn.Module:
        """A stage as the schedule runs it: contiguous at its boundaries, under autocast below fp32."""
        if getattr(self.workload, "channels_last", False):  # the p2p buffers must be contiguous (gloo, NCCL)
            module.register_forward_pre_hook(_contiguous_input_grad)
            module.register_forward_hook(_contiguous_output)
        precision = self.cfg.trainer.precision
        return module if precision == "fp32" else AutocastModule(module, precision, self.device)

    def stage_shapes(self, micro_batch: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """{stage: (input, output)} of this rank's stages for one micro-batch, as `PipelineStage`'s static
        `input_args` / `output_args`: the whole model's forward, stage by stage through `_wrap`, on fake tensors
        (FakeTensorMode: shapes, dtypes and strides; no storage, no arithmetic, no random draw).

        Why: without them each stage infers its neighbours' shapes at the first step with a real forward and
        backward of every stage and metadata sends between the ranks, which a fake process group cannot deliver
        (python -m ptbench.scale); torchtitan passes them too. The inputs of stage s > 0 require grad, as the
        activations the schedule receives do, so that their gradients are sent back. None where the workload
        gives no example batch: the schedule then infers them."""
        from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

        try:
            self.workload.example_batch(micro_batch, "meta")
        except NotImplementedError:
            return None
        # built on meta, then made fake: a model built under the fake mode could not take channels_last weights
        # (Module._apply cannot swap fake parameters); outside a dry run's own fake mode, so it is a plain module
        with unset_fake_temporarily(), torch.device("meta"):
            model = self.workload.build_model()
        with FakeTensorMode(allow_non_fake_inputs=True):
            x, _ = self.workload.example_batch(micro_batch, self.device)
            layers = list(self.workload.sequential(model.to_empty(device=self.device)).named_children())
            shapes = {}
            for s, part in enumerate(P.stage_slices(self.balance)):
                out = self._wrap(nn.Sequential(OrderedDict(layers[part])))(x)
                shapes[s] = (x, out)
                x = out.detach().requires_grad_(out.requires_grad)
        return {s: shapes[s] for s in self.stage_ids}

    def _untie(self, seq: nn.Sequential, n_stages: int) -> list[P.TiedPair]:
        """Untie weights whose two users land on different stages; keep on this rank what it holds."""
        pairs = []
        for main_name, copy_name in self.workload.tied_parameters(sequential=True):
            s_main = P.stage_of_layer(self.balance, P.layer_index(seq, main_name))
            s_copy = P.stage_of_layer(self.balance, P.layer_index(seq, copy_name))
            if s_main != s_copy:
                pairs.append((main_name, copy_name, s_main % self.pp, s_copy % self.pp))
        ties = P.untie(seq, [(m, c) for m, c, _, _ in pairs])
        self.tie_groups = []
        for t, (_, _, r_main, r_copy) in zip(ties, pairs):
            group = None
            if r_main != r_copy:
                # new_group is collective over the world: every rank creates every replica's group
                for replica in range(self.dp_size):
                    ranks = [replica * self.pp + r_main, replica * self.pp + r_copy]
                    g = dist.new_group(ranks)
                    if self.ctx.rank in ranks:
                        group = g
            t.main = t.main if self.pp_rank == r_main else None
            t.copy = t.copy if self.pp_rank == r_copy else None
            self.tie_groups.append(group)
        return ties

    def modules(self):
        return self.stage_modules

    def checkpoint_module(self) -> nn.Module:
        """This rank's stages under their global stage index: the keys are the same on every replica."""
        return nn.ModuleDict({f"stage{s}": m for s, m in zip(self.stage_ids, self.stage_modules)})

    def _checkpoint_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        module, options = self.checkpoint_module(), StateDictOptions(flatten_optimizer_state_dict=True)
        model_state, optim_state = get_state_dict(module, self.optimizer, options=options)
        return module, options, {"model": model_state, "optimizer": optim_state}

    def save_checkpoint(self, path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._checkpoint_state()[2], checkpoint_id=str(Path(path) / "dcp"))

    def load_checkpoint(self, path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        module, options, state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(
            module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        losses_all: list[torch.Tensor] = []
        with timer.phase("forward_backward"):  # the schedule interleaves them: one phase
            for x, y in micro_batches:  # trainer.grad_accum pipelined mini-batches
                losses: list[torch.Tensor] = []
                self.schedule.step(
                    *((x,) if self.is_first else ()),
                    target=y if self.is_last else None,
                    losses=losses if self.is_last else None,
                    return_outputs=False,
                )
                losses_all += losses
        with timer.phase("optimizer"):
            self._sync_tied_grads()
            self._clip(self.cfg.trainer.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # keep gradient buffers, as DDP does
        return torch.stack(losses_all).sum().detach() if self.is_last else None

    @torch.no_grad()
    def _sync_tied_grads(self) -> None:
        for t, group in zip(self.ties, self.tie_groups):
            if t.main is not None and t.copy is not None:  # both copies on this rank (interleaved, one pipeline rank)
                t.sum_local_grads()
            elif group is not None:  # one copy here, the other on the rank this group joins
                dist.all_reduce(P.grad_or_zeros(t.main if t.main is not None else t.copy), group=group)
            # else: a middle stage holds neither copy

    @torch.no_grad()
    def _clip(self, max_norm: float) -> None:
        """torch's clip_grad_norm_ over the whole pipeline: the norm sums every stage's squares once
        (tied copies excluded); replicas hold equal gradients after DDP, so the pipeline group suffices."""
        if max_norm <= 0:
            return
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.unique_params:
            if p.grad is not None:
                sq += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=self.pp_group)
        coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for mod in self.stage_modules:
            for p in mod.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        # the schedule's buffers have the training micro-batch shape: pad a short last batch (weight 0)
        n = inputs.shape[0]
        if n < self.local_batch:
            idx = torch.arange(self.local_batch, device=inputs.device) % n
            inputs, targets = inputs[idx], targets[idx]
            weight = torch.cat([weight, weight.new_zeros(self.local_batch - n)])
        out = self.schedule.eval(*((inputs,) if self.is_first else ()), target=targets if self.is_last else None)
        if not self.is_last:
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        return self.workload.eval_sums(out, targets, weight)

    def describe(self) -> dict:
        return {
            "schedule": self.cfg.adapter.schedule,
            "pipeline_ranks": self.pp,
            "data_parallel_replicas": self.dp_size,
            "stages": len(self.balance),
            "balance": self.balance,
            "balance_by": "config" if self.cfg.adapter.balance is not None else "layer_count",
            "microbatches": self.m,
            "micro_batch_size": self.local_batch // self.m,
            "tied_weights": [
                f"{t.copy_name} = copy of {t.main_name} on the last stage, gradients all-reduced "
                f"with the first stage each step"
                for t in self.ties
            ],
        }


ADAPTER = PipelineAdapter


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a stage's input gradient is sent to the previous stage."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_input_grad(module: nn.Module, args: tuple) -> tuple:
    """workload.channels_last: stage boundaries carry contiguous (NCHW) tensors both ways; inside a stage the
    channels_last weights make the activations NHWC again."""
    return tuple(_ContiguousGrad.apply(a) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _contiguous_output(module: nn.Module, args: tuple, out):
    return out.contiguous() if torch.is_tensor(out) else out
