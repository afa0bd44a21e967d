"""Megatron-core: GPT-2 with tensor, pipeline and data parallelism (TP x PP x DP = world size).

What a user of megatron-core writes, and nothing else: `initialize_model_parallel`, a `GPTModel`
built from a `TransformerConfig` and a layer spec, Megatron's `DistributedDataParallel` wrapper,
its forward-backward schedule (`get_forward_backward_func`: no pipelining, or 1F1B for PP > 1)
with `finalize_model_grads` (data-parallel reduction, tied-embedding reduction between the first and
last stage, sequence-parallel LayerNorm reduction), then an optimizer step.

The model is Megatron's own GPTModel with the workload's GPT-2 dimensions (layers, width, heads,
sequence length; vocabulary padded as Megatron-LM pads it, to a multiple of
`adapter.make_vocab_size_divisible_by` x TP; GELU's tanh approximation, as GPT-2; tied embeddings; learned
positions). Its initial weights differ from the harness GPT-2's, so compare Megatron layouts with
each other. The loss is Megatron's per-token vocab-parallel cross-entropy averaged over tokens,
as the workload's loss, except that the softmax also spans the padded vocabulary rows.

Attention: the local spec's core attention is torch's scaled_dot_product_attention (`sdpa_core_attention`),
as in the harness GPT-2 every other adapter trains, instead of its unfused [b, np, s, s] scores.
GPU: Transformer Engine layer spec when TE is installed (local spec otherwise), Megatron's
distributed optimizer for adam/adamw (clip_grad always passed: its default is 1.0), bf16 as
autocast around the forward (fp32 weights, gradients and optimizer state).
CPU: local spec, `use_cpu_initialization`, fusions off, an explicit causal mask, gloo, a torch
optimizer stepping Megatron's gradient buffers, fp32 only, and adapters/_megatron_cpu.py for the few
CUDA-only calls. The schedule, DDP wrapper and gradient finalization are the same code on both.
Sequence parallelism: without Apex or TE the local spec's norm refuses it, so the layer spec then
uses a torch LayerNorm marked for Megatron's sequence-parallel gradient all-reduce.

Initialization does not depend on the layout: every transformer layer reseeds the CPU generator
from (seed, global layer number) before building, and `use_cpu_initialization` draws full weights
before slicing them for TP, so any TP x PP layout starts from the same weights on CPU (tested). On
GPU, weights sliced over TP come from Megatron's per-TP-rank CUDA generator as usual.

Checkpoints: Megatron's own `dist_checkpointing` (the format Megatron-LM writes, torch_dist backend):
`GPTModel.sharded_state_dict()` names every tensor by its global (un-split) key and TP/PP/DP offset,
and the torch optimizer's state is mapped onto those keys as Megatron's FP32Optimizer does
(`optim_state_to_sharding_state`), so every rank writes only its slice and a replica's copy is
written once. Runs on CPU over gloo. Megatron's distributed optimizer (GPU, adam/adamw) is not
checkpointed here yet: that combination refuses trainer.checkpoint_every before launch.

Batch: `batch_policy=linear` (conf/adapter/megatron.yaml), as the paper scales Megatron: the global
batch is trainer.batch_size x ranks; a replica (TP x PP ranks) loads global / DP samples per
micro-step and Megatron's schedule runs them as the layout's micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Sequence
from functools import partial

import torch

from ptbench.adapters import _vocab_parallel as vocab_parallel
from ptbench.adapters._pipeline import check_microbatches
from ptbench.adapters.base import Adapter, Batch, tensor_bytes
from ptbench.core.dist import dist_timeout_s
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.optim import build_optimizer, refuse_layerwise
from ptbench.core.precision import autocast
from ptbench.core.timing import PhaseTimer

# Megatron's timer names (config.timers) -> the harness's phases. Gradient reductions count as
# backward, as DDP's all-reduce does; pipeline send/recv waits stay outside every phase.
_PHASE_OF = {
    "forward-compute": "forward",
    "backward-compute": "backward",
    "all-grads-sync": "backward",
    "non-tensor-parallel-grads-all-reduce": "backward",
    "embedding-grads-all-reduce": "backward",
}
# Megatron's distributed optimizer (GPU) wraps Adam only (DistributedOptimizer asserts Adam/AdamW); SGD steps a
# torch optimizer on Megatron's main_grad buffers, on GPU as on CPU (recorded as `optimizer`)
_MEGATRON_OPTIMIZERS = ("adam", "adamw")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation: what the harness GPT-2 computes and what Megatron's fused bias_gelu (GPU,
    bias_activation_fusion) computes; the CPU path's activation_func, so CPU and GPU runs compute one GELU."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: up to a multiple of divisible_by x TP, so every TP slice is equal and aligned."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


class MegatronAdapter(Adapter):
    name = "megatron"
    kinds = ("language",)
    framework = "megatron-core"
    framework_module = "megatron.core"
    extra = "megatron"
    compiles_on_cuda = "its fusions go through torch.compile"
    checkpoint_format = "megatron.core.dist_checkpointing (torch_dist): GPTModel.sharded_state_dict + optimizer state"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward": "megatron-core forward steps (its timers): tensor-parallel all-reduces inside; with PP > 1 "
        "pipeline waits are outside every phase (in the step, not its parts)",
        "backward": "megatron-core backward steps plus its gradient reductions (all-grads-sync, embedding "
        "and non-TP gradient all-reduces), as DDP's all-reduce counts as backward",
        "optimizer": "clip over the TP x PP global norm, step (GPU: the distributed optimizer's gathers)",
    }

    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        return [f"launcher.nprocs={devices}", f"adapter.tensor_parallel={2 if devices % 2 == 0 else 1}"]

    # --- before launch ----------------------------------------------------------------------------
    @classmethod
    def checkpoint_refusal(cls, cfg) -> str | None:
        """megatron.core.dist_checkpointing (module docstring), except with Megatron's distributed optimizer."""
        if cls.distributed_optimizer(cfg, torch.cuda.is_available()):
            return (
                f"Megatron's distributed optimizer (GPU, optimizer={cfg.optimizer.name}) is not checkpointed here "
                "yet; CPU runs and GPU runs with another optimizer are"
            )
        return None

    @classmethod
    def rank_environment(cls, cfg) -> dict[str, str]:
        """TP > 1: one CUDA work queue, so a tensor-parallel collective launched before a GEMM runs before it
        (Megatron-LM's launch scripts export it; sequence parallelism and TP overlap rely on it)."""
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if cfg.adapter.tensor_parallel > 1 else {}

    @classmethod
    def distributed_optimizer(cls, cfg, cuda: bool) -> bool:
        """Megatron's distributed optimizer: on CUDA for adam/adamw (it asserts Adam); else a torch optimizer."""
        return cuda and cfg.optimizer.name in _MEGATRON_OPTIMIZERS

    @classmethod
    def attention(cls, cuda: bool) -> str:
        """The attention kernel (ptbench.core.layout.ATTENTION): Transformer Engine's fused attention with its
        layer spec (CUDA, TE installed), else the local spec with torch's SDPA as core attention (`_spec`)."""
        return "te" if cuda and importlib.util.find_spec("transformer_engine") else "sdpa"

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str]:
        # tensor parallel inside a node, data parallel across nodes
        return [f"launcher.nprocs={gpus}", f"adapter.tensor_parallel={min(gpus, gpus_per_node or gpus)}"]

    @classmethod
    def layout(cls, cfg, world_size: int) -> Layout:
        """TP x PP ranks per replica; micro-batches: adapter.microbatches, else 1 without a pipeline and
        4 x stages with one (the paper's GPipe rule; 1F1B needs >= stages to fill the pipeline)."""
        a = cfg.adapter
        tp, pp = a.tensor_parallel, a.pipeline_parallel
        return Layout(
            world_size=world_size,
            dp=world_size // max(1, tp * pp),
            tp=tp,
            pp=pp,
            microbatches=a.microbatches or (1 if pp == 1 else 4 * pp),
        )

    @classmethod
    def cost_inputs(cls, cfg) -> CostInputs:
        a = cfg.adapter
        return CostInputs(
            # Megatron's distributed optimizer shards the optimizer state over dp (it is used on CUDA only)
            sharding="distributed_optimizer" if cfg.optimizer.name in _MEGATRON_OPTIMIZERS else "none",
            half_activation_comm=True,  # TP all-reduces and stage sends carry bf16 activations under autocast
            padded_vocab=padded_vocab_size(
                cfg.workload.vocab_size, max(1, a.tensor_parallel), max(1, a.make_vocab_size_divisible_by)
            ),
            schedule=a.schedule if a.pipeline_parallel > 1 else "none",
            sequence_parallel=a.sequence_parallel,
            attention=cls.attention(torch.cuda.is_available()),
            vocab_parallel_loss=True,  # vocab-parallel embedding, output layer and cross-entropy (parallel_output)
            tied_embedding_stages=True,  # share_embeddings_and_output_weights: megatron-core's embedding group
        )

    @classmethod
    def check(cls, cfg, world_size):
        w, a = cfg.workload, cfg.adapter
        if w.kind != "language" or w.arch != "gpt2":
            raise ConfigError(
                f"adapter=megatron does not support workload={w.name}: megatron-core builds GPT models "
                f"only here; use a gpt2 workload, or another adapter (ddp, fsdp, zero, ...) for {w.arch}"
            )
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ConfigError("adapter=megatron needs megatron-core: pip install megatron-core==0.16.1")
        tp, pp = a.tensor_parallel, a.pipeline_parallel
        if tp < 1 or pp < 1:
            raise ConfigError(f"adapter.tensor_parallel={tp} and adapter.pipeline_parallel={pp} must be >= 1")
        if world_size % (tp * pp):
            raise ConfigError(
                f"adapter.tensor_parallel={tp} x adapter.pipeline_parallel={pp} = {tp * pp} does not divide "
                f"the {world_size} ranks (launcher.nprocs): TP x PP x DP must equal the world size"
            )
        if w.n_head % tp:
            raise ConfigError(
                f"workload.n_head={w.n_head} is not divisible by adapter.tensor_parallel={tp}: Megatron "
                f"gives every tensor-parallel rank whole attention heads"
            )
        if w.n_layer % pp:
            raise ConfigError(
                f"workload.n_layer={w.n_layer} is not divisible by adapter.pipeline_parallel={pp}: Megatron "
                f"gives every pipeline stage the same number of layers"
            )
        if a.sequence_parallel and tp == 1:
            raise ConfigError(
                "adapter.sequence_parallel=true needs adapter.tensor_parallel > 1: it splits the sequence "
                "over the tensor-parallel ranks"
            )
        if a.sequence_parallel and w.seq_len % tp:
            raise ConfigError(
                f"adapter.sequence_parallel=true: workload.seq_len={w.seq_len} is not divisible by "
                f"adapter.tensor_parallel={tp}"
            )
        if pp > 1 and a.schedule != "1f1b":
            raise ConfigError(
                f"adapter.schedule={a.schedule}: adapter=megatron pipelines with megatron-core's 1F1B "
                f"schedule; set adapter.schedule=1f1b"
            )
        if tp > 1:
            refuse_layerwise(
                cfg.optimizer,
                f"adapter=megatron with tensor_parallel={tp}",
                "gives each rank column/row slices of the weights",
            )
        if a.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"adapter.make_vocab_size_divisible_by={a.make_vocab_size_divisible_by} must be >= 1")
        if cfg.trainer.precision == "fp16":
            raise ConfigError(
                "trainer.precision=fp16: adapter=megatron runs mixed precision as bf16 autocast (fp16 "
                "would need Megatron's loss scaler); use trainer.precision=bf16 or fp32"
            )
        if cfg.trainer.precision == "bf16" and not torch.cuda.is_available():
            raise ConfigError(
                "trainer.precision=bf16 with adapter=megatron needs a GPU: Megatron's tensor-parallel "
                "linear layers register autocast for CUDA only, so their backward fails under CPU "
                "autocast; use trainer.precision=fp32 on CPU"
            )
        check_microbatches(
            cls.local_batch_size(cfg, world_size),
            cls.layout(cfg, world_size).microbatches,
            "adapter=megatron: the per-replica batch",
        )

    # --- on each rank -----------------------------------------------------------------------------
    def setup(self) -> None:
        with warnings.catch_warnings():
            # megatron-core warns at import and spec time that Apex/TE are absent (describe() states the
            # layer spec and optimizer in use) and about a cuda-graph default it sets itself
            warnings.filterwarnings(
                "ignore", message=".*(Apex|Transformer Engine).* not installed", category=UserWarning
            )
            warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
            self._setup()

    def _setup(self) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        a, w = self.cfg.adapter, self.cfg.workload
        cuda = self.ctx.is_cuda
        pp_rank = self._init_parallel(cuda)
        self.vocab = padded_vocab_size(w.vocab_size, self.tp, a.make_vocab_size_divisible_by)
        self.timers = _PhaseTimers()
        self.config = self._transformer_config(cuda)
        self.layer_spec = "transformer_engine" if self.attention(cuda) == "te" else "local"
        self.model = self._ddp(self._gpt_model(cuda, pp_rank), cuda)
        self.forward_backward = get_forward_backward_func()
        self.optimizer = self._build_optimizer()
        self.scheduler = self._constant_scheduler()
        ps = self.ps
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.vocab_start = ps.get_tensor_model_parallel_rank() * (self.vocab // self.tp)
        self.positions = torch.arange(w.seq_len, device=self.device).unsqueeze(0)
        # get_default_causal_mask hard-codes cuda; True = masked out
        self.causal_mask = (
            None
            if cuda
            else torch.triu(torch.ones(w.seq_len, w.seq_len, dtype=torch.bool, device=self.device), 1)[None, None]
        )

    def _init_parallel(self, cuda: bool) -> int:
        """Megatron's process groups and seeds; this rank's pipeline stage."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        a, t = self.cfg.adapter, self.cfg.trainer
        self.tp, self.pp = a.tensor_parallel, a.pipeline_parallel
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            distributed_timeout_minutes=max(1, dist_timeout_s(t) // 60),
        )
        if not cuda:
            from ptbench.adapters import _megatron_cpu

            _megatron_cpu.enable(announce=self.ctx.rank == 0)
        self.ps = ps
        pp_rank = ps.get_pipeline_model_parallel_rank()
        # Megatron-LM's seeding: one seed per pipeline stage; the tracker adds one per TP rank
        tensor_parallel.model_parallel_cuda_manual_seed(t.seed + 100 * pp_rank)
        return pp_rank

    def _transformer_config(self, cuda: bool):
        from megatron.core.transformer.transformer_config import TransformerConfig

        a, w = self.cfg.adapter, self.cfg.workload
        # batch_p2p_sync=False on both: True (megatron-core's default) synchronizes the device after every
        # batched pipeline send/recv, a workaround for old NCCL/torch (Megatron-LM: --no-batch-p2p-sync)
        on_gpu = dict(bias_activation_fusion=True, bias_dropout_fusion=True, deallocate_pipeline_outputs=True)
        on_cpu = dict(use_cpu_initialization=True, deallocate_pipeline_outputs=True, activation_func=gelu_tanh)
        return TransformerConfig(
            num_layers=w.n_layer,
            hidden_size=w.n_embd,
            num_attention_heads=w.n_head,
            ffn_hidden_size=4 * w.n_embd,
            hidden_dropout=w.dropout,
            attention_dropout=w.dropout,
            layernorm_epsilon=1e-5,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            sequence_parallel=a.sequence_parallel,
            pipeline_dtype=torch.float32,
            params_dtype=torch.float32,
            timers=self.timers,
            batch_p2p_sync=False,
            **(on_gpu if cuda else on_cpu),
        )

    def _gpt_model(self, cuda: bool, pp_rank: int):
        """This stage's GPTModel, seeded as Megatron-LM seeds it."""
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel

        w, seed = self.cfg.workload, self.cfg.trainer.seed
        torch.manual_seed(seed)  # the embedding is built first on the first stage: same in every layout
        with self._compat():
            model = GPTModel(
                self.config,
                self._spec(),
                vocab_size=self.vocab,
                max_sequence_length=w.seq_len,
                pre_process=self.ps.is_pipeline_first_stage(),
                post_process=self.ps.is_pipeline_last_stage(),
                share_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute",
            )
        torch.manual_seed(seed + 100 * pp_rank)  # dropout outside TP regions: same on the TP ranks of a stage
        for p in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if cuda:
            model.cuda(torch.cuda.current_device())
        return model

    def _ddp(self, model, cuda: bool):
        """Megatron's own DDP around the model (distributed optimizer's buffers when chosen), hooked into the
        schedule's config."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        a = self.cfg.adapter
        self.megatron_optimizer = self.distributed_optimizer(self.cfg, cuda)
        self.ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=bool(cuda and a.overlap_comm),  # overlap uses CUDA streams
            use_distributed_optimizer=self.megatron_optimizer,
            bucket_size=a.reduce_bucket_size,
        )
        wrapped = DistributedDataParallel(self.config, self.ddp_config, model)
        self.config.no_sync_func = wrapped.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        if self.ddp_config.overlap_grad_reduce:
            self.config.grad_sync_func = wrapped.start_grad_sync
        return wrapped

    def _constant_scheduler(self):
        """Megatron-LM's loop sets lr and weight decay (x each group's wd_mult) through this scheduler;
        constant here, as the harness's other adapters run."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.optimizer
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=o.lr,
            max_lr=o.lr,
            min_lr=o.lr,
            lr_warmup_steps=0,
            lr_decay_steps=1,
            lr_decay_style="constant",
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def _spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        if self.layer_spec == "transformer_engine":
            spec = get_gpt_layer_with_transformer_engine_spec()
        else:
            spec = with_sdpa_core_attention(get_gpt_layer_local_spec())
        spec = _layout_invariant(spec, self.cfg.trainer.seed)
        if not (self.config.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm):
            return spec
        # Without Apex or TE the local spec's norm is megatron-core's torch LayerNorm, which refuses
        # sequence parallelism: use one that marks its parameters, as the fused norms do.
        layer = dataclasses.replace(
            spec,
            submodules=dataclasses.replace(
                spec.submodules,
                input_layernorm=_SequenceParallelLayerNorm,
                pre_mlp_layernorm=_SequenceParallelLayerNorm,
            ),
        )
        return TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(self.config), layer_norm=_SequenceParallelLayerNorm
        )

    def _build_optimizer(self):
        o, clip = self.cfg.optimizer, self.cfg.trainer.grad_clip
        if self.megatron_optimizer:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            mcfg = OptimizerConfig(
                optimizer="adam",  # adam/adamw only (distributed_optimizer)
                lr=o.lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=o.eps,
                decoupled_weight_decay=o.name != "adam",  # Megatron's "adam" is AdamW unless told otherwise
                use_distributed_optimizer=True,
                clip_grad=clip,
                min_lr=o.lr,
            )
            return get_megatron_optimizer(mcfg, [self.model])
        # Megatron's weight-decay groups (wd_mult read by the scheduler): none on biases and 1-D parameters
        decay, no_decay = [], []
        for name, p in self.model.module.named_parameters():
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        return build_optimizer([{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}], o)

    def _compat(self):
        if self.ctx.is_cuda:
            return contextlib.nullcontext()
        from ptbench.adapters import _megatron_cpu

        return _megatron_cpu.cuda_to_cpu()

    def modules(self):
        return [self.model.module]

    @property
    def dp_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    @property
    def reports_metrics(self) -> bool:
        return self.ps.get_tensor_model_parallel_rank() == 0 and self.ps.is_pipeline_last_stage()

    # --- one step ---------------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        """Megatron's forward_step_func: labels give per-token losses; eval batches (with weights) give logits."""
        x, y, weight = next(data_iterator)
        positions = self.positions.expand(x.shape[0], -1)
        with autocast(self.cfg.trainer.precision, self.device):
            out = model(x, positions, self.causal_mask, labels=y if weight is None else None)
        if weight is None:
            return out, self._train_loss
        return out, partial(self._eval_sums, y, weight)

    @staticmethod
    def _train_loss(per_token_loss):
        loss = per_token_loss.float().mean()
        # the schedule divides the returned loss in place by the micro-batch count: report a copy
        return loss, {"loss": loss.detach().clone()}

    def _eval_sums(self, targets, weight, logits):
        sums = vocab_parallel.eval_sums(logits, self.vocab_start, targets, weight, self.tp_group)
        return torch.zeros((), device=self.device), {"sums": sums}

    def _run_schedule(self, batches, forward_only: bool):
        with self._compat():
            return self.forward_backward(
                forward_step_func=self._forward_step,
                data_iterator=iter(batches),
                model=[self.model],
                num_microbatches=len(batches),
                seq_length=batches[0][0].shape[1],
                micro_batch_size=batches[0][0].shape[0],
                forward_only=forward_only,
            )

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        m = self.layout(self.cfg, self.ctx.world_size).microbatches
        batches = [(xc, yc, None) for x, y in micro_batches for xc, yc in zip(x.chunk(m), y.chunk(m))]
        self.model.zero_grad_buffer()
        self.timers.phase_timer = timer
        try:
            outputs = self._run_schedule(batches, forward_only=False)
        finally:
            self.timers.phase_timer = None
        with timer.phase("optimizer"):
            self._optimizer_step()
        if not outputs:  # not the last pipeline stage
            return None
        return torch.stack([o["loss"] for o in outputs]).mean()

    def _optimizer_step(self):
        if self.megatron_optimizer:
            self.optimizer.step()  # clips (clip_grad), steps, gathers the updated shards
            self.optimizer.zero_grad()
            self.scheduler.step(increment=1)
            return
        params = [p for p in self.model.module.parameters() if p.requires_grad]
        for p in params:  # Megatron's DDP accumulated and reduced the gradients in its main_grad buffers
            p.grad = p.main_grad
        if self.cfg.trainer.grad_clip > 0:
            self._clip(params)
        self.optimizer.step()
        for p in params:  # else the next backward accumulates into the buffer twice (grad, then main_grad)
            p.grad = None
        self.scheduler.step(increment=1)

    def _clip(self, params):
        """Megatron's norm: the tied embedding copy and TP-duplicated parameters counted once,
        summed over the TP x PP group (torch's clip_grad_norm_ would see only this rank's slices)."""
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        grads = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        with self._compat():
            norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=self.ps.get_model_parallel_group())
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.grad_clip, torch.tensor(norm))

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        outputs = self._run_schedule([(inputs, targets, weight)], forward_only=True)
        if not outputs:
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        return outputs[0]["sums"]

    # --- checkpoints --------------------------------------------------------------------------------
    def _checkpoint_state(self) -> tuple[dict, dict]:
        """(Megatron's sharded state: model and optimizer as ShardedTensors with global keys and this
        rank's offsets, plus the scheduler; this rank's own: optimizer step counts, RNG tracker states)."""
        from megatron.core import tensor_parallel
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model = self.model.module.sharded_state_dict()  # keys as GPTModel.state_dict() names them
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        optim = self.optimizer.state_dict()
        optim["state"] = {i: dict(st) for i, st in optim["state"].items()}  # state_dict() shares the live dicts
        # per-parameter step counts are scalars, not shards of a parameter (Megatron's FP32Optimizer
        # keeps them aside too)
        steps = {i: st.pop("step") for i, st in optim["state"].items() if "step" in st}
        optim_state_to_sharding_state(optim, get_param_id_to_sharded_param_map(model, params))
        own = {"optimizer_steps": steps, "rng_tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        return {"model": model, "optimizer": optim, "scheduler": self.scheduler.state_dict()}, own

    def save_checkpoint(self, path) -> None:
        from pathlib import Path

        from megatron.core import dist_checkpointing

        refusal = self.checkpoint_refusal(self.cfg)
        if refusal:
            raise RuntimeError(f"adapter=megatron cannot checkpoint: {refusal}")
        folder = Path(path) / "megatron"
        if self.ctx.rank == 0:
            folder.mkdir()
        torch.distributed.barrier()
        sharded, own = self._checkpoint_state()
        torch.save(own, Path(path) / f"megatron-rank{self.ctx.rank}.pt")  # Megatron's format has no per-rank objects
        with self._compat():
            dist_checkpointing.save(sharded, str(folder))

    def load_checkpoint(self, path) -> None:
        from pathlib import Path

        from megatron.core import dist_checkpointing, tensor_parallel
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        refusal = self.checkpoint_refusal(self.cfg)
        if refusal:
            raise RuntimeError(f"adapter=megatron cannot resume a checkpoint: {refusal}")
        _init_optim_state(self.optimizer)  # the state tensors the shards are read into (a zero-lr step)
        sharded, _ = self._checkpoint_state()
        with self._compat():
            loaded = dist_checkpointing.load(sharded, str(Path(path) / "megatron"))
        # step counts and RNG tracker tensors only: weights-only, so a planted pickle is refused, never run
        own = torch.load(Path(path) / f"megatron-rank{self.ctx.rank}.pt", weights_only=True)
        self.model.module.load_state_dict(loaded["model"], strict=True)
        optim = loaded["optimizer"]
        for i, step in own["optimizer_steps"].items():
            optim["state"][i]["step"] = step
        self.optimizer.load_state_dict(optim)
        self.scheduler.load_state_dict(loaded["scheduler"])
        tensor_parallel.get_cuda_rng_tracker().set_states(own["rng_tracker"])

    # --- accounting ---------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Parameters and optimizer state as held; gradients are Megatron's contiguous main_grad buffers
        (param.grad is only borrowed during the step). `params_tp_sharded`: the part split over TP."""
        inner = _torch_optimizers(self.optimizer)
        out = tensor_bytes(self.modules(), None)
        out["optimizer"] = sum(tensor_bytes([], o)["optimizer"] for o in inner)
        out["grads"] = sum(
            b.grad_data.numel() * b.grad_data.element_size()
            for b in self.model.buffers + self.model.expert_parallel_buffers
        )
        out["params_tp_sharded"] = sum(
            p.numel() * p.element_size()
            for p in self.model.module.parameters()
            if getattr(p, "tensor_model_parallel", False)
        )
        return out

    def describe(self) -> dict:
        import os

        a = self.cfg.adapter
        return {
            "gelu": "tanh approximation (GPU: fused bias_gelu; CPU: F.gelu(approximate='tanh'))",
            "batch_p2p_sync": self.config.batch_p2p_sync,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "data_parallel": self.dp_size,
            "sequence_parallel": a.sequence_parallel,
            "schedule": "1f1b" if self.pp > 1 else "no_pipelining",
            "microbatches": self.layout(self.cfg, self.ctx.world_size).microbatches,
            "padded_vocab_size": self.vocab,
            # FLOPs, MFU and tokens/s count the workload's vocabulary, as for every adapter: the padding
            # columns are computed here but not counted (comparability with the harness GPT-2)
            "flops_vocab_size": int(self.cfg.workload.vocab_size),
            "layer_spec": self.layer_spec,
            # the class the built layers call (plan.cost.attention: the kernel the memory model reads)
            "core_attention": type(self.model.module.decoder.layers[0].self_attention.core_attention).__name__,
            "optimizer": ("megatron distributed " if self.megatron_optimizer else "torch ") + self.cfg.optimizer.name,
            "grad_clip": self.cfg.trainer.grad_clip,
            "overlap_grad_reduce": self.ddp_config.overlap_grad_reduce,
            "bucket_size": self.ddp_config.bucket_size,
            "init": "per-layer seeded (layout-invariant with use_cpu_initialization)",
            "cpu_compat": None if self.ctx.is_cuda else list(_cpu_changes()),
        }

    def close(self) -> None:
        if getattr(self, "ps", None) is not None and self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()


def _cpu_changes():
    from ptbench.adapters._megatron_cpu import CHANGES

    return CHANGES


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding state: a torch optimizer itself, or those inside Megatron's wrappers."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _layout_invariant(spec, seed: int):
    """The layer spec with a layer class that reseeds the CPU generator from the global layer number.

    Megatron draws each layer's weights in construction order, so a later pipeline stage, which
    builds its first layer straight after the seed, would otherwise initialise it like layer 1.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    base = spec.module

    class SeededLayer(base):
        def __init__(self, config, submodules, layer_number=1, *args, **kwargs):
            global_number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"))
            torch.manual_seed(seed * 1_000_003 + global_number)
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    SeededLayer.__name__ = base.__name__  # module reprs and logs keep Megatron's name
    return dataclasses.replace(spec, module=SeededLayer)


def with_sdpa_core_attention(spec):
    """The local layer spec with `SDPACoreAttention` as its self-attention's core attention."""
    attn = spec.submodules.self_attention
    core = dataclasses.replace(attn.submodules, core_attention=sdpa_core_attention())
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attn, submodules=core))
    )


@functools.cache
def sdpa_core_attention():
    """megatron-core's local DotProductAttention computing through torch's F.scaled_dot_product_attention.

    The local spec's own keeps the [b, np, s, s] scores, their softmax and a dropout mask (unfused), while the
    harness GPT-2 of every other adapter calls SDPA (flash / memory-efficient on CUDA): a comparison would then
    measure attention kernels. Same interface, scale and dropout (p of its nn.Dropout, under the TP RNG fork as
    the original), causal by is_causal; the class is made on first use (megatron imports lazily)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kw):
            if attention_bias is not None or kw.get("packed_seq_params") is not None or self.softmax_offset is not None:
                raise ValueError("SDPACoreAttention: no attention bias, packed sequences or softmax offset")
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:  # grouped-query attention: repeat the key/value heads, as the original does
                key, value = (t.repeat_interleave(groups, dim=2) for t in (key, value))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, np, hn] -> [b, np, s, hn]
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            mask = None if causal or attention_mask is None else ~attention_mask  # Megatron's True = masked out
            p = self.attention_dropout.p if self.training else 0.0
            fork = tensor_parallel.get_cuda_rng_tracker().fork
            with contextlib.nullcontext() if self.config.sequence_parallel else fork():
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.softmax_scale
                )
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)

    return SDPACoreAttention


class _SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm whose parameters carry Megatron's `sequence_parallel` mark: with the sequence
    split over TP ranks each rank's norm gradients are partial, and finalize_model_grads all-reduces
    the marked ones over the TP group (what FusedLayerNorm and TENorm set up)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


class _PhaseTimers:
    """Megatron's `config.timers` protocol (`timers(name, log_level).start()/.stop()`) feeding the
    harness's PhaseTimer, so the schedule's own forward/backward boundaries give the phase times."""

    def __init__(self):
        self.phase_timer: PhaseTimer | None = None  # set during train_step only
        self.open: dict[str, object] = {}

    def __call__(self, name: str, log_level: int = 0):
        return _Span(self, name)


class _Span:
    def __init__(self, timers: _PhaseTimers, name: str):
        self.timers, self.name = timers, name

    def start(self, barrier: bool = False) -> None:
        phase = _PHASE_OF.get(self.name)
        if phase and self.timers.phase_timer is not None:
            span = self.timers.phase_timer.phase(phase)
            span.__enter__()
            self.timers.open[self.name] = span

    def stop(self, barrier: bool = False) -> None:
        span = self.timers.open.pop(self.name, None)
        if span is not None:
            span.__exit__(None, None, None)


ADAPTER = MegatronAdapter
