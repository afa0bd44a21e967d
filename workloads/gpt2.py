"""A compact GPT-2 (nn.Linear + scaled_dot_product_attention) and its workload.

Module names are stable and referenced by adapters (tensor-parallel plans, Megatron):
    wte, wpe, drop, blocks.{i}.ln_1, blocks.{i}.attn.c_attn, blocks.{i}.attn.c_proj,
    blocks.{i}.ln_2, blocks.{i}.mlp.c_fc, blocks.{i}.mlp.c_proj, ln_f, lm_head (weight tied to wte)

c_attn layout (differs from OpenAI/Hugging Face checkpoints): its 3*d output features are ordered
per head, [q_h0, k_h0, v_h0, q_h1, k_h1, v_h1, ...] (each head_dim wide), the layout Megatron
uses for `linear_qkv` with one query group per head. A column-wise shard of c_attn over whole
heads (torch ColwiseParallel, n_head divisible by the TP degree) therefore holds matching q, k, v
for its heads, and the forward, which reshapes by head_dim only (`view(b, t, -1, 3 * hd)`), runs
unchanged on the local shard. c_proj's input features are head-major, so RowwiseParallel fits.
`qkv_to_hf` / `qkv_from_hf` convert to and from the [q | k | v] layout of GPT-2 checkpoints.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.errors import ConfigError
from ptbench.workloads import data as D
from ptbench.workloads.base import Workload


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0

    @classmethod
    def from_workload(cls, cfg: WorkloadConfig) -> GPT2Config:
        return cls(cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.head_dim = c.head_dim
        self.dropout = c.dropout
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)  # per-head [q, k, v] layout, see module doc
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        qkv = self.c_attn(x).view(b, t, -1, 3 * hd).transpose(1, 2)  # [b, heads, t, 3*hd]
        q, k, v = qkv.split(hd, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)  # head-major features
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=1e-5)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _TiedLinear(torch.autograd.Function):
    """x @ w.T (what F.linear computes without bias, the same matmul) whose weight gradient is one
    fresh contiguous tensor, g^T x. F.linear's comes back as a transposed view of that product, and
    autograd then sums a tied weight's two gradients (this one and the embedding's) out of place:
    one more [vocab, d] tensor per step. With this one it adds the embedding's gradient in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ w).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


class LMHead(nn.Linear):
    """nn.Linear without bias (the adapters' plans see an nn.Linear named lm_head) that computes
    plain-tensor, autocast-off forwards through `_TiedLinear`: same logits, same gradients, one
    [vocab, d] temporary fewer per step. DTensor weights (tensor parallel) or inputs and autocast
    take nn.Linear's own forward."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            type(w) is nn.Parameter
            and type(x) is torch.Tensor
            and self.bias is None
            and (x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type))  # meta: no autocast
        ):
            return _TiedLinear.apply(x, w)
        return super().forward(x)


class Embedding(nn.Module):
    """Token + position embedding and dropout (the model's own modules, shared)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """Final LayerNorm and the language-model head (whose weight is wte.weight)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: LMHead):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2(nn.Module):
    """GPT-2: forward(idx [B, T] int64) -> logits [B, T, vocab] (T <= seq_len)."""

    def __init__(self, c: GPT2Config):
        super().__init__()
        if c.n_embd % c.n_head:
            raise ConfigError(f"workload.n_embd={c.n_embd} is not divisible by workload.n_head={c.n_head}")
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.seq_len, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, eps=1e-5)
        self.lm_head = LMHead(c.n_embd, c.vocab_size)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- loss: mean token cross-entropy without materialising [N, vocab] temporaries -------------------
# F.cross_entropy on [N, V] logits allocates three more [N, V] tensors per train step (log_softmax
# output, nll_loss's zero-filled gradient, log_softmax's backward output). On CPU every fresh tensor
# that large is new pages from the kernel (page faults + zeroing), which cost more than the
# arithmetic. `_CrossEntropy` computes the same loss with one [N, V] tensor (the gradient), working
# through the logits a few rows at a time so that each chunk's temporaries stay in cache.
_CE_CHUNK_BYTES = 1 << 20  # fp32 bytes of logits per chunk


def _chunks(n: int, v: int):
    step = max(1, _CE_CHUNK_BYTES // (4 * v))
    return ((s, min(s + step, n)) for s in range(0, n, step))


def _row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logsumexp of each row of [N, V] logits (any float dtype), chunk by chunk."""
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for s, e in _chunks(n, v):
        torch.logsumexp(logits[s:e].float(), -1, out=out[s:e])
    return out


def _token_losses(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token cross-entropy [N] fp32, row logsumexp [N] fp32) of [N, V] logits and [N] targets."""
    lse = _row_logsumexp(logits)
    return lse - logits.gather(1, target[:, None]).squeeze(1).float(), lse


class _CrossEntropy(torch.autograd.Function):
    """mean_i(logsumexp(z_i) - z_i[t_i]) of [N, V] logits z, computed in fp32 whatever z's dtype;
    gradient (softmax(z_i) - onehot(t_i)) * grad / N in fp32 (autograd casts it to z's dtype).

    One pass of exp over the logits: the forward writes softmax(z) chunk by chunk into the one [N, V]
    fp32 tensor the step needs (it is saved instead of the logits, which are then free), and the backward
    scales it in place into the gradient. First-order only (double backward raises)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        probs = torch.empty((n, v), dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s, e in _chunks(n, v):
            p = probs[s:e]
            m = logits[s:e].amax(-1, keepdim=True).float()
            torch.sub(logits[s:e], m, out=p).exp_()
            total = p.sum(-1, keepdim=True)
            p.div_(total)
            torch.add(m.squeeze(1), total.squeeze(1).log(), out=lse[s:e])
        ctx.save_for_backward(probs, target)
        return (lse - logits.gather(1, target[:, None]).squeeze(1).float()).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        probs, target = ctx.saved_tensors
        scale = grad.float() / probs.shape[0]
        probs.mul_(scale)
        probs[torch.arange(probs.shape[0], device=probs.device), target] -= scale
        return probs, None


def _fused_loss_applies(output: torch.Tensor, target: torch.Tensor) -> bool:
    """The chunked loss runs on plain CPU tensors with class-index targets (no ignore_index);
    anything else (DTensor logits under loss_parallel, CUDA) takes the generic F.cross_entropy."""
    return (
        type(output) is torch.Tensor
        and output.device.type == "cpu"
        and output.is_floating_point()
        and type(target) is torch.Tensor
        and target.dtype == torch.int64
        and target.numel() > 0
        and bool(target.min() >= 0)
    )


def qkv_to_hf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """c_attn weight [3d, d] or bias [3d] from the per-head layout to [q | k | v] (rows)."""
    return t.reshape(n_head, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_from_hf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `qkv_to_hf`."""
    return t.reshape(3, n_head, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class GPT2Workload(Workload):
    kind = "language"

    def __init__(self, cfg: WorkloadConfig, data: DataConfig):
        super().__init__(cfg, data)
        self.gpt = GPT2Config.from_workload(cfg)

    def build_model(self) -> GPT2:
        return GPT2(self.gpt)

    def sequential(self, model: GPT2) -> nn.Sequential:
        """[embed, block_0 .. block_{n-1}, head], sharing `model`'s modules; same output as model(x).

        Tied weight: `head.lm_head.weight` IS `embed.wte.weight` (one Parameter). That is right when
        both stages live in one process. When a pipeline puts them on different devices/ranks, the
        pipeline adapter must handle the tie (e.g. keep a separate copy on the last stage and
        all-reduce the two gradients each step, as Megatron does); `tied_parameters()` names the pair.
        """
        layers = [("embed", Embedding(model.wte, model.wpe, model.drop))]
        layers += [(f"block_{i}", b) for i, b in enumerate(model.blocks)]
        layers.append(("head", Head(model.ln_f, model.lm_head)))
        return nn.Sequential(OrderedDict(layers))

    def tied_parameters(self, sequential: bool = False) -> list[tuple[str, str]]:
        """Names of parameters that are one tensor: in the model, or in `sequential(model)`."""
        if sequential:
            return [("embed.wte.weight", "head.lm_head.weight")]
        return [("wte.weight", "lm_head.weight")]

    def forward_flops_per_sample(self) -> float:
        """Forward FLOPs of one sequence of seq_len tokens. Convention: 2 FLOPs per multiply-add;
        counted: per layer the four matmuls (qkv 3d^2, attention out d^2, MLP 8d^2 MACs per token)
        and attention scores QK^T and AV (2 * T * d MACs per token, the full T x T: the causal mask
        is NOT discounted), plus the lm_head matmul (d * vocab). Not counted: embeddings, LayerNorm,
        softmax, GELU, biases, dropout. Per token: 2 * (L * (12 d^2 + 2 T d) + d V)."""
        c = self.gpt
        d, T = c.n_embd, c.seq_len
        per_token = 2 * (c.n_layer * (12 * d * d + 2 * T * d) + d * c.vocab_size)
        return float(per_token * T)

    def tokens_per_sample(self) -> int:
        return self.gpt.seq_len

    def example_batch(self, n: int, device="meta") -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros((n, self.gpt.seq_len), dtype=torch.int64, device=device)
        return ids, ids.clone()

    # --- loss and metrics: Workload's definitions, computed without [N, vocab] temporaries ---
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy in fp32, as `Workload.loss` (F.cross_entropy on `output.float()`)
        computes it, equal to it within fp32 rounding; see `_CrossEntropy`."""
        if not _fused_loss_applies(output, target):
            return super().loss(output, target)
        return _CrossEntropy.apply(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`Workload.eval_sums` (per-sample mean token loss and next-token hit rate), chunked."""
        if not _fused_loss_applies(output, target):
            return super().eval_sums(output, target, weight)
        logits = output.reshape(-1, output.shape[-1])
        per_elem, _ = _token_losses(logits, target.reshape(-1))
        hits = (logits.argmax(-1) == target.reshape(-1)).float()
        per_sample_loss = per_elem.view(target.shape[0], -1).mean(1)
        per_sample_hit = hits.view(target.shape[0], -1).mean(1)
        w = weight.to(per_sample_loss.dtype)
        return torch.stack([(per_sample_loss * w).sum(), (per_sample_hit * w).sum(), w.sum()]).double()

    # --- data --------------------------------------------------------------------------------
    def check_data(self) -> None:
        root, tok = self.real_data_root("wikitext", "language", "train.txt and valid.txt"), self.data.tokenizer_dir
        if root is None:
            return
        for name in ("train.txt", "valid.txt"):
            if not (Path(root) / name).is_file():
                raise ConfigError(
                    f"data.root: {root} has no {name}; set data.root=<folder with train.txt and "
                    "valid.txt> or BENCH_DATA_ROOT"
                )
            if D.blank_text(Path(root) / name):  # before any rank starts, named as the user gave it
                raise ConfigError(
                    f"data.root: {Path(root) / name} is empty (no text to train on): put WikiText's {name} there "
                    "or set data.root=<folder with train.txt and valid.txt>"
                )
        if not tok:
            raise ConfigError(
                "data.tokenizer_dir is not set; set data.tokenizer_dir=<folder with vocab.json and "
                "merges.txt> or BENCH_DATA_ROOT"
            )
        for name in D.TOKENIZER_FILES:
            if not (Path(tok) / name).is_file():
                raise ConfigError(
                    f"data.tokenizer_dir: {tok} has no {name}; set data.tokenizer_dir=<folder with "
                    "vocab.json and merges.txt> or BENCH_DATA_ROOT"
                )

    def datasets(self, local_rank: int = 0):
        """(train, val): items (input_ids [seq_len] int64, targets [seq_len] int64, shifted by one).

        synthetic: `MarkovTokens` with data.train_samples / data.val_samples sequences.
        wikitext: <root>/train.txt and valid.txt as GPT-2 BPE ids cut into non-overlapping blocks
        of seq_len + 1 tokens (cached once per file; `local_rank` 0 builds, other ranks wait).
        """
        self.check_data()
        c, d = self.gpt, self.data
        if d.source == "synthetic":
            return (
                D.MarkovTokens(d.train_samples, c.seq_len, c.vocab_size, "train"),
                D.MarkovTokens(d.val_samples, c.seq_len, c.vocab_size, "val"),
            )
        vocab = D.gpt2_tokenizer(d.tokenizer_dir).get_vocab_size()
        if vocab > c.vocab_size:
            raise ConfigError(
                f"workload.vocab_size={c.vocab_size} is smaller than the tokenizer's {vocab}; "
                f"set workload.vocab_size={vocab}"
            )
        out = []
        for name in ("train.txt", "valid.txt"):
            path = D.token_cache(Path(d.root) / name, d.tokenizer_dir, d.cache_dir, local_rank)
            out.append(D.TokenBlocks(path, c.seq_len, source=Path(d.root) / name))
        return tuple(out)
