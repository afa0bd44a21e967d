"""Mixed precision: autocast + (fp16 only) a gradient scaler, chosen by trainer.precision.

The GPU path is autocast on cuda; its CPU twin is autocast on cpu with bf16, which runs the same
code so tests exercise it here. fp16 needs a GradScaler and is GPU-only.
"""

from __future__ import annotations

import contextlib

import torch

from ptbench.core.errors import ConfigError

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # trainer.precision -> dtype, for every adapter


def check_precision(precision: str) -> None:
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"trainer.precision={precision}: choose fp32, bf16 or fp16")
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("trainer.precision=fp16 needs a GPU; use trainer.precision=bf16 or fp32 on CPU")


def apply_tf32(enabled: bool) -> dict:
    """TF32 tensor cores for fp32 matmuls and convolutions, or not (trainer.tf32); returns the flags set.
    torch's own defaults differ (cuDNN on, matmul off), which made "fp32" mean two things."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    return {
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=HALF_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device):
    """A GradScaler for fp16 (loss scaling against underflow); None otherwise."""
    if precision == "fp16":
        return torch.amp.GradScaler(device.type)
    return None


class AutocastModule(torch.nn.Module):
    """Runs `module` under autocast. For pipelines: torchgpipe computes partitions in worker threads
    and torch.distributed.pipelining runs forward and backward inside one schedule call, so autocast
    (thread-local, and meant for the forward only) must be entered by each stage's own forward;
    a recomputation under activation checkpointing then sees it too."""

    def __init__(self, module: torch.nn.Module, precision: str, device: torch.device):
        super().__init__()
        self.module = module
        self.precision = precision
        self.device_type = torch.device(device).type

    def forward(self, *args):
        with autocast(self.precision, torch.device(self.device_type)):
            return self.module(*args)
