"""What every workload supplies: model, data, loss, validation metrics, analytic FLOPs.

Adapters only see this interface, so a framework never needs to know which model it trains,
and a new workload never needs to know about frameworks.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.errors import ConfigError


class Workload(ABC):
    kind: str  # "vision" | "language"
    # False where the adapter's framework flattens, shards or broadcasts parameters as contiguous buffers
    # (DeepSpeed, FSDP2, Horovod): vision then keeps NCHW weights and makes activations channels_last
    # from the input (Adapter.channels_last_weights sets it; the record says which was applied)
    channels_last_weights: bool = True

    def __init__(self, cfg: WorkloadConfig, data: DataConfig):
        self.cfg = cfg
        self.data = data

    # --- model -------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model; deterministic for a given torch seed."""

    @abstractmethod
    def sequential(self, model: nn.Module) -> nn.Sequential:
        """The same model as an nn.Sequential of layers (for pipeline adapters).

        Shares the parameters of `model` and computes exactly what `model(x)` computes.
        """

    def tied_parameters(self, sequential: bool = False) -> list[tuple[str, str]]:
        """Pairs of parameter names that are one tensor (in the model, or in `sequential(model)`)."""
        return []

    # --- data --------------------------------------------------------------------------------
    @abstractmethod
    def datasets(self, local_rank: int = 0) -> tuple[Dataset, Dataset]:
        """(train, val); items are (input, target) tensors.

        `local_rank` 0 (one process per node) builds any on-disk cache; other ranks wait for it.
        """

    def describe(self) -> dict:
        """Input-pipeline and layout facts for the record (vision: channels_last, decoder, cache)."""
        return {}

    def check_data(self) -> None:
        """Raise ConfigError (one line: which path, which key) if the configured data is missing."""

    def real_data_root(self, source: str, kind: str, holds: str) -> str | None:
        """check_data's start: None for synthetic data (nothing to check), else data.root, refusing a source other
        than `source` (this `kind` of workload reads no other) and an unset root (one that `holds` its files)."""
        src = self.data.source
        if src == "synthetic":
            return None
        if src != source:
            raise ConfigError(f"data.source '{src}' does not suit a {kind} workload: use synthetic or {source}")
        if not self.data.root:
            raise ConfigError(f"data.root is not set; set data.root=<folder with {holds}> or BENCH_DATA_ROOT")
        return self.data.root

    # --- loss and metrics --------------------------------------------------------------------
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over samples (and tokens)."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[loss_sum, correct_sum, sample_count] over the batch, padded samples having weight 0.

        Language: a sample's loss is its mean token loss and `correct` counts next-token hits
        divided by tokens, so sums over samples give token means (every sample has seq_len tokens).
        """
        logits = output.float()
        per_elem = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        hits = (logits.argmax(-1) == target).float()
        per_sample_loss = per_elem.view(target.shape[0], -1).mean(1)
        per_sample_hit = hits.view(target.shape[0], -1).mean(1)
        w = weight.to(per_sample_loss.dtype)
        return torch.stack([(per_sample_loss * w).sum(), (per_sample_hit * w).sum(), w.sum()]).double()

    def metrics(self, sums: torch.Tensor) -> dict:
        loss_sum, correct, count = (float(x) for x in sums)
        count = max(count, 1.0)
        val_loss = loss_sum / count
        out = {"val_loss": val_loss, "val_samples": int(round(count))}
        if self.kind == "vision":
            out["val_accuracy"] = correct / count
        else:
            out["val_perplexity"] = math.exp(min(val_loss, 50.0))
            out["val_token_accuracy"] = correct / count
        return out

    # --- cost model --------------------------------------------------------------------------
    @abstractmethod
    def forward_flops_per_sample(self) -> float:
        """Analytic forward FLOPs for one sample (one multiply-add = 2 FLOPs)."""

    def train_flops_per_sample(self) -> float:
        """Convention: backward = 2x forward, so one training step costs 3x the forward FLOPs."""
        return 3.0 * self.forward_flops_per_sample()

    def tokens_per_sample(self) -> int:
        return 0

    # --- the FLOP cross-check (ptbench.core.flops.count_train_flops) -------------------------------------
    def example_batch(self, n: int, device="meta") -> tuple[torch.Tensor, torch.Tensor]:
        """(input, target) of `n` samples shaped as the data loader gives them (values meaningless on meta)."""
        raise NotImplementedError(f"{type(self).__name__} gives no example batch")

    def counted_flops(self, n: int = 2) -> dict:
        """Training FLOPs per sample as torch counts them (FlopCounterMode over one forward + backward of
        `n` samples on the meta device: nothing allocated, nothing computed): {forward, backward, total}
        per sample and `by_op` (per batch of n)."""
        from ptbench.core.flops import count_train_flops

        with torch.device("meta"):
            model = self.build_model()
        x, y = self.example_batch(n, "meta")
        out = count_train_flops(model, x, y, self.loss)
        return {**{k: out[k] / n for k in ("forward", "backward", "total")}, "by_op": out["by_op"]}
