"""Optimizers by name, shared by every adapter that uses a torch optimizer.

LAMB and LARS (the paper's GPT-2 and MLPerf vision optimizers) come from timm: torch has neither.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ptbench.core.config import OptimizerConfig
from ptbench.core.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars")
# Optimizers whose update reads each parameter tensor whole (LAMB/LARS trust ratio = ||w|| / ||update||
# per tensor): an adapter that hands the optimizer slices of tensors must refuse them (`refuse_layerwise`).
LAYERWISE = ("lamb", "lars")


def refuse_layerwise(cfg: OptimizerConfig, adapter: str, why: str) -> None:
    """One line before launch: LAMB/LARS on slices of tensors would be another algorithm."""
    if cfg.name in LAYERWISE:
        raise ConfigError(
            f"optimizer.name={cfg.name}: its per-tensor trust ratio needs whole parameter tensors but "
            f"{adapter} {why}; use optimizer=adam or adamw, or an adapter that keeps tensors whole "
            "(ddp, horovod, pipeline, gpipe)"
        )


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """One weight-decay rule for every adapter: no decay on biases and norm weights (tensors of fewer
    than 2 dimensions), as Megatron-LM, torchtitan and nanoGPT do; decay on matrices and embeddings."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `params`, with the one weight-decay rule (`param_groups`) and no
    clipping of its own: clipping is `trainer.grad_clip`'s, over the global norm, in every adapter."""
    params = list(params)
    if not (params and isinstance(params[0], dict)):  # param groups given (Megatron's wd_mult): the caller's rule
        params = param_groups(params, cfg.weight_decay)
    betas = tuple(cfg.betas)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "lamb":
        from timm.optim import Lamb

        # timm clips at max_grad_norm=1.0 by default, over the tensors this rank holds: off, always
        return Lamb(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, max_grad_norm=None)
    if cfg.name == "lars":
        from timm.optim import Lars

        return Lars(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ConfigError(f"unknown optimizer.name '{cfg.name}': choose one of {', '.join(OPTIMIZERS)}")


def clip_gradients(parameters, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def optimizer_step(
    optimizer: torch.optim.Optimizer, parameters, max_norm: float, scaler=None, before_step=None
) -> None:
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
