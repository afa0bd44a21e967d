"""Optimizers by name, shared by every adapter that uses a torch optimizer.

LAMB and LARS (the paper's GPT-2 and MLPerf vision optimizers) come from timm: torch has neither.
"""
from __future__ import annotations

from typing import Iterable

import torch

from bench.core.config import OptimizerConfig
from bench.core.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = list(params)
    betas = tuple(cfg.betas)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "lamb":
        from timm.optim import Lamb

        return Lamb(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "lars":
        from timm.optim import Lars

        return Lars(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ConfigError(f"unknown optimizer.name '{cfg.name}': choose one of {', '.join(OPTIMIZERS)}")


def clip_gradients(parameters, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def optimizer_step(optimizer: torch.optim.Optimizer, parameters, max_norm: float, scaler=None,
                   before_step=None) -> None:
    """Unscale (fp16), clip, step: the order every torch-optimizer adapter needs. `before_step` runs
    between clipping and the step (gpipe copies a tied gradient to its second copy there)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    clip_gradients(parameters, max_norm)
    if before_step is not None:
        before_step()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
