"""Learning-rate schedules (`lr_schedule=constant|step|warmup_poly|warmup_cosine`, conf/lr_schedule/).

One `torch.optim.lr_scheduler.LambdaLR` per torch optimizer of the adapter, stepped once per optimizer
step by the training loop (bench/runner/trainer.py), so every adapter follows the same curve. The factor
on `optimizer.lr` used by the optimizer step k (counted from 0 over the whole run) is `lr_factor(k)`:

- constant: 1
- step: gamma ** floor(k / step_size)                       (torchvision's StepLR, stepped per epoch)
- warmup_poly: (k + 1) / W for k < W, then end + (1 - end) (1 - (k - W) / (T - W)) ** power   (MLPerf)
- warmup_cosine: (k + 1) / W for k < W, then end + (1 - end) (1 + cos(pi (k - W) / (T - W))) / 2
  (after T: end)

with W, step_size and T converted from `lr_schedule.unit` (epoch: x the run's optimizer steps per epoch).
A closed-form LambdaLR rather than the chained built-ins (SequentialLR, LinearLR, PolynomialLR, ...):
those multiply the param group's current lr, so anything else writing the lr (Megatron's own
OptimizerParamScheduler sets it to optimizer.lr after every step on GPU) would bend the curve; the
closed form sets base_lr x factor whatever was there, and is exact against hand-computed values.
"""

from __future__ import annotations

import math

import torch

from ptbench.core.config import ScheduleConfig
from ptbench.core.errors import ConfigError

SCHEDULES = ("constant", "step", "warmup_poly", "warmup_cosine")
UNITS = ("epoch", "step")


def check_schedule(cfg: ScheduleConfig) -> None:
    """Before launch: one line naming the bad value and the fix."""
    if cfg.name not in SCHEDULES:
        raise ConfigError(f"unknown schedule '{cfg.name}': choose schedule=" + " | ".join(SCHEDULES))
    if cfg.unit not in UNITS:
        raise ConfigError(f"lr_schedule.unit={cfg.unit}: use lr_schedule.unit=epoch or lr_schedule.unit=step")
    if cfg.name == "step" and (cfg.step_size <= 0 or cfg.gamma <= 0):
        raise ConfigError(
            f"lr_schedule=step needs lr_schedule.step_size > 0 and lr_schedule.gamma > 0 (got {cfg.step_size:g}, {cfg.gamma:g})"
        )
    if cfg.warmup < 0 or cfg.total < 0 or not 0 <= cfg.end_factor <= 1:
        raise ConfigError("lr_schedule.warmup and lr_schedule.total must be >= 0 and lr_schedule.end_factor in [0, 1]")
    if cfg.name.startswith("warmup_") and cfg.total and cfg.total <= cfg.warmup:
        raise ConfigError(
            f"lr_schedule.total={cfg.total:g} must exceed lr_schedule.warmup={cfg.warmup:g} (or be 0: the whole run)"
        )


def lr_factor(cfg: ScheduleConfig, step: int, steps_per_epoch: int, total_steps: int) -> float:
    """The factor on optimizer.lr for optimizer step `step` (0-based over the run)."""
    if cfg.name == "constant":
        return 1.0
    per = steps_per_epoch if cfg.unit == "epoch" else 1
    if cfg.name == "step":
        return cfg.gamma ** (step // max(1, round(cfg.step_size * per)))
    warm = round(cfg.warmup * per)
    total = round(cfg.total * per) if cfg.total else total_steps
    if step < warm:
        return (step + 1) / warm
    if total <= warm or step >= total:
        return cfg.end_factor if step >= total else 1.0
    progress = (step - warm) / (total - warm)
    shape = (1 - progress) ** cfg.power if cfg.name == "warmup_poly" else (1 + math.cos(math.pi * progress)) / 2
    return cfg.end_factor + (1 - cfg.end_factor) * shape


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside an adapter's optimizer: itself (DDP, FSDP, Horovod's subclass, ...),
    the one a wrapper holds as `.optimizer` (DeepSpeed's ZeRO/bf16 wrappers, Megatron's), or each of
    Megatron's ChainedOptimizer. Their param_groups are what the wrapped step reads."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        return torch_optimizers(inner)
    raise TypeError(f"no torch optimizer found inside {type(optimizer).__name__} for the lr schedule")


class Schedule:
    """LambdaLRs over an adapter's optimizer(s); `step()` after each optimizer step."""

    def __init__(self, cfg: ScheduleConfig, optimizer, steps_per_epoch: int, total_steps: int):
        self.cfg = cfg
        self.optimizers = torch_optimizers(optimizer)

        def factor(k: int) -> float:
            return lr_factor(cfg, k, steps_per_epoch, total_steps)

        self.factor = factor
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]

    def lr(self) -> float:
        """The lr the next optimizer step uses (the first param group's)."""
        return float(self.optimizers[0].param_groups[0]["lr"])

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> list[dict]:
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, states: list[dict]) -> None:
        """Continue where the checkpoint left off, and set the groups' lr to that point's value (an
        adapter's own checkpoint may or may not have restored param_groups' lr)."""
        for s, st in zip(self.schedulers, states):
            s.load_state_dict(st)
            for group, base in zip(s.optimizer.param_groups, s.base_lrs):
                group["lr"] = base * self.factor(s.last_epoch)
            s._last_lr = [g["lr"] for g in s.optimizer.param_groups]
