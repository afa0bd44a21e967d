"""Validation sums from logits split over the vocabulary (tensor parallelism), without gathering them.

Tensor-parallel adapters (megatron, tensor_parallel) hold on each rank only the logits of a slice
of the vocabulary. Gathering [batch, seq, vocab] logits for validation would cost the memory that
sharding saved, so the sums that `Workload.eval_sums` computes from full logits are computed here
from the slices, with three all-reduces of [batch, seq] tensors over the tensor-parallel group.

Same definitions as `Workload.eval_sums` (language): per-sample mean token cross-entropy and
per-sample fraction of next-token hits, weighted by `weight` (0 for padded samples). A token is a
hit when its target holds the largest logit (an exact tie counts as a hit; argmax would pick the
lower index).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def eval_sums(
    local_logits: torch.Tensor, vocab_start: int, targets: torch.Tensor, weight: torch.Tensor, group
) -> torch.Tensor:
    """[loss_sum, correct_sum, count] (float64) from this rank's logits slice [b, t, v_local].

    `vocab_start`: global id of this slice's first column. Every rank of `group` must call this.
    """
    logits = local_logits.float()
    width = logits.shape[-1]
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - top.unsqueeze(-1)).exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    local_ids = targets - vocab_start
    mine = (local_ids >= 0) & (local_ids < width)
    target_logit = logits.gather(-1, local_ids.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(target_logit, group=group)

    token_loss = top + sum_exp.log() - target_logit
    hits = (target_logit >= top).float()
    b = targets.shape[0]
    w = weight.to(torch.float32)
    loss = (token_loss.view(b, -1).mean(1) * w).sum()
    correct = (hits.view(b, -1).mean(1) * w).sum()
    return torch.stack([loss, correct, w.sum()]).double()
